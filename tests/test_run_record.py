"""The run record (coordinator/run_record.py) and the run's files for people's tools (coordinator/run_logs.py):
metrics.csv and a TensorBoard log that TensorBoard's own reader loads."""
from __future__ import annotations

import csv
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from coordinator.checkpoint import HistoryFile, RoundEntry, RunState, load_latest, load_run_state, save_run_state
from coordinator.inbox import Registration, Status, Update
from coordinator.roster import Roster
from coordinator.rounds import OpenRound
from coordinator.run_logs import (
    LIVE_FILE,
    METRICS_FILE,
    RESULTS_FILE,
    ROUND_FILES_MAX_SHARE,
    TENSORBOARD_DIR,
    Paced,
    RunLogs,
)
from coordinator.run_record import RunRecord


@dataclass
class LinkCounters:
    """The link's traffic counters, as the record reads them (a link's own are tested in test_link.py)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    connects: int = 1


def make_record(total_steps: int = 6, state: RunState | None = None, history_file: HistoryFile | None = None
                ) -> tuple[RunRecord, Counter[str], LinkCounters]:
    counters: Counter[str] = Counter()
    traffic = LinkCounters()
    roster = Roster(["a", "b"])
    state = state or RunState(weights=np.zeros(3, dtype=np.float32))
    record = RunRecord("lab", {"preset": "digits-class"}, {"name": "fedavg"}, {"rounds_per_task": 2}, state, roster,
                       counters, traffic, total_rounds=total_steps, total_steps=total_steps, history_file=history_file)
    return record, counters, traffic


def close_round(record: RunRecord, number: int, task: int, accuracy: list[float], ended_at: float,
                task_done: bool = False) -> None:
    entry = record.entry(round=number, task=task, selected=["a", "b"], received=["a"], samples=10,
                         accuracy=accuracy, aggregate_s=0.01, metrics={}, rule_metrics={"signal": 0.5, "kind": "x"})
    entry["ended_at"] = ended_at
    record.state.history.append(entry)
    record.state.round = number
    if task_done:
        record.state.accuracy_matrix.append(accuracy)
    record.round_closed(entry)


def test_an_entry_carries_its_rounds_refusals_and_the_traffic_so_far():
    record, counters, traffic = make_record()
    counters["late"] += 2  # before the round opened: not this round's
    record.round_opened(OpenRound.open(1, 0, "m", ["a", "b"], 60.0))
    counters["rate"] += 3
    traffic.bytes_sent, traffic.bytes_received = 1000, 4000
    record.round_opened(OpenRound.open(1, 0, "m", ["a"], 60.0))  # a retry: still counted from the first attempt
    counters["stale"] += 1
    entry = record.entry(round=1, task=0, accuracy=[0.5])
    assert entry["refusals"] == {"rate": 3, "stale": 1}
    assert (entry["bytes_sent"], entry["bytes_received"]) == (1000, 4000)
    record.state.history.append(entry)
    record.round_closed(entry)
    assert record.entry(round=2, task=0, accuracy=[0.5])["refusals"] == {}


def test_the_eta_is_the_recent_round_time_times_the_rounds_left():
    record, _, _ = make_record(total_steps=6)
    assert record.eta_s() is None  # no round done in this process yet
    record.started_at = 100.0
    close_round(record, 1, 0, [0.5], ended_at=110.0)
    close_round(record, 2, 0, [0.7], ended_at=130.0, task_done=True)
    assert record.eta_s() == pytest.approx(15.0 * 4) and record.eta_text() == "; ETA 1 min 0 s"
    live = record.live()
    assert (live["steps_done"], live["steps_total"], live["open_round"]) == (2, 6, None)
    opened = OpenRound.open(3, 1, "m", ["a", "b"], 60.0)
    opened.delivered.add("b")
    record.round_opened(opened)
    assert record.live()["open_round"]["delivered"] == ["b"]
    for n in range(3, 7):
        close_round(record, n, 1, [0.5, 0.5], ended_at=130.0 + n)
    assert record.eta_s() == 0.0


def test_results_say_what_was_run_and_the_devices_state():
    record, _, _ = make_record()
    record.roster.register(Registration("a", "ort", "jetson-nano", "i"))
    record.roster.take_status(Status("a", "error", 1, error="no room", instance="i"), 0)
    close_round(record, 1, 0, [0.8], ended_at=1.0, task_done=True)
    close_round(record, 2, 1, [0.6, 0.9], ended_at=2.0, task_done=True)
    results = record.results()
    assert results["settings"] == {"rounds_per_task": 2} and results["strategy"] == {"name": "fedavg"}
    assert results["final_accuracy"] == pytest.approx(0.75)
    assert results["average_accuracy"] == pytest.approx((0.8 + 0.75) / 2)  # the mean over the matrix's rows
    assert results["device_errors"] == {"a": {"round": 1, "error": "no room"}}
    assert [(d["device"], d["profile"], d["state"]) for d in results["devices"]] == [
        ("a", "jetson-nano", "error"), ("b", "", "unseen")]
    json.dumps(record.live())  # every reader gets JSON


def test_live_json_carries_each_round_without_its_per_device_fields_and_with_its_devices_means():
    """results.json keeps every device's metrics of every round; live.json, which the dashboard reads every second,
    carries each round's mean of each metric over the devices that reported it, and no per-device field, so it does
    not grow with the devices. A resumed history (another list) is summarised anew."""
    record, _, _ = make_record()
    entry = record.entry(round=1, task=0, selected=["a", "b", "c"], received=["a", "b"], samples=10, accuracy=[0.5],
                         metrics={"a": {"loss": 1.0, "pim": 0.2}, "b": {"loss": 3.0}, "c": {}},
                         client_accuracy={"a": 0.4, "b": 0.6}, rule_metrics={"signal": 0.5})
    record.state.history.append(entry)
    record.round_closed(entry)
    live = record.live()["history"]
    assert len(live) == 1 and live[0]["device_means"] == {"loss": 2.0, "pim": 0.2}
    assert not {"selected", "received", "metrics", "client_accuracy"} & live[0].keys()
    assert {k: v for k, v in live[0].items() if k != "device_means"} == {
        k: v for k, v in entry.items() if k not in ("selected", "received", "metrics", "client_accuracy")}
    assert record.results()["history"][0]["metrics"]["a"] == {"loss": 1.0, "pim": 0.2}  # results.json: whole
    resumed = record.entry(round=1, task=0, accuracy=[0.7], metrics={"a": {"loss": 5.0}})
    record.state.history = [resumed]
    assert [(e["accuracy"], e["device_means"]) for e in record.live()["history"]] == [([0.7], {"loss": 5.0})]


def test_live_json_is_the_live_text_as_the_devices_and_rounds_change():
    """live.json is written in parts, each device's row and each round's entry encoded once (`Roster.table_texts`,
    `RunRecord.live_json`): after each kind of change of a device's record, and a round's close, it reads as
    live() does (but its clock)."""
    record, _, _ = make_record()

    def read_alike() -> bool:
        written = json.loads(b"".join(record.live_json()))
        live = record.live()
        return {**written, "updated_at": 0} == {**live, "updated_at": 0} and list(written) == list(live)

    assert read_alike()
    record.roster.register(Registration("a", "ort", "pi4", "i"))
    assert read_alike()
    record.roster.take_status(Status("a", "online", 0, instance="i"), 0)
    assert read_alike() and record.live()["devices"][0]["online"]
    record.roster.asked_to_train("a")
    assert read_alike()
    record.roster.take_update(Update("a", 1, 0, "m", 3, {"stored_samples": 3, "stored_bytes": 120}, np.zeros(3),
                                     label_counts=(1, 2)))
    assert read_alike() and record.live()["devices"][0]["label_counts"] == [1, 2]
    record.roster.take_status(Status("a", "offline", 1, instance="i"), 0)
    assert read_alike() and not record.live()["devices"][0]["online"]
    close_round(record, 1, 0, [0.5], ended_at=1.0)
    assert read_alike() and len(record.live()["history"]) == 1


def test_results_json_is_the_results_text():
    """results.json's bytes are json.dumps(results()) to the byte: as rounds close, after the live file was made,
    with a device error in the roster, and after the history was replaced."""
    record, counters, _ = make_record()

    def text() -> str:
        return b"".join(record.results_json()).decode()

    assert text() == json.dumps(record.results())  # no round yet
    for number in (1, 2, 3):
        entry = record.entry(round=number, task=0, selected=["a", "b"], received=["a"], samples=3, accuracy=[0.5],
                             metrics={"a": {"loss": float(number), "pim": 0.25}}, rule_metrics={"kind": "x"})
        record.state.history.append(entry)
        record.round_closed(entry)
        counters["late"] += number
        record.live()
        assert text() == json.dumps(record.results())
    record.roster.take_status(Status("a", "error", 3, error="no room", instance="i"), 0)
    assert text() == json.dumps(record.results())
    record.state.history = [record.entry(round=1, task=0, accuracy=[0.9], metrics={"b": {"loss": 2.0}})]
    assert text() == json.dumps(record.results())
    assert json.loads(text())["history"][0]["metrics"] == {"b": {"loss": 2.0}}


def checkpointed_round(record: RunRecord, folder: Path, number: int) -> RoundEntry:
    """Round `number` closed and checkpointed in `folder` as the coordinator does; its entry as written."""
    entry = record.entry(round=number, task=0, selected=["a", "b"], received=["a", "b"], samples=3, accuracy=[0.5],
                         metrics={"a": {"loss": float(number)}, "b": {"loss": 3.0 * number}},
                         client_accuracy={"a": 0.25 * number})
    record.state.history.append(entry)
    record.state.round = number
    save_run_state(folder / f"round-{number}", record.state, record.history_file)
    record.round_closed(entry)
    return json.loads(json.dumps(entry))


def test_a_rounds_values_per_device_are_kept_in_the_history_file_not_in_memory(tmp_path, caplog):
    """The coordinator keeps of a round checkpointed before the last one its own numbers and who took part; its
    every device's metrics and each client's accuracy are in the checkpoint's history file, from which results()
    and results.json read them back whole, byte for byte what they were; live.json's device means were made
    while the round held them. A history file edited or removed by a hand: those rounds are given without them,
    said."""
    record, _, _ = make_record(history_file=HistoryFile(tmp_path / "history.jsonl"))
    record.state.rng = dict(np.random.default_rng(0).bit_generator.state)
    made = [checkpointed_round(record, tmp_path, number) for number in (1, 2, 3)]
    kept = record.state.history
    assert [("metrics" in e, "client_accuracy" in e) for e in kept] == [(False, False), (False, False), (True, True)]
    assert [e["received"] for e in kept] == [["a", "b"]] * 3  # who took part, kept
    assert record.results()["history"] == made
    assert b"".join(record.results_json()) == json.dumps(record.results()).encode()
    assert [e["device_means"] for e in record.live()["history"]] == [{"loss": 2.0 * n} for n in (1, 2, 3)]
    loaded = load_run_state(tmp_path / "round-3")
    assert loaded is not None and loaded.history == made  # a resume reads them whole

    lines = (tmp_path / "history.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "history.jsonl").write_bytes(lines[0] + lines[1].replace(b"2.0", b"2.25") + lines[2])  # by a hand
    with caplog.at_level(logging.WARNING, logger="edgefil.coordinator"):
        results = json.loads(b"".join(record.results_json()))
        assert [("metrics" in e) for e in results["history"]] == [True, False, True]
        assert "holds 1 of the 2 rounds" in caplog.text
        (tmp_path / "history.jsonl").unlink()
        assert [("metrics" in e) for e in record.results()["history"]] == [False, False, True]
        assert "holds 0 of the 2 rounds" in caplog.text


def test_a_resumed_run_holds_its_history_as_the_run_did_and_appends_to_its_file(tmp_path):
    """A resume takes the history file's lines its generation names, and keeps of each entry what the run kept: its
    values per device let go as it is read (all but the newest's), not held until the first save; live.json's
    device means are made of each entry read back, results() and results.json give the entries whole; its first
    save appends after the lines it took (a crash's tail cut), where it wrote the whole file again."""
    path = tmp_path / "history.jsonl"
    record, _, _ = make_record(history_file=HistoryFile(path))
    record.state.rng = dict(np.random.default_rng(0).bit_generator.state)
    made = [checkpointed_round(record, tmp_path, number) for number in (1, 2, 3)]
    with path.open("ab") as handle:  # a crash after round 4's append, before its state
        handle.write(b'{"round": 4, "ta')
    inode = path.stat().st_ino

    history = HistoryFile(path)
    latest = load_latest(tmp_path, history=history)
    assert latest is not None and latest[1].name == "round-3"
    state = latest[0]
    assert [("metrics" in e, "client_accuracy" in e) for e in state.history] == [(False, False)] * 2 + [(True, True)]
    resumed, _, _ = make_record(state=state, history_file=history)
    assert [e["device_means"] for e in resumed.live()["history"]] == [{"loss": 2.0 * n} for n in (1, 2, 3)]
    assert resumed.results()["history"] == made
    made.append(checkpointed_round(resumed, tmp_path, 4))
    assert path.stat().st_ino == inode  # appended to, not written whole again
    assert path.read_bytes().splitlines() == [json.dumps(entry).encode() for entry in made]
    assert [("metrics" in e) for e in state.history] == [False] * 3 + [True]
    assert resumed.results()["history"] == made
    assert b"".join(resumed.results_json()) == json.dumps(resumed.results()).encode()
    assert [e["device_means"] for e in resumed.live()["history"]] == [{"loss": 2.0 * n} for n in (1, 2, 3, 4)]
    latest = load_latest(tmp_path)
    assert latest is not None and latest[0].history == made  # the next resume's, whole


def test_every_run_folder_gets_metrics_csv_and_a_tensorboard_log_that_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record, counters, traffic = make_record(total_steps=4)
    logs = RunLogs(tmp_path, record, n_tasks=2)
    record.round_opened(OpenRound.open(1, 0, "m", ["a"], 60.0))
    counters["rate"] += 2
    traffic.bytes_sent = 500
    close_round(record, 1, 0, [0.25], ended_at=record.started_at + 1, task_done=True)
    logs.round_done()
    close_round(record, 2, 1, [0.5, 0.75], ended_at=record.started_at + 2, task_done=True)
    record.outcome = "complete"
    logs.run_ended()

    rows = list(csv.DictReader((tmp_path / METRICS_FILE).open()))
    assert [(r["round"], r["task"], r["accuracy_task_0"], r["accuracy_task_1"]) for r in rows] == [
        ("1", "0", "0.250000", ""), ("2", "1", "0.500000", "0.750000")]
    assert rows[1]["average_accuracy"] == "0.625000"
    assert (rows[0]["refusals"], rows[0]["refusal_reasons"], rows[0]["bytes_sent"]) == ("2", "rate=2", "500")
    assert json.loads((tmp_path / RESULTS_FILE).read_text())["outcome"] == "complete"
    assert json.loads((tmp_path / LIVE_FILE).read_text())["steps_done"] == 2

    files = list((tmp_path / TENSORBOARD_DIR).iterdir())
    assert len(files) == 1
    events = EventAccumulator(str(files[0]))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"accuracy/task_0", "accuracy/task_1", "accuracy/average", "traffic/bytes_sent", "rule/signal"} <= set(tags)
    assert "rule/kind" not in tags  # not a number
    average = events.Scalars("accuracy/average")
    assert [(s.step, round(s.value, 4)) for s in average] == [(1, 0.25), (2, 0.625)]
    assert [s.step for s in events.Scalars("accuracy/task_1")] == [2]

    resumed = RunLogs(tmp_path, record, n_tasks=2)  # a resumed run rewrites the same log, whole
    close_round(record, 3, 1, [0.5, 0.5], ended_at=record.started_at + 3)
    resumed.round_done()
    assert list((tmp_path / TENSORBOARD_DIR).iterdir()) == files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert [s.step for s in events.Scalars("accuracy/average")] == [1, 2, 3]


def test_a_rounds_files_are_written_at_the_next_write_due_not_in_its_close(tmp_path):
    """`round_due` (a round's close) writes nothing; the next `write_due` (the coordinator's loop, once the next round
    is open) writes every file, and one with no round closed since writes them not again; `run_ended` writes what is
    due."""
    record, _, _ = make_record()
    logs = RunLogs(tmp_path, record, n_tasks=1)
    close_round(record, 1, 0, [0.5], ended_at=1.0)
    logs.round_due()
    assert not (tmp_path / RESULTS_FILE).exists() and not (tmp_path / METRICS_FILE).exists()
    logs.write_due()
    assert json.loads((tmp_path / RESULTS_FILE).read_text())["rounds_completed"] == 1
    assert len(list(csv.DictReader((tmp_path / METRICS_FILE).open()))) == 1
    (tmp_path / RESULTS_FILE).unlink()
    logs.write_due()
    assert not (tmp_path / RESULTS_FILE).exists()
    close_round(record, 2, 0, [0.6], ended_at=2.0)
    logs.round_due()
    record.outcome = "complete"
    logs.run_ended()
    assert json.loads((tmp_path / RESULTS_FILE).read_text())["rounds_completed"] == 2


def test_a_paced_file_waits_its_last_writes_cost_over_its_share_and_at_least_its_interval():
    now = [100.0]
    pace = Paced(1.0, 0.05, clock=lambda: now[0])
    assert pace.due()
    pace.write(lambda: now.__setitem__(0, now[0] + 2.0))  # a write that took 2 s: due 40 s after it ended
    now[0] += 39.9
    assert not pace.due()
    now[0] += 0.1
    assert pace.due()
    pace.write(lambda: None)  # one that took nothing: the interval still holds
    now[0] += 0.5
    assert not pace.due()
    now[0] += 0.5
    assert pace.due()


def test_round_files_that_take_long_to_write_wait_so_they_keep_to_their_share(tmp_path, monkeypatch):
    """A large fleet's results.json (its every device's metrics of every round) takes long to write: it is not
    written again after each round but once the time since is 1 / ROUND_FILES_MAX_SHARE times what it took, while
    live.json goes on at its own pace, and the run's end writes it at once."""
    now = [0.0]
    record, _, _ = make_record(total_steps=8)
    encode = record.results_json

    def one_second_to_encode() -> str:
        now[0] += 1.0
        return encode()

    monkeypatch.setattr(record, "results_json", one_second_to_encode)
    logs = RunLogs(tmp_path, record, n_tasks=1, clock=lambda: now[0])

    def rounds_in(name: str) -> int:
        got: int = json.loads((tmp_path / name).read_text())["steps_done" if name == LIVE_FILE else "rounds_completed"]
        return got

    assert logs.round_files_due_in() == math.inf  # no round closed: the coordinator's wait is its own
    close_round(record, 1, 0, [0.5], ended_at=1.0)
    logs.round_due()
    assert logs.round_files_due_in() == 0.0
    logs.write_due()
    assert rounds_in(RESULTS_FILE) == 1  # the first: nothing to wait for
    wait = 1.0 / ROUND_FILES_MAX_SHARE
    for number in (2, 3):
        now[0] += wait / 3
        close_round(record, number, 0, [0.5], ended_at=now[0])
        logs.round_due()
        logs.write_due()
    assert (rounds_in(RESULTS_FILE), rounds_in(LIVE_FILE)) == (1, 3)
    assert logs.round_files_due_in() == pytest.approx(1.0 + wait - now[0])  # the wait ends when they are due
    now[0] = 1.0 + wait  # the first write ended at 1.0
    assert logs.round_files_due_in() == 0.0
    logs.write_due()
    assert rounds_in(RESULTS_FILE) == 3
    assert len(list(csv.DictReader((tmp_path / METRICS_FILE).open()))) == 3
    close_round(record, 4, 0, [0.5], ended_at=now[0])
    logs.round_due()
    record.outcome = "complete"
    logs.run_ended()
    assert rounds_in(RESULTS_FILE) == 4


def test_a_run_folder_that_cannot_be_written_does_not_stop_the_round(tmp_path):
    record, _, _ = make_record()
    logs = RunLogs(tmp_path, record, n_tasks=1)
    (tmp_path / TENSORBOARD_DIR).write_text("a file where the folder goes")
    (tmp_path / RESULTS_FILE).mkdir()  # a folder where results.json goes: its write fails as a full disk's would
    close_round(record, 1, 0, [0.5], ended_at=1.0)
    logs.round_done()  # logged, not raised
    assert Path(tmp_path / METRICS_FILE).exists() and (tmp_path / RESULTS_FILE).is_dir()


def test_local_epsilon_is_the_largest_any_device_reported_in_any_round_and_follows_a_replaced_history():
    """results' `local_epsilon`: the largest a device reported over every round (each round's scanned once), None
    where none did; a replaced history (a resume) is read anew."""
    record, _, _ = make_record()
    assert record.results()["local_epsilon"] is None
    for number, spent in ((1, {"a": 0.5, "b": 2.0}), (2, {"a": 1.5}), (3, {})):
        entry = record.entry(round=number, task=0, accuracy=[0.5],
                             metrics={d: {"loss": 1.0, "local_epsilon": e} for d, e in spent.items()} | {"c": {}})
        record.state.history.append(entry)
        record.round_closed(entry)
        record.live()
    assert record.results()["local_epsilon"] == 2.0
    record.state.history = [record.entry(round=1, task=0, accuracy=[0.5], metrics={"a": {"local_epsilon": 0.25}})]
    assert record.results()["local_epsilon"] == 0.25
