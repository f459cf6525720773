"""A run's files for people and their tools, all read from the one run record (coordinator/run_record.py):

- `results.json`: the results and the history (rewritten after a round, as often as `ROUND_FILES_MAX_SHARE` allows,
  and at the end);
- `metrics.csv`: one row per round (round, task, accuracy per task seen, their mean, samples, traffic, refusals);
- `tensorboard/events.out.tfevents.<start>.edgefil`: the same numbers as TensorBoard scalars (coordinator/
  tensorboard.py), plus the rule's own numeric metrics;
- `live.json`: what the dashboard shows while the run goes (the roster, the open round, the ETA), rewritten at most
  every `LIVE_MIN_INTERVAL_S`, and less often when writing it takes long (a large fleet's roster): it never takes
  more than `LIVE_MAX_SHARE` of the coordinator's time.

A round's files are written once the next round has opened (`round_due`, then `write_due` between messages), not in
its close: the fleet waits for a close, for the next round's model, and not for them (a 200-device round's close took
17-21 ms with them and 10-13 without, the round 3.7 % less wall time; docs/results.md, issue 57). A stop writes them
at once (`run_ended`); a crash between a close and the next round's first message leaves them behind the checkpoint,
never ahead, and a resumed run writes them whole.

They are written whole, and results.json grows with rounds x devices (each round's entry holds every device's
metrics: 7 MB a round at 10,000 devices, so the 100th round's rewrite is 700 MB; its rounds are copied from the
checkpoint's history file a line at a time, not held in memory: `RunRecord.results_json`): written after every
round, a long run's coordinator spends more on them each round, without end. So they are paced as live.json is
(`Paced`): after a round whose files are due, written once the time since their last write is at least `1 /
ROUND_FILES_MAX_SHARE` times what that write took, so they never take more than that share of the coordinator's
time; a small fleet's take milliseconds and are written after (nearly) every round, a large fleet's after every few;
the coordinator's wait for its next message ends when they are due (`round_files_due_in`), so a quiet fleet does not
hold them back. A crash may then leave them a few rounds behind the checkpoint (never ahead); the end of a run
writes them at once.

The CSV and the event file are made whole from the history each time, so a resumed run's logs hold every round.
Writing them may fail (a full disk): the failure is logged, and the run goes on.
"""
from __future__ import annotations

import csv
import io
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator import tensorboard
from coordinator.checkpoint import RoundEntry
from coordinator.run_record import RunRecord
from edgefil.durable import write_atomically

log = logging.getLogger("edgefil.coordinator")
RESULTS_FILE = "results.json"
METRICS_FILE = "metrics.csv"
LIVE_FILE = "live.json"
TENSORBOARD_DIR = "tensorboard"
LIVE_MIN_INTERVAL_S = 1.0
LIVE_MAX_SHARE = 0.05
ROUND_FILES_MAX_SHARE = 0.05


def csv_rows(history: list[RoundEntry], n_tasks: int) -> list[dict[str, Any]]:
    """The rows of metrics.csv: a column per task (empty before the task is seen)."""
    rows = []
    for step, entry in enumerate(history, start=1):
        accuracy = entry["accuracy"]
        refusals = entry.get("refusals", {})
        rows.append({
            "step": step, "round": entry["round"], "task": entry["task"], "trained": int(entry.get("trained", True)),
            **{f"accuracy_task_{t}": (f"{accuracy[t]:.6f}" if t < len(accuracy) else "") for t in range(n_tasks)},
            "average_accuracy": f"{sum(accuracy) / len(accuracy):.6f}" if accuracy else "",
            "samples": entry.get("samples", 0), "updates": len(entry.get("received", [])),
            "bytes_sent": entry.get("bytes_sent", ""), "bytes_received": entry.get("bytes_received", ""),
            "refusals": sum(refusals.values()),
            "refusal_reasons": " ".join(f"{k}={n}" for k, n in sorted(refusals.items())),
            "ended_at": f"{entry['ended_at']:.3f}" if "ended_at" in entry else "",
        })
    return rows


def csv_text(history: list[RoundEntry], n_tasks: int) -> str:
    columns = ["step", "round", "task", "trained", *(f"accuracy_task_{t}" for t in range(n_tasks)),
               "average_accuracy", "samples", "updates", "bytes_sent", "bytes_received", "refusals",
               "refusal_reasons", "ended_at"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_rows(history, n_tasks))
    return out.getvalue()


