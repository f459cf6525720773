"""Coordinator parts without a broker: selection, the round's acceptance rules, the inbox gate, checkpoints,
configuration files."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from coordinator.checkpoint import (
    CheckpointPolicy,
    RunState,
    generation_dir,
    generations,
    load_run_state,
    prune_generations,
    save_run_state,
)
from coordinator.config import CoordinatorConfig
from coordinator.inbox import Inbox, Registration, Status, Update
from coordinator.rounds import OpenRound, select
from edge_client.config import DeviceConfig
from edgefil import topics, wire
from edgefil.durable import StateError
from edgefil.settings import dump_toml
from firmware_sim.scenarios import preset

FLEET = "f"
ROOT = Path(__file__).resolve().parents[1]
MODEL = "ab" * 32


@pytest.mark.parametrize("n, fraction, quorum, expected", [(10, 0.3, 2, 3), (10, 0.1, 2, 2), (3, 1.0, 1, 3), (4, 0.5, 9, 4)])
def test_selection_takes_ceil_r_n_at_least_the_quorum(n, fraction, quorum, expected):
    available = [f"d{i}" for i in range(n)]
    chosen = select(available, fraction, quorum, np.random.default_rng(0))
    assert len(chosen) == expected and len(set(chosen)) == expected and set(chosen) <= set(available)
    assert chosen == sorted(chosen)
    assert chosen == select(list(reversed(available)), fraction, quorum, np.random.default_rng(0))  # seeded
    assert all(any(name is own for own in available) for name in chosen)  # the names given, not copies


def test_a_round_keeps_the_names_it_selected_not_those_its_updates_carry():
    """A round's entry names its devices by the strings it selected, one per device however many rounds name it,
    not by a string made from each update's topic (which the history kept, a round's worth at a time)."""
    selected = ["d1", "d2"]
    current = OpenRound.open(5, 0, MODEL, selected, deadline_s=60)
    carried = "".join(["d", "1"])  # as a topic's parse makes it: equal, another object
    assert carried == "d1" and carried is not selected[0]
    assert current.offer(update(carried), Counter()) is None
    assert next(iter(current.delivered)) is selected[0]


def update(device="d1", round_=5, model=MODEL, task=0) -> Update:
    return Update(device, round_, task, model, 10, {}, np.zeros(3, np.float32))


def test_open_round_accepts_each_selected_device_once_and_names_every_refusal():
    current = OpenRound.open(5, 0, MODEL, ["d1", "d2"], deadline_s=60)
    counts: Counter[str] = Counter()
    assert current.offer(update(), counts) is None
    assert current.offer(update(), counts) == "duplicate"
    assert current.offer(update(round_=4), counts) == "late"
    assert current.offer(update(round_=6), counts) == "wrong-round"
    assert current.offer(update("d2", model="cd" * 32), counts) == "wrong-round"
    assert current.offer(update("d3"), counts) == "not-selected"
    assert current.offer(update("d2", task=1), counts) == "wrong-task"
    assert not current.complete and current.missing() == ["d2"]
    assert current.offer(update("d2"), counts) is None and current.complete
    assert counts == Counter({"duplicate": 1, "late": 1, "wrong-round": 2, "not-selected": 1, "wrong-task": 1})


def test_inbox_turns_valid_messages_into_events_and_counts_the_rest():
    inbox = Inbox(FLEET, {"d1", "d2"}, manifest="m" * 64, num_parameters=8)
    register = wire.encode("register", device="d1", profile="pi4", backend="ort", manifest="m" * 64, software="0")
    event = inbox.accept(topics.from_device(FLEET, "d1", "register"), register)
    assert event == Registration("d1", "ort", "pi4")
    status = wire.encode("status", device="d2", state="idle", round=0)
    assert inbox.accept(topics.from_device(FLEET, "d2", "status"), status) == Status("d2", "idle", 0)
    w = np.arange(8, dtype=np.float32)
    chunks = wire.encode_blob("update", wire.weights_bytes(w), device="d1", round=1, task=0, model=MODEL,
                              num_samples=4, metrics={"loss": 1.0}).chunks
    event = inbox.accept(topics.from_device(FLEET, "d1", "update"), chunks[0])
    assert isinstance(event, Update) and event.num_samples == 4
    np.testing.assert_array_equal(event.weights, w)
    assert not inbox.rejections

    refused = {
        "unknown-device": (topics.from_device(FLEET, "d9", "register"), register),
        "impersonation": (topics.from_device(FLEET, "d2", "register"), register),
        "manifest-mismatch": (topics.from_device(FLEET, "d1", "register"),
                              wire.encode("register", device="d1", profile="p", backend="ort", manifest="x",
                                          software="0")),
        "kind": (topics.from_device(FLEET, "d1", "update"), status),
        "topic": ("elsewhere/d1/update", status),
    }
    for reason, (topic, payload) in refused.items():
        assert inbox.accept(topic, payload) is None, reason
    assert inbox.rejections == Counter({reason: 1 for reason in refused})
    # the coordinator's own messages, echoed back by a wildcard subscription, are not counted as bad input
    assert inbox.accept(topics.to_device(FLEET, "d1", "round"), b"x") is None
    assert sum(inbox.rejections.values()) == len(refused)


def test_run_state_checkpoint_round_trips_and_refuses_a_tampered_weight_file(tmp_path):
    entry = {"round": 3, "task": 1, "accuracy": [0.9, 0.8]}
    state = RunState(weights=np.arange(5, dtype=np.float32), round=3, task=1, round_in_task=1,
                     rng=np.random.default_rng(4).bit_generator.state, history=[entry],
                     accuracy_matrix=[[0.9]], counters={"late": 2})
    save_run_state(tmp_path, state)
    loaded = load_run_state(tmp_path)
    np.testing.assert_array_equal(loaded.weights, state.weights)
    assert (loaded.round, loaded.task, loaded.history, loaded.counters) == (3, 1, [entry], {"late": 2})
    rng = np.random.default_rng()
    rng.bit_generator.state = loaded.rng
    assert rng.random() == np.random.default_rng(4).random()
    weight_file = next(tmp_path.glob("weights-*.f32"))
    weight_file.write_bytes(b"\0" * weight_file.stat().st_size)
    with pytest.raises(StateError, match="sha256"):
        load_run_state(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("round", "3"), ("task", -1), ("round_in_task", True), ("rng", {"state": 5}), ("history", 5),
    ("history", [{"round": 1, "task": 2, "accuracy": [0.5]}]), ("accuracy_matrix", [["x"]]),
    ("counters", {"late": "2"}), ("counters", [1]), ("unknown", 1),
])
def test_a_checkpoint_value_of_the_wrong_type_is_refused_at_load(tmp_path, field, value):
    """A saved run state that parses but holds a value of another type would break the run rounds later: it is
    refused when it is loaded (and --resume falls back to the generation before)."""
    save_run_state(tmp_path, RunState(weights=np.zeros(4, np.float32), rng=np.random.default_rng(0).bit_generator.state))
    path = tmp_path / "state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(StateError, match=field):
        load_run_state(tmp_path)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    save_run_state(tmp_path, RunState(weights=np.zeros(4, np.float32), rng=np.random.default_rng(0).bit_generator.state))
    assert load_run_state(tmp_path, num_parameters=4) is not None
    with pytest.raises(StateError, match="4 values, this run's has 5"):
        load_run_state(tmp_path, num_parameters=5)


def test_configs_refuse_unknown_keys_and_bad_values(tmp_path):
    base = {"fleet": FLEET, "out": "run", "artifacts": "a", "devices": ["d1", "d2"], "scenario": {"preset": "x"}}
    config = CoordinatorConfig.from_dict(base, base=tmp_path)
    assert config.out == (tmp_path / "run").resolve() and config.broker.username == "coordinator"
    for bad in ({"rounds": 3}, {"fraction": 0.0}, {"min_clients": 3}, {"devices": ["a/b"]}, {"broker": {"pw": "x"}}):
        with pytest.raises(ValueError):
            CoordinatorConfig.from_dict({**base, **bad}, base=tmp_path)
    device = {"device_id": "d1", "fleet": FLEET, "artifacts": "a", "state_dir": "s", "data": {"folder": "data"}}
    loaded = DeviceConfig.from_dict(device, base=tmp_path)
    assert loaded.broker.username == "d1" and loaded.data.folder == (tmp_path / "data").resolve()
    for bad in ({"device_id": "d 1"}, {"trainer": {"speed": 2}}, {"policy": {"lam": 0.5}}, {"extra": 1}):
        with pytest.raises(ValueError):
            DeviceConfig.from_dict({**device, **bad}, base=tmp_path)


def test_a_run_folder_with_a_checkpoint_needs_resume(tmp_path, export_artifacts):
    from coordinator.server import CHECKPOINT_DIR, Coordinator

    config = CoordinatorConfig.from_dict({
        "fleet": FLEET, "out": "run", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "devices": ["d1"], "scenario": {"preset": "digits-class", "n_clients": 1},
    }, base=tmp_path)
    test_sets = preset("digits-class", n_clients=1).build()
    fresh = Coordinator(config, test_sets=test_sets)
    assert fresh.state.round == 0 and fresh.state.weights.dtype == np.float32
    root = tmp_path / "run" / CHECKPOINT_DIR
    for round_ in (1, 2, 3):
        save_run_state(generation_dir(root, round_),
                       RunState(weights=fresh.state.weights, round=round_, task=1, rng=fresh.state.rng))
    with pytest.raises(FileExistsError, match="--resume"):
        Coordinator(config, test_sets=test_sets)
    resumed = Coordinator(config, resume=True, test_sets=test_sets)
    assert (resumed.state.round, resumed.state.task) == (3, 1)
    # a damaged newest generation: --resume falls back to the one before
    next(generation_dir(root, 3).glob("weights-*.f32")).write_bytes(b"\0" * 4)
    assert Coordinator(config, resume=True, test_sets=test_sets).state.round == 2
    (generation_dir(root, 2) / "state.json").write_text("{not json")
    (generation_dir(root, 1) / "state.json").write_text("[]")
    with pytest.raises(StateError, match="round-000003.*round-000002.*round-000001"):
        Coordinator(config, resume=True, test_sets=test_sets)
    # the command line says so in one line
    file = tmp_path / "coordinator.toml"
    file.write_text(dump_toml({"fleet": FLEET, "out": "run", "artifacts": str(config.artifacts), "devices": ["d1"],
                               "scenario": {"preset": "digits-class", "n_clients": 1}}))
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "coordinator", "--config", str(file), "--resume"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # the log's warnings, then the reason in one line
    assert done.stderr.splitlines()[-1].startswith("edgefil coordinator: no checkpoint in"), done.stderr


def test_devices_out_of_the_run_are_kept_failed_said_at_most_a_few_times_and_end_a_quorum_out_of_reach(
        tmp_path, export_artifacts, caplog):
    """`device_failed` (a fleet's worker says a device failed to start): the device is "failed" with why and
    counted, once however often it is said, a device not of the run passed over; the first FAILURES_SAID are each
    said at ERROR, then one line for the rest (a fleet whose 10,000 devices all fail said so 10,000 times); the
    quorum is out of reach once fewer devices than it are left."""
    from coordinator.server import FAILURES_SAID, Coordinator

    devices = [f"d{k}" for k in range(FAILURES_SAID + 3)]
    config = CoordinatorConfig.from_dict({
        "fleet": FLEET, "out": "run", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "devices": devices, "scenario": {"preset": "digits-class", "n_clients": len(devices)}, "min_clients": 2,
    }, base=tmp_path)
    coordinator = Coordinator(config, test_sets=preset("digits-class", n_clients=len(devices)).build())
    for device in [*devices[:-2], devices[0], "stranger"]:
        coordinator.device_failed(device, f"it failed to start: OSError: {device}'s disk")
    with caplog.at_level("ERROR", logger="edgefil.coordinator"):
        coordinator._take_failures()
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == FAILURES_SAID + 1 and said[0].startswith("device d0 is out of the run: it failed to start")
    assert said[-1].startswith("more devices are out of the run")
    assert coordinator.counters["device-failed"] == len(devices) - 2 and set(coordinator.roster.failed) == set(
        devices[:-2])
    assert coordinator.roster.records["d0"].state == "failed" and coordinator._can_reach_quorum()
    coordinator.device_failed(devices[-1], "it stopped: RuntimeError: no")
    coordinator._take_failures()
    assert not coordinator._can_reach_quorum()


def test_a_large_fleets_console_says_a_few_registrations_a_round_and_names_a_few_selected_devices(
        tmp_path, export_artifacts, caplog):
    """A fleet of 10,000 devices put every registration on the coordinator's console and, each round, a line naming
    all its selected devices: the first REGISTRATIONS_SAID registrations until the first round opens are said at
    INFO, then one line says the others go to DEBUG (where each still is), and each round says its first ones again;
    a round's line names NAMES_SHOWN devices and counts the rest."""
    from coordinator.inbox import Registration
    from coordinator.server import REGISTRATIONS_SAID, Coordinator
    from edgefil.logs import NAMES_SHOWN

    devices = [f"d{k:02d}" for k in range(max(REGISTRATIONS_SAID, NAMES_SHOWN) + 5)]
    config = CoordinatorConfig.from_dict({
        "fleet": FLEET, "out": "run", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "devices": devices, "scenario": {"preset": "digits-class", "n_clients": len(devices)},
    }, base=tmp_path)
    coordinator = Coordinator(config, test_sets=preset("digits-class", n_clients=len(devices)).build())
    with caplog.at_level("DEBUG", logger="edgefil.coordinator"):
        for device in devices:
            coordinator._on_registration(Registration(device, "portable", "generic", "first"))
        coordinator._first_round = False  # (as the first round's wait ends)
        coordinator._open(1, 0, devices, None)
        coordinator._on_registration(Registration(devices[0], "portable", "generic", "second"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    registered = [(level, text.split()[0]) for level, text in lines if " registered (" in text]
    assert registered == [("INFO", d) for d in devices[:REGISTRATIONS_SAID]] + [
        ("DEBUG", d) for d in devices[REGISTRATIONS_SAID:]] + [("INFO", devices[0])]
    told = [text for level, text in lines if text.startswith("more devices registering")]
    assert len(told) == 1 and "waiting for the fleet" in told[0]
    selected = next(text for _, text in lines if text.startswith("round 1 (task 0): selected"))
    shown = ", ".join(devices[:NAMES_SHOWN])
    assert selected == f"round 1 (task 0): selected {shown} and {len(devices) - NAMES_SHOWN} more"


def test_generations_beyond_keep_and_incomplete_ones_are_pruned(tmp_path):
    weights = np.zeros(3, dtype=np.float32)
    for round_ in range(1, 6):
        save_run_state(generation_dir(tmp_path, round_), RunState(weights=weights, round=round_))
    generation_dir(tmp_path, 6).mkdir()  # a crash before its state.json: incomplete
    prune_generations(tmp_path, keep=3, current=generation_dir(tmp_path, 5))
    assert [g.name for g in generations(tmp_path)] == ["round-000005", "round-000004", "round-000003"]


def test_a_model_that_explodes_or_collapses_is_refused():
    policy = CheckpointPolicy()
    old = np.ones(10, dtype=np.float32)
    assert policy.problem(old * 1.5, old) is None
    assert policy.problem(old * 1e30, old) == "model-exploded"
    assert policy.problem(np.full(10, np.nan, dtype=np.float32), old) == "model-nonfinite"
    assert policy.collapsed(0.2, best=0.9) and not policy.collapsed(0.5, best=0.9) and not policy.collapsed(0.1, None)
    assert CheckpointPolicy(explode_factor=0).problem(old * 1e30, old) is None
    state = RunState(weights=old, history=[
        {"task": 0, "accuracy": [0.5]}, {"task": 0, "accuracy": [0.9]}, {"task": 0, "accuracy": [0.95], "refused": "x"},
        {"task": 1, "accuracy": [0.8, 0.3]}])
    assert state.best_accuracy(0) == 0.9 and state.best_accuracy(1) == 0.3 and state.best_accuracy(2) is None


def test_an_open_round_waits_for_exactly_the_selected_devices_that_have_not_answered():
    """`complete` is kept as devices answer, leave, return and fail (not recomputed from the selection)."""
    current = OpenRound.open(5, 0, MODEL, ["d1", "d2", "d3", "d4"], deadline_s=60)
    current.carry_over({"d1", "d9"})  # the earlier attempt's deliveries, one of them not selected now
    assert current.waiting == {"d2", "d3", "d4"} and not current.awaits("d1") and not current.awaits("d9")
    current.went_offline("d2")
    current.failed_with("d3", "no data")
    assert current.waiting == {"d4"} and current.awaits("d2") and current.awaits("d3")
    assert current.came_back("d2")
    assert not current.came_back("d3")  # never gone: still failed
    assert current.waiting == {"d2", "d4"}
    counts: Counter[str] = Counter()
    assert current.offer(update("d2"), counts) is None and not current.complete
    assert current.offer(update("d4"), counts) is None and current.complete
    assert current.delivered == {"d1", "d2", "d4", "d9"} and current.missing() == ["d3"]


def test_a_selected_device_that_goes_offline_does_not_hold_the_round_but_may_still_deliver():
    current = OpenRound.open(5, 0, MODEL, ["d1", "d2"], deadline_s=60)
    counts: Counter[str] = Counter()
    assert current.offer(update("d1"), counts) is None
    current.went_offline("d2")
    assert current.complete and current.missing() == ["d2"]
    assert current.offer(update("d2"), counts) is None  # back in time after all
    assert current.delivered == {"d1", "d2"} and not current.gone


def test_a_coordinator_started_before_its_broker_says_it_waits_and_keeps_waiting(tmp_path, export_artifacts):
    """`edgefil coordinator` with no broker at its address: a warning naming the address within seconds (not a
    minute of silence and a traceback), and it keeps trying, as a device does, until it is stopped."""
    import queue
    import signal
    import threading

    from coordinator.broker import free_port

    port = free_port()
    file = tmp_path / "coordinator.toml"
    file.write_text(dump_toml({"fleet": FLEET, "out": "run", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
                               "devices": ["d1"], "scenario": {"preset": "digits-class", "n_clients": 1},
                               "broker": {"host": "127.0.0.1", "port": port}}))
    process = subprocess.Popen([sys.executable, "-m", "edgefil.cli", "coordinator", "--config", str(file)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        said = ""
        while f"waiting for the MQTT broker at 127.0.0.1:{port}" not in said:
            said = lines.get(timeout=300)  # a ceiling (its imports on a busy host), not an expectation
            assert "Traceback" not in said, said
        assert process.poll() is None  # said, and still waiting
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 130
