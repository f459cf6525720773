"""`random`: a uniform random cache at each task switch — the papers' "FedAvg" baseline with the same budget."""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import ReplayPolicy, RoundView, Samples


class RandomCache(ReplayPolicy):
    name = "random"

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return view.rng.permutation(len(old))[:keep]
