"""Secure aggregation's protocol (edgefil/secagg.py, edge_client/secagg.py, coordinator/secagg.py), its devices and
coordinator in one process, their messages through the wire codec: the sum is exact within quantisation, with
devices dropping out at every stage; a single masked vector looks like noise; what a device refuses to reveal; a
wrong share fails the session rather than its sum."""
from __future__ import annotations

import signal
import threading
from collections import Counter

import numpy as np
import pytest
from fleet_harness import CEILING_S, Fleet, run_fleet_file
from mqtt_helpers import Peer
from scipy import stats
from secagg_session import SESSION, SETTINGS, devices_of, expected_mean, run_session
from thread_fleet import ThreadFederation

from coordinator.aggregation import RoundAggregate
from coordinator.broker import mosquitto_path
from coordinator.checkpoint import load_latest
from coordinator.config import CoordinatorConfig
from coordinator.containment import RULE_FAILED, ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.privacy import BuiltFrom
from coordinator.secagg import LIES, SecureAggregationSettings, SecureSum, neighbourhoods, secure_refused
from coordinator.strategies import make_strategy, secure_aggregation_refused
from edge_client.device import secure_round
from edge_client.policies import make_policy
from edge_client.secagg import SecureRoundSettings, SecureUpload
from edge_client.state import load_state
from edgefil import topics, wire
from edgefil.secagg import PRIME, Quantiser, SecAggError, combine, split
from edgefil.settings import ConfigError
from firmware_sim.fleet_config import FleetConfig
from firmware_sim.report import write_report
from models.checkpoint import checkpoint_weights


def test_shamir_threshold() -> None:
    secret = bytes(range(32))
    shares = split(secret, range(1, 8), threshold=4)
    assert combine({x: shares[x] for x in (2, 3, 5, 7)}, 4) == secret
    assert combine({x: shares[x] for x in (1, 4, 6, 7)}, 4) == secret
    with pytest.raises(SecAggError, match="too-few-shares"):
        combine({x: shares[x] for x in (1, 2, 3)}, 4)
    # three shares say nothing of the secret: two secrets agree with them (the fourth point decides)
    assert all(int.from_bytes(s, "big") < PRIME for s in shares.values())


def test_neighbourhoods_are_regular_and_symmetric() -> None:
    devices = [f"d{i:03d}" for i in range(100)]
    graph = neighbourhoods(devices, SETTINGS.degree_for(100), np.random.default_rng(0))
    assert SETTINGS.degree_for(100) == 16 and SETTINGS.degree_for(10) == 9 and SETTINGS.degree_for(1000) == 22
    assert all(len(n) == 16 for n in graph.values())
    assert all(d in graph[n] for d, ns in graph.items() for n in ns)


def test_the_sum_is_exact_within_quantisation() -> None:
    devices = devices_of(10, 5000, np.random.default_rng(2))
    secure, _, _ = run_session(devices)
    result = secure.result()
    assert result.survivors == set(devices)
    assert result.samples == pytest.approx(sum(n for _, n in devices.values()), abs=1e-3)
    error = np.abs(result.mean_change - expected_mean(devices, set(devices)))
    # stochastic rounding: each value of each device off by less than one step, and unbiased, so that the sum's
    # typical error grows as the root of the devices' count (0.9 steps at 10), not as their count (truncation: 5)
    bound = len(devices) * result.quantisation_step / (result.samples / SETTINGS.max_weight)
    assert error.max() < bound and error.mean() < bound / 5


@pytest.mark.parametrize("stage", ["keys", "shares", "masked"])
def test_the_sum_survives_devices_that_drop_out(stage: str) -> None:
    """Two of ten drop after advertising, after sharing (their pairwise masks are in their neighbours' vectors:
    taken off with their reconstructed keys), or after masking (their vectors are in, their self masks come off with
    b's shares): the sum is the survivors' (those whose vectors came)."""
    devices = devices_of(10, 3000, np.random.default_rng(3))
    secure, _, _ = run_session(devices, drop={"dev-2": stage, "dev-7": stage})
    result = secure.result()
    survivors = set(devices) - ({"dev-2", "dev-7"} if stage != "masked" else set())
    assert result.survivors == survivors
    assert secure.counts == {"advertised": 10, "shared": 8 if stage == "keys" else 10,
                             "masked": len(survivors), "revealed": 8}
    error = np.abs(result.mean_change - expected_mean(devices, survivors))
    assert error.max() < len(devices) * result.quantisation_step / (result.samples / SETTINGS.max_weight)


