"""The device daemon against a real mosquitto, with the test playing the coordinator: it registers, trains on
its round, answers a repeated round with the same update (also after a process restart, from its saved state),
and shrugs off garbage. Its data comes from a folder of task files, as on a real device."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
from mqtt_helpers import Peer

from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.privacy import LocalPrivacySettings
from edge_client.sources import FolderSource
from edge_client.state import load_state
from edge_client.trainers.ort import OrtTrainer
from edgefil import topics, wire
from edgefil.dp import gaussian_epsilon
from firmware_sim.datasets import load_dataset
from models.manifest import manifest_digest

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"


@pytest.fixture
def setup(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    data = load_dataset("digits")
    folder = tmp_path / "incoming"
    folder.mkdir()
    first = np.isin(data.y_train, [0, 1])
    np.savez(folder / "task-0.npz", x=data.x_train[first][:80], y=data.y_train[first][:80])
    broker = MosquittoBroker(tmp_path / "broker", FLEET, {"dev-0": "pw"}, Credentials("coordinator", "pw-c"))
    broker.start()
    config = DeviceConfig.from_dict({
        "device_id": "dev-0", "fleet": FLEET, "artifacts": str(artifacts), "state_dir": str(tmp_path / "state"),
        "heartbeat_s": 0.5, "broker": {"port": broker.address.port, "password": "pw", "keepalive": 2},
        "store": {"max_samples": 50}, "policy": {"name": "random"}, "data": {"folder": str(folder)},
    })
    coordinator = Peer(broker.address, "coordinator", "pw-c")
    assert not coordinator.connect().is_failure
    coordinator.subscribe(f"{topics.prefix(FLEET)}/dev/+/+")
    yield config, coordinator, OrtTrainer(artifacts).get_weights()
    coordinator.close()
    broker.stop()


def start(config: DeviceConfig, **options: Any) -> tuple[Device, threading.Thread]:
    """Build and run a device (`options`: the Device's) on its own thread."""
    built: list[Device] = []
    ready = threading.Event()

    def run() -> None:
        built.append(Device(config, **options))
        ready.set()
        built[0].run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60)
    return built[0], thread


def updates(coordinator: Peer, n_params: int) -> list[wire.Blob]:
    reassembler = wire.Reassembler(4 * n_params)
    topic = topics.from_device(FLEET, "dev-0", "update")
    blobs = []
    for i, (t, payload) in enumerate(list(coordinator.messages)):
        if t == topic and (blob := reassembler.add(f"{i}", wire.decode(payload))) is not None:
            blobs.append(blob)
    return blobs


def send_round(coordinator: Peer, weights: np.ndarray, round_: int = 1, task: int = 0, **config) -> str:
    encoded = wire.encode_blob("weights", wire.weights_bytes(weights), round=round_, version=round_ - 1)
    for chunk in encoded.chunks:
        coordinator.publish(topics.to_all(FLEET, "weights"), chunk)
    model = encoded.id
    coordinator.publish(topics.to_device(FLEET, "dev-0", "round"), wire.encode(
        "round", round=round_, task=task, model=model, version=round_ - 1, deadline_s=30,
        config={"epochs": 1, **config}))
    return model


def wait_for(condition, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_device_trains_its_round_and_answers_repeats_with_the_same_update(setup):
    config, coordinator, initial = setup
    n = len(initial)
    device, thread = start(config)
    register = wire.decode(coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30))
    assert register["manifest"] == manifest_digest(config.artifacts) and register["backend"] == "ort"

    coordinator.publish(topics.to_device(FLEET, "dev-0", "round"), b"\xc1 garbage")  # ignored, not fatal
    model = send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 1)
    first = updates(coordinator, n)[0]
    assert first.header["round"] == 1 and first.header["model"] == model and first.header["num_samples"] == 50
    assert not np.array_equal(first.weights(n), initial)  # it trained
    assert device.rejected == 1 and thread.is_alive()

    send_round(coordinator, initial)  # the same round again (e.g. after a broker restart): same update
    wait_for(lambda: len(updates(coordinator, n)) == 2)
    assert updates(coordinator, n)[1].id == first.id

    device.stop_requested.set()
    thread.join(15)
    wait_for(lambda: statuses(coordinator)[-1]["state"] == "offline")  # (it reaches this peer after the join)

    restarted, thread = start(config)  # a new process would do the same: restore, then answer from the state
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30, index=1)  # subscribed again
    assert restarted.learner.state.round == 1 and restarted.learner.state.model == model
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 3)
    assert updates(coordinator, n)[2].id == first.id

    # FedProx: the coordinator sends mu and the device applies the proximal term; a strong pull keeps the
    # update near the global weights it started from
    send_round(coordinator, initial, round_=2, epochs=10)
    wait_for(lambda: len(updates(coordinator, n)) == 4)
    send_round(coordinator, initial, round_=3, epochs=10, mu=500.0)
    wait_for(lambda: len(updates(coordinator, n)) == 5)
    free, pulled = updates(coordinator, n)[3:]
    assert (free.header["round"], pulled.header["round"]) == (2, 3)
    distance = lambda blob: np.linalg.norm(blob.weights(n) - initial)  # noqa: E731
    assert distance(pulled) < 0.5 * distance(free)
    restarted.stop_requested.set()
    thread.join(15)


