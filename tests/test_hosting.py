"""Many devices in one process, as a fleet worker hosts them: what they share (one read-only copy of each global
model) and how they take turns at CPU work (starting a task, training and the policy's after-training work are the
worker's turns, run on its one turns thread; nothing else is)."""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
from test_netloop import needs_mosquitto, wait_for

from coordinator.broker import Credentials, MosquittoBroker, free_port
from edge_client.config import DeviceConfig
from edge_client.environment import RealEnvironment, Turns, TurnsClosed
from edge_client.policies.random_cache import RandomCache
from edge_client.shared_models import shared_model
from firmware_sim.virtual_device import virtual_device


class ActsAfterTraining(RandomCache):
    """Random replay with an update of its own after training (a no-op here): its device takes a turn for it."""

    name = "test-acts-after-training"

    def acts_after_training(self) -> bool:
        return True


def test_a_process_keeps_one_read_only_copy_of_each_global_model():
    first = shared_model("blob-a", np.arange(6, dtype=np.float32))
    again = shared_model("blob-a", np.arange(6, dtype=np.float32))  # another device assembled the same blob
    assert again is first and not first.flags.writeable
    other = shared_model("blob-b", np.ones(6, dtype=np.float32))
    assert other is not first and float(other.sum()) == 6.0


def test_the_devices_of_a_process_check_a_one_chunk_global_model_once(tmp_path, export_artifacts, monkeypatch):
    """A global model of one chunk that one device decoded and verified is taken as checked by the process's other
    devices handed the very same message (edge_client/shared_models.py): no decode, the same array, the model known
    and heard once a round (a duplicate is ignored, as the reassembler ignores one); the same bytes in another
    object are decoded and checked again, and a damaged copy is refused."""
    from edge_client.device import Device
    from edgefil import topics, wire

    def device(name: str) -> Device:
        return virtual_device(DeviceConfig.from_dict({
            "device_id": name, "fleet": "lab", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
            "state_dir": str(tmp_path / name), "broker": {"port": 1, "password": "pw"},
            "store": {"max_samples": 30}, "policy": {"name": "random"},
            "data": {"scenario": {"preset": "digits-class", "n_tasks": 2, "n_clients": 3}, "client": 0},
        }))

    first, second, third = devices = [device(f"dev-{i}") for i in range(3)]
    decoded: list[object] = []
    decode = wire.decode
    monkeypatch.setattr(wire, "decode", lambda payload, *a, **k: decoded.append(payload) or decode(payload, *a, **k))
    heard: list[str] = []
    for each in devices:
        arrived = each.learner.global_model_arrived
        monkeypatch.setattr(each.learner, "global_model_arrived",
                            lambda weights, _id=each.id, _arrived=arrived: heard.append(_id) or _arrived(weights))
    try:
        weights = first.trainer.get_weights() + np.float32(0.5)
        encoded = wire.encode_blob("weights", wire.weights_bytes(weights), round=1, version=0, task=0)
        assert len(encoded.chunks) == 1
        topic = topics.to_all("lab", "weights")
        message = memoryview(bytearray(encoded.chunks[0]))  # what a worker's links hand each device (SharedPayloads)
        first.handle(topic, message)
        second.handle(topic, message)
        second.handle(topic, message)  # the same round's model again: ignored
        assert decoded == [message] and heard == ["dev-0", "dev-1"]
        assert second.models[encoded.id] is first.models[encoded.id]
        np.testing.assert_array_equal(second.models[encoded.id], weights)
        assert second.task_heard == 0
        copy = memoryview(bytearray(encoded.chunks[0]))
        third.handle(topic, copy)  # the same bytes, another object: checked again
        assert decoded == [message, copy] and third.models[encoded.id] is first.models[encoded.id]
        damaged = bytearray(encoded.chunks[0])
        damaged[-1] ^= 1
        third.handle(topic, memoryview(damaged))
        assert third.rejected == 1 and heard == ["dev-0", "dev-1", "dev-2"]
    finally:
        for each in devices:
            each.learner.store.close()