def test_a_masked_vector_looks_like_noise() -> None:
    """One device's masked vector, as the coordinator receives it: its words uniform over 2^32 (a chi-square test on
    their top byte) and unrelated to the quantised contribution under the mask (no correlation)."""
    rng = np.random.default_rng(4)
    devices = devices_of(10, 20000, rng)
    secure, uploads, masked = run_session(devices)
    words = np.frombuffer(masked[0], dtype="<u4")
    counts = np.bincount(words >> 24, minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-3
    change, n = devices["dev-0"]
    plain = Quantiser(SETTINGS.clip_range, 10).encode(change * n / SETTINGS.max_weight, n / SETTINGS.max_weight, rng)
    assert abs(np.corrcoef(words[:-1].astype(float), plain[:-1].astype(float))[0, 1]) < 0.05
    # while the plain contribution is far from uniform (its values sit near the middle of the range)
    assert stats.chisquare(np.bincount(plain >> 24, minlength=256)).pvalue < 1e-10


def test_one_lying_neighbour_spoils_nothing_and_a_lying_masker_is_caught_in_the_sum() -> None:
    """A device that reveals wrong shares: the coordinator finds t shares that give back what each device committed
    to, and the sum is exact. One that seals garbage for four of its nine neighbours: they cannot open its shares but
    mask with it all the same, the other five reconstruct its secrets, and the sum is exact. Enough wrong shares that
    no t give back a secret, garbage sealed for every neighbour, or (where two dropped, so that the sum has room to
    fall outside what the eight survivors can give) a masked vector shifted by half the modulus: the session refuses
    the sum (a lie, `LIES`), rather than give a wrong one."""
    devices = devices_of(10, 300, np.random.default_rng(5))
    for lie in ("revealed", "sealed"):
        secure = run_session(devices, lies={"dev-1": lie})[0]
        result = secure.result()
        assert result.survivors == set(devices), lie
        bound = len(devices) * result.quantisation_step / (result.samples / SETTINGS.max_weight)
        assert np.abs(result.mean_change - expected_mean(devices, set(devices))).max() < bound, lie
    with pytest.raises(SecAggError, match="shares-inconsistent"):  # 5 of each device's 9 neighbours lie, t = 5
        run_session(devices, lies={f"dev-{i}": "revealed" for i in range(5)})[0].result()
    with pytest.raises(SecAggError, match="shares-withheld"):
        run_session(devices, lies={"dev-1": "sealed-all"})[0].result()
    with pytest.raises(SecAggError, match="sum-out-of-range"):
        run_session(devices, drop={"dev-8": "shares", "dev-9": "shares"}, lies={"dev-4": "masked"})[0].result()
    assert {"shares-inconsistent", "shares-withheld", "sum-out-of-range"} == LIES


def test_a_device_reveals_once_and_never_both_secrets_of_one_device() -> None:
    devices = devices_of(4, 10, np.random.default_rng(6))
    secure, uploads, _ = run_session(devices, drop={"dev-3": "masked"})
    upload = uploads["dev-0"]
    with pytest.raises(SecAggError, match="twice"):
        upload.on_unmask({"survivors": ["dev-1"], "dropped": []})
    fresh = SecureUpload("dev-9", 1, SecureRoundSettings(SESSION, 1.0, 100.0), np.zeros(3), 1, 0, "model", {})
    fresh.neighbours = {"dev-1": (2, b"", b""), "dev-2": (3, b"", b"")}
    with pytest.raises(SecAggError, match="overlap"):
        fresh.on_unmask({"survivors": ["dev-1"], "dropped": ["dev-1"]})
    with pytest.raises(SecAggError, match="overlap"):
        fresh.on_unmask({"survivors": ["dev-5"], "dropped": []})


def test_too_few_survivors_are_not_unmasked() -> None:
    devices = devices_of(5, 10, np.random.default_rng(7))
    with pytest.raises(SecAggError, match="too-few-survivors"):
        run_session(devices, drop={d: "shares" for d in ("dev-0", "dev-1", "dev-2", "dev-3")})
    with pytest.raises(SecAggError, match="too-few-devices"):  # a sum of one would be its update
        run_session(devices_of(1, 10, np.random.default_rng(7)))


def test_only_a_mean_rule_runs_under_secure_aggregation() -> None:
    assert secure_refused(SETTINGS, "fedavg", BuiltFrom.MEAN) is None
    assert "needs each update" in secure_refused(SETTINGS, "median", BuiltFrom.WEIGHTS)
    assert secure_refused(SecureAggregationSettings(), "median", BuiltFrom.WEIGHTS) is None
    for reads_attachments in ("glfc", "sdd", "pfedgrp"):  # GLFC's global model is a mean, but it reads more
        assert "needs each update" in secure_aggregation_refused(SETTINGS, reads_attachments)


def test_the_wire_refuses_a_masked_blob_of_floats_and_short_keys() -> None:
    blob = wire.encode_blob("masked", np.zeros(4, np.uint32).data.cast("B"), device="d", round=1, session="s")
    assert wire.decode(blob.chunks[0])["dtype"] == "<u4"
    with pytest.raises(wire.WireError, match="32 bytes"):
        wire.encode("keys", device="d", round=1, session="s", task=0, model="m", cipher_key=b"x" * 31,
                    mask_key=b"x" * 32, commitment=b"x" * 32, metrics={})


def _claim(weights: np.ndarray, start: np.ndarray, metrics: dict[str, float]) -> tuple[np.ndarray, int]:
    """A device's update as it saved it, and the samples it claimed: its store's, or none where training left the
    global model as it was (`Device._claims`)."""
    return weights, 0 if np.array_equal(weights, start.astype(np.float32)) else int(metrics["stored_samples"])


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
@pytest.mark.parametrize("rule", [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}])
def test_a_secure_round_through_a_real_broker_gives_the_mean_of_the_devices(tmp_path, export_artifacts, rule):
    """Three devices, one secure round, FedAvg or FedProx (whose devices train with its proximal term): the
    coordinator's new global model is the devices' sample-weighted mean (as each saved its update on its disk),
    within quantisation; the round's history says what each stage saw, and the run took no update of any one
    device."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=1, n_devices=3) as federation:
        coordinator = federation.coordinator(rule, rounds_per_task=1, max_attempts=1,
                                             secure_aggregation=SecureAggregationSettings(mode="secagg+"),
                                             guard=GuardSettings.only())
        start = coordinator.state.weights.astype(np.float64)
        results = coordinator.run()
        weights = {d.id: load_state(d.config.state_dir).weights for d in federation.devices}
    entry = results["history"][-1]
    saved = {d: _claim(w, start, entry["metrics"][d]) for d, w in weights.items()}
    assert entry["secure"] == {"advertised": 3, "shared": 3, "masked": 3, "revealed": 3}
    assert entry["received"] == sorted(saved) and entry["samples"] == sum(n for _, n in saved.values())
    expected = start + sum(n * (w - start) for w, n in saved.values()) / sum(n for _, n in saved.values())
    assert np.abs(coordinator.state.weights - expected).max() < 1e-5
    assert np.abs(coordinator.state.weights - start).max() > 100 * 1e-5  # it moved: the bound above says something
    assert "not-secure" not in results["counters"] and not any(k.startswith("secure-") for k in results["counters"])


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_sum_is_recovered_when_two_of_ten_devices_are_killed_after_masking(tmp_path, export_artifacts):
    """Ten device processes, one secure round through mosquitto: the first two whose masked vectors reach the broker
    are killed (SIGKILL) at once. The coordinator cannot have asked anyone to unmask by then, whatever the host's
    load: it is paused (SIGSTOP) from the first share it relays, before any device masks, until both are dead (their
    wills then say they went offline), and it asks only once all ten vectors are in. Their self masks come off with
    the shares the eight others reveal, and the global model is FedAvg of all ten updates (each as its device saved
    it), within quantisation."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=10, observer_reads_learning=True,
                  keepalive=60,  # the paused coordinator keeps its connection
                  coordinator_options={"rounds_per_task": 1, "train_tasks": 1, "min_clients": 8, "max_attempts": 1,
                                       "deadline_s": 900.0, "wait_for_devices_s": 900.0,  # every device waited for
                                       "secure_aggregation": {"mode": "secagg+"}},
                  device_options={"policy": {"name": "random"}})
    killed: list[str] = []
    paused = threading.Event()

    def pause_then_kill_the_first_two(client, userdata, message) -> None:
        coordinator = fleet.processes["coordinator"]
        if message.topic.endswith("/relayed"):
            if not paused.is_set():
                coordinator.send_signal(signal.SIGSTOP)
                paused.set()
            return
        device = message.topic.split("/")[3]
        if len(killed) < 2 and device not in killed:
            fleet.processes[device].kill()
            killed.append(device)
            if len(killed) == 2:
                coordinator.send_signal(signal.SIGCONT)

    try:
        fleet.start()
        fleet.wait_online()
        watcher = Peer(fleet.broker.address, "observer", fleet.observer_credentials.password)
        assert not watcher.connect().is_failure
        watcher.client.on_message = pause_then_kill_the_first_two
        watcher.subscribe(f"{topics.prefix(fleet.fleet)}/{topics.TO_DEVICE}/+/relayed")
        watcher.subscribe(f"{topics.prefix(fleet.fleet)}/{topics.FROM_DEVICE}/+/masked")
        fleet.start_coordinator()
        assert fleet.wait_coordinator(CEILING_S) == 0, fleet.log_tail("coordinator")
        watcher.close()
    finally:
        if "coordinator" in fleet.processes:
            fleet.processes["coordinator"].send_signal(signal.SIGCONT)  # never left paused, whatever failed
        fleet.stop()
    entry = fleet.results()["history"][0]
    assert len(killed) == 2 and all(fleet.processes[d].returncode == -signal.SIGKILL for d in killed)
    assert entry["secure"] == {"advertised": 10, "shared": 10, "masked": 10, "revealed": 8}, entry["secure"]
    assert entry["received"] == fleet.devices
    start = checkpoint_weights(artifacts).astype(np.float64)
    saved = {d: _claim(load_state(tmp_path / "devices" / d).weights, start, entry["metrics"][d]) for d in fleet.devices}
    expected = start + sum(n * (w - start) for w, n in saved.values()) / sum(n for _, n in saved.values())
    state, _ = load_latest(tmp_path / "run" / "checkpoint")
    assert np.abs(state.weights - expected).max() < 1e-5