def test_under_local_dp_a_device_sends_one_release_a_round_however_often_asked(setup):
    """edge_client/privacy.py: what leaves is the trained weights' change clipped to C = 1 plus noise of sd 2 z C =
    2 a weight (the clipped change adds at most 1 / sqrt(30,986) in rms), with its epsilon; asked again, and after
    a restart, the device sends that same release (one noise draw, one round counted), never a second one."""
    config, coordinator, initial = setup
    config = dataclasses.replace(config, privacy=LocalPrivacySettings(mode="local", clip_norm=1.0,
                                                                      noise_multiplier=1.0))
    n = len(initial)
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 1)
    first = updates(coordinator, n)[0]
    assert np.std(first.weights(n) - initial) == pytest.approx(2.0, rel=0.05)
    assert first.header["metrics"]["local_epsilon"] == pytest.approx(gaussian_epsilon(1, 1.0, 1e-5))
    send_round(coordinator, initial)  # the same round again: the same release
    wait_for(lambda: len(updates(coordinator, n)) == 2)
    assert updates(coordinator, n)[1].id == first.id
    device.stop_requested.set()
    thread.join(15)
    restarted, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30, index=1)
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 3)
    assert updates(coordinator, n)[2].id == first.id
    assert restarted.privacy is not None and restarted.privacy.rounds == 1
    restarted.stop_requested.set()
    thread.join(15)


def test_a_device_whose_task_brings_no_samples_trains_on_its_store(setup):
    """GLFC's old-data-only clients: task 1's file holds no samples, the store holds task 0's: the device starts
    task 1 and trains on what it stores (an update of its 50 samples), instead of refusing the round."""
    config, coordinator, initial = setup
    n = len(initial)
    np.savez(config.data.folder / "task-1.npz", x=np.zeros((0, 1, 8, 8), np.float32), y=np.zeros(0, np.int64))
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 1)
    send_round(coordinator, initial, round_=2, task=1)
    wait_for(lambda: len(updates(coordinator, n)) == 2)
    second = updates(coordinator, n)[1]
    assert second.header["round"] == 2 and second.header["num_samples"] == 50
    assert not np.array_equal(second.weights(n), initial)  # it trained
    assert device.learner.state.task == 1 and not any(m["state"] == "error" for m in statuses(coordinator))
    device.stop_requested.set()
    thread.join(15)


def test_a_device_that_learnt_nothing_claims_no_samples(setup):
    """A device whose data hold one class, and which masks the classes it has not seen, has a loss of 0: its
    weights come back as the global model's, and it says it learnt from nothing rather than claiming its 50 samples
    (which would weigh the global model back into the round and make it a free rider to the guard)."""
    config, coordinator, initial = setup
    n = len(initial)
    x, y = (np.load(config.data.folder / "task-0.npz")[k] for k in ("x", "y"))
    np.savez(config.data.folder / "task-0.npz", x=x[y == 0], y=y[y == 0])
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, n)) == 1)
    update = updates(coordinator, n)[0]
    assert np.array_equal(update.weights(n), initial) and update.header["num_samples"] == 0
    assert update.header["metrics"]["stored_samples"] > 0  # it holds samples; it learnt nothing from them
    device.stop_requested.set()
    thread.join(15)


def statuses(coordinator: Peer) -> list[wire.Message]:
    topic = topics.from_device(FLEET, "dev-0", "status")
    return [wire.decode(p) for t, p in list(coordinator.messages) if t == topic]


