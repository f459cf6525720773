"""Class balance as a wrapper: any ranking, the same number of cached samples per class seen.

`ClassBalanced(inner)` asks the inner policy for its whole ranking of the old samples, gives every class a quota
(water-filled: `balanced_quotas`), takes each class's first samples in the inner ranking up to its quota, and
interleaves the classes so every prefix stays balanced — as Avalanche's `ParametricBuffer(groupby="class")`
composes grouping with any selection strategy. Any policy gets it with `group_by = "class"` in its config
(`[policy] name = "refed"`, `group_by = "class"`: Re-Fed with class quotas); `class-balanced` is random caching
grouped by class. Every other hook is the inner policy's.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.policies.base import (
    Admission,
    PolicyContext,
    ReplayPolicy,
    Samples,
    SelectionContext,
    TrainingSet,
    balanced_quotas,
    interleave_by_class,
)
from edge_client.policies.random_cache import RandomCache

if TYPE_CHECKING:
    from edge_client.learner import Learner

GROUPINGS = ("class",)


class ClassBalanced(ReplayPolicy):
    """`inner`'s ranking under per-class quotas (see the module docstring)."""

    name = "class-balanced"

    def __init__(self, inner: ReplayPolicy | None = None) -> None:
        self.inner = inner if inner is not None else RandomCache()

    @property
    def keeps_old(self) -> bool:  # type: ignore[override]
        return self.inner.keeps_old

    def rank(self, old: Samples, keep: int, ctx: SelectionContext) -> np.ndarray:
        order = np.asarray(self.inner.rank(old, len(old), ctx), dtype=np.int64)
        quotas = balanced_quotas(old.y[order], keep)
        chosen = {c: order[old.y[order] == c][:quota] for c, quota in quotas.items() if quota}
        return interleave_by_class(chosen)

    def admit(self, n_seen: int, n_stored: int, n_new: int, capacity: int,
              rng: np.random.Generator) -> Admission | None:
        return self.inner.admit(n_seen, n_stored, n_new, capacity, rng)

    def open(self, ctx: PolicyContext) -> None:
        self.inner.open(ctx)

    def requests(self, learner: Learner, config: Mapping[str, Any]) -> list[str]:
        return self.inner.requests(learner, config)

    def receive(self, learner: Learner, payloads: Mapping[str, bytes]) -> None:
        self.inner.receive(learner, payloads)

    def training_set(self, learner: Learner, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        return self.inner.training_set(learner, x, y)

    def after_training(self, learner: Learner, x: np.ndarray, y: np.ndarray) -> None:
        self.inner.after_training(learner, x, y)

    def attachments(self, learner: Learner) -> dict[str, bytes]:
        return self.inner.attachments(learner)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()
