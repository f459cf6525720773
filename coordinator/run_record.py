"""The record of a run: what each round did, who is in the fleet, how the run ends. Every reader reads this one
record: `results.json`, `metrics.csv` and the TensorBoard log (coordinator/run_logs.py), the dashboard (through
`live.json`) and the reports.

A round's entry (`RoundEntry`) is made by the round loop when it closes the round and kept in the run state, so it
is checkpointed with the round and a resumed run's record is whole. Its values per device (every device's metrics)
are kept in the checkpoint's history file once a newer round closed (coordinator/checkpoint.py `HistoryFile`): the
record makes what live.json shows of them when the round closes, and reads them back from the file for results.json
and the run's results. The record adds what only exists while the coordinator runs: the open round (who was
selected, who delivered), the roster's table, traffic, and the ETA.

The ETA is the mean duration of the last `ETA_WINDOW` completed rounds times the rounds left (a task past
`train_tasks` counts as one step: it is evaluated, not trained); None before a round has completed in this process.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from coordinator.checkpoint import (
    PER_DEVICE_VALUES,
    HistoryFile,
    PerEntry,
    RoundEntry,
    RunState,
)
from coordinator.roster import Roster
from coordinator.rounds import OpenRound
from edgefil.metrics import (
    LAST_ROUNDS,
    accuracy_matrix,
    average_incremental_accuracy,
    average_of_iaa,
    backward_transfer,
    forgetting,
    iaa_forgetting,
    last_rounds_accuracy,
)

ETA_WINDOW = 5  # completed rounds the ETA averages over
# A round entry's fields that hold a value per device: results.json keeps them, live.json leaves them out (and the
# coordinator's memory the values, once the history file holds them)
PER_DEVICE_FIELDS = ("selected", "received", *PER_DEVICE_VALUES)


def live_entry(entry: RoundEntry) -> dict[str, Any]:
    """A round's entry as live.json carries it: without its per-device fields (PER_DEVICE_FIELDS), with what the
    dashboard plots of its devices' metrics, each metric's mean over the devices that reported it (`device_means`).
    The dashboard reads live.json every second while the coordinator rewrites it: with every device's metrics of
    every round it grew with rounds x devices (29 MB and 1.3 s of encoding after 4 rounds of 10,000 devices; 2.6 MB
    and 74 ms this way, the roster's table the rest: benchmarks/live_file.py), all of it encoded again at each
    write."""
    out: dict[str, Any] = {key: value for key, value in entry.items() if key not in PER_DEVICE_FIELDS}
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for metrics in entry.get("metrics", {}).values():
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] += 1
    out["device_means"] = {name: sums[name] / counts[name] for name in sorted(sums)}
    return out


def json_with_lists(fields: dict[str, Any], lists: Mapping[str, Iterable[bytes]]) -> Iterator[bytes]:
    """The bytes of json.dumps(fields) with the fields named in `lists` moved last, in its order, each a list given
    as its items' JSON texts, in parts: a long run's history and a large fleet's table are not made into one string,
    and what was encoded before is not encoded again."""
    head = json.dumps({name: value for name, value in fields.items() if name not in lists})
    yield head[:-1].encode()
    first = head == "{}"
    for name, items in lists.items():
        yield (b"" if first else b", ") + json.dumps(name).encode() + b": ["
        first = False
        for number, item in enumerate(items):
            yield b", " + item if number else item
        yield b"]"
    yield b"}"


@dataclasses.dataclass(frozen=True)
class _Closed:
    """What the record's readers make of a round entry of the history, made once (`PerEntry`)."""

    live: dict[str, Any]  # live_entry(entry)
    live_text: bytes  # and its JSON text
    local_epsilon: float | None  # the largest local epsilon a device of the round reported (None: none did)

    @classmethod
    def of(cls, entry: RoundEntry) -> _Closed:
        spent = [metrics["local_epsilon"] for metrics in entry.get("metrics", {}).values()
                 if "local_epsilon" in metrics]
        live = live_entry(entry)
        return cls(live, json.dumps(live).encode(), max(spent, default=None))


class Traffic(Protocol):
    """What the record reads of the coordinator's link."""

    bytes_sent: int
    bytes_received: int
    connects: int


class RunRecord:
    """The run as its readers see it, from the run state, the roster, the counters and the link."""

    def __init__(self, fleet: str, scenario: dict[str, Any], strategy: dict[str, Any], settings: dict[str, Any],
                 state: RunState, roster: Roster, counters: Counter[str], traffic: Traffic, total_rounds: int,
                 total_steps: int, history_file: HistoryFile | None = None) -> None:
        """`settings`: what was run (rounds per task, quorum, the devices' round config) for the reports;
        `total_rounds`: the rounds the run trains; `total_steps`: those and its evaluation-only tasks;
        `history_file`: the checkpoint's, which keeps the history's values per device (None: the state keeps
        them all)."""
        self.fleet, self.scenario, self.strategy, self.settings = fleet, scenario, strategy, settings
        self.state, self.roster, self.counters, self.traffic = state, roster, counters, traffic
        self.total_rounds, self.total_steps = total_rounds, total_steps
        self.last_rounds = int(settings.get("last_rounds", LAST_ROUNDS))
        self.outcome = "running"
        self.started_at = time.time()
        self.open_round: OpenRound | None = None
        self._counted_at_open: Counter[str] = Counter()
        self._step_seconds: list[float] = []  # durations of the rounds completed in this process
        self._closed: PerEntry[_Closed] = PerEntry(_Closed.of)  # the entries as live.json and results() read them
        self.history_file = history_file
        self._closed_entries()  # a resumed run's, each read back whole from the history file as it is made

    # --- what the round loop tells it -------------------------------------------------------------

    def round_opened(self, opened: OpenRound) -> None:
        if self.open_round is None or self.open_round.number != opened.number:  # a retry counts from its first try
            self._counted_at_open = Counter(self.counters)
        self.open_round = opened

    def entry(self, **fields: Any) -> RoundEntry:
        """A closing round's entry: its fields, with the time, the traffic and the round's refusals added."""
        refusals = {k: n for k, n in (self.counters - self._counted_at_open).items() if n}
        entry = RoundEntry(**fields)  # type: ignore[typeddict-item]
        entry.update(ended_at=time.time(), bytes_sent=self.traffic.bytes_sent,
                     bytes_received=self.traffic.bytes_received, refusals=refusals)
        return entry

    def round_closed(self, entry: RoundEntry) -> None:
        """The entry is in the history: the next round's refusals count from here; what live.json shows of it is
        made now, while it holds its values per device."""
        self._closed_entries()
        previous = self.state.history[-2]["ended_at"] if len(self.state.history) > 1 else None
        began = max(previous or 0.0, self.started_at)
        self._step_seconds.append(max(entry["ended_at"] - began, 0.0))
        self.open_round = None
        self._counted_at_open = Counter(self.counters)

    # --- what its readers read --------------------------------------------------------------------

    @property
    def history(self) -> list[RoundEntry]:
        return self.state.history

    def eta_s(self) -> float | None:
        done = len(self.state.history)
        if not self._step_seconds or done >= self.total_steps:
            return None if done < self.total_steps else 0.0
        recent = self._step_seconds[-ETA_WINDOW:]
        return float(np.mean(recent)) * (self.total_steps - done)

    def eta_text(self) -> str:
        """"; ETA 1 min 5 s" for a log line, "" when there is none yet or nothing is left."""
        eta = self.eta_s()
        if not eta:
            return ""
        minutes, seconds = divmod(round(eta), 60)
        return f"; ETA {minutes} min {seconds} s" if minutes else f"; ETA {seconds} s"

    def results(self) -> dict[str, Any]:
        """`results.json`: the run's outcome, accuracy matrix and summary numbers, counters, per-device problems,
        traffic and the history, whole (its values per device read back from the history file)."""
        history = self.history if self.history_file is None else self.history_file.whole(self.history)
        return {**self._summary(), "devices": self.roster.table(), "history": history}

    def _summary(self) -> dict[str, Any]:
        """The results but the devices' table and the history."""
        state = self.state
        done = len(state.accuracy_matrix)
        square = accuracy_matrix(state.accuracy_matrix) if done else None
        last_row = state.history[-1]["accuracy"] if state.history else []
        return {
            "fleet": self.fleet,
            "outcome": self.outcome,
            "scenario": self.scenario,
            "strategy": self.strategy,
            "settings": self.settings,
            "rounds_completed": state.round,
            "tasks_completed": done,
            "accuracy_matrix": state.accuracy_matrix,
            # the global model after the last completed round, on every task seen (mid-task too, unlike the matrix)
            "final_accuracy": float(np.mean(last_row)) if last_row else 0.0,
            # and as the papers report it: the mean over the last task's last rounds, with their spread
            "last_rounds_accuracy": (dataclasses.asdict(last_rounds_accuracy(state.history, self.last_rounds))
                                     if state.history else None),
            "average_accuracy": average_incremental_accuracy(square) if square is not None else 0.0,
            "forgetting": forgetting(square) if square is not None else 0.0,
            "backward_transfer": backward_transfer(square) if square is not None else 0.0,
            **self._iaa_summary(),
            # central DP: epsilon at the settings' delta after the last round released (None: no DP release yet)
            "epsilon": next((entry["privacy"]["epsilon"] for entry in reversed(state.history) if "privacy" in entry),
                            None),
            # local DP (edge_client/privacy.py): the largest epsilon a device said its updates spent (None: none did)
            # (each round's made once: every device's metrics of every round scanned at each call took most of a
            # live.json write at 10,000 devices)
            "local_epsilon": max((closed.local_epsilon for closed in self._closed_entries()
                                  if closed.local_epsilon is not None), default=None),
            "counters": dict(self.counters),
            "device_errors": self.roster.errors(),
            "without_data": sorted(self.roster.without_data),  # online devices that said they hold no data yet
            "privacy_spent": dict(self.roster.spent),  # devices past their local privacy budget, and why
            "duplicate_devices": self.roster.duplicates,
            "bytes_sent": self.traffic.bytes_sent,
            "bytes_received": self.traffic.bytes_received,
            "reconnects": max(self.traffic.connects - 1, 0),
        }

    def live(self) -> dict[str, Any]:
        """`live.json`, what the dashboard shows: the results so far, the open round and the progress."""
        return {**self._live_fields(), "devices": self.roster.table(),
                "history": [closed.live for closed in self._closed_entries()]}

    def live_json(self) -> Iterator[bytes]:
        """`live.json`: the bytes of json.dumps(self.live()), in parts, the devices' rows and the rounds' entries
        as their texts, each encoded once (`Roster.table_texts`, `_Closed.live_text`): the dashboard reads it every
        second and the coordinator rewrites it as often, so encoding every row and round again at each write cost
        it in proportion to the fleet times the round's length."""
        return json_with_lists(self._live_fields(), {
            "devices": self.roster.table_texts(),
            "history": [closed.live_text for closed in self._closed_entries()]})

    def _live_fields(self) -> dict[str, Any]:
        """`live()` but the devices' table and the history."""
        current = self.open_round
        return {
            **self._summary(),
            "updated_at": time.time(),
            "started_at": self.started_at,
            "steps_total": self.total_steps,
            "steps_done": len(self.state.history),
            "eta_s": self.eta_s(),
            "open_round": None if current is None else {
                "round": current.number, "task": current.task, "selected": current.selected,
                "delivered": sorted(current.delivered), "failed": dict(current.failed),
                "remaining_s": max(current.remaining_s(), 0.0),
            },
        }

    def results_json(self) -> Iterator[bytes]:
        """`results.json`: the bytes of json.dumps(self.results()), in parts, each round's entry as the history
        file holds it (an entry holds every device's metrics: 7 MB of JSON a round at 10,000 devices, so a close
        re-encoding the whole history took 1.3 s at round 4 and longer each round, and holding it grew the
        coordinator by as much: benchmarks/live_file.py)."""
        texts = ((json.dumps(entry).encode() for entry in self.history) if self.history_file is None
                 else self.history_file.texts(self.history))
        return json_with_lists(self._summary(), {"devices": self.roster.table_texts(), "history": texts})

    def _closed_entries(self) -> list[_Closed]:
        """The history's entries, each made for its readers once (again where the history was replaced)."""
        return self._closed.of(self.state.history, None if self.history_file is None else self.history_file.wholes)

    def _iaa_summary(self) -> dict[str, Any]:
        """IAA, AA and AFM over the rounds so far (per-client test data only)."""
        iaa = [entry["iaa"] for entry in self.state.history if "iaa" in entry]
        if not iaa:
            return {}
        return {"iaa": iaa, "aa": average_of_iaa(iaa), "afm": iaa_forgetting(iaa)}