def test_a_round_the_device_cannot_train_is_reported_with_its_reason(setup, tmp_path):
    """Malformed task data and a training that diverges: instead of going silent until the deadline, the device
    says it cannot train the round and why (a status "error"), uploads nothing and carries on."""
    config, coordinator, initial = setup
    (config.data.folder / "task-0.npz").write_bytes(b"PK\x03\x04 not really a zip")
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    send_round(coordinator, initial)
    wait_for(lambda: any(m["state"] == "error" for m in statuses(coordinator)))
    error = next(m for m in statuses(coordinator) if m["state"] == "error")
    assert error["round"] == 1 and "task-0.npz is not a task file" in error["error"], error
    assert error["instance"] == device.instance

    np.savez(config.data.folder / "task-0.npz", x=np.full((40, 1, 8, 8), 1e30, np.float32),
             y=np.arange(40) % 2)  # finite data, but no training survives it
    send_round(coordinator, initial, round_=2)
    wait_for(lambda: sum(m["state"] == "error" for m in statuses(coordinator)) == 2)
    diverged = [m for m in statuses(coordinator) if m["state"] == "error"][1]
    assert diverged["round"] == 2 and "diverged" in diverged["error"], diverged
    assert updates(coordinator, len(initial)) == [] and thread.is_alive()

    # data that do not fit the model: refused before anything is stored or trained, the reason in one line
    for round_, (x, y, reason) in enumerate([
        (np.zeros((40, 1, 28, 28), np.float32), np.arange(40) % 2, "have shape (1, 28, 28), the model takes (1, 8, 8)"),
        (np.zeros((40, 1, 8, 8), np.float32), np.arange(40) % 2 + 10, "labels [10, 11] are not classes of the model"),
        (np.full((40, 1, 8, 8), np.nan, np.float32), np.arange(40) % 2, "NaN or infinite"),
    ], start=3):
        np.savez(config.data.folder / "task-0.npz", x=x, y=y)
        device.learner.state.data_task = -1  # a new task file: taken again
        send_round(coordinator, initial, round_=round_)
        wait_for(lambda n=round_: sum(m["state"] == "error" for m in statuses(coordinator)) == n)
        error = [m for m in statuses(coordinator) if m["state"] == "error"][-1]
        assert error["round"] == round_ and reason in error["error"] and "\n" not in error["error"], error
    assert updates(coordinator, len(initial)) == []  # nothing trained, nothing uploaded
    device.stop_requested.set()
    thread.join(15)


def test_a_trained_round_takes_no_status_heartbeats_go_unacknowledged_and_what_a_round_waits_on_acknowledged(setup):
    """A round the device trains takes no status from it (its round message and its update say it all: the
    coordinator shows it training between the two); its heartbeats are QoS 0, no acknowledgement at the device, the
    broker or the coordinator for what is said again anyway, and one comes after the update. Its announcement, its
    update, an answer the round waits on (an error) and its exit's offline stay QoS 1 (the coordinator subscribes at
    QoS 1, so each arrives at its publisher's QoS)."""
    config, coordinator, initial = setup
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    send_round(coordinator, initial)
    wait_for(lambda: len(updates(coordinator, len(initial))) == 1)
    update = next(i for i, (t, _) in enumerate(coordinator.messages) if t.endswith("/update"))
    # a heartbeat (heartbeat_s = 0.5) after the update
    wait_for(lambda: any(t.endswith("/status") for t, _ in list(coordinator.messages)[update:]))
    (config.data.folder / "task-1.npz").write_bytes(b"not a task file")
    send_round(coordinator, initial, round_=2, task=1)
    wait_for(lambda: any(m["state"] == "error" for m in statuses(coordinator)))
    device.stop_requested.set()
    thread.join(15)

    received = list(zip(coordinator.messages, coordinator.qos))
    said = [(wire.decode(p)["state"], qos) for (t, p), qos in received if t.endswith("/status")]
    assert said[0] == ("idle", 1) and said[-1] == ("offline", 1), said  # the announcement, the exit
    errors = [i for i, entry in enumerate(said) if entry[0] == "error"]
    assert [said[i] for i in errors] == [("error", 1)], said  # round 2 cannot be trained: the answer
    assert set(said[1:errors[0]]) == {("idle", 0)}, said  # heartbeats only: nothing said of round 1's training
    assert {qos for (t, _), qos in received if t.endswith("/update")} == {1}


