"""The data a device receives: chunks of samples, with task boundaries announced or detected.

The runtime usually knows when a task starts (the stream announces it). As an option a device detects a new
task by itself: a chunk that brings a label it has never seen starts one.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunk:
    x: np.ndarray
    y: np.ndarray
    task: int | None = None  # announced task id; None when the stream does not say


def chunked(x: np.ndarray, y: np.ndarray, task: int | None, size: int | None = None) -> Iterator[Chunk]:
    """Cut one task's data into chunks of `size` (all at once when None), announcing `task` on each."""
    step = len(y) if size is None else size
    for start in range(0, len(y), max(step, 1)):
        yield Chunk(x[start : start + step], y[start : start + step], task)


class NoveltyDetector:
    """Flags a chunk as the start of a new task when it holds a label never seen before."""

    def __init__(self, seen: Iterable[int] = ()) -> None:
        self.seen: set[int] = {int(c) for c in seen}

    def is_new_task(self, y: np.ndarray) -> bool:
        return bool(set(np.unique(y).tolist()) - self.seen) and bool(self.seen)

    def update(self, y: np.ndarray) -> None:
        self.seen.update(np.unique(y).tolist())
