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

A rule that folds updates as they arrive (FedAvg, FedProx) cannot wait for the round's medians without holding the
round, which is what folding avoids. For it the bounds stream (`BoundedStream`): the round's first `hold` updates
(`[guard] hold`) wait and are bounded together, exactly as a round of that many; every later update is bounded as
it arrives by the medians over all updates so far, itself included, and goes on. A round of at most `hold`
updates is bounded exactly as a held one, and a larger one holds `hold` updates at most. The bound stays a
median's: each update is bounded by the majority of those before it, so hostile updates move it only where they
are the majority of a round's first arrivals; `hold` sets how many arrivals that takes.

Every bound that acts is counted (`samples-capped`, `clipped`, `norm-rejected`) in the run's counters and logged.
Coordinate-wise robust rules (`median`, `trimmed-mean` in coordinator/strategies/robust.py) go further; the bounds
compose with them and with every other rule.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from bisect import insort
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.compute import float64_blocks
from coordinator.strategies.base import ClientUpdate

log = logging.getLogger("edgefil.coordinator")
NORM_BOUNDS = ("clip", "reject", "off")


def distance(global_weights: np.ndarray, weights: np.ndarray) -> float:
    """||w - g|| in float64 (finite for any finite float32 weights), a block at a time (`float64_blocks`): no
    model-sized copy. The sum of squares is einsum's, on this thread: np.dot hands it to BLAS, whose threads wait
    for busy cores (measured beside a running test suite: 22 ms per million values, against 1 ms)."""
    total = 0.0
    for block, part in float64_blocks(weights.size):
        np.subtract(weights[block], global_weights[block], out=part, dtype=np.float64)
        total += float(np.einsum("i,i->", part, part))
    return math.sqrt(total)


class RunningTypical:
    """The median of the values above 0 added so far (the updates that carry something), None when there is
    none; kept sorted as they come, so a stream asks it after every update."""

    def __init__(self, values: Sequence[float] = ()) -> None:
        self.values: list[float] = sorted(float(v) for v in values if v > 0)

    def add(self, value: float) -> None:
        if value > 0:
            insort(self.values, float(value))

    def value(self) -> float | None:
        n = len(self.values)
        if not n:
            return None
        middle = n // 2
        return self.values[middle] if n % 2 else (self.values[middle - 1] + self.values[middle]) / 2


def typical(values: Sequence[float]) -> float | None:
    """The median of the values above 0 (the updates that carry something), None when there is none."""
    return RunningTypical(values).value()


@dataclass(frozen=True)
class UpdateBounds:
    """`[guard]`: the bounds above; the defaults are on."""

    norm_bound: str = "clip"
    norm_factor: float = 3.0
    max_samples: int = 0
    sample_factor: float = 10.0
    hold: int = 8  # a folding rule's first updates of a round, bounded together before any is folded

    def __post_init__(self) -> None:
        if self.norm_bound not in NORM_BOUNDS:
            raise ValueError(f"norm_bound must be one of {', '.join(NORM_BOUNDS)}, got {self.norm_bound!r}")
        if not self.norm_factor >= 1 or self.max_samples < 0 or not self.sample_factor >= 0 or self.hold < 1:
            raise ValueError("norm_factor must be >= 1, max_samples >= 0, sample_factor >= 0 and hold >= 1")

    @property
    def measures_distance(self) -> bool:
        return self.norm_bound != "off"

    def sample_cap(self, typical_count: float | None) -> float:
        """The most samples an update may count for: max_samples (0: none) and sample_factor x the typical count."""
        cap = float(self.max_samples) if self.max_samples else math.inf
        if self.sample_factor and typical_count is not None:
            cap = min(cap, self.sample_factor * typical_count)
        return cap

    def distance_bound(self, typical_distance: float | None) -> float:
        """How far an update may move the model: norm_factor x the typical distance (none when off or unknown)."""
        if not self.measures_distance or typical_distance is None:
            return math.inf
        return self.norm_factor * typical_distance

    def apply(self, global_weights: np.ndarray, updates: Sequence[ClientUpdate], counters: Counter[str],
              measured: Sequence[float] | None = None) -> list[ClientUpdate]:
        """A whole round's updates within the bounds (clipped ones are new arrays; the others are passed as they
        are). `measured`: their distances from the global model, when known already."""
        if measured is None:
            measured = [distance(global_weights, u.weights) if self.measures_distance else 0.0 for u in updates]
        cap = self.sample_cap(typical([u.num_samples for u in updates]))
        bound = self.distance_bound(typical(measured))
        within = (self.bounded(global_weights, u, d, cap, bound, counters) for u, d in zip(updates, measured))
        return [update for update in within if update is not None]

    def stream(self, global_weights: np.ndarray, take: Callable[[ClientUpdate], None], counters: Counter[str]
               ) -> BoundedStream:
        return BoundedStream(self, global_weights, take, counters)

    def bounded(self, global_weights: np.ndarray, update: ClientUpdate, moved: float, cap: float, bound: float,
                counters: Counter[str]) -> ClientUpdate | None:
        """One update within a sample cap and a distance bound (`moved`: its distance from the global model);
        None when it is rejected."""
        if update.num_samples > cap:
            counters["samples-capped"] += 1
            log.warning("%s claimed %d samples: counted as %d", update.device, update.num_samples, int(cap))
            update = dataclasses.replace(update, num_samples=int(cap))
        if moved <= bound:
            return update
        if self.norm_bound == "reject":
            counters["norm-rejected"] += 1
            log.warning("update of %s dropped: %.3g from the global model, the bound is %.3g", update.device, moved,
                        bound)
            return None
        counters["clipped"] += 1
        log.warning("update of %s clipped: %.3g from the global model, the bound is %.3g", update.device, moved, bound)
        change = (update.weights.astype(np.float64) - global_weights) * (bound / moved)
        return dataclasses.replace(update, weights=(global_weights + change).astype(np.float32))


class BoundedStream:
    """The bounds for a rule that folds (module docstring): `add` each update as it arrives; each one within the
    bounds is passed to `take`, the first `hold` of them only once `hold` have come or at `close`."""

    def __init__(self, bounds: UpdateBounds, global_weights: np.ndarray, take: Callable[[ClientUpdate], None],
                 counters: Counter[str]) -> None:
        self.bounds = bounds
        self.global_weights = global_weights
        self.take = take
        self.counters = counters
        self.counts = RunningTypical()
        self.distances = RunningTypical()
        self.held: list[tuple[ClientUpdate, float]] | None = []  # and their distances; None once they went on

    def add(self, update: ClientUpdate) -> None:
        moved = distance(self.global_weights, update.weights) if self.bounds.measures_distance else 0.0
        self.counts.add(update.num_samples)
        self.distances.add(moved)
        if self.held is not None:
            self.held.append((update, moved))
            if len(self.held) >= self.bounds.hold:
                self._release()
            return
        bounded = self.bounds.bounded(
            self.global_weights, update, moved, self.bounds.sample_cap(self.counts.value()),
            self.bounds.distance_bound(self.distances.value()), self.counters,
        )
        if bounded is not None:
            self.take(bounded)

    def close(self) -> None:
        """The round is over: the held updates (a round of fewer than `hold`) go on, bounded together."""
        if self.held is not None:
            self._release()

    def _release(self) -> None:
        held, self.held = self.held or [], None
        updates = [update for update, _ in held]
        for update in self.bounds.apply(self.global_weights, updates, self.counters, [d for _, d in held]):
            self.take(update)
