"""Timing shared by the benchmarks."""
from __future__ import annotations

import time
from collections.abc import Callable


def best_time(run: Callable[[int], object], repeats: int) -> float:
    """Best wall time of `repeats` calls run(k), k the repeat's index (e.g. for a fresh directory each time)."""
    best = float("inf")
    for k in range(repeats):
        start = time.perf_counter()
        run(k)
        best = min(best, time.perf_counter() - start)
    return best
