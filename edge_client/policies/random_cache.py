"""`random`: a uniform random cache at each task switch — the papers' "FedAvg" baseline with the same budget."""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import ReplayPolicy, Samples, SelectionContext


class RandomCache(ReplayPolicy):
    name = "random"

    def rank(self, old: Samples, keep: int, ctx: SelectionContext) -> np.ndarray:
        return ctx.rng.permutation(len(old))[:keep]