@pytest.mark.parametrize("on_end", ["exit", "wait"])
def test_when_the_coordinator_says_the_run_is_over_the_device_exits_or_waits(setup, on_end):
    config, coordinator, _ = setup
    device, thread = start(dataclasses.replace(config, on_end=on_end))
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    coordinator.publish(topics.to_all(FLEET, "end"), b"", retain=True)  # a cleared end (a new run): nothing
    coordinator.publish(topics.to_all(FLEET, "end"), wire.encode("end", outcome="complete", rounds=5), retain=True)
    wait_for(lambda: device.run_ended is not None)
    assert device.run_ended == "complete after 5 rounds" and device.rejected == 0
    if on_end == "exit":
        thread.join(15)
        assert not thread.is_alive()
        # its goodbye was published before the thread ended, and reaches this peer through the broker after it
        wait_for(lambda: statuses(coordinator)[-1]["state"] == "offline")
    else:
        assert thread.is_alive() and not device.stop_requested.is_set()
        device.stop_requested.set()
        thread.join(15)
    coordinator.publish(topics.to_all(FLEET, "end"), b"", retain=True)


def test_a_device_stopped_by_request_stop_does_not_poll_and_leaves_at_once(setup):
    """A fleet worker stops its devices with request_stop, so they need not wake every STOP_POLL_S to look: idle,
    this one would sleep until its next heartbeat, an hour away, and it still leaves when asked."""
    config, coordinator, _ = setup
    device, thread = start(dataclasses.replace(config, heartbeat_s=3600.0), stop_poll_s=None)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    wait_for(lambda: bool(statuses(coordinator)))  # its first status: the heartbeat clock has started
    assert device._idle_wait() > 3000.0
    device.request_stop()
    thread.join(15)
    assert not thread.is_alive()
    wait_for(lambda: statuses(coordinator)[-1]["state"] == "offline")


def test_a_notice_is_logged_only_by_the_processes_it_names(setup):
    config, coordinator, _ = setup
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
    notice = topics.to_device(FLEET, "dev-0", "notice")
    coordinator.publish(notice, wire.encode("notice", reason="duplicate-device", detail="about others",
                                            instances=["0" * 16, "1" * 16]))
    coordinator.publish(notice, wire.encode("notice", reason="duplicate-device", detail="about this one",
                                            instances=[device.instance, "1" * 16]))
    wait_for(lambda: len(device.notices) == 1)
    assert device.notices == ["duplicate-device: about this one"]
    device.stop_requested.set()
    thread.join(15)


def test_folder_source_reads_task_files_and_names_what_is_missing(tmp_path):
    np.savez(tmp_path / "task-0.npz", x=np.zeros((3, 1, 8, 8)), y=np.array([1, 2, 3]))
    x, y = FolderSource(tmp_path).task_data(0)
    assert x.dtype == np.float32 and y.dtype == np.int64 and len(y) == 3
    with pytest.raises(FileNotFoundError, match="task-1.npz"):
        FolderSource(tmp_path).task_data(1)
    with pytest.raises(FileNotFoundError):
        FolderSource(tmp_path / "nowhere")


def test_a_device_whose_disk_fills_keeps_a_valid_store_and_reports_it(setup, tmp_path):
    from edge_client.budget import Budget
    from edge_client.store import ReplayStore
    from firmware_sim import disk

    config, coordinator, initial = setup
    folder = tmp_path / "small-disk"
    if not disk.mount(folder, 48 * 1024):  # smaller than the samples, and than a weight file (124 KB)
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        config = DeviceConfig.from_dict({**_raw(config), "state_dir": str(folder), "store": {"max_samples": 200}})
        device, thread = start(config)
        coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)
        send_round(coordinator, initial)
        wait_for(lambda: len(updates(coordinator, len(initial))) == 1)
        reported = updates(coordinator, len(initial))[0].header["metrics"]
        assert reported["disk_full"] == 1.0 and reported["disk_free_bytes"] < 48 * 1024
        device.stop_requested.set()
        thread.join(15)
        store = ReplayStore(folder / "store", Budget(200))
        store.check()  # valid after the failed writes
        assert len(store) == reported["stored_samples"] < 80
        store.close()
        saved = load_state(folder)  # no room for the weights: the record alone, so a restart keeps the task
        assert saved is not None and saved.task == 0 and sum(saved.label_counts) >= 80 and saved.model == ""
    finally:
        disk.unmount(folder)


def _raw(config: DeviceConfig) -> dict:
    """A config back as the mapping it was read from (to change a field)."""
    from dataclasses import asdict

    raw = asdict(config)
    raw["artifacts"], raw["state_dir"] = str(config.artifacts), str(config.state_dir)
    return raw