def scalars(entry: RoundEntry) -> dict[str, float]:
    """A round's TensorBoard scalars: accuracy per task and on average, samples, traffic, refusals, IAA, and the
    rule's numeric metrics under `rule/`."""
    accuracy = entry["accuracy"]
    values: dict[str, float] = {f"accuracy/task_{t}": a for t, a in enumerate(accuracy)}
    if accuracy:
        values["accuracy/average"] = sum(accuracy) / len(accuracy)
    values["round/samples"] = float(entry.get("samples", 0))
    values["round/updates"] = float(len(entry.get("received", [])))
    values["round/refusals"] = float(sum(entry.get("refusals", {}).values()))
    for name in ("bytes_sent", "bytes_received"):
        if name in entry:
            values[f"traffic/{name}"] = float(entry[name])
    if "iaa" in entry:
        values["accuracy/iaa"] = entry["iaa"]
    for name, value in entry.get("rule_metrics", {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[f"rule/{name}"] = float(value)
    return values


class Paced:
    """When a file that is written again and again, whole, is due: at most every `min_interval_s`, and never taking
    more than `max_share` of the time: a write waits `1 / max_share` times what the last one took (`clock`'s
    seconds, from the end of that write), so one that grows costs its writer a bounded share however large it gets."""

    def __init__(self, min_interval_s: float, max_share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s, self.max_share, self._clock = min_interval_s, max_share, clock
        self._at = float("-inf")  # when the last write ended
        self._cost = 0.0  # what it took

    def due(self) -> bool:
        return self.due_in() <= 0.0

    def due_in(self) -> float:
        """Seconds until the next write is due (0 or less: due now)."""
        return self._at + max(self.min_interval_s, self._cost / self.max_share) - self._clock()

    def write(self, writing: Callable[[], None]) -> None:
        """`writing` now, timed (whether or not it was due)."""
        started = self._clock()
        try:
            writing()
        finally:
            self._at = self._clock()
            self._cost = self._at - started


class RunLogs:
    """Writes a run's files under `out` from its record; `clock` times their writes (`Paced`)."""

    def __init__(self, out: Path, record: RunRecord, n_tasks: int, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.out, self.record, self.n_tasks = out, record, n_tasks
        # one event file per run folder, kept across resumes (its name holds the time the run first started)
        found = sorted((out / TENSORBOARD_DIR).glob("events.out.tfevents.*.edgefil"))
        name = f"events.out.tfevents.{int(record.started_at)}.edgefil"
        self.events = found[0] if found else out / TENSORBOARD_DIR / name
        self._first_started = float(self.events.name.split(".")[3])
        self._live = Paced(LIVE_MIN_INTERVAL_S, LIVE_MAX_SHARE, clock)
        self._round_files = Paced(0.0, ROUND_FILES_MAX_SHARE, clock)
        self._due = False  # a round closed since the round files were written

    def round_due(self) -> None:
        """A round is checkpointed: its files are due, for the next `write_due` (the module docstring)."""
        self._due = True

    def write_due(self) -> None:
        """Every file where a round has closed since they were written and their pace allows (the module
        docstring), else live.json if it is due (called between messages)."""
        if self._due and self._round_files.due():
            self.round_done()
        elif self._live.due():
            self.write_live()

    def round_files_due_in(self) -> float:
        """Seconds until `write_due` has a round's files to write (inf: none due): how long the coordinator may wait
        for a message, so that a paced write is made when due and not only when a message comes."""
        return max(self._round_files.due_in(), 0.0) if self._due else math.inf

    def round_done(self) -> None:
        """Every file anew, now."""
        self._due = False
        self._round_files.write(self._write_round_files)
        self.write_live()

    def run_ended(self) -> None:
        """However the run ended (its outcome is in the record): every file, so each run has them all."""
        self.round_done()

    def write_live(self) -> None:
        self._live.write(self._write_live)

    def _write_live(self) -> None:
        try:
            write_atomically(self.out / LIVE_FILE, self.record.live_json())
        except OSError as err:
            log.warning("live.json not written: %s", err)

    def _write_round_files(self) -> None:
        """results.json (without indentation: json's C encoder takes no indent, and its Python one took ten times
        as long on a record that grows with every round and device; summary.md and metrics.csv are the files to
        read), metrics.csv and the TensorBoard log."""
        try:
            write_atomically(self.out / RESULTS_FILE, self.record.results_json())
        except OSError as err:
            log.warning("results.json not written: %s", err)
        history = self.record.history
        try:
            write_atomically(self.out / METRICS_FILE, csv_text(history, self.n_tasks).encode())
            self.events.parent.mkdir(exist_ok=True)
            steps = [(step, entry.get("ended_at", self._first_started), scalars(entry))
                     for step, entry in enumerate(history, start=1)]
            write_atomically(self.events, tensorboard.event_file(steps, self._first_started))
        except OSError as err:
            log.warning("metrics.csv or the TensorBoard log not written: %s", err)
