"""Client state that must survive a restart of the device process: task, round, seen classes, weights.

Saved atomically with `edgefil.durable` (a crash leaves the previous or the new state, whole).
The replay store persists itself; it is not part of this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgefil.durable import STATE_FILE, StateError, load_record, save_record, save_record_keeping_weights

__all__ = ["STATE_FILE", "ClientState", "StateError", "load_state", "save_state", "save_state_keeping_weights"]


@dataclass
class ClientState:
    task: int = -1  # the learner's own task index (its tasks may start where the round's do not: detect_new_tasks)
    round: int = 0
    data_task: int = -1  # the round's task whose data the device took last: what its updates answer
    seen_classes: list[int] = field(default_factory=list)
    n_seen: int = 0  # samples seen since the start (reservoir sampling needs it)
    label_counts: list[int] = field(default_factory=list)  # samples seen per class since the start
    task_counts: list[int] = field(default_factory=list)  # samples seen per class in the current task
    model: str = ""  # id of the global model the saved weights were trained from ("" before any round)
    metrics: dict[str, float] = field(default_factory=dict)  # what the last update reported (for a resend)
    weights: np.ndarray | None = None


def save_state(directory: str | Path, state: ClientState) -> None:
    save_record(directory, state)


def save_state_keeping_weights(directory: str | Path, state: ClientState) -> None:
    """The state's record, beside the weights saved before (`state.weights` is not written): what fits a full disk."""
    save_record_keeping_weights(directory, state)


def load_state(directory: str | Path) -> ClientState | None:
    """The last saved state, or None when the device has never saved one."""
    saved = load_record(directory)
    if saved is None:
        return None
    record, weights = saved
    try:
        return ClientState(
            task=int(record["task"]),
            round=int(record["round"]),
            data_task=int(record.get("data_task", record["task"])),  # saved before it was kept: the same
            seen_classes=[int(c) for c in record["seen_classes"]],
            n_seen=int(record["n_seen"]),
            label_counts=[int(n) for n in record.get("label_counts", [])],
            task_counts=[int(n) for n in record.get("task_counts", [])],
            model=str(record.get("model", "")),
            metrics={str(k): float(v) for k, v in record.get("metrics", {}).items()},
            weights=weights,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise StateError(f"client state in {directory} is unreadable: {err!r}") from err
