"""Continual-learning metrics, defined once. `acc[i, j]` is the accuracy on task j's test set after task i."""
from __future__ import annotations

import numpy as np


def check_matrix(acc: np.ndarray) -> np.ndarray:
    acc = np.asarray(acc, dtype=np.float64)
    if acc.ndim != 2 or acc.shape[0] != acc.shape[1]:
        raise ValueError(f"an accuracy matrix is square (tasks x tasks), got shape {acc.shape}")
    return acc


def average_accuracy(acc: np.ndarray, after: int | None = None) -> float:
    """Mean accuracy over the tasks seen so far, after task `after` (default: the last)."""
    acc = check_matrix(acc)
    t = acc.shape[0] - 1 if after is None else after
    return float(acc[t, : t + 1].mean())


def forgetting(acc: np.ndarray) -> float:
    """Mean over the earlier tasks of (best accuracy ever reached on it) - (accuracy after the last task)."""
    acc = check_matrix(acc)
    last = acc.shape[0] - 1
    if last == 0:
        return 0.0
    return float(np.mean([acc[:last, j].max() - acc[last, j] for j in range(last)]))


def backward_transfer(acc: np.ndarray) -> float:
    """Mean over the earlier tasks of (accuracy after the last task) - (accuracy right after learning it)."""
    acc = check_matrix(acc)
    last = acc.shape[0] - 1
    if last == 0:
        return 0.0
    return float(np.mean([acc[last, j] - acc[j, j] for j in range(last)]))
