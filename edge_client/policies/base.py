"""The ReplayPolicy interface: given the samples of earlier tasks, decide which of them the device keeps.

A policy never touches files: the learner loads the candidates from the store, asks the policy for a ranking,
and tells the store what to keep. Rankings are ordered most valuable first, so the learner can always keep a
prefix (when a byte budget turns out tighter than the sample budget).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import numpy as np

from edge_client.trainers.base import Trainer

if TYPE_CHECKING:
    from edge_client.learner import Learner


@dataclass(frozen=True)
class Samples:
    """Samples in memory: inputs, labels and the task each came from."""

    x: np.ndarray
    y: np.ndarray
    task: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class SelectionContext:
    """What a policy may use to rank: the device's trainer, the latest global weights, the seen-class mask."""

    trainer: Trainer
    global_weights: np.ndarray
    class_mask: np.ndarray | None
    rng: np.random.Generator
    batch_size: int = 64


class ReplayPolicy(ABC):
    """Ranks old samples for the store; the hooks below (no-ops here) let a policy keep more than samples, in the
    manner of a training-loop plugin: the learner calls them at fixed points of a round."""

    name: ClassVar[str]
    streaming: ClassVar[bool] = False  # True: the policy also decides which new samples enter (reservoir)
    keeps_old: ClassVar[bool] = True  # False: earlier tasks' samples leave the store at every task switch
    lambda_align: float = 0.0  # weight of an alignment term against a teacher model, when the policy wants one

    @abstractmethod
    def rank(self, old: Samples, keep: int, ctx: SelectionContext) -> np.ndarray:
        """Positions into `old` of at most `keep` samples to cache, most valuable first."""

    def open(self, learner: Learner, state_dir: Path, model_artifacts: Path) -> None:
        """Open what the policy keeps on disk besides the store (in `state_dir`)."""

    def storage_bytes(self) -> int:
        """Bytes the policy holds on disk besides the store; they count against the store's byte budget."""
        return 0

    def replay_samples(self, learner: Learner) -> Samples | None:
        """Samples to train on besides the store's (e.g. generated ones)."""
        return None

    def after_training(self, learner: Learner, x: np.ndarray, y: np.ndarray, offered: Mapping[int, Any]) -> None:
        """Called after the task model's local training with the current task's real samples; `offered` holds
        what the coordinator supplied for this round (e.g. cached generators by class)."""

    def wanted_generators(self, learner: Learner, cached: list[int]) -> list[int]:
        """Which of the coordinator's cached generators (by class) the policy would warm-start from this round."""
        return []

    def attachments(self, learner: Learner) -> dict[str, bytes]:
        """Named byte strings the round's update carries besides the model."""
        return {}

    def metrics(self) -> dict[str, float]:
        """The last round's numbers worth reporting."""
        return {}


def balanced_quotas(labels: np.ndarray, keep: int) -> dict[int, int]:
    """Split `keep` slots over the classes as evenly as their sample counts allow (water-filling)."""
    classes, counts = np.unique(labels, return_counts=True)
    quotas = dict.fromkeys(classes.tolist(), 0)
    remaining = min(keep, int(counts.sum()))
    open_classes = sorted(zip(counts.tolist(), classes.tolist()))
    while remaining and open_classes:
        share = remaining // len(open_classes)
        if share == 0:  # fewer slots than classes: one each, smallest classes first (seeded order upstream)
            for _, c in open_classes[:remaining]:
                quotas[c] += 1
            break
        still_open = []
        for count, c in open_classes:
            take = min(share, count - quotas[c])
            quotas[c] += take
            remaining -= take
            if quotas[c] < count:
                still_open.append((count, c))
        open_classes = still_open
    return quotas


def interleave_by_class(order_per_class: dict[int, np.ndarray]) -> np.ndarray:
    """Merge per-class rankings round-robin, so any prefix of the result stays class-balanced."""
    lists = [list(v) for v in order_per_class.values()]
    merged = []
    for depth in range(max((len(v) for v in lists), default=0)):
        merged.extend(v[depth] for v in lists if depth < len(v))
    return np.asarray(merged, dtype=np.int64)
