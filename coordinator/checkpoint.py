"""The run's state after each completed round, saved atomically (edgefil.durable) so `--resume` loses none.

It holds everything the next round depends on: the global weights and their version, where the run is in the
task schedule, the selection generator's state, the per-round history, the accuracy matrix and the counters.

Each round's checkpoint is a generation of its own, `checkpoint/round-<n>/` (the run state, the rule's state and
the personalized models), written whole before older generations beyond `keep` are removed. `--resume` takes the
newest generation that loads and verifies, so a damaged one (a bad disk, a hand edit) falls back to the one before.

What is checkpointed is only a model that passes `CheckpointPolicy.problem`: finite weights whose norm did not
jump, and whose accuracy on the current task did not collapse below its best in this task. A model that fails is
refused: the round keeps the previous global model, and the refusal is counted.
"""
from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.durable import STATE_FILE, StateError, load_record, save_record

log = logging.getLogger("edgefil.coordinator")
GENERATION_PREFIX = "round-"


@dataclass
class RunState:
    weights: np.ndarray
    round: int = 0  # completed rounds (the next round is round + 1)
    task: int = 0  # task of the next round
    round_in_task: int = 0  # rounds of `task` completed
    rng: dict[str, Any] = field(default_factory=dict)  # numpy bit generator state for selection
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per completed round
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


def save_run_state(directory: str | Path, state: RunState) -> None:
    save_record(directory, state)


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


def load_run_state(directory: str | Path, num_parameters: int | None = None) -> RunState | None:
    """The run state saved in `directory` (None when there is none); StateError when a field is missing or not of
    its type, or the weights are not the model's `num_parameters` values (when given)."""
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
    unknown = sorted(set(record) - set(FIELD_CHECKS))
    wrong = [name for name, valid in FIELD_CHECKS.items() if name not in record or not valid(record[name])]
    if unknown or wrong:
        raise StateError(f"run state in {directory} is unreadable: "
                         + "; ".join([*(f"{n} is missing or not of its type" for n in wrong),
                                      *(f"{n} is not a field" for n in unknown)]))
    return RunState(weights=weights, **record)


def load_latest(root: Path, num_parameters: int | None = None) -> tuple[RunState, Path] | None:
    """The newest generation under `root` that loads and verifies (a model of `num_parameters` values, when given),
    and its folder; None when there is none. Generations that do not load are skipped with a warning; when none
    loads, StateError names each reason."""
    candidates: Sequence[Path] = [g for g in generations(root) if (g / STATE_FILE).exists()]
    failures = []
    for directory in candidates:
        try:
            state = load_run_state(directory, num_parameters)
        except StateError as err:
            log.warning("checkpoint %s cannot be resumed (%s); trying the one before", directory.name, err)
            failures.append(f"{directory.name}: {err}")
            continue
        if state is not None:
            return state, directory
    if failures:
        raise StateError(f"no checkpoint in {root} can be resumed: {'; '.join(failures)}")
    return None
