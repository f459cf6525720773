"""Local differential privacy (edge_client/privacy.py): the device's epsilon against the mechanism's exact one and
dp-accounting's, its clip and noise by hand on a toy update, the count that survives a restart, the budget a device
stops at (through a real broker: the update that leaves is the release, and the run reports what was spent, its
dashboard in a real browser too), and a policy whose attachments the noise would not cover refused in one line."""
from __future__ import annotations

import math

import numpy as np
import pytest
from browser import CHROMEDRIVER, CHROMIUM, progress_line
from scipy.optimize import brentq
from scipy.stats import norm
from thread_fleet import ThreadFederation

from coordinator.broker import mosquitto_path
from coordinator.checkpoint import CheckpointPolicy
from coordinator.privacy import Accountant, PrivacySettings
from edge_client.config import DeviceConfig
from edge_client.device import local_privacy
from edge_client.policies import make_policy
from edge_client.policies.base import AttachedValues, RoundView
from edge_client.policies.random_cache import RandomCache
from edge_client.privacy import LocalPrivacy, LocalPrivacySettings
from edgefil.dp import gaussian_epsilon
from edgefil.settings import ConfigError
from firmware_sim.report import write_report
from models.feature_stats import STATISTICS, LayerStatistics, decode_statistics
from models.generator_record import GeneratorRecord, attachment_name, decode_record
from models.glfc import encode_gradient


@pytest.mark.parametrize(("sigma", "rounds"), [(1.0, 1), (1.0, 10), (4.0, 100), (0.5, 3)])
def test_a_devices_epsilon_is_the_gaussian_mechanisms_exact_one(sigma, rounds):
    """k Gaussian rounds of multiplier z are one Gaussian of mu = sqrt(k) / z; its exact epsilon (Balle and Wang
    2018), solved here by scipy, and dp-accounting's PLD (tight) agree with the device's closed form."""
    mu = math.sqrt(rounds) / sigma
    exact = brentq(lambda e: norm.cdf(mu / 2 - e / mu) - math.exp(e) * norm.cdf(-mu / 2 - e / mu) - 1e-5, 0, 200)
    device = gaussian_epsilon(rounds, sigma, 1e-5)
    accountant = Accountant(PrivacySettings(mode="central", noise_multiplier=sigma, accountant="pld"))
    accountant.add(1.0, rounds)
    assert device == pytest.approx(exact, rel=1e-6)
    assert device == pytest.approx(accountant.epsilon(), rel=0.01)
    assert gaussian_epsilon(0, sigma, 1e-5) == 0.0


def test_the_release_clips_the_change_then_adds_noise_of_twice_the_clip_and_is_counted_first(tmp_path):
    """Change [3, 4, 0, 0] (5 long) clipped to C = 1: [0.6, 0.8, 0, 0]; then noise of sd z x 2C; the count is on
    disk before the release is returned, and a device restarted later counts on from it."""
    g = np.full(4, 0.5, np.float32)
    settings = LocalPrivacySettings(mode="local", clip_norm=1.0, noise_multiplier=0.7)
    privacy = LocalPrivacy(settings, tmp_path)
    privacy.rng = np.random.default_rng(3)
    sent, attachments = privacy.release(g + np.array([3, 4, 0, 0], np.float32), g)
    assert attachments is None
    noise = np.random.default_rng(3).normal(0.0, 0.7 * 2 * 1.0, size=4)
    np.testing.assert_allclose(sent, g + np.array([0.6, 0.8, 0, 0]) + noise, atol=1e-6)
    near = np.array([0.1, 0, 0, 0], np.float32)  # within C: not scaled
    privacy.rng = np.random.default_rng(4)
    np.testing.assert_allclose(privacy.release(g + near, g)[0], g + near + np.random.default_rng(4).normal(
        0.0, 1.4, size=4), atol=1e-6)
    again = LocalPrivacy(settings, tmp_path)
    assert again.rounds == 2 and again.epsilon() == pytest.approx(gaussian_epsilon(2, 0.7, 1e-5))
    assert not np.array_equal(LocalPrivacy(settings, tmp_path / "a").release(g, g)[0],
                              LocalPrivacy(settings, tmp_path / "b").release(g, g)[0])  # the OS's entropy, not a seed


