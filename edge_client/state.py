"""Client state that must survive a restart of the device process: task, round, seen classes, weights, and the
optimiser's state where the device saves it (`[learner] between_rounds = "disk"`).

Saved in `edgefil.durable`'s slots (a crash leaves the previous or the new state, whole).
The replay store persists itself; it is not part of this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.trainers.base import OptimizerState
from edgefil.durable import StateError, load_buffers, load_slotted, save_slotted

__all__ = ["ClientState", "StateError", "load_state", "save_state", "save_state_keeping_weights"]


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
    # the optimiser's state (Trainer.optimizer_state), its buffers one after another in `optimizer_buffers`' order
    optimizer: np.ndarray | None = None
    optimizer_buffers: list[str] = field(default_factory=list)
    optimizer_steps: int = 0

    def with_optimizer(self, state: OptimizerState | None, **changes: Any) -> ClientState:
        """This state with `state` as its optimiser's (None: none saved), and any other `changes` of its fields
        (a device's save gives its weights: one copy of the state a round)."""
        if state is None:
            return replace(self, optimizer=None, optimizer_buffers=[], optimizer_steps=0, **changes)
        names = sorted(state.buffers)
        return replace(self, optimizer=np.concatenate([state.buffers[name] for name in names]),
                       optimizer_buffers=names, optimizer_steps=state.steps, **changes)

    def optimizer_state(self, size: int) -> OptimizerState | None:
        """The saved optimiser state, its buffers `size` values each; None when none was saved."""
        if self.optimizer is None:
            return None
        if len(self.optimizer) != size * len(self.optimizer_buffers):
            raise StateError(f"saved optimizer state holds {len(self.optimizer)} values, not {size} for each of "
                             f"{self.optimizer_buffers}")
        return OptimizerState(self.optimizer_steps, {
            name: self.optimizer[i * size:(i + 1) * size] for i, name in enumerate(self.optimizer_buffers)})


def save_state(directory: str | Path, state: ClientState) -> dict[str, Any]:
    """Save `state`; returns the record saved, with which `load_state` reads it back without looking for the newest
    record (where its caller knows that nothing was saved there since)."""
    return save_slotted(directory, state)


def save_state_keeping_weights(directory: str | Path, state: ClientState) -> None:
    """The state's record, beside the weights and optimiser state saved before (`state.weights` and
    `state.optimizer` are not written): what fits a full disk."""
    save_slotted(directory, state, keep_buffers=True)


def load_state(directory: str | Path, weights: bool = True, optimizer: bool = True,
               saved: dict[str, Any] | None = None) -> ClientState | None:
    """The last saved state, or None when the device has never saved one; `weights`, `optimizer` False: without
    reading that buffer (None in the state); `saved`: the record `save_state` returned, read as it is (its buffers
    checked against their checksums as ever)."""
    record = load_slotted(directory) if saved is None else saved
    if record is None:
        return None
    buffers = load_buffers(directory, record, [name for name, wanted in (("weights", weights), ("optimizer", optimizer))
                                               if wanted])  # both from one read of their slot
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
            weights=buffers.get("weights"),
            optimizer=buffers.get("optimizer"),
            optimizer_buffers=[str(name) for name in record.get("optimizer_buffers", [])],
            optimizer_steps=int(record.get("optimizer_steps", 0)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise StateError(f"client state in {directory} is unreadable: {err!r}") from err
