"""End-to-end runs over a real mosquitto: a coordinator and device daemons as separate processes, and the faults a
deployment meets (a device killed mid-round, the broker restarted mid-round, the coordinator killed and resumed)."""
from __future__ import annotations

import json
import threading

import pytest
from fleet_harness import CEILING_S, Fleet
from mqtt_helpers import Peer

from coordinator.broker import mosquitto_path
from edge_client.state import load_state
from edgefil import topics, wire

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
CHANCE = 0.1  # ten digit classes


@pytest.fixture
def fleet_factory(tmp_path, export_artifacts):
    made: list[Fleet] = []

    def make(**options) -> Fleet:
        fleet = Fleet(tmp_path / f"fleet{len(made)}", export_artifacts("lenet", 10, (1, 8, 8)), **options)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.stop()


def watch(fleet: Fleet, topic: str, when, action) -> tuple[Peer, threading.Event]:
    """Run `action` (once) from a read-only observer when a message on `topic` passes `when`."""
    peer = Peer(fleet.broker.address, "observer", fleet.observer_credentials.password)
    assert not peer.connect().is_failure
    fired = threading.Event()

    def on_message(client, userdata, message) -> None:
        if not fired.is_set() and when(message.topic, message.payload):
            fired.set()
            action()

    peer.client.on_message = on_message
    peer.subscribe(topic)
    return peer, fired


def test_five_devices_learn_class_incremental_digits_with_refed(fleet_factory):
    fleet = fleet_factory(coordinator_options={"rounds_per_task": 3, "min_clients": 5})
    fleet.start()
    fleet.start_coordinator()
    assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    results = fleet.results()
    matrix = results["accuracy_matrix"]
    assert [len(row) for row in matrix] == [1, 2, 3, 4, 5]  # after task i, on tasks 0..i
    assert results["rounds_completed"] == 15
    assert all(sorted(r["received"]) == fleet.devices for r in results["history"])
    assert results["final_accuracy"] > 3 * CHANCE, matrix
    # every device kept its replay store within M (the stored counts each update reports); the history keeps the
    # reports of the updates aggregated: a round's 5 less those the guard's Krum selection refused
    stored = [m["stored_samples"] for r in results["history"] for m in r["metrics"].values()]
    assert len(stored) == 15 * 5 - results["counters"].get("krum-outlier", 0) and max(stored) <= 200
    for device in fleet.devices:
        state = load_state(fleet.root / "devices" / device, weights=False, optimizer=False)
        assert state.task == 4 and state.round == 15


def test_device_killed_mid_round_round_completes_by_deadline(fleet_factory):
    fleet = fleet_factory(n_devices=4, coordinator_options={"deadline_s": 6.0, "min_clients": 2})
    fleet.start()
    victim = fleet.devices[-1]
    # Kill the victim as soon as it is sent the first round of task 1 (a task switch: it ranks and trains).
    peer, fired = watch(
        fleet, topics.to_device(fleet.fleet, victim, "round"),
        lambda topic, payload: wire.decode(payload)["task"] == 1, lambda: fleet.kill(victim),
    )
    fleet.start_coordinator()
    assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    peer.close()
    assert fired.is_set()
    results = fleet.results()
    assert results["rounds_completed"] == 10
    cut = next(r for r in results["history"] if r["task"] == 1)
    assert victim in cut["selected"] and victim not in cut["received"]
    assert len(cut["received"]) == 3
    assert results["counters"]["missed-deadline"] >= 1
    assert results["final_accuracy"] > 2 * CHANCE


def test_broker_restart_mid_round_run_completes(fleet_factory):
    fleet = fleet_factory(n_devices=3, coordinator_options={"deadline_s": 40.0, "min_clients": 3})
    fleet.start()
    restarted = threading.Event()

    def restart() -> None:
        threading.Thread(target=lambda: (fleet.broker.restart(), restarted.set())).start()

    peer, fired = watch(fleet, topics.to_device(fleet.fleet, fleet.devices[0], "round"),
                 lambda topic, payload: wire.decode(payload)["round"] == 4, restart)
    fleet.start_coordinator()
    assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    assert restarted.is_set()
    results = fleet.results()
    assert results["rounds_completed"] == 10
    assert all(len(r["received"]) == 3 for r in results["history"])
    assert results["reconnects"] >= 1
    assert results["final_accuracy"] > 2 * CHANCE
    assert all(fleet.processes[d].poll() is None for d in fleet.devices)  # the devices rode it out
    peer.close()


def test_coordinator_killed_and_resumed_loses_no_completed_round(fleet_factory):
    fleet = fleet_factory(n_devices=3, coordinator_options={"min_clients": 3})
    fleet.start()
    fleet.start_coordinator()
    fleet.wait_rounds(4, timeout=CEILING_S)
    fleet.kill("coordinator")
    kept = fleet.results()
    checkpoint = json.loads(max((fleet.root / "run" / "checkpoint").glob("round-*/state.json")).read_text())
    # a round's files are written once the next round is open (coordinator/run_logs.py): a kill in between leaves
    # them behind the checkpoint, never ahead, and the resumed run writes them whole
    assert checkpoint["round"] >= kept["rounds_completed"] >= 4
    fleet.start_coordinator(resume=True)
    assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    final = fleet.results()
    assert final["rounds_completed"] == 10
    assert [r["round"] for r in final["history"]] == list(range(1, 11))
    assert final["history"][: len(kept["history"])] == kept["history"]  # the kept rounds, unchanged
    assert final["accuracy_matrix"][: len(kept["accuracy_matrix"])] == kept["accuracy_matrix"]
    assert final["final_accuracy"] > 2 * CHANCE


def test_a_full_run_over_the_embedded_python_broker(fleet_factory):
    fleet = fleet_factory(n_devices=2, embedded=True, scenario={"preset": "digits-class", "n_tasks": 2},
                          coordinator_options={"rounds_per_task": 1, "min_clients": 2})
    fleet.start()
    fleet.start_coordinator()
    assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    results = fleet.results()
    assert results["rounds_completed"] == 2
    assert all(sorted(r["received"]) == fleet.devices for r in results["history"])