def test_what_a_policy_attaches_is_released_with_the_change_as_one_vector(tmp_path):
    """A change [3, 0] and attached values [0, 4] (a vector 5 long) are clipped to C = 1 together: [0.6, 0] and
    [0, 0.8], then noised alike (sd z 2C each); the values go back to the policy's encoding. GLFC's gradients and SDD's
    statistics and pFedGRP's generators give their numbers and take them back (a variance noised below zero is taken
    as 0; a generator keeps its header)."""
    g = np.zeros(2, np.float32)
    privacy = LocalPrivacy(LocalPrivacySettings(mode="local", clip_norm=1.0, noise_multiplier=0.5), tmp_path)
    privacy.rng = np.random.default_rng(7)
    attached = AttachedValues(np.array([0.0, 4.0]), lambda v: {"values": v.astype("<f8").tobytes()})
    sent, attachments = privacy.release(np.array([3.0, 0.0], np.float32), g, attached)
    noise = np.random.default_rng(7).normal(0.0, 0.5 * 2 * 1.0, size=4)
    np.testing.assert_allclose(sent, np.array([0.6, 0.0]) + noise[:2], atol=1e-6)
    np.testing.assert_allclose(np.frombuffer(attachments["values"]), np.array([0.0, 0.8]) + noise[2:], atol=1e-12)
    assert privacy.rounds == 1  # one mechanism, counted once
    glfc = make_policy("glfc", gamma="glfc_mlp")
    glfc._pending = {"proto/1": encode_gradient(np.arange(3.0)), "proto/0": encode_gradient(np.ones(2))}
    values = glfc.attached_values()
    np.testing.assert_array_equal(values.values, [1, 1, 0, 1, 2])
    assert values.encode(values.values) == glfc._pending
    sdd = make_policy("sdd")
    sdd._statistics = (LayerStatistics("input", np.ones(1, np.float32), np.ones(1, np.float32), 5),)
    values = sdd.attached_values()
    np.testing.assert_array_equal(values.values, [1, 1])
    released = decode_statistics(values.encode(np.array([0.3, -2.0]))[STATISTICS], {"input": 1})["input"]
    assert released.mean[0] == pytest.approx(0.3) and released.var[0] == 0.0 and released.count == 5
    generator = make_policy("generator")
    generator._attached = [GeneratorRecord(3, {"kind": "test"}, "float32", np.arange(4, dtype=np.float32),
                                           np.ones(2, np.float32), 10, 5)]
    values = generator.attached_values()
    np.testing.assert_array_equal(values.values, [0, 1, 2, 3, 1, 1])
    record = decode_record(values.encode(np.arange(6.0) / 2)[attachment_name(3)])
    np.testing.assert_array_equal(record.sampler, [0, 0.5, 1, 1.5])
    np.testing.assert_array_equal(record.auxiliary, [2, 2.5])
    assert (record.label, record.spec, record.trained_samples, record.steps) == (3, {"kind": "test"}, 10, 5)


def test_a_noise_seed_gives_each_devices_round_its_own_noise_again_after_a_restart(tmp_path):
    """`noise_seed` (experiments): a device's k-th release draws the same noise in any process (a restarted device, a
    rerun of the table); another device's stream, or another round, draws other noise."""
    g = np.zeros(50, np.float32)
    settings = LocalPrivacySettings(mode="local", noise_seed=5)

    def first_release(folder: str, stream: int) -> np.ndarray:
        return LocalPrivacy(settings, tmp_path / folder, stream=stream).release(g, g)[0]

    np.testing.assert_array_equal(first_release("a", 1), first_release("b", 1))
    assert not np.array_equal(first_release("c", 1), first_release("d", 2))
    again = LocalPrivacy(settings, tmp_path / "a", stream=1)  # its second round
    assert not np.array_equal(again.release(g, g)[0], first_release("e", 1))
    with pytest.raises(ConfigError, match="privacy.*noise_seed must be >= 0"):
        DeviceConfig.from_dict({"device_id": "dev-0", "fleet": "lab", "artifacts": "a", "state_dir": "s",
                                "privacy": {"mode": "local", "noise_seed": -1}})


