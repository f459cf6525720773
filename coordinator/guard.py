"""Bounds on what one update can do, applied to a round's updates before any aggregation rule sees them.

A device with valid credentials can send any finite weights and claim any sample count. Two bounds hold whatever
the rule (`[guard]` in the coordinator file):

- **Sample counts** are capped: at `max_samples` (a fleet maximum; 0: none) and at `sample_factor` times the
  round's median count (0: none), so one claim of 10^9 samples cannot replace the global model under FedAvg.
- **Update norms**: each update's distance from the global model, ||w_k - g||, is compared with `norm_factor`
  times the round's median distance. Beyond it, `norm_bound = "clip"` scales the update's change back onto that
  bound (w_k -> g + s (w_k - g)), `"reject"` drops the update, `"off"` lets it through. A boosted or exploded
  update then moves the model at most as far as `norm_factor` typical honest updates, as long as honest devices
  are the majority of the round (the median is theirs). Clipping relative to the median follows the adaptive
  clipping of robust FL (e.g. Sun et al. 2019, "Can you really backdoor federated learning?"); the factor is ours.

Both medians are taken over the updates that carry something: counts above 0, distances above 0. A device with
nothing to train on this round (an empty share, a task that brought it no data) sends the global model back with
0 samples; were those the majority, a median of 0 would cap every honest count at 0 and clip every honest update
back onto the global model (seen: 1000 devices sharing 270 samples learnt nothing). With no such update there is
no bound to take, and none applies.

Every bound that acts is counted (`samples-capped`, `clipped`, `norm-rejected`) in the run's counters and logged.
Coordinate-wise robust rules (`median`, `trimmed-mean` in coordinator/strategies/robust.py) go further; the bounds
compose with them and with every other rule.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.strategies.base import ClientUpdate

log = logging.getLogger("edgefil.coordinator")
NORM_BOUNDS = ("clip", "reject", "off")


def distances(global_weights: np.ndarray, updates: Sequence[ClientUpdate]) -> np.ndarray:
    """||w_k - g|| per update, in float64 (finite for any finite float32 weights)."""
    g = global_weights.astype(np.float64)
    return np.array([np.linalg.norm(u.weights.astype(np.float64) - g) for u in updates])


def typical(values: np.ndarray | Sequence[float]) -> float | None:
    """The median of the values above 0 (the updates that carry something), None when there is none."""
    positive = np.asarray(values, dtype=np.float64)
    positive = positive[positive > 0]
    return float(np.median(positive)) if positive.size else None


def norm_scales(distance: np.ndarray, factor: float) -> np.ndarray:
    """s_k = min(1, factor * typical(d) / d_k): 1 for updates within the bound, below 1 for those beyond it."""
    median = typical(distance)
    if median is None:
        return np.ones_like(distance, dtype=np.float64)
    bound = factor * median
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(distance > bound, bound / np.where(distance > 0, distance, 1.0), 1.0)


def sample_caps(num_samples: Sequence[int], max_samples: int, sample_factor: float) -> list[int]:
    """Each count capped at max_samples (0: no cap) and at sample_factor x the typical count (0: no cap)."""
    cap = float("inf")
    if max_samples:
        cap = max_samples
    median = typical(num_samples)
    if sample_factor and median is not None:
        cap = min(cap, sample_factor * median)
    return [int(min(n, cap)) for n in num_samples]


@dataclass(frozen=True)
class UpdateBounds:
    """`[guard]`: the bounds above; the defaults are on."""

    norm_bound: str = "clip"
    norm_factor: float = 3.0
    max_samples: int = 0
    sample_factor: float = 10.0

    def __post_init__(self) -> None:
        if self.norm_bound not in NORM_BOUNDS:
            raise ValueError(f"norm_bound must be one of {', '.join(NORM_BOUNDS)}, got {self.norm_bound!r}")
        if not self.norm_factor >= 1 or self.max_samples < 0 or not self.sample_factor >= 0:
            raise ValueError("norm_factor must be >= 1, max_samples >= 0 and sample_factor >= 0")

    def apply(self, global_weights: np.ndarray, updates: Sequence[ClientUpdate], counters: Counter[str]
              ) -> list[ClientUpdate]:
        """The round's updates within the bounds (clipped ones are new arrays; the others are passed as they are)."""
        capped = sample_caps([u.num_samples for u in updates], self.max_samples, self.sample_factor)
        bounded = []
        for update, n in zip(updates, capped):
            if n < update.num_samples:
                counters["samples-capped"] += 1
                log.warning("%s claimed %d samples: counted as %d", update.device, update.num_samples, n)
                update = dataclasses.replace(update, num_samples=n)
            bounded.append(update)
        if self.norm_bound == "off" or len(bounded) < 2:
            return bounded
        distance = distances(global_weights, bounded)
        scales = norm_scales(distance, self.norm_factor)
        kept = []
        for update, d, s in zip(bounded, distance, scales):
            if s >= 1.0:
                kept.append(update)
            elif self.norm_bound == "reject":
                counters["norm-rejected"] += 1
                log.warning("update of %s dropped: %.3g from the global model, the bound is %.3g", update.device,
                            d, d * s)
            else:
                counters["clipped"] += 1
                log.warning("update of %s clipped: %.3g from the global model, the bound is %.3g", update.device,
                            d, d * s)
                change = (update.weights.astype(np.float64) - global_weights) * s
                kept.append(dataclasses.replace(update, weights=(global_weights + change).astype(np.float32)))
        return kept