@pytest.mark.parametrize("policy", ["random", ActsAfterTraining.name])
def test_a_hosted_device_starts_its_task_trains_and_finishes_its_round_in_its_turn_on_the_turns_thread(
        tmp_path, export_artifacts, monkeypatch, policy):
    """Its turns run on the worker's one turns thread (not the device's: what deep native work leaves on a thread's
    stack stays there), and the round's device seconds count them; the policy's after-training work takes a turn
    only where the policy has such work (`acts_after_training`)."""
    turns = Turns(name="turns-under-test")
    config = DeviceConfig.from_dict({
        "device_id": "dev-0", "fleet": "lab", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "state_dir": str(tmp_path / "state"), "broker": {"port": 1, "password": "pw"},
        "store": {"max_samples": 30}, "policy": {"name": policy},
        "data": {"scenario": {"preset": "digits-class", "n_tasks": 2, "n_clients": 3}, "client": 0},
    })
    device = turns.run(lambda: virtual_device(config, turns=turns))
    held: list[tuple[str, str]] = []
    for name in ("observe", "train", "finish_round"):
        real = getattr(device.learner, name)
        monkeypatch.setattr(device.learner, name, lambda *a, _real=real, _name=name, **k: held.append(
            (_name, threading.current_thread().name)) or _real(*a, **k))
    spent: list[float] = []
    monkeypatch.setattr(device.environment, "compute", lambda seconds, samples=0: spent.append(seconds) or seconds)
    try:
        weights = device.trainer.get_weights()
        before = device.environment.cpu_time()
        device._train({"round": 1, "task": 0, "model": "m", "config": {"epochs": 1}}, weights)
        finished = [("finish_round", "turns-under-test")] if policy == ActsAfterTraining.name else []
        assert held == [("observe", "turns-under-test"), ("train", "turns-under-test"), *finished]
        assert device.learner.state.round == 1  # the round went through: trained, saved
        assert spent and spent[0] <= device.environment.cpu_time() - before
    finally:
        device.learner.store.close()


def test_a_hosted_device_whose_turns_are_closed_leaves_its_round_unsaved_and_unsent(tmp_path, export_artifacts,
                                                                                     monkeypatch):
    """Its worker stops (`Turns.close`): the round it was given is left, not reported as an error to the coordinator,
    nothing of it saved or uploaded; the device saved before stays as it was."""
    turns = Turns(name="turns-under-test")
    config = DeviceConfig.from_dict({
        "device_id": "dev-0", "fleet": "lab", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "state_dir": str(tmp_path / "state"), "broker": {"port": 1, "password": "pw"},
        "store": {"max_samples": 30}, "policy": {"name": "random"},
        "data": {"scenario": {"preset": "digits-class", "n_tasks": 2, "n_clients": 3}, "client": 0},
    })
    device = turns.run(lambda: virtual_device(config, turns=turns))
    sent: list[tuple[object, ...]] = []
    monkeypatch.setattr(device, "_publish_status", lambda *args, **kwargs: sent.append(("status", *args)))
    monkeypatch.setattr(device, "_upload", lambda *args, **kwargs: sent.append(("upload", *args)))
    try:
        turns.close()
        device._train_round({"round": 1, "task": 0, "model": "m", "config": {"epochs": 1}},
                            device.trainer.get_weights())
        assert sent == [] and device.learner.state.round == 0 and not len(device.learner.store)
    finally:
        device.learner.store.close()


def test_turns_run_one_at_a_time_in_order_and_raise_in_the_caller():
    turns = Turns()
    order: list[str] = []
    first_running = threading.Event()
    release_first = threading.Event()

    def first() -> str:
        order.append("first starts")
        first_running.set()
        release_first.wait(30)
        order.append("first ends")
        return "one"

    results: list[str] = []
    caller = threading.Thread(target=lambda: results.append(turns.run(first)))
    caller.start()
    assert first_running.wait(30)
    second = threading.Thread(target=lambda: results.append(turns.run(lambda: order.append("second") or "two")))
    second.start()
    while turns._jobs.qsize() < 1:  # wait for the event: the second turn queued behind the first
        assert second.is_alive()
        time.sleep(0.001)
    release_first.set()
    caller.join(30)
    second.join(30)
    assert order == ["first starts", "first ends", "second"] and sorted(results) == ["one", "two"]

    def fails() -> None:
        raise KeyError("the work's own error")

    with pytest.raises(KeyError, match="the work's own error"):
        turns.run(fails)
    assert turns.run(lambda: 3) == 3  # the turns thread serves on after a turn raised
    with pytest.raises(RuntimeError, match="turns do not nest"):
        turns.run(lambda: turns.run(lambda: 1))