def test_what_secure_aggregation_cannot_run_with_is_refused_in_one_line(tmp_path, export_artifacts):
    """A rule that needs each update, a guard check, central DP: each refused in one line, in a coordinator file and
    a fleet file; left out, the guard is off; a device whose policy attaches payloads refuses a secure round, and one
    that requires secure aggregation refuses a plain one."""
    base = {"fleet": "lab", "out": str(tmp_path / "run"), "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
            "devices": ["dev-0"], "scenario": {"preset": "digits-class"}, "secure_aggregation": {"mode": "secagg+"}}
    config = CoordinatorConfig.from_dict(base)
    assert config.guard.checks == () and config.secure_aggregation.on
    assert GuardSettings().checks  # the default guard judges each update
    refusals = [
        ({"strategy": {"name": "median"}}, "strategy.*secure_aggregation.*median needs each update"),
        ({"guard": {"norm_bound": "reject"}}, "secure_aggregation.*checks norm_bound, .* judge each update"),
        ({"privacy": {"mode": "central"}}, "secure_aggregation.*central DP clips each update"),
    ]
    for extra, expected in refusals:
        with pytest.raises(ConfigError, match=expected) as refused:
            CoordinatorConfig.from_dict({**base, **extra})
        assert "\n" not in str(refused.value)
    fleet = FleetConfig(name="lab", out=tmp_path / "fleet", devices=2, scenario={"preset": "digits-class"},
                        coordinator={"secure_aggregation": {"mode": "secagg+"}})
    assert fleet.coordinator_options()["guard"].checks == ()
    for extra, expected in refusals:
        table = {"strategy": {"name": "fedavg"}, **extra}
        fleet = FleetConfig(name="lab", out=tmp_path / "fleet", devices=2, scenario={"preset": "digits-class"},
                            strategy=table.pop("strategy"),
                            coordinator={"secure_aggregation": {"mode": "secagg+"}, **table})
        with pytest.raises(ConfigError, match=f"fleet config: .*{expected.rsplit('.*', 1)[1]}"):
            fleet.check()
    secure = {"secure": {"session": "s", "clip_range": 4.0, "max_weight": 100.0, "weighted": False}}
    assert secure_round(secure, make_policy("random")) == SecureRoundSettings("s", 4.0, 100.0, False)
    assert secure_round({}, make_policy("glfc", gamma="glfc_mlp")) is None
    with pytest.raises(ValueError, match="sums the weights alone: policy glfc attaches"):
        secure_round(secure, make_policy("glfc", gamma="glfc_mlp"))
    with pytest.raises(ValueError, match="require_secure_aggregation: this device sends its update only masked"):
        secure_round({}, make_policy("random"), required=True)
    assert secure_round(secure, make_policy("random"), required=True) is not None
    with pytest.raises(ValueError, match="secure aggregation: round-config"):
        secure_round({"secure": {"session": "s", "clip_range": -1.0, "max_weight": 100.0}}, make_policy("random"))


