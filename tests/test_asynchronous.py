"""Asynchronous rounds (coordinator/buffered.py): the schedule's arithmetic and order, what cannot run
asynchronously, and a simulated fleet of mixed profiles through a real mosquitto whose rounds do not wait for its
slowest devices and whose run is the same twice for a seed on the virtual clock."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fleet_harness import run_fleet_file
from test_sites import needs_mosquitto

from coordinator.buffered import AsynchronousSettings, BufferedSchedule, asynchronous_refused
from edgefil.settings import dump_toml


def schedule(virtual: bool = True, **settings: object) -> BufferedSchedule:
    return BufferedSchedule(AsynchronousSettings(mode="buffered", **settings), virtual, wall_limit_s=3600.0)


def test_a_stale_update_goes_into_the_round_as_its_model_plus_its_change_weighed_by_its_staleness():
    """w' = g_R + (1 + tau)^-a (w - g_r); an update more stale than max_staleness, or whose model is no longer held,
    is refused (None); one of the open round's own model is taken as it is."""
    plan = schedule(max_staleness=2, staleness_exponent=0.5)
    rng = np.random.default_rng(0)
    models = {r: rng.normal(size=5).astype(np.float32) for r in range(1, 5)}
    for r in (1, 2, 3):
        plan.opened(r, models[r])
    trained = rng.normal(size=5).astype(np.float32)
    weights, staleness = plan.rebased(trained, 1, 3)
    assert staleness == 2
    np.testing.assert_allclose(weights, models[3] + (trained - models[1]) / np.sqrt(3), rtol=1e-6, atol=1e-6)
    assert plan.rebased(trained, 3, 3) == (trained, 0)
    plan.opened(4, models[4])  # round 1's model is 3 moves old now: dropped
    assert plan.rebased(trained, 1, 4) is None
    assert AsynchronousSettings(staleness_exponent=0.0).weight(7) == 1.0  # every update alike


def test_in_virtual_time_ended_work_is_taken_in_the_order_it_ends_on_the_fleets_clock_not_as_it_arrives():
    """The slow device reports first; the schedule takes nothing while work is out (work out may end earlier), then
    the fast device's update first; a tie goes by device id; a device away when given work is given it again
    `away_retry_s` later; a device is busy until its ended work is taken."""
    plan = schedule(away_retry_s=30.0)
    plan.opened(1, np.zeros(2, np.float32))
    assert plan.to_give(["slow", "fast", "away"], 1) == ["away", "fast", "slow"]
    for device in ("slow", "fast", "away"):
        plan.give(device, 1, "m1")
    assert plan.ended("slow", 1, "slow's update", seconds=9.0)
    assert plan.next_done() is None  # fast and away are still out
    assert not plan.ended("fast", 2, "wrong round")  # no such work out: the caller refuses it
    assert plan.ended("fast", 1, "fast's update", seconds=2.0)
    assert plan.ended("away", 1, again_after_s=plan.settings.away_retry_s)
    assert plan.to_give(["slow", "fast", "away"], 1) == []  # each still at work on the fleet's clock
    first = plan.next_done()
    assert (first.device, first.update, plan.clock_s) == ("fast", "fast's update", 2.0)
    assert plan.to_give(["slow", "fast", "away"], 1) == []  # fast trained round 1; the others are busy still
    assert plan.next_done().device == "slow" and plan.clock_s == 9.0
    sat_out = plan.next_done()
    assert (sat_out.device, sat_out.update, plan.clock_s) == ("away", None, 30.0)
    assert plan.to_give(["slow", "fast", "away"], 1) == ["away"]  # the same round's work again, once back
    assert plan.to_give(["slow", "fast", "away"], 2) == ["away", "fast", "slow"]
    tie = schedule()
    for device in ("b", "a"):
        tie.give(device, 1, "m1")
        tie.ended(device, 1, device, seconds=1.0)
    assert [tie.next_done().device, tie.next_done().device] == ["a", "b"]