def test_closed_turns_finish_the_one_running_and_refuse_those_waiting_and_later():
    """A stopping worker closes its turns: the turn running ends as it would, the turns queued behind it never run
    (their callers get TurnsClosed), nor does one asked for after. Its devices queued hundreds of turns of seconds
    each (a generator's training), and each ran before its device saw the stop."""
    turns = Turns()
    running, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> str:
        running.set()
        release.wait(30)
        ran.append("first")
        return "one"

    outcomes: dict[str, object] = {}

    def call(name: str, work: Callable[[], object]) -> None:
        try:
            outcomes[name] = turns.run(work)
        except TurnsClosed as err:
            outcomes[name] = err

    caller = threading.Thread(target=call, args=("first", first))
    caller.start()
    assert running.wait(30)
    waiting = [threading.Thread(target=call, args=(f"queued-{k}", lambda k=k: ran.append(f"queued-{k}")))
               for k in range(3)]
    for thread in waiting:
        thread.start()
    while turns._jobs.qsize() < 3:  # wait for the event: three turns queued behind the first
        assert all(thread.is_alive() for thread in waiting)  # (a caller that died would never queue its turn)
        time.sleep(0.001)
    turns.close()
    release.set()
    for thread in (caller, *waiting):
        thread.join(30)
    assert ran == ["first"] and outcomes["first"] == "one"
    assert all(isinstance(outcomes[f"queued-{k}"], TurnsClosed) for k in range(3))
    with pytest.raises(TurnsClosed):
        turns.run(lambda: ran.append("later"))
    assert ran == ["first"]


def test_a_device_s_cpu_time_counts_its_turns_on_the_turns_thread():
    environment = RealEnvironment(Turns())

    def burn() -> float:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            sum(range(1000))
        return time.thread_time() - start

    before = environment.cpu_time()
    burned = environment.turn(burn)
    assert environment.cpu_time() - before >= burned


def test_an_idle_device_sleeps_until_its_heartbeat_or_its_availability_changes(tmp_path, export_artifacts):
    """Not a fixed one-second poll: thousands of idle device threads waking every second starved their worker's
    network thread. An idle device waits for its next heartbeat, or less when its schedule may take it away."""
    import time

    from edge_client.device import STOP_POLL_S
    from firmware_sim.emulation import EmulatedEnvironment
    from firmware_sim.limits import HostCalibration
    from firmware_sim.profiles import load_profile

    config = DeviceConfig.from_dict({
        "device_id": "dev-0", "fleet": "lab", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "state_dir": str(tmp_path / "state"), "broker": {"port": 1, "password": "pw"}, "heartbeat_s": 3.0,
        "store": {"max_samples": 30}, "policy": {"name": "random"},
        "data": {"scenario": {"preset": "digits-class", "n_tasks": 2, "n_clients": 3}, "client": 0},
    })
    device = virtual_device(config)
    try:
        device._last_status = time.monotonic()
        assert 2.9 < device._idle_wait() <= 3.0  # the heartbeat is due in 3 s
        device._last_status -= 10.0
        assert device._idle_wait() == 0.0  # overdue: at once
        zero = EmulatedEnvironment(load_profile("raspberry-pi-zero-2w"), HostCalibration(1.0), time_scale=60.0)
        device.environment = zero
        device._last_status = time.monotonic() + 100.0  # no heartbeat due soon: the schedule and STOP_POLL_S say
        t = (time.monotonic() - zero._joined) * zero.time_scale
        if zero.schedule.online(t):
            change = zero.schedule.next_change(t)
            expected = STOP_POLL_S if change is None else min(STOP_POLL_S, (change - t) / zero.time_scale)
            assert device._idle_wait() == pytest.approx(expected, abs=0.05)
        else:
            assert zero.online_for() == 0.0 and device._idle_wait() == 0.0
    finally:
        device.learner.store.close()


