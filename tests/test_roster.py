"""The roster: the coordinator's one record of its devices (coordinator/roster.py)."""
from __future__ import annotations

from coordinator.inbox import Registration, Status, Update
from coordinator.roster import Roster


def update(device: str, round_: int, **metrics: float) -> Update:
    return Update(device=device, round=round_, task=0, model="m", num_samples=5, metrics=metrics, weights=None,
                  label_counts=(3, 2))


def test_a_device_is_selectable_once_registered_online_and_holding_data():
    roster = Roster(["a", "b", "c"])
    assert roster.available(0) == set() and [r["state"] for r in roster.table()] == ["unseen"] * 3
    roster.register(Registration("a", "ort", "raspberry-pi-4-4gb", "i1"))
    assert roster.available(0) == set()  # registered, but no status says it is online yet
    roster.take_status(Status("a", "idle", 0, instance="i1"), 0)
    roster.register(Registration("b", "portable", "jetson-nano", "j1"))
    roster.take_status(Status("b", "no-data", 0, instance="j1"), 0)
    roster.take_status(Status("c", "idle", 0), 0)  # online, but never registered
    assert roster.connected() == {"a", "b"} and roster.available(0) == {"a"}
    roster.take_status(Status("b", "idle", 0, instance="j1"), 0)
    roster.take_status(Status("a", "offline", 0, instance="i1"), 0)
    assert roster.available(0) == {"b"}
    table = {row["device"]: row for row in roster.table()}
    assert (table["a"]["profile"], table["a"]["backend"], table["a"]["online"]) == ("raspberry-pi-4-4gb", "ort", False)
    assert (table["b"]["profile"], table["b"]["online"], table["b"]["state"]) == ("jetson-nano", True, "idle")


def test_a_device_without_data_for_a_task_is_selected_again_in_a_later_one():
    """"no-data" speaks for a task (the one it names, else the run's): a device that joins at task 2 is selected
    from that task's first round on, not only once a status of its own says it has data."""
    roster = Roster(["a", "b"])
    for device in ("a", "b"):
        roster.register(Registration(device, "ort", "pc", device))
        roster.take_status(Status(device, "idle", 0, instance=device), 0)
    roster.take_status(Status("b", "no-data", 0, instance="b", task=1), 0)  # it heard task 1 first
    assert roster.available(0) == roster.available(1) == {"a"}
    assert roster.available(2) == {"a", "b"}
    roster.take_status(Status("b", "no-data", 3, instance="b"), 2)  # names no task: the run's
    assert roster.available(2) == {"a"} and roster.available(3) == {"a", "b"}
    assert list(roster.without_data) == ["b"]


def test_an_error_is_kept_with_its_round_until_the_device_reports_another():
    roster = Roster(["a"])
    roster.register(Registration("a", "ort", "pc", "i1"))
    roster.take_status(Status("a", "error", 3, error="data of shape (5,) do not fit the model's (1, 8, 8)",
                              instance="i1"), 0)
    assert roster.errors() == {"a": {"round": 3, "error": "data of shape (5,) do not fit the model's (1, 8, 8)"}}
    assert roster.connected() == {"a"}  # it answers, it cannot train
    roster.take_status(Status("a", "error", 4, error="disk full", instance="i1"), 0)
    assert roster.errors() == {"a": {"round": 4, "error": "disk full"}}


def test_a_late_last_will_of_a_replaced_process_is_stale_and_an_old_instance_back_is_a_duplicate():
    roster = Roster(["a"])
    assert roster.register(Registration("a", "ort", "pc", "old")) is None
    assert roster.register(Registration("a", "ort", "pc", "new")) is None  # a restart
    assert roster.instance("a") == "new"
    assert roster.is_stale(Status("a", "offline", 0, instance="old"))
    assert not roster.is_stale(Status("a", "offline", 0, instance="new"))
    assert not roster.is_stale(Status("a", "offline", 0))  # a device that names no instance is believed
    assert roster.register(Registration("a", "ort", "pc", "old")) == ["new", "old"]  # both run at once
    assert roster.duplicates == {"a": ["new", "old"]}


def test_an_update_records_the_devices_round_store_and_labels():
    roster = Roster(["a"])
    roster.take_update(update("a", 4, stored_samples=120, stored_bytes=40_000, store_budget_bytes=65_536,
                              store_budget_samples=200))
    assert roster.table()[0]["budget_samples"] == 200
    roster.take_update(update("a", 3, stored_samples=1, stored_bytes=1, store_budget_bytes=0))  # a late resend
    row = roster.table()[0]
    assert row["last_round"] == 4  # never goes back
    assert (row["stored_samples"], row["stored_bytes"], row["budget_bytes"]) == (1, 1, None)  # 0: no byte budget
    assert row["label_counts"] == [3, 2]
    roster.take_update(update("a", 5, stored_bytes=float("nan"), stored_samples=-1))  # what a gate would not pass
    row = roster.table()[0]
    assert (row["stored_samples"], row["stored_bytes"]) == (None, None)


def test_a_device_sent_a_round_shows_training_until_its_update_or_its_word_that_it_cannot():
    """A device says nothing of a round's progress (edge_client/device.py): the roster shows it "training" from the
    round message it is sent to the update taken from it, "idle" after; a status that answers the round instead (an
    error) replaces "training", and stays online."""
    roster = Roster(["a", "b"])
    for device in ("a", "b"):
        roster.register(Registration(device, "portable", "pc", device))
        roster.take_status(Status(device, "idle", 0, instance=device), 0)
        roster.asked_to_train(device)
    assert [r["state"] for r in roster.table()] == ["training", "training"]
    roster.take_update(update("a", 1))
    roster.take_status(Status("b", "error", 1, instance="b", error="its data is damaged"), 0)
    table = {row["device"]: row for row in roster.table()}
    assert (table["a"]["state"], table["b"]["state"]) == ("idle", "error")
    assert roster.connected() == {"a", "b"}


def test_a_device_out_of_the_run_stays_failed_with_its_reason_whatever_it_said_before_or_says_after():
    """`fail` (its host says it failed to start, or stopped on an error): offline, "failed" with why, for the rest
    of the run: a late status (its last will, a stray "idle") does not bring it back into the selection."""
    roster = Roster(["a", "b"])
    for device in ("a", "b"):
        roster.register(Registration(device, "ort", "pc", device))
        roster.take_status(Status(device, "idle", 0, instance=device), 0)
    roster.fail("b", "it stopped: OSError: [Errno 28] No space left on device")
    roster.take_status(Status("b", "idle", 1, instance="b"), 0)
    roster.take_status(Status("b", "offline", 1, instance="b"), 0)
    assert roster.connected() == roster.available(0) == {"a"} and roster.failed == {"b": roster.records["b"].error}
    row = {row["device"]: row for row in roster.table()}["b"]
    assert (row["state"], row["online"], row["error"]) == ("failed", False, "it stopped: OSError: [Errno 28] No "
                                                           "space left on device")
