"""Emulated device limits in action over a real broker: a slow profile misses the deadline that a fast one meets
(virtual time), and a device without enough RAM for training drops out of the fleet."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from fleet_harness import CEILING_S, Fleet
from thread_fleet import ThreadFederation

from coordinator.broker import mosquitto_path
from coordinator.inbox import Update
from coordinator.rounds import OpenRound
from firmware_sim.emulation import EmulatedEnvironment
from firmware_sim.limits import HostCalibration
from firmware_sim.profiles import load_profile

needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed")
HOST_GFLOPS = 50.0


def profile_file(folder, name: str, gflops: float, ram_bytes: int = 2**31, availability: str = "") -> str:
    path = folder / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
description = "test profile"
disk_bytes = 1000000000
ram_bytes = {ram_bytes}
cpu_gflops = {gflops}
threads = 1
up_mbps = 100.0
down_mbps = 100.0
latency_ms = 1.0
{availability}
[sources]
disk_bytes = "test"
ram_bytes = "test"
cpu_gflops = "test"
threads = "test"
up_mbps = "test"
down_mbps = "test"
latency_ms = "test"
availability = "test"
""")
    return str(path)


def test_emulated_environment_scales_compute_and_charges_transfers(tmp_path):
    slow = load_profile(profile_file(tmp_path, "slow", gflops=HOST_GFLOPS / 4))
    env = EmulatedEnvironment(slow, HostCalibration(HOST_GFLOPS))
    assert env.compute(0.5) == pytest.approx(2.0)  # a device 4x slower than the host
    # 1 MB up at 100 Mb/s: 0.08 s, plus 1 ms latency for each of 2 messages
    assert env.transfer(1_000_000, 2, upload=True) == pytest.approx(0.082)
    assert env.clock.now() == pytest.approx(2.082)


def test_an_update_too_slow_in_device_time_is_late_and_still_closes_the_round():
    from collections import Counter

    current = OpenRound.open(1, 0, "m", ["fast", "slow"], deadline_s=10.0, virtual=True)
    counts: Counter[str] = Counter()
    fast = Update("fast", 1, 0, "m", 5, {"device_seconds": 3.0}, None)
    slow = Update("slow", 1, 0, "m", 5, {"device_seconds": 30.0}, None)
    assert current.offer(fast, counts) is None
    assert current.offer(slow, counts) == "late"
    assert current.complete and current.delivered == {"fast"} and counts["late"] == 1


@needs_mosquitto
def test_a_slow_device_misses_the_deadline_a_fast_one_meets_and_a_device_short_of_ram_drops_out(
    tmp_path, export_artifacts
):
    def emulation(name: str, gflops: float, ram_bytes: int = 2**31) -> dict:
        return {"emulation": {"profile": profile_file(tmp_path, name, gflops, ram_bytes), "host_gflops": HOST_GFLOPS}}

    fleet = Fleet(
        tmp_path / "fleet", export_artifacts("lenet", 10, (1, 8, 8)), n_devices=3,
        scenario={"preset": "digits-class", "n_tasks": 2},
        coordinator_options={"rounds_per_task": 2, "min_clients": 1, "deadline_s": 20.0, "virtual_time": True,
                             "wait_for_devices_s": 30.0},
        per_device={
            0: emulation("fast", gflops=HOST_GFLOPS * 10),
            1: emulation("slow", gflops=HOST_GFLOPS / 10_000),  # ~0.05 host s of training -> ~500 device s
            2: emulation("tiny-ram", gflops=HOST_GFLOPS, ram_bytes=1_000_000),
        },
    )
    try:
        fleet.start()
        fleet.start_coordinator()
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        results = fleet.results()
    finally:
        fleet.stop()
    assert results["rounds_completed"] == 4
    history = results["history"]
    assert all(r["received"] == ["dev-0"] for r in history)
    assert all(r["metrics"]["dev-0"]["device_seconds"] < 20.0 for r in history)
    assert "dev-1" in history[0]["selected"] and results["counters"]["late"] >= 1
    # the device short of RAM left at its first round and was not selected once the coordinator saw it go
    assert "dev-2" in history[0]["selected"] and "dev-2" not in history[-1]["selected"]
    assert "needs" in fleet.log_tail("dev-2") and fleet.processes["dev-2"].poll() == 0