def test_a_budget_stops_the_round_past_it_and_a_typo_or_an_attaching_policy_is_refused_in_one_line(tmp_path):
    budget = (gaussian_epsilon(2, 1.0, 1e-5) + gaussian_epsilon(3, 1.0, 1e-5)) / 2
    privacy = LocalPrivacy(LocalPrivacySettings(mode="local", epsilon_budget=budget), tmp_path)
    g = np.zeros(3, np.float32)
    for _ in range(2):
        assert privacy.refusal() is None
        privacy.release(g, g)
    assert privacy.refusal().startswith("local DP: another round would take epsilon to")
    base = {"device_id": "dev-0", "fleet": "lab", "artifacts": "a", "state_dir": str(tmp_path / "s")}
    with pytest.raises(ConfigError, match="privacy.*mode must be one of off, local"):
        DeviceConfig.from_dict({**base, "privacy": {"mode": "locl"}})
    config = DeviceConfig.from_dict({**base, "privacy": {"mode": "local"}})

    class Opaque(RandomCache):  # attaches bytes that are no numbers local DP could release
        def attachments(self, view: RoundView) -> dict[str, bytes]:
            return {"opaque": b"x"}

        def attaches(self) -> bool:
            return True

    with pytest.raises(ValueError, match="noises the weights and numbers a policy attaches: policy random "
                                         "attaches more") as refused:
        local_privacy(config, Opaque())
    assert "\n" not in str(refused.value)
    for name, options in (("glfc", {"gamma": "glfc_mlp"}), ("sdd", {}), ("generator", {}),
                          ("glfc", {"gamma": "glfc_mlp", "prototypes": False})):
        assert local_privacy(config, make_policy(name, **options)) is not None  # its numbers go into the release
    assert local_privacy(config, make_policy("random")) is not None


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_devices_release_noised_updates_and_stop_at_their_budget_through_a_real_broker(tmp_path, export_artifacts):
    """Two devices, z = 1, C = 1, a budget between one round's epsilon and two's: round 1's global model is the mean
    of two releases, so it moved from the first by noise of sd 2 z C / sqrt(2) a weight (the clipped changes add at
    most 1 / sqrt(30,986) in rms); in round 2 both refuse, saying why; the run reports the epsilon they spent."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    budget = (gaussian_epsilon(1, 1.0, 1e-5) + gaussian_epsilon(2, 1.0, 1e-5)) / 2
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100},
              "privacy": {"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0, "epsilon_budget": budget}}
    # the noise is far longer than the model (its norm about 250 against LeNet's weights'): the coordinator's check
    # of exploded models would refuse it, as it does any model that long (docs/security.md says to raise it)
    never_exploded = CheckpointPolicy(explode_factor=1e6)
    with ThreadFederation(tmp_path, artifacts, device, tasks=1) as federation:
        coordinator = federation.coordinator({"name": "fedavg", "weighted": False}, rounds_per_task=2,
                                             max_attempts=1, checkpoint=never_exploded)
        first = coordinator.state.weights.copy()
        moved = []
        coordinator.progress = lambda entry: moved.append(coordinator.state.weights - first)
        results = coordinator.run()
    step = moved[0].astype(np.float64)
    assert np.std(step) == pytest.approx(2 / math.sqrt(2), rel=0.05), np.std(step)
    assert results["local_epsilon"] == pytest.approx(gaussian_epsilon(1, 1.0, 1e-5))
    assert results["outcome"] == ("privacy-budget: 2 devices have spent their local privacy budget; 0 can still "
                                  "train, the quorum is 2"), results["outcome"]
    assert results["rounds_completed"] == 1 and results["counters"]["privacy-spent"] == 2
    reasons = list(results["privacy_spent"].values())
    assert len(reasons) == 2 and all("past the device's budget" in r for r in reasons), results["privacy_spent"]
    summary = write_report(federation.root / "run")[0].read_text()
    assert f"| privacy (local DP) | epsilon {results['local_epsilon']:.3f}" in summary
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/test installs them)")
    shown = progress_line(federation.root / "run", tmp_path, "local ε")  # the page says what the devices spent
    assert f"local ε ≤ {results['local_epsilon']:.2f} (the largest a device reported)" in shown, shown


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_glfc_devices_under_local_dp_release_their_prototype_gradients_with_their_weights(tmp_path, export_artifacts):
    """GLFC's devices under local DP through a real broker: their prototype gradients reach the coordinator inside
    the release (noised with the weights, one mechanism), the proxy judges every one that arrived, and each device's
    epsilon is the weights' alone, one round's per round."""
    from edge_client.policies import POLICIES

    artifacts = export_artifacts("lenet", 10, (1, 8, 8), backends=("ort", "torch", "portable"))
    POLICIES.get("glfc").export_artifacts({"gamma": "glfc_mlp"}, artifacts)
    device = {"store": {"max_samples": 60}, "policy": {"name": "glfc", "gamma": "glfc_mlp"},
              "privacy": {"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0, "noise_seed": 0}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=1) as federation:
        coordinator = federation.coordinator({"name": "glfc", "gamma": "glfc_mlp", "lbfgs_iterations": 5},
                                             rounds_per_task=2, checkpoint=CheckpointPolicy(explode_factor=1e6))
        results = coordinator.run()
    assert results["rounds_completed"] == 2
    assert results["local_epsilon"] == pytest.approx(gaussian_epsilon(2, 1.0, 1e-5))
    # every released gradient reached the proxy, which pooled it or refused it (a label read from noise may repeat or
    # lie outside the task's classes): one per class of the task from each of the two devices, in their first round
    proxy = [entry.get("rule_metrics", {}).get("proxy", {}) for entry in results["history"]]
    assert sum(p.get("prototypes_pooled", 0) + p.get("prototypes_refused", 0) for p in proxy) == 4, proxy
