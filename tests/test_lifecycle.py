"""A fleet's life in a real run (mosquitto, coordinator and device processes): what a device cannot do is shown
per device, and two processes sharing a device id are found and reported by both sides."""
from __future__ import annotations

import json
import signal
import time

import pytest
from fleet_harness import CEILING_S, Fleet

from coordinator.broker import mosquitto_path

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_device_error_is_shown_per_device_and_a_duplicate_id_by_both_sides(tmp_path, export_artifacts):
    """dev-1's task 0 file is damaged (it cannot train: "error"), and it has no file of a later task (it holds no
    data: "no-data", not selected in that task); dev-0 gets a twin process."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    broken = tmp_path / "broken-data"
    broken.mkdir()
    (broken / "task-0.npz").write_bytes(b"not an npz file")
    fleet = Fleet(tmp_path, artifacts, n_devices=3, per_device={1: {"data": {"folder": str(broken)}}},
                  coordinator_options={"rounds_per_task": 4, "min_clients": 1, "deadline_s": 20.0})
    try:
        fleet.start()
        twin_config = tmp_path / "dev-0-twin.toml"
        twin_config.write_text(fleet.device_config(0).read_text().replace(
            str(tmp_path / "devices" / "dev-0"), str(tmp_path / "devices" / "dev-0-twin")))
        fleet._spawn("dev-0-twin", ["client", "--config", str(twin_config)])
        fleet.start_coordinator()
        results = lambda: json.loads((tmp_path / "run" / "results.json").read_text())  # noqa: E731
        fleet.wait_rounds(1, timeout=CEILING_S)
        wait_for(lambda: "dev-0" in results()["duplicate_devices"], 120, "the coordinator to see the twin")
        logs = lambda: [(tmp_path / f"{n}.log").read_text() for n in ("dev-0", "dev-0-twin")]  # noqa: E731
        wait_for(lambda: any("the coordinator reports duplicate-device" in log for log in logs()), 60,
                 "a device to report the coordinator's notice")
        fleet.kill("dev-0-twin")
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")

        final = fleet.results()
        assert final["rounds_completed"] == 20
        assert final["counters"]["duplicate-device"] >= 1
        assert len(final["duplicate_devices"]["dev-0"]) == 2  # the two instances
        error = final["device_errors"]["dev-1"]  # its last error: task 0's damaged file, in a round of task 0
        assert error["round"] <= 4 and "task-0.npz is not a task file" in error["error"], error
        # from task 1 on it has no file and nothing stored: it says it holds no data for the task, and is selected
        # again at most in a later task's first round (where it may have data; it says it has none, counted)
        assert "dev-1" in final["without_data"] and 1 <= final["counters"]["no-data"] <= 4
        first_rounds = {min(r["round"] for r in final["history"] if r["task"] == t) for t in range(1, 5)}
        assert all("dev-1" not in r["selected"] for r in final["history"][4:] if r["round"] not in first_rounds)
        log = (tmp_path / "coordinator.log").read_text()
        assert "dev-1 cannot train round 1: ValueError: " + str(broken / "task-0.npz") + " is not a task file" in log
        assert final["counters"]["device-error"] >= 1
        # a device that says it cannot train is not waited for: never counted as missing the deadline
        assert all("dev-1" not in r["received"] for r in final["history"])
        assert "two processes use device id dev-0" in log
    finally:
        fleet.stop()


def wait_in_log(path, text: str, timeout: float) -> None:
    wait_for(lambda: path.exists() and text in path.read_text(), timeout, repr(text))


def test_a_retry_waits_for_devices_that_are_coming_back(tmp_path, export_artifacts):
    """Two of three devices die during round 2: its first attempt misses the quorum. The retry waits (up to the
    backoff) for both to be back rather than firing at the one device left or the first to return."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=3,
                  coordinator_options={"rounds_per_task": 1, "min_clients": 2, "deadline_s": 120.0,
                                       "retry_backoff_s": 60.0, "client": {"epochs": 15}})
    try:
        fleet.start()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        fleet.kill("dev-1")
        fleet.kill("dev-2")
        wait_in_log(tmp_path / "coordinator.log", "running it again", 60)
        fleet.start_device(1)
        time.sleep(3.0)  # the second one returns later: the retry still waits for it
        fleet.start_device(2)
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        results = fleet.results()
        second = results["history"][1]
        assert second["round"] == 2 and second["selected"] == fleet.devices == second["received"], second
        assert results["counters"]["round-retried"] == 1
    finally:
        fleet.stop()


def test_a_failed_run_still_writes_its_final_results(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2,
                  coordinator_options={"rounds_per_task": 1, "min_clients": 2, "max_attempts": 1,
                                       "client": {"epochs": 15}})
    try:
        fleet.start()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        fleet.kill("dev-1")  # gone for good: round 2 cannot reach its quorum
        assert fleet.wait_coordinator(timeout=CEILING_S) != 0
        results = fleet.results()
        assert results["outcome"].startswith("failed: QuorumError"), results["outcome"]
        assert results["rounds_completed"] == 1
        assert results["counters"]["missed-deadline"] == 1  # counted after the last checkpoint, and kept
    finally:
        fleet.stop()


def test_sigterm_stops_the_coordinator_with_its_results_written(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2,
                  coordinator_options={"rounds_per_task": 4, "min_clients": 2, "client": {"epochs": 15}})
    try:
        fleet.start()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        fleet.processes["coordinator"].send_signal(signal.SIGTERM)
        assert fleet.wait_coordinator(timeout=CEILING_S) == 130
        results = fleet.results()
        assert results["outcome"] == "stopped" and results["rounds_completed"] < 20
        fleet.start_coordinator(resume=True)  # and it goes on from there
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        assert fleet.results()["outcome"] == "complete" and fleet.results()["rounds_completed"] == 20
    finally:
        fleet.stop()
