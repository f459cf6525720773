"""The garbage collector over a long run (edgefil/collector.py): what is alive when a run starts is not scanned while
it runs, and is scanned again, its garbage collected rather than lost, once the process's last run ends; the
coordinator and every device hold such a run while they run."""
from __future__ import annotations

import gc
import weakref

import pytest
from fleet_harness import CEILING_S
from thread_fleet import ThreadFederation

from coordinator.broker import mosquitto_path
from edgefil.collector import _Runs, runs


class Node:
    def __init__(self) -> None:
        self.self = self  # a cycle: only the collector frees it


def test_what_a_run_starts_with_is_not_scanned_until_the_last_run_ends():
    # a count of its own (the process's is `long_run`'s): an earlier test's device thread still ending on a busy
    # host holds a run in the process's count, not in this one
    process = _Runs()
    cycle = Node()
    alive = weakref.ref(cycle)
    with process.long_run():
        assert process.count == 1 and gc.get_freeze_count() > 0
        with process.long_run():  # another run (a second device of the process) starts and ends
            del cycle
            gc.collect()
            assert alive() is not None  # frozen with everything else when the first run started
        assert process.count == 1 and gc.get_freeze_count() > 0
        gc.collect()
        assert alive() is not None
    assert process.count == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # the last run ended: scanned again, and collected


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_coordinator_and_the_devices_each_hold_a_run_while_they_run(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    before = runs()  # runs of earlier tests' devices whose threads are still ending (none, on a quiet host)
    seen = []
    with ThreadFederation(tmp_path, artifacts, {"store": {"max_samples": 100}}, n_devices=2) as federation:
        federation.wait_online()
        coordinator = federation.coordinator({"name": "fedavg"}, rounds_per_task=1)
        opening = coordinator.run_round

        def probed() -> None:  # the coordinator's round, with what the process's collector holds then
            seen.append((runs(), gc.get_freeze_count()))
            opening()

        coordinator.run_round = probed  # type: ignore[method-assign]
        assert coordinator.run()["rounds_completed"] == 1
    assert seen and seen[0][0] == before + 3 and seen[0][1] > 0  # the coordinator's and the two devices'
    assert federation.devices_stopped(CEILING_S)  # their runs end with their threads: waited for, not timed
    assert runs() <= before and (runs() or gc.get_freeze_count() == 0)
