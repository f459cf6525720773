"""The run's state after each completed round, saved atomically (edgefil.durable) so `--resume` loses none.

It holds everything the next round depends on: the global weights and their version, where the run is in the
task schedule, the selection generator's state, the per-round history, the accuracy matrix and the counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.durable import StateError, load_record, save_record


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


def save_run_state(directory: str | Path, state: RunState) -> None:
    save_record(directory, state)


def load_run_state(directory: str | Path) -> RunState | None:
    saved = load_record(directory)
    if saved is None:
        return None
    record, weights = saved
    if weights is None:
        raise StateError(f"run state in {directory} has no global weights")
    record.pop("weights_file", None)
    record.pop("weights_sha256", None)
    try:
        return RunState(weights=weights, **record)
    except TypeError as err:
        raise StateError(f"run state in {directory} is unreadable: {err}") from err