@needs_mosquitto
def test_a_worker_builds_no_further_ahead_of_its_devices_connections_than_its_bound(tmp_path, export_artifacts,
                                                                                     monkeypatch, caplog):
    """While their broker does not answer, a worker builds CONNECTING_PER_WORKER devices and no more (building the
    rest would only starve its network thread: fleet_worker.py); once the broker answers, the rest are built and
    every device connects."""
    from firmware_sim import fleet_worker
    from firmware_sim import virtual_device as virtual_device_module

    n = fleet_worker.CONNECTING_PER_WORKER + 4
    ids = [f"dev-{i}" for i in range(n)]
    port = free_port()
    broker = MosquittoBroker(tmp_path / "broker", "lab", {d: f"pw-{d}" for d in ids},
                             Credentials("coordinator", "pw-c"), port=port)
    artifacts = str(export_artifacts("lenet", 10, (1, 8, 8)))
    configs = [{"device_id": d, "fleet": "lab", "artifacts": artifacts, "state_dir": str(tmp_path / d),
                "broker": {"port": port, "password": f"pw-{d}"}, "store": {"max_samples": 10},
                "policy": {"name": "random"},
                "data": {"scenario": {"preset": "digits-class", "n_tasks": 1, "n_clients": n}, "client": k}}
               for k, d in enumerate(ids)]
    built: list[str] = []
    real = virtual_device_module.virtual_device
    monkeypatch.setattr(virtual_device_module, "virtual_device",
                        lambda config, *a, **k: built.append(config.device_id) or real(config, *a, **k))
    monkeypatch.setattr(sys, "setswitchinterval", lambda _: None)  # the process-wide settings a worker makes
    monkeypatch.setattr(fleet_worker, "set_worker_allocator", lambda: True)
    monkeypatch.setattr(fleet_worker, "size_futex_hash", lambda _: None)
    monkeypatch.setattr(fleet_worker, "limit_torch_threads", lambda: None)
    caplog.set_level(logging.INFO)

    def said(text: str) -> int:
        return sum(text in record.getMessage() for record in caplog.records)

    stop = threading.Event()
    worker = threading.Thread(target=fleet_worker.serve_devices, args=(configs, stop.wait, False), daemon=True)
    worker.start()
    try:
        bound = fleet_worker.CONNECTING_PER_WORKER
        # the built devices have tried for BROKER_NOTICE_S and say they wait: were there no bound, the others
        # would have been built meanwhile (a build takes milliseconds)
        assert wait_for(lambda: said("waiting for the MQTT broker") >= bound, 60)
        assert len(built) == bound
        with broker:
            assert wait_for(lambda: said("connected to 127.0.0.1") == n, 60), f"{said('connected to')} of {n}"
            assert sorted(built) == sorted(ids)
            stop.set()
            worker.join(fleet_worker.STOP_GRACE_S + 10)
            assert not worker.is_alive()
    finally:
        stop.set()


def test_a_worker_counts_the_devices_still_stopping_when_its_grace_ends_and_ends_without_exit_hooks(
        tmp_path, monkeypatch):
    """`serve_devices` returns how many devices outlived the stop's grace; a worker process with any ends as a power
    cut would end them (`end_now`): its log says how many, and the interpreter's exit hooks, which would run beside
    their threads, do not run."""
    import subprocess

    from fleet_harness import ROOT

    from edge_client import device as device_module
    from firmware_sim import fleet_worker
    from firmware_sim import virtual_device as virtual_device_module

    class Stopping:  # a device whose stop takes longer than any grace
        def request_stop(self) -> None:
            pass

    release = threading.Event()
    monkeypatch.setattr(virtual_device_module, "virtual_device", lambda *a, **k: Stopping())
    monkeypatch.setattr(device_module, "run_until_stopped", lambda device, connected: (connected(), release.wait()))
    monkeypatch.setattr(fleet_worker, "STOP_GRACE_S", 0.2)
    monkeypatch.setattr(sys, "setswitchinterval", lambda _: None)  # the process-wide settings a worker makes
    monkeypatch.setattr(fleet_worker, "set_worker_allocator", lambda: True)
    monkeypatch.setattr(fleet_worker, "size_futex_hash", lambda _: None)
    monkeypatch.setattr(fleet_worker, "limit_torch_threads", lambda: None)
    configs = [{"device_id": f"dev-{k}", "fleet": "lab", "artifacts": str(tmp_path), "state_dir": str(tmp_path / str(k)),
                "broker": {"port": 1, "password": "pw"}, "store": {"max_samples": 10}, "policy": {"name": "random"}}
               for k in range(3)]
    try:
        assert fleet_worker.serve_devices(configs, lambda: time.sleep(0.2), False) == 3
    finally:
        release.set()
    assert fleet_worker.serve_devices([], lambda: None, False) == 0

    log, hook = tmp_path / "worker.log", tmp_path / "hook-ran"
    script = (f"import atexit, logging, pathlib; from firmware_sim import fleet_worker; "
              f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO); "
              f"atexit.register(lambda: pathlib.Path({str(hook)!r}).touch()); fleet_worker.end_now(2, 5)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 of 5 devices still stopping after" in log.read_text() and not hook.exists()