def test_an_unweighted_rule_weighs_every_device_alike_under_secure_aggregation() -> None:
    """FedAvg's `weighted = false` travels with the secure round: each device's change counts once, whatever its
    samples, and the sum weighs as its devices."""
    devices = devices_of(5, 200, np.random.default_rng(8))
    secure, _, _ = run_session(devices, weighted=False)
    result = secure.result()
    plain = sum(change for change, _ in devices.values()) / len(devices)
    assert np.abs(result.mean_change - plain).max() < 1e-6 and result.samples == pytest.approx(5)
    assert np.abs(result.mean_change - expected_mean(devices, set(devices))).max() > 1e-3  # not the weighted mean


def test_a_refused_sum_leaves_the_round_without_a_model_and_an_earlier_attempts_sum_stands() -> None:
    """A session that caught a lie gives the rule nothing: the round's result is None, said as the lie (the
    coordinator keeps its previous model and goes on), and no rule failure is counted; where an earlier attempt of
    the round delivered a sum, that sum is the round's model."""
    counters: Counter[str] = Counter()
    start = np.zeros(4, np.float32)

    def aggregate() -> RoundAggregate:
        return RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters),
                              GuardSettings.only(), start, counters, 1 << 30)

    refused = aggregate()
    refused.sum_refused("secure-sum-out-of-range", {"advertised": 3, "masked": 3})
    assert refused.close() is None and refused.refused_sum == "secure-sum-out-of-range"
    assert counters[RULE_FAILED] == 0 and refused.secure_counts == {"advertised": 3, "masked": 3}
    earlier = aggregate()
    summed = SecureSum(frozenset({"a", "b"}), np.full(4, 0.5), 30.0, 1e-9)
    earlier.add_sum(summed, start, {"a": {"loss": 1.0}, "b": {"loss": 2.0}}, {"masked": 2})
    earlier.sum_refused("secure-shares-withheld", {"masked": 3})
    result = earlier.close()
    assert result is not None and np.allclose(result.global_weights.numpy(), 0.5)
    assert earlier.samples == 30 and [u.device for u in earlier.used] == ["a", "b"]


