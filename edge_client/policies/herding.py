"""`herding`: iCaRL's exemplar selection. Per class (balanced quotas), greedily pick the samples whose running
feature mean stays closest to the class mean, with L2-normalised penultimate features of the current model."""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import ReplayPolicy, RoundView, Samples, balanced_quotas, interleave_by_class


def herding_order(features: np.ndarray, count: int) -> np.ndarray:
    """Indices of `count` rows chosen greedily so their mean approximates the mean of all rows."""
    target = features.mean(axis=0)
    chosen: list[int] = []
    running = np.zeros_like(target)
    available = np.ones(len(features), dtype=bool)
    for k in range(1, count + 1):
        candidates = (running + features) / k  # mean after adding each candidate
        distance = np.linalg.norm(candidates - target, axis=1)
        distance[~available] = np.inf
        best = int(distance.argmin())
        chosen.append(best)
        available[best] = False
        running += features[best]
    return np.asarray(chosen, dtype=np.int64)


class Herding(ReplayPolicy):
    name = "herding"

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        features = _normalised_features(old, view)
        quotas = balanced_quotas(old.y, keep)
        chosen = {}
        for c, quota in quotas.items():
            members = np.flatnonzero(old.y == c)
            if quota:
                chosen[c] = members[herding_order(features[members], quota)]
        return interleave_by_class(chosen)


def _normalised_features(old: Samples, view: RoundView) -> np.ndarray:
    _, features = view.trainer.outputs(old.x, old.y, view.class_mask)
    features = features.astype(np.float64)
    return features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
