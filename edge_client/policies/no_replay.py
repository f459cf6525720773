"""`none`: no replay. At each task switch the old samples go; the device trains on the current task only (plain
FedAvg on flowing data, the lower bound every replay method is measured against)."""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import ReplayPolicy, RoundView, Samples


class NoReplay(ReplayPolicy):
    name = "none"
    keeps_old = False

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return np.empty(0, dtype=np.int64)