def test_a_worker_tells_which_devices_failed_to_start_or_stopped_on_an_error_and_not_those_of_its_stop(
        tmp_path, monkeypatch):
    """`serve_devices(failed=...)`: a device whose build raises (its disk) and one whose broker refuses it are told,
    each with a line that says why; one that raises once the worker stops is the stop's, not told."""
    from edge_client import device as device_module
    from edgefil.link import ConnectionRefused
    from firmware_sim import fleet_worker
    from firmware_sim import virtual_device as virtual_device_module

    class Hosted:
        def __init__(self, name: str) -> None:
            self.name = name

        def request_stop(self) -> None:  # after the worker's word to stop, as a device's connection then closes
            stopped.set()

    def build(config: DeviceConfig, *args: Any, **kwargs: Any) -> Hosted:
        if config.device_id == "dev-0":
            raise OSError(28, "No space left on device")
        return Hosted(config.device_id)

    stopped = threading.Event()

    def run(device: Hosted, connected: Callable[[], None]) -> None:
        connected()
        if device.name == "dev-1":
            raise ConnectionRefused("broker at 127.0.0.1:1 refused: not authorised")
        stopped.wait()
        raise RuntimeError("its connection closed as the worker stopped")

    monkeypatch.setattr(virtual_device_module, "virtual_device", build)
    monkeypatch.setattr(device_module, "run_until_stopped", run)
    for setting in ("set_worker_allocator", "size_futex_hash", "limit_torch_threads"):  # process-wide: not here
        monkeypatch.setattr(fleet_worker, setting, lambda *_: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda _: None)
    told: list[tuple[str, str]] = []
    configs = [{"device_id": f"dev-{k}", "fleet": "lab", "artifacts": str(tmp_path), "state_dir": str(tmp_path / str(k)),
                "broker": {"port": 1, "password": "pw"}, "store": {"max_samples": 10}, "policy": {"name": "random"}}
               for k in range(3)]

    assert fleet_worker.serve_devices(configs, lambda: wait_for(lambda: len(told) == 2, 30), False,
                                      failed=lambda *said: told.append(said)) == 0
    assert sorted(told) == [("dev-0", "it failed to start: OSError: [Errno 28] No space left on device"),
                            ("dev-1", "it stopped: ConnectionRefused: broker at 127.0.0.1:1 refused: not authorised")]


def _gone_while_held(lock: AbstractContextManager[Any], drop: Callable[[], None]) -> bool:
    """Whether `drop` (which lets the last reference to something with a finalizer go) returns when it runs in a
    thread that holds `lock`, as a thread may when the cyclic collector or a free-threaded build runs the
    finalizer there; False if it waits for the lock its own thread holds (a ceiling of 30 s on a hang)."""
    done = threading.Event()

    def run() -> None:
        with lock:
            drop()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(30)


def test_a_verified_payload_may_go_in_a_thread_that_holds_the_shared_models_lock():
    """The weak reference by which the process forgets a verified global model calls back into
    edge_client/shared_models.py; where the payload's last reference goes in a thread inside that module's lock,
    the callback must not wait for it (a fleet worker's network thread hung there, every device of the worker with
    it, on CPython's free-threaded build)."""
    from edge_client import shared_models

    weights = shared_model("blob-gone", np.zeros(4, dtype=np.float32))  # held here: the process keeps it weakly
    held = [memoryview(bytes(64))]
    shared_models.remember_verified(held[0], "blob-gone", {"round": 1})
    key = id(held[0])
    assert shared_models.verified_model(held[0]) == ("blob-gone", {"round": 1}, weights)
    assert _gone_while_held(shared_models._lock, held.clear)
    assert key not in shared_models._by_payload  # forgotten


def test_a_trainer_may_go_in_a_thread_that_holds_the_spare_pool_lock():
    """A portable trainer's finalizer gives its size up in the process's spare pool (`_SparePool.leave`); where the
    trainer's last reference goes in a thread inside one of the pool's calls, it must not wait for the pool's lock."""
    import weakref

    from edge_client.trainers.portable import _SparePool

    class Holder:
        pass

    pool = _SparePool()
    pool.join(8)
    held = [Holder()]
    weakref.finalize(held[0], pool.leave, 8)
    assert _gone_while_held(pool._lock, held.clear)
    assert pool.held(8) == 0 and not pool._users  # left