SECURE_FLEET = """
name = "secure"
out = "run"
devices = 6
model = "lenet"
seed = 0
broker = "mosquitto"
scenario = {preset = "digits-class", n_clients = 6, seed = 0}
[policy]
name = "random"
[client]
epochs = 10
[coordinator]
rounds_per_task = 2
train_tasks = 2
min_clients = 6
deadline_s = 900.0
wait_for_devices_s = 900.0
[coordinator.secure_aggregation]
mode = "secagg+"
"""


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_simulated_fleet_runs_secure_aggregation_from_its_fleet_file(tmp_path):
    """`edgefil fleet run` of a fleet file that turns secure aggregation on (virtual devices in worker processes,
    sharing their network loops): every round sums all six devices, with the guard off as the file leaves it, and
    each task is learnt right after its rounds; the run's report says what the sessions summed."""
    results = run_fleet_file(tmp_path, SECURE_FLEET)
    trained = [entry for entry in results["history"] if entry.get("trained", True)]
    assert len(trained) == 4 and all(entry["secure"] == {"advertised": 6, "shared": 6, "masked": 6, "revealed": 6}
                                     for entry in trained), [entry.get("secure") for entry in trained]
    assert all(len(entry["received"]) == 6 for entry in trained)
    settings = results["settings"]
    assert settings["secure_aggregation"]["mode"] == "secagg+" and settings["guard"]["norm_bound"] == "off"
    diagonal = [results["accuracy_matrix"][t][t] for t in range(2)]
    assert min(diagonal) > 0.7, diagonal  # two classes a task: a coin gets 0.5
    summary = write_report(tmp_path / "run")[0].read_text()
    assert ("| secure aggregation (SecAgg+) | 24 masked vectors summed of 24 devices' keys, in 4 rounds; nothing "
            "refused, no session failed |") in summary