def test_at_most_concurrency_devices_train_at_once_and_the_longest_idle_goes_first():
    plan = schedule(concurrency=2)
    plan.give("a", 1, "m1")
    plan.taken("b", 3)  # b's last update went into round 3; c's into none yet
    assert plan.to_give(["a", "b", "c", "d"], 4) == ["c"]
    plan.lost("a")  # went offline with its work: given it again when back
    assert plan.to_give(["a", "b", "c", "d"], 4) == ["a", "c"]
    plan.give("c", 4, "m4")
    plan.ended("c", 4, "c's update", seconds=5.0)  # reported, but at work on the fleet's clock until taken
    assert plan.to_give(["a", "b", "c", "d"], 4) == ["a"]


def test_what_cannot_run_asynchronously_is_refused_in_one_line(export_artifacts):
    from coordinator.config import CoordinatorConfig
    from coordinator.strategies import make_strategy
    from models.manifest import load_manifest

    on = AsynchronousSettings(mode="buffered", buffer=3)
    with pytest.raises(ValueError, match="buffer = 3 is more updates than the 2 devices"):
        CoordinatorConfig("lab", Path("out"), Path("art"), ("d0", "d1"), test_data=Path("t"), asynchronous=on)
    with pytest.raises(ValueError, match="mode must be one of"):
        AsynchronousSettings(mode="fedasync")  # type: ignore[arg-type]
    fedavg = make_strategy("fedavg", device="cpu")
    assert asynchronous_refused(fedavg, False, False, False) is None
    assert asynchronous_refused(make_strategy("median", device="cpu"), False, False, False) is None
    pfedgrp = make_strategy("pfedgrp", device="cpu", manifest=load_manifest(export_artifacts("lenet", 10, (1, 8, 8))))
    for refused in (asynchronous_refused(pfedgrp, False, False, False), asynchronous_refused(fedavg, True, False, False),
                    asynchronous_refused(fedavg, False, False, True)):
        assert refused is not None and "\n" not in refused and 'mode = "off"' in refused


MIXED_FLEET = {
    "name": "mixed", "out": "run", "devices": 6, "workers": 2, "seed": 0, "broker": "mosquitto",
    "scenario": {"preset": "digits-class", "n_tasks": 2},
    "profiles": {"raspberry-pi-zero-2w": 2, "raspberry-pi-4-4gb": 2, "jetson-orin-nano": 2},
    "compute": "modelled", "client": {"epochs": 2},
    "coordinator": {"rounds_per_task": 4, "deadline_s": 600.0,
                    "asynchronous": {"mode": "buffered", "buffer": 3, "max_staleness": 8}},
}
SLOWEST = ("dev-000", "dev-001")  # the Raspberry Pi Zero 2 Ws: 2.8 GFLOPS and 25 Mb/s against the Orins' 19.2 and 941


@needs_mosquitto
def test_an_asynchronous_fleet_of_mixed_profiles_moves_on_without_its_slowest_devices_and_runs_the_same_twice(
        tmp_path):
    """Six devices, two Raspberry Pi Zeros to two Jetson Orins, their compute modelled from the model's FLOPs: every
    round takes 3 updates; the model moves several times before a Pi Zero's first update comes, which is then taken
    stale; and a second run of the same file gives the same rounds (who, when on the fleet's clock, accuracies) and
    the same last model, however the host delivered the updates."""
    runs = []
    for k in (1, 2):
        (tmp_path / str(k)).mkdir()
        results = run_fleet_file(tmp_path / str(k), dump_toml(MIXED_FLEET))
        assert results["outcome"] == "complete"
        runs.append(results)
    history = runs[0]["history"]
    assert len(history) == 8 and all(len(entry["received"]) == 3 for entry in history)
    first_slow = next(k for k, entry in enumerate(history) if set(SLOWEST) & set(entry["received"]))
    assert first_slow >= 2, "a round waited for a Pi Zero"
    stale = [entry["metrics"][d]["staleness"] for entry in history for d in SLOWEST if d in entry["metrics"]]
    assert stale and min(stale) >= 1
    assert [entry["clock_s"] for entry in history] == sorted(entry["clock_s"] for entry in history)
    keys = ("round", "received", "clock_s", "staleness", "accuracy")
    assert [{k: e[k] for k in keys} for e in history] == [{k: e[k] for k in keys} for e in runs[1]["history"]]
    last = [next((tmp_path / str(k) / "run" / "checkpoint" / "round-000008").glob("weights-*.f32")).read_bytes()
            for k in (1, 2)]
    assert last[0] == last[1]
    assert json.loads((tmp_path / "1" / "run" / "fleet.json").read_text())["coordinator"]["asynchronous"]["buffer"] == 3