class SteppedClock:
    """The wall clock a device's availability follows, moved by the test on the run's events."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CEILING_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.05)


@needs_mosquitto
def test_a_device_follows_its_availability_trace_it_leaves_and_comes_back(tmp_path, export_artifacts, caplog):
    """The wanderer's trace: online for 3 s, away until 6 s, then back for good. Its clock moves on the run's
    events, not with the host's speed: to 4 s once two rounds are done, to 7 s once a round went without it. The
    coordinator's progress hook waits until the device has left, and is back, before the next round opens."""
    (tmp_path / "trace.csv").write_text("0,3\n6,inf\n")
    away = f'[availability]\nmode = "trace"\ntrace = "{tmp_path / "trace.csv"}"'
    clock = SteppedClock()
    wanderer = EmulatedEnvironment(load_profile(profile_file(tmp_path, "wanderer", HOST_GFLOPS, availability=away)),
                                   HostCalibration(HOST_GFLOPS), clock=clock)
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    history: list[dict] = []
    with ThreadFederation(tmp_path / "fleet", export_artifacts("lenet", 10, (1, 8, 8)), device, tasks=2, n_devices=3,
                          environments={1: wanderer}) as federation:
        link = federation.devices[1].link

        def step(entry: dict) -> None:
            history.append(entry)
            if entry["round"] == 2:
                clock.now = 4.0
                wait_until(lambda: not link.connected, "dev-1 leaving")
            elif "dev-1" not in entry["selected"] and clock.now < 6.0:
                clock.now = 7.0
                wait_until(lambda: link.connected, "dev-1 coming back")

        coordinator = federation.coordinator({"name": "fedavg"}, rounds_per_task=6, min_clients=1)
        coordinator.progress = step
        with caplog.at_level("INFO", logger="edgefil.device"):
            assert coordinator.run()["outcome"] == "complete"
    absent = [r["round"] for r in history if "dev-1" not in r["selected"]]
    back = [r["round"] for r in history if "dev-1" in r["received"] and absent and r["round"] > absent[0]]
    assert absent, "dev-1 was never left out while away"
    assert back, "dev-1 never took part again after coming back"
    assert "dev-1 goes offline" in caplog.text and "dev-1 is back online" in caplog.text


@needs_mosquitto
def test_a_device_that_joins_a_later_task_trains_from_that_tasks_first_round(tmp_path, export_artifacts):
    """dev-3 holds data from task 1 on (a client joining later, as in GLFC's client dynamics). Selected in round 1,
    before any global model named a task, it answers "no-data" and the round does not wait for it (the other three
    make the quorum). It is left out of task 0's later rounds (its "no-data" names task 0), and selected again from
    task 1's first round (round 5, 4 rounds a task), whose message names task 1: it trains there and after."""
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)), device, tasks=2, n_devices=4,
                          joins={"dev-3": 1}) as federation:
        for running in federation.devices:
            assert running.link.wait_subscribed(60)
        joiner = federation.devices[3]
        results = federation.coordinator({"name": "fedavg"}, rounds_per_task=4, min_clients=3).run()
    history, counters = results["history"], results["counters"]
    assert results["outcome"] == "complete" and counters["no-data"] == 1
    assert "device-error" not in counters and "round-retried" not in counters and "missed-deadline" not in counters
    assert "dev-3" in history[0]["selected"] and "dev-3" not in history[0]["received"]
    assert all("dev-3" not in h["selected"] for h in history[1:4])
    assert all("dev-3" in h["selected"] for h in history[4:])
    assert joiner.id == "dev-3" and joiner.learner.state.round == 8  # it trained (the guard may drop an outlier)
    assert results["without_data"] == []


