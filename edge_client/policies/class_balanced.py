"""`class-balanced`: the same number of cached samples per class seen (random within a class)."""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import ReplayPolicy, SelectionContext, Samples, balanced_quotas, interleave_by_class


class ClassBalanced(ReplayPolicy):
    name = "class-balanced"

    def rank(self, old: Samples, keep: int, ctx: SelectionContext) -> np.ndarray:
        quotas = balanced_quotas(old.y, keep)
        chosen = {
            c: ctx.rng.permutation(np.flatnonzero(old.y == c))[:quota] for c, quota in quotas.items() if quota
        }
        return interleave_by_class(chosen)