def test_a_generator_device_waits_for_its_personal_model_asks_for_cached_generators_and_uploads_its_own(
        setup, tmp_path):
    """pFedGRP on the device, the test playing the coordinator: the round names a personalized model that arrives
    after the round message; the device asks for the cached generator of a class new to it, ignores a garbled
    answer, warm-starts from the good one, and uploads its generators and label counts with the model."""
    from models.generator_export import export_generator_artifacts
    from models.generator_record import GeneratorRecord, decode_record, encode_record
    from models.generators import build_sampler, default_spec, flatten_module

    config, coordinator, initial = setup
    spec = default_spec("vae", (1, 8, 8))
    export_generator_artifacts(spec, tmp_path / "gen")
    config = DeviceConfig.from_dict({
        **_raw(config), "store": {"max_bytes": 1 << 20}, "trainer": {"backend": "torch"},
        "policy": {"name": "generator", "artifacts": str(tmp_path / "gen"), "init_steps": 20, "transfer_steps": 5},
    })
    n = len(initial)
    device, thread = start(config)
    coordinator.expect(topics.from_device(FLEET, "dev-0", "register"), timeout=30)

    data, layout = wire.pack_attachments(b"", {"personal": bytes(wire.weights_bytes(initial + 0.01))})
    personal = wire.encode_blob("payload", data, round=1, attachments=layout)
    glob = wire.encode_blob("weights", wire.weights_bytes(initial), round=1, version=0)
    for chunk in glob.chunks:
        coordinator.publish(topics.to_all(FLEET, "weights"), chunk)
    coordinator.publish(topics.to_device(FLEET, "dev-0", "round"), wire.encode(
        "round", round=1, task=0, model=glob.id, version=0, deadline_s=60, payload=personal.id,
        config={"epochs": 1, "generator_classes": [0, 7], "answer_wait_s": 30}))
    wait_for(lambda: device.waiting is not None)  # the round and the global model are in: it waits for its own
    assert device.learner.state.round == 0
    for chunk in personal.chunks:
        coordinator.publish(topics.to_device(FLEET, "dev-0", "payload"), chunk)

    request = wire.decode(coordinator.expect(topics.from_device(FLEET, "dev-0", "request"), timeout=60))
    assert request["names"] == ["generator/0"] and request["round"] == 1  # 0 is new to it and cached; 7 is not its
    answer_topic = topics.to_device(FLEET, "dev-0", "answer")
    coordinator.publish(answer_topic, b"\xc1 not a message")
    cached = GeneratorRecord(0, spec.to_dict(), "float32", flatten_module(build_sampler(spec, seed=5)), None, 99, 40)
    data, layout = wire.pack_attachments(b"", {"generator/0": encode_record(cached)})
    for chunk in wire.encode_blob("answer", data, round=1, attachments=layout).chunks:
        coordinator.publish(answer_topic, chunk)

    reassembler = wire.Reassembler(4 * n + (8 << 20))
    topic = topics.from_device(FLEET, "dev-0", "update")
    wait_for(lambda: any(t == topic for t, _ in coordinator.messages), timeout=60)
    blob = None
    for t, payload in list(coordinator.messages):
        if t == topic:
            blob = reassembler.add("dev-0", wire.decode(payload)) or blob
    weights, attachments = blob.split(n)
    metrics = blob.header["metrics"]
    assert sorted(attachments) == ["generator/0", "generator/1"]
    assert decode_record(bytes(attachments["generator/0"])).steps == 40 + 5  # warm-started from the cached one
    assert decode_record(bytes(attachments["generator/1"])).steps == 20  # trained from scratch
    assert metrics["generators_from_coordinator"] == 1 and metrics["replayed_samples"] == 0
    assert blob.header["label_counts"][:2] == [int((np.load(
        str(config.data.folder) + "/task-0.npz")["y"] == c).sum()) for c in (0, 1)]
    assert metrics["stored_bytes"] <= metrics["store_budget_bytes"] == 1 << 20
    # what it trained on, for the coordinator's calibration reference: its store, by task and class
    parts = blob.header["trained_counts"]
    assert {task for task, _, _ in parts} == {0} and sum(n for _, _, n in parts) == metrics["stored_samples"]
    assert device.rejected >= 1 and thread.is_alive()
    device.stop_requested.set()
    thread.join(15)
