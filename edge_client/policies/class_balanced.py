"""`class-balanced`: random caching with the same number of cached samples per class seen.

Class quotas compose with any policy's ranking: `group_by = "class"` in a `[policy]` table makes the learner
apply them around that policy's `rank` (`group_ranking`), as Avalanche's `ParametricBuffer(groupby="class")`
composes grouping with any selection strategy; every other hook stays the policy's own. This policy is the
random ranking under class quotas, by name.
"""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import RoundView, Samples, group_ranking
from edge_client.policies.random_cache import RandomCache


class ClassBalanced(RandomCache):
    name = "class-balanced"

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return group_ranking(super().rank(old, len(old), view), old.y, keep)
