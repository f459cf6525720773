"""`reservoir`: a uniform sample of everything the device has ever seen, kept while the data streams in.

Unlike the other policies it also decides which NEW samples enter (Vitter's algorithm R): once the store is
full, the n-th sample seen replaces a uniformly chosen stored sample with probability capacity / n. At a task
switch the stored samples already are a uniform sample, so any subset of them is too.
"""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import Admission, ReplayPolicy, RoundView, Samples


class Reservoir(ReplayPolicy):
    name = "reservoir"

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return view.rng.permutation(len(old))[:keep]

    def admit(self, view: RoundView, n_new: int, capacity: int) -> Admission | None:
        return Admission(*reservoir_update(view.n_seen, view.n_stored(), n_new, capacity, view.rng))


def reservoir_update(
    n_seen: int, n_stored: int, n_new: int, capacity: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Run algorithm R over n_new arriving samples.

    Returns (positions of the stored samples that stay, positions of the new samples that enter); a new sample
    that enters and is replaced later in the same call does not enter.
    """
    slots: list[tuple[bool, int]] = [(False, i) for i in range(n_stored)]  # (is_new, position)
    for i in range(n_new):
        seen = n_seen + i + 1
        if len(slots) < capacity:
            slots.append((True, i))
        else:
            j = int(rng.integers(seen))
            if j < capacity:
                slots[j] = (True, i)
    stays = np.sort([p for is_new, p in slots if not is_new]).astype(np.int64)
    enters = np.sort([p for is_new, p in slots if is_new]).astype(np.int64)
    return stays, enters