@needs_mosquitto
def test_a_stopped_asynchronous_fleet_resumes_where_its_checkpoint_is_and_its_clock_goes_on(tmp_path):
    """Ctrl-C after a few model moves, then `--resume`: the run completes every round once, the rounds before the
    stop are kept as they were, and the fleet's clock goes on from the last checkpointed round's (no round ends
    before the one before it)."""
    import signal

    from fleet_harness import CEILING_S
    from test_fleet_runner import fleet, wait_rounds

    spec = {**MIXED_FLEET, "coordinator": {**MIXED_FLEET["coordinator"], "rounds_per_task": 10}}
    path = tmp_path / "fleet.toml"
    path.write_text(dump_toml(spec))
    out = tmp_path / "run"
    proc = fleet(path)
    wait_rounds(proc, out, 3, tmp_path / "fleet.log")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(CEILING_S) == 130
    kept = json.loads((out / "results.json").read_text())["history"]
    assert fleet(path, "--resume").wait(CEILING_S) == 0, (tmp_path / "fleet.log").read_text()[-3000:]
    final = json.loads((out / "results.json").read_text())
    assert final["outcome"] == "complete"
    assert [entry["round"] for entry in final["history"]] == list(range(1, 21))
    assert final["history"][: len(kept)] == kept
    clocks = [entry["clock_s"] for entry in final["history"]]
    assert clocks == sorted(clocks) and clocks[len(kept)] > clocks[len(kept) - 1]


class Held:
    """A device whose every turn at the CPU waits until `released` is set: the slowest device there can be."""

    def __init__(self, released) -> None:
        from edge_client.environment import RealEnvironment

        self.released, self.real = released, RealEnvironment()

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def turn(self, work):
        self.released.wait(600)
        return self.real.turn(work)


@needs_mosquitto
def test_on_the_wall_clock_rounds_move_on_with_the_updates_that_came_and_never_wait_for_a_device_still_at_work(
        tmp_path, export_artifacts):
    """Three devices, a buffer of 2; dev-2 cannot finish its work until the run's last round has closed (its turn
    waits for that): every round takes dev-0's and dev-1's updates, taken in the order they arrive, and the run
    completes with dev-2's work still out."""
    import threading

    from thread_fleet import ThreadFederation

    released = threading.Event()
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)), device, tasks=1, n_devices=3,
                          environments={2: Held(released)}) as federation:
        coordinator = federation.coordinator(
            {"name": "fedavg"}, rounds_per_task=3, deadline_s=3600.0,  # a round that waited for dev-2 would hang
            asynchronous=AsynchronousSettings(mode="buffered", buffer=2))
        coordinator.progress = lambda entry: entry["round"] == 3 and released.set()
        try:
            results = coordinator.run()
        finally:
            released.set()
    assert results["outcome"] == "complete"
    assert [sorted(entry["received"]) for entry in results["history"]] == [["dev-0", "dev-1"]] * 3
    assert "dev-2" in results["history"][0]["selected"]  # given work with the first model, and never done with it
    clocks = [entry["clock_s"] for entry in results["history"]]  # on the wall clock: the run's seconds
    assert clocks == sorted(clocks)


def test_in_virtual_time_a_round_is_past_its_deadline_only_once_nothing_out_can_end_before_it():
    plan = schedule()
    plan.give("a", 1, "m1")
    assert not plan.past(10.0)  # a's work may end before it
    plan.ended("a", 1, "a's update", seconds=12.0)
    assert plan.past(10.0) and plan.clock_s == 10.0  # the round closes at its deadline on the fleet's clock
    assert plan.next_done(before_s=10.0) is None and plan.next_done().device == "a"