class BusyHost:
    """A device on a busy host: every turn at the CPU waits `seconds` of wall time first (other processes had the
    core), and its own CPU time, what it reports as device seconds, is what it would be on a quiet host."""

    def __init__(self, seconds: float) -> None:
        from edge_client.environment import RealEnvironment

        self.seconds, self.real = seconds, RealEnvironment()

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def turn(self, work):
        time.sleep(self.seconds)
        return self.real.turn(work)


@needs_mosquitto
@pytest.mark.parametrize("virtual", [True, False])
def test_in_virtual_time_a_busy_host_drops_no_device(tmp_path, export_artifacts, virtual):
    """dev-1 waits 2.5 s of wall time for the CPU at each of its turns (two or more a round), beyond the 2 s
    deadline. On the wall clock it misses the round; in virtual time (a simulated fleet's) the deadline counts its
    device seconds, the round waits for it, and it is in the round."""
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)), device, tasks=1, n_devices=2,
                          environments={1: BusyHost(2.5)}) as federation:
        coordinator = federation.coordinator({"name": "fedavg"}, rounds_per_task=1, min_clients=1, deadline_s=2.0,
                                             virtual_time=virtual, wall_limit_s=120.0)
        results = coordinator.run()
    assert results["outcome"] == "complete"
    took_part = [("dev-1" in h["received"]) for h in results["history"]]
    assert took_part == ([True] if virtual else [False])
    assert ("missed-deadline" in results["counters"]) != virtual


@needs_mosquitto
def test_on_the_fleets_clock_a_device_sits_out_the_rounds_it_is_away_for_and_stays_connected(tmp_path,
                                                                                           export_artifacts, caplog):
    """Virtual time: round r starts at (r - 1) x deadline_s = 0, 50, 100, ... on the fleet's clock, whatever the
    host's speed. The wanderer's trace has it away on [100, 200): it answers rounds 3 and 4 "away" (the round does
    not wait for it, and it is counted), takes part in every other, and never disconnects. Being away on its schedule
    is the fleet as it is: the coordinator says so at INFO, and warns of nothing (a clean demo's console)."""
    caplog.set_level("INFO", logger="edgefil.coordinator")
    (tmp_path / "trace.csv").write_text("0,100\n200,inf\n")
    away = f'[availability]\nmode = "trace"\ntrace = "{tmp_path / "trace.csv"}"'
    wanderer = EmulatedEnvironment(load_profile(profile_file(tmp_path, "wanderer", HOST_GFLOPS, availability=away)),
                                   HostCalibration(HOST_GFLOPS), availability_clock="fleet")
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path / "fleet", export_artifacts("lenet", 10, (1, 8, 8)), device, tasks=2, n_devices=2,
                          environments={1: wanderer}) as federation:
        link = federation.devices[1].link
        connected: list[bool] = []
        coordinator = federation.coordinator({"name": "fedavg"}, rounds_per_task=3, min_clients=1, deadline_s=50.0,
                                             virtual_time=True, wall_limit_s=120.0)
        coordinator.progress = lambda entry: connected.append(link.connected)
        results = coordinator.run()
    took_part = ["dev-1" in h["received"] for h in results["history"]]
    assert took_part == [True, True, False, False, True, True]
    assert all("dev-1" in h["selected"] for h in results["history"])  # away, not offline: still selected
    assert results["counters"]["away"] == 2 and "missed-deadline" not in results["counters"]
    assert all(connected)
    said = [r for r in caplog.records if r.name == "edgefil.coordinator" and "closed without dev-1" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO", "INFO"], [(r.levelname, r.getMessage()) for r in said]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dev-1" in r.getMessage()]
