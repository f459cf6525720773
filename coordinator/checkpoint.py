"""The run's state after each completed round, saved atomically (edgefil.durable) so `--resume` loses none.

It holds everything the next round depends on: the global weights and their version, where the run is in the
task schedule, the selection generator's state, the per-round history, the accuracy matrix and the counters.

Each round's checkpoint is a generation of its own, `checkpoint/round-<n>/` (the run state, the rule's state and
the personalized models), written whole before older generations beyond `keep` are removed. `--resume` takes the
newest generation that loads and verifies, so a damaged one (a bad disk, a hand edit) falls back to the one before.
The history, which grows with rounds x devices (every device's metrics of every round), is not in each generation:
it is `checkpoint/history.jsonl`, an entry a line, appended as rounds close, and a generation's state names how
many of its lines are its history and their sha256 (`HistoryFile`). A state saved outside a checkpoint folder (and
one of a run before the file) holds its history itself. Nor is it all in memory: once a round's entry is in the
file and a newer round has closed, the entry the run state keeps lets its values per device go
(`PER_DEVICE_VALUES`), and whoever needs them whole reads them from the file (`HistoryFile.texts`, `whole`).

What is checkpointed is only a model that passes `CheckpointPolicy.problem`: finite weights whose norm did not
jump, and whose accuracy on the current task did not collapse below its best in this task. A model that fails is
refused: the round keeps the previous global model, and the refusal is counted.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypedDict, TypeVar

import msgpack
import numpy as np

from edgefil.durable import STATE_FILE, StateError, load_record, power_loss_safe, save_record, write_atomically

log = logging.getLogger("edgefil.coordinator")
GENERATION_PREFIX = "round-"
PERSONALIZED_FILE = "personalized.msgpack"  # beside the run state: the devices' personalized models and payloads
HISTORY_FILE = "history.jsonl"  # in the checkpoint folder, beside the generations: the run's history (HistoryFile)
# A round entry's fields that hold a value for each device (its update's metrics, each client's accuracy): the
# history file keeps them, the entry kept in memory lets them go once the file holds it and a newer round closed
# (`HistoryFile.hold`). Kept, they grew the coordinator by 1.9 MB a round at 1000 devices and 19 MB at 10,000
# (1.9 GB after 100 rounds; docs/results.md, issue 57).
PER_DEVICE_VALUES = ("metrics", "client_accuracy")


class RoundEntry(TypedDict, total=False):
    """One completed round (or evaluation-only task) as the history keeps it (coordinator/run_record.py makes it)."""

    round: int
    task: int
    selected: list[str]
    received: list[str]
    samples: int
    accuracy: list[float]  # the global model after the round on tasks 0..task
    aggregate_s: float
    metrics: dict[str, dict[str, float]]  # device -> what its update reported
    trained: bool  # False: an evaluation-only task of a Fixed run
    rule_metrics: dict[str, Any]  # the rule's own numbers (a detector's signal, a generator's progress)
    refused: str  # why the round kept the previous global model
    client_accuracy: dict[str, float]  # flowing data: each client's model on its own test data
    iaa: float
    ended_at: float  # wall-clock time the round was committed
    bytes_sent: int  # the coordinator's traffic up to the round's end
    bytes_received: int
    refusals: dict[str, int]  # what the gate and the round refused during the round, by reason
    privacy: dict[str, float]  # central DP: the round's sampling rate and the run's epsilon after it (privacy.py)
    clock_s: float  # virtual time: the round's end on the fleet's clock (an asynchronous round's: its last update's)
    staleness: float  # an asynchronous round's mean staleness of the updates it took (coordinator/buffered.py)


def standing(entries: Sequence[RoundEntry], history: Sequence[RoundEntry]) -> int:
    """How many of `entries` (what something made for a history's entries, in order) still stand for the first
    entries of `history`: the same objects in the same places. An entry does not change once it is history, so
    what was made of it stands until the history is replaced (a resume) or cut."""
    return next((i for i, entry in enumerate(entries) if i >= len(history) or history[i] is not entry), len(entries))


def let_go(entry: RoundEntry) -> None:
    """The entry without its values per device (PER_DEVICE_VALUES): the history file keeps them."""
    for name in PER_DEVICE_VALUES:
        entry.pop(name, None)  # type: ignore[misc]


T = TypeVar("T")
HistoryLine = tuple[RoundEntry, int, Any]  # a line of the history file: its entry, the line's end, sha256 through it


class PerEntry(Generic[T]):
    """`make` of each entry of a history, made once per entry (`standing`): the history grows with rounds x devices
    (each entry holds every device's metrics of its round: 7 MB of JSON a round at 10,000 devices), so making
    anything of all of it again at every round's close grew with the run (encoding it for each checkpoint took 6 s
    of the coordinator's CPU at round 20 of such a fleet, and as long again for results.json:
    benchmarks/live_file.py). The run record's live forms are made so, each while its entry still holds its
    values per device (`HistoryFile.hold`), or of its entry read back whole (`HistoryFile.wholes`)."""

    def __init__(self, make: Callable[[RoundEntry], T]) -> None:
        self._make = make
        self._entries: list[RoundEntry] = []
        self._made: list[T] = []

    def of(self, history: Sequence[RoundEntry],
           wholes: Callable[[Sequence[RoundEntry], int], Iterable[RoundEntry]] | None = None) -> list[T]:
        """What was made of each of `history`'s entries; `wholes(history, start)`: the entries from `start` on as
        they are to be made of (the history file's, with the values per device they let go)."""
        kept = standing(self._entries, history)
        del self._entries[kept:], self._made[kept:]
        if kept < len(history):
            self._entries.extend(history[kept:])
            self._made.extend(self._make(entry) for entry in (history[kept:] if wholes is None
                                                                else wholes(history, kept)))
        return self._made


class HistoryFile:
    """The run's history as a file of the checkpoint folder, an entry's JSON text a line, appended as rounds close.

    A generation's state names the count of lines that are its history and the sha256 of their bytes
    (`history_lines`, `history_sha256`), so a generation costs its own round's entry, not every round's again: with
    the history inside each generation's state.json, a generation wrote 133 MB at round 20 of 10,000 devices (each
    entry holds every device's metrics), and the `keep` generations held as many copies of it.

    Crash safety: the lines are appended (and synced, where writes are to survive a power cut) before the
    generation's state is written, and a line is never changed while a generation names it; lines past the newest
    state's count (a crash between the two writes) are cut at the next save. A resumed process takes the lines its
    generation names, checked by their sha256 (`lines_of`, `adopt`), and appends after them: the lines past them
    (a newer generation's that did not load, a crash's tail) are cut at its first save, the ones it took are never
    written again. A new process that finds no lines it knows writes the whole file at its first save
    (`write_atomically`), so that dying there leaves no half-written file. From then on it appends; a history
    replaced in the process (none of the round loop's) is cut back to the entries it shares with the file's and
    appended from there.

    Memory: an entry the file holds lets its values per device go once a newer one is held (`hold`), and a resumed
    process's entries let them go as they are read (`lines_of`), so the run keeps of each round its own numbers and
    who took part, not every device's metrics; `texts`, `wholes` and `whole` give them back from the file. A file
    removed by a hand while the run goes is written again from what the run keeps: those rounds' values per device
    are then lost; from one cut or edited, only the lines as written are read back (either said in the log where
    they are read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: list[HistoryLine] = []  # as written, or as read back by a resume (`adopt`)
        self._written = False  # the file's first lines are `_lines` (this process wrote them, or read them back)
        self._released = 0  # the first lines whose entries let their values per device go

    def hold(self, history: Sequence[RoundEntry]) -> tuple[int, str]:
        """Make the file hold `history`, an entry's JSON text a line; returns the count of lines and the sha256 of
        their bytes, what the generation's state names. Then every entry it holds but the newest lets its values
        per device go (PER_DEVICE_VALUES): the newest keeps them for whoever reads the round just closed (a run's
        progress, its live record)."""
        if self._written and not self.path.is_file():  # gone (a hand): written whole again
            self._lines, self._written, self._released = [], False, 0
        lines = self._lines
        del lines[standing([entry for entry, _, _ in lines], history):]
        self._released = min(self._released, len(lines))
        digest = lines[-1][2].copy() if lines else hashlib.sha256()
        kept = end = lines[-1][1] if lines else 0
        added, made = [], []
        for entry in history[len(lines):]:
            line = json.dumps(entry).encode() + b"\n"
            added.append(line)
            digest.update(line)
            end += len(line)
            made.append((entry, end, digest.copy()))
        if not self._written:
            write_atomically(self.path, added)
            self._written = True
        elif added or self.path.stat().st_size != end:  # (a failed append's tail, cut)
            with open(self.path, "r+b") as handle:
                handle.truncate(kept)
                handle.seek(kept)
                handle.writelines(added)
                if power_loss_safe():
                    handle.flush()
                    os.fsync(handle.fileno())
        lines.extend(made)  # written: a write that failed leaves them to the next save
        for entry, _, _ in lines[self._released:-1]:
            let_go(entry)
        self._released = max(self._released, len(lines) - 1)
        return len(lines), digest.hexdigest()

    def texts(self, history: Sequence[RoundEntry]) -> Iterator[bytes]:
        """Each of `history`'s entries' JSON text, in order, as the file holds it: an entry that let its values per
        device go, its line read back (a line at a time), the others encoded."""
        read = 0
        for line in self._read_released(history):
            yield line
            read += 1
        for entry in history[read:]:
            yield json.dumps(entry).encode()

    def wholes(self, history: Sequence[RoundEntry], start: int = 0) -> Iterator[RoundEntry]:
        """`history[start:]` with its values per device, an entry at a time: those that let them go read back from
        the file (one that does not parse, as kept)."""
        read = start
        for line, kept in zip(self._read_released(history, start), history[start:]):
            try:
                yield json.loads(line)
            except ValueError:
                log.warning("%s: round %s's line is not JSON: given without its values per device", self.path,
                            kept.get("round"))
                yield kept
            read += 1
        yield from history[read:]

    def whole(self, history: Sequence[RoundEntry]) -> list[RoundEntry]:
        """`history` with its values per device (`wholes`)."""
        return list(self.wholes(history))

    def _read_released(self, history: Sequence[RoundEntry], start: int = 0) -> Iterator[bytes]:
        """The lines of `history`'s entries from `start` on that let their values per device go, read from the file;
        fewer where the file no longer holds them as written (removed, cut or edited by a hand: a line of another
        length; said in the log), those entries are then given as kept."""
        released = standing([entry for entry, _, _ in self._lines[:self._released]], history)
        if released <= start:
            return
        read = start
        begin = self._lines[start - 1][1] if start else 0
        try:
            with open(self.path, "rb") as handle:
                handle.seek(begin)
                for line, (_, end, _) in zip(itertools.islice(handle, released - start), self._lines[start:]):
                    if len(line) != end - begin or not line.endswith(b"\n"):
                        break
                    yield line[:-1]
                    read, begin = read + 1, end
        except OSError as err:
            log.warning("the run's history file is unreadable (%s)", err)
        if read < released:
            log.warning("%s holds %d of the %d rounds whose values per device only it keeps: the others are given "
                        "without them", self.path, read - start, released - start)

    @staticmethod
    def read(path: Path, count: int, sha256: str) -> list[RoundEntry]:
        """The first `count` entries of the file at `path`, whole; StateError where it holds fewer, they do not match
        `sha256`, or one is not JSON (`lines_of`)."""
        return [entry for entry, _, _ in HistoryFile._lines_at(path, count, sha256, release=False)]

    def lines_of(self, count: int, sha256: str) -> list[HistoryLine]:
        """This file's first `count` lines as a resumed run keeps them (`adopt`): each entry but the last without its
        values per device (PER_DEVICE_VALUES, let go as it is read), with its line's end and the sha256 through it;
        StateError as `read`. Nothing of this object changes: a generation's state may still be refused."""
        return HistoryFile._lines_at(self.path, count, sha256, release=True)

    def adopt(self, lines: list[HistoryLine]) -> None:
        """The file's first lines are `lines` (`lines_of`), whose entries are the resumed run's history: its saves
        append after them, as after lines this process wrote."""
        self._lines, self._written, self._released = lines, True, max(len(lines) - 1, 0)

    @staticmethod
    def _lines_at(path: Path, count: int, sha256: str, release: bool) -> list[HistoryLine]:
        """The first `count` lines of the file at `path` (`lines_of`; `release`: whether the entries but the last let
        their values per device go). Read a line at a time, each parsed as it comes: a long run's file (1.4 GB
        after 200 rounds of 10,000 devices) is not held as bytes besides its entries."""
        lines: list[HistoryLine] = []
        digest, end, not_json = hashlib.sha256(), 0, None
        try:
            with open(path, "rb") if count else contextlib.nullcontext(io.BytesIO()) as handle:
                for line in itertools.islice(handle, count):
                    if not line.endswith(b"\n"):
                        break
                    digest.update(line)
                    end += len(line)
                    try:
                        entry = json.loads(line)
                    except ValueError as err:
                        not_json, entry = not_json or err, {}
                    if release and lines:
                        let_go(lines[-1][0])
                    lines.append((entry, end, digest.copy()))
        except OSError as err:
            raise StateError(f"its history ({path.name}) is unreadable: {err}") from None
        if len(lines) < count:
            raise StateError(f"its history ({path.name}) holds {len(lines)} whole lines, the state names {count}")
        if digest.hexdigest() != sha256:
            raise StateError(f"its history's {count} lines ({path.name}) do not match their sha256")
        if not_json is not None:
            raise StateError(f"its history ({path.name}) holds a line that is not JSON: {not_json}")
        return lines


@dataclass
class RunState:
    weights: np.ndarray
    round: int = 0  # completed rounds (the next round is round + 1)
    task: int = 0  # task of the next round
    round_in_task: int = 0  # rounds of `task` completed
    rng: dict[str, Any] = field(default_factory=dict)  # numpy bit generator state for selection
    history: list[RoundEntry] = field(default_factory=list)  # one entry per completed round
    accuracy_matrix: list[list[float]] = field(default_factory=list)  # row i: after task i, on tasks 0..i
    counters: dict[str, int] = field(default_factory=dict)  # rejections and round events by reason

    def best_accuracy(self, task: int) -> float | None:
        """The best accuracy on `task` of a global model kept while training it, or None before its first."""
        seen = [entry["accuracy"][task] for entry in self.history
                if entry["task"] == task and "refused" not in entry]
        return max(seen) if seen else None


@dataclass(frozen=True)
class CheckpointPolicy:
    """`[checkpoint]`: how many generations are kept, and when a new global model is refused: its norm grew by
    more than `explode_factor` in one round, or its accuracy on the task being trained fell more than
    `collapse_drop` below the best of that task so far (0 turns either check off)."""

    keep: int = 3
    explode_factor: float = 10.0
    collapse_drop: float = 0.5

    def __post_init__(self) -> None:
        if self.keep < 1 or self.explode_factor < 0 or not 0 <= self.collapse_drop <= 1:
            raise ValueError("keep must be >= 1, explode_factor >= 0 and collapse_drop in [0, 1]")

    def problem(self, new: np.ndarray, old: np.ndarray) -> str | None:
        """Why the new global weights must not replace the old ones, from the weights alone (else None)."""
        if not np.isfinite(new).all():
            return "model-nonfinite"
        with np.errstate(over="ignore"):  # finite weights past ~1e19 overflow float32's norm to inf: exploded
            old_norm, new_norm = float(np.linalg.norm(old)), float(np.linalg.norm(new))
        if self.explode_factor and new_norm > self.explode_factor * max(old_norm, 1e-12):
            return "model-exploded"
        return None

    def collapsed(self, accuracy: float, best: float | None) -> bool:
        return bool(self.collapse_drop) and best is not None and accuracy < best - self.collapse_drop


def generation_dir(root: Path, round: int) -> Path:
    return root / f"{GENERATION_PREFIX}{round:06d}"


def generations(root: Path) -> list[Path]:
    """The generation folders under `root`, newest first."""
    numbered = {p: p.name[len(GENERATION_PREFIX):] for p in root.glob(f"{GENERATION_PREFIX}*") if p.is_dir()}
    found = [p for p, n in numbered.items() if n.isascii() and n.isdigit()]
    return sorted(found, key=lambda p: int(numbered[p]), reverse=True)


def prune_generations(root: Path, keep: int, current: Path) -> None:
    """Keep the newest `keep` complete generations; remove the older ones and any incomplete one (a crash while
    it was written), never `current`."""
    complete = [g for g in generations(root) if (g / STATE_FILE).exists()]
    incomplete = [g for g in generations(root) if not (g / STATE_FILE).exists()]
    for old in complete[keep:] + incomplete:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def save_run_state(directory: str | Path, state: RunState, history: HistoryFile | None = None) -> None:
    """Save `state` into `directory`: its history in `history` (the checkpoint folder's file), the state naming
    its lines; without one, in the state itself (encoded whole each time: a coordinator's runs have the file)."""
    if history is None:
        save_record(directory, state)
        return
    lines, sha256 = history.hold(state.history)
    save_record(directory, state, encode=lambda record: json.dumps(
        {**{name: value for name, value in record.items() if name != "history"},
         "history_lines": lines, "history_sha256": sha256}))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _accuracies(value: Any) -> bool:
    return isinstance(value, list) and all(_number(a) for a in value)


def _history_entry(entry: Any) -> bool:
    """What the coordinator reads back of a round's entry: its round, its task and the accuracies on tasks 0..task."""
    return (isinstance(entry, dict) and _count(entry.get("round")) and _count(entry.get("task"))
            and _accuracies(entry.get("accuracy")) and len(entry["accuracy"]) > entry["task"])


def _selection_state(value: Any) -> bool:
    """A state numpy's default bit generator takes (the selection resumes from it)."""
    try:
        np.random.default_rng().bit_generator.state = value
    except (TypeError, ValueError, KeyError):
        return False
    return True


# Each field of a saved run state and what its value must be: a checkpoint that loads but holds another type (a hand
# edit, a damaged disk that still parses) would break the run rounds later instead of falling back at once.
FIELD_CHECKS = {
    "round": _count, "task": _count, "round_in_task": _count, "rng": _selection_state,
    "history": lambda v: isinstance(v, list) and all(_history_entry(e) for e in v),
    "accuracy_matrix": lambda v: isinstance(v, list) and all(_accuracies(row) for row in v),
    "counters": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _count(n) for k, n in v.items()),
}


@dataclass(frozen=True)
class RunSchedule:
    """The run's task schedule, which a resumed state must lie within: a checkpoint of another run's schedule (or a
    hand-edited task of 10^9) would otherwise end the run at once as complete, or index past its test sets."""

    n_tasks: int
    rounds_per_task: int

    def refusal(self, state: RunState) -> str | None:
        """Why `state` does not lie within this schedule (the first reason), or None."""
        if state.task > self.n_tasks:
            return f"its task {state.task} is past this run's {self.n_tasks} tasks"
        if state.round_in_task >= self.rounds_per_task:
            return f"its round_in_task {state.round_in_task} is not below rounds_per_task {self.rounds_per_task}"
        if len(state.accuracy_matrix) > self.n_tasks:
            return f"its accuracy_matrix has {len(state.accuracy_matrix)} rows, this run {self.n_tasks} tasks"
        late = [e["task"] for e in state.history if e["task"] > state.task]
        if late:
            return f"its history holds task {late[0]}, after its own task {state.task}"
        return None


def load_run_state(directory: str | Path, num_parameters: int | None = None,
                   schedule: RunSchedule | None = None, history: HistoryFile | None = None) -> RunState | None:
    """The run state saved in `directory` (None when there is none); StateError when a field is missing or not of
    its type, the weights are not the model's `num_parameters` values, or it lies outside the run's `schedule`
    (each when given). `history`: the checkpoint folder's history file as the resuming run holds it: a state that
    loads gives it its lines (`HistoryFile.adopt`), its entries but the newest without their values per device;
    None: the history whole."""
    saved = load_record(directory)
    if saved is None:
        return None
    record, weights = saved
    if weights is None:
        raise StateError(f"run state in {directory} has no global weights")
    if num_parameters is not None and weights.size != num_parameters:
        raise StateError(f"run state in {directory} holds a model of {weights.size} values, this run's has "
                         f"{num_parameters}")
    record.pop("weights_file", None)
    record.pop("weights_sha256", None)
    lines, sha256 = record.pop("history_lines", None), record.pop("history_sha256", None)
    adopted: list[HistoryLine] | None = None
    if "history" not in record and (lines is not None or sha256 is not None):  # in the folder's file
        if not _count(lines) or not isinstance(sha256, str):
            raise StateError(f"run state in {directory} is unreadable: history_lines or history_sha256 is not of "
                             "its type")
        path = Path(directory).parent / HISTORY_FILE
        try:
            if history is not None and history.path == path:
                adopted = history.lines_of(lines, sha256)
                record["history"] = [entry for entry, _, _ in adopted]
            else:
                record["history"] = HistoryFile.read(path, lines, sha256)
        except StateError as err:
            raise StateError(f"run state in {directory} is unreadable: {err}") from None
    unknown = sorted(set(record) - set(FIELD_CHECKS))
    wrong = [name for name, valid in FIELD_CHECKS.items() if name not in record or not valid(record[name])]
    if unknown or wrong:
        raise StateError(f"run state in {directory} is unreadable: "
                         + "; ".join([*(f"{n} is missing or not of its type" for n in wrong),
                                      *(f"{n} is not a field" for n in unknown)]))
    state = RunState(weights=weights, **record)
    refusal = None if schedule is None else schedule.refusal(state)
    if refusal is not None:
        raise StateError(f"run state in {directory} does not fit this run: {refusal}")
    if adopted is not None and history is not None:
        history.adopt(adopted)
    return state


def load_latest(root: Path, num_parameters: int | None = None, schedule: RunSchedule | None = None,
                history: HistoryFile | None = None) -> tuple[RunState, Path] | None:
    """The newest generation under `root` that loads and verifies (a model of `num_parameters` values, when given),
    and its folder; None when there is none. Generations that do not load are skipped with a warning; when none
    loads, StateError names each reason. `history`: as `load_run_state`'s."""
    candidates: Sequence[Path] = [g for g in generations(root) if (g / STATE_FILE).exists()]
    failures = []
    for directory in candidates:
        try:
            state = load_run_state(directory, num_parameters, schedule, history)
        except StateError as err:
            log.warning("checkpoint %s cannot be resumed (%s); trying the one before", directory.name, err)
            failures.append(f"{directory.name}: {err}")
            continue
        if state is not None:
            return state, directory
    if failures:
        raise StateError(f"no checkpoint in {root} can be resumed: {'; '.join(failures)}")
    return None


@dataclass
class DeviceDeliveries:
    """What the coordinator holds for devices between rounds: each one's personalized model and named payloads for
    its next round, and the fleet's broadcast payloads (with the round that made them)."""

    models: dict[str, np.ndarray] = field(default_factory=dict)
    payloads: dict[str, dict[str, bytes]] = field(default_factory=dict)
    broadcast: dict[str, bytes] = field(default_factory=dict)
    broadcast_round: int = 0

    def __bool__(self) -> bool:
        return bool(self.models or self.payloads or self.broadcast)


class Checkpoints:
    """A run's checkpoint folder: where a run starts from (fresh, or the newest generation that loads) and the
    generation each completed round writes, whole, before older ones are pruned."""

    def __init__(self, root: Path, policy: CheckpointPolicy, num_parameters: int,
                 schedule: RunSchedule | None = None) -> None:
        self.root, self.policy, self.num_parameters, self.schedule = root, policy, num_parameters, schedule
        self.history = HistoryFile(root / HISTORY_FILE)

    def start(self, resume: bool, fresh: RunState) -> tuple[RunState, Path | None]:
        """The newest checkpoint that loads (and its folder) when resuming, else `fresh`; FileExistsError when the
        folder holds a run and `resume` is not set."""
        if generations(self.root) and not resume:
            raise FileExistsError(f"{self.root} holds a run: pass --resume, or choose another `out`")
        latest = load_latest(self.root, self.num_parameters, self.schedule, self.history) if resume else None
        if latest is None:
            return fresh, None
        state, directory = latest
        log.info("resuming after round %d (task %d) from %s", state.round, state.task, directory.name)
        return state, directory

    @staticmethod
    def deliveries(directory: Path, round_: int) -> DeviceDeliveries:
        """The deliveries checkpointed with round `round_` in `directory` (none when absent or of another round)."""
        path = directory / PERSONALIZED_FILE
        if not path.exists():
            return DeviceDeliveries()
        saved = msgpack.unpackb(path.read_bytes(), raw=False)
        if saved["round"] != round_:
            return DeviceDeliveries()
        return DeviceDeliveries(
            models={d: np.frombuffer(b, dtype="<f4").copy() for d, b in saved["models"].items()},
            payloads={d: dict(p) for d, p in saved.get("payloads", {}).items()},
            broadcast=dict(saved.get("broadcast", {})), broadcast_round=saved["round"],
        )

    def save(self, state: RunState, deliveries: DeviceDeliveries, save_rule: Callable[[Path], None]) -> Path:
        """Write round `state.round`'s generation: the rule's state (`save_rule` into the folder), the deliveries,
        then the run state last (a generation without its state.json is incomplete); prune the old ones."""
        generation = generation_dir(self.root, state.round)
        shutil.rmtree(generation, ignore_errors=True)  # a retried round's or a crashed write's leftovers
        generation.mkdir(parents=True)
        save_rule(generation)
        if deliveries:
            write_atomically(generation / PERSONALIZED_FILE, msgpack.packb({
                "round": state.round, "models": {d: w.tobytes() for d, w in deliveries.models.items()},
                "payloads": deliveries.payloads, "broadcast": deliveries.broadcast,
            }, use_bin_type=True))
        save_run_state(generation, state, self.history)
        prune_generations(self.root, self.policy.keep, generation)
        return generation
