"""Robust rules: the coordinate-wise median (Yin et al. 2018) and trimmed mean, as Flower's FedMedian and
FedTrimmedAvg; and centered clipping (Karimireddy, He and Jaggi 2021). (Multi-Krum is the guard's Krum selection,
`[guard] krum_share`, followed by FedAvg: coordinator/guard.py, so it composes with every rule and folds.)

Coordinate-wise: each coordinate of the global model is the median, or the mean after dropping the `beta` share of
the largest and of the smallest values, of that coordinate over the round's updates. Neither weighs by
`num_samples`, so an inflated sample count buys nothing, and a minority of arbitrary updates cannot move a
coordinate beyond the honest values' range. The updates are sorted a column block at a time (a block of every
update's same coordinates, at most `BLOCK_VALUES` values, on the strategy's device), so memory is one model plus the
updates the round holds anyway plus one block and its sort's output (values and int64 indices: 3 blocks), never a
second N x model stack. (Measured: a block of a fixed 2^20 columns made a 100-update median of a 1M-parameter model
peak at 509 models above its round's start.)

`squared_distances` (the guard's Krum scores) comes from one Gram matrix of the updates, accumulated a column
block at a time.

Centered clipping starts from the coordinate-wise median v and takes `iterations` steps v <- v + mean_i
clip(x_i - v, tau), clip scaling a difference longer than tau back onto it; tau = `radius` x the median of
||x_i - v|| at the start. Each update moves the result by at most tau / n a step, however far it is.

All three need every update of the round at once (the coordinator holds them, up to `max_held_mib`).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from coordinator.compute import UpdateChanges, as_tensor
from coordinator.privacy import BuiltFrom
from coordinator.strategies.base import (
    OUTSIDE_A_RUN,
    AggregateResult,
    ClientUpdate,
    RoundContext,
    Strategy,
    validate_updates,
)
from models.manifest import Manifest

BLOCK_VALUES = 1 << 22  # 16 MiB of float32 per block: the column count is this over the number of updates
DISTANCE_CACHE_BYTES = 1 << 28  # `DistancesTo` keeps its float64 rows up to 256 MiB (8 LeNets' 0.25 MiB each: 2 MiB)


def sorted_mean(updates: Sequence[np.ndarray], trim: int, device: torch.device,
                columns: int | None = None) -> torch.Tensor:
    """Per coordinate: sort the N values, drop `trim` from each end, average the rest (trim = (N-1)//2 and N
    odd: the median; N even: the mean of the two middle values, as numpy's median)."""
    n = len(updates)
    if not 0 <= 2 * trim < n:
        raise ValueError(f"cannot trim {trim} from each end of {n} updates")
    out = torch.empty(updates[0].size, dtype=torch.float32, device=device)
    start = 0
    for part in _stacked_columns(updates, device, columns):
        ordered = torch.sort(part, dim=0).values
        torch.mean(ordered[trim : n - trim], dim=0, out=out[start:start + part.shape[1]])
        start += part.shape[1]
    return out


def _stacked_columns(updates: Sequence[np.ndarray], device: torch.device,
                     columns: int | None = None) -> Iterator[torch.Tensor]:
    """The updates' same coordinates, `columns` at a time (at most BLOCK_VALUES values): (n, columns) on device,
    in one buffer reused for every block."""
    n, size = len(updates), updates[0].size
    columns = columns or max(1, BLOCK_VALUES // n)
    block = torch.empty((n, min(columns, size)), dtype=torch.float32, device=device)
    for start in range(0, size, columns):
        stop = min(start + columns, size)
        part = block[:, : stop - start]
        for row, update in enumerate(updates):
            part[row].copy_(as_tensor(update[start:stop], device))
        yield part


class Median(Strategy):
    name = "median"
    built_from = BuiltFrom.WEIGHTS
    reads_more = False

    def __init__(self, device: torch.device | str = "auto", manifest: Manifest | None = None) -> None:
        super().__init__(device, manifest)

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        validate_updates(global_weights, updates)
        n = len(updates)
        return AggregateResult(sorted_mean([u.weights for u in updates], (n - 1) // 2, self.device))


class TrimmedMean(Strategy):
    name = "trimmed-mean"
    built_from = BuiltFrom.WEIGHTS
    reads_more = False

    def __init__(self, beta: float = 0.2, device: torch.device | str = "auto", manifest: Manifest | None = None
                 ) -> None:
        """`beta`: the share of updates dropped at each end of every coordinate (Flower's default 0.2), rounded
        down but at least one (`trimmed`)."""
        if not 0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {beta!r}")
        super().__init__(device, manifest)
        self.beta = float(beta)

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        validate_updates(global_weights, updates)
        return AggregateResult(sorted_mean([u.weights for u in updates], trimmed(self.beta, len(updates)),
                                           self.device))


def trimmed(beta: float, n: int) -> int:
    """How many values to drop at each end: beta x n rounded down, but one at least where beta > 0 and there are
    three or more (Flower's rounding trims nothing from a round of 4 at its default beta of 0.2)."""
    trim = int(beta * n)
    return max(trim, 1) if beta > 0 and n >= 3 else trim


def squared_distances(updates: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """(n, n) squared Euclidean distances between the updates, in float64, from their Gram matrix."""
    n = len(updates)
    gram = torch.zeros((n, n), dtype=torch.float64, device=device)
    for part in _stacked_columns(updates, device):
        wide = part.double()
        gram += wide @ wide.T
    norms = torch.diagonal(gram)
    return (norms[:, None] + norms[None, :] - 2 * gram).clamp_(min=0)


class DistancesTo:
    """Squared distances from any update to a fixed set of `others`, in float64, each in O(len(others) x P): their
    float64 rows and squared norms are kept once, where a later update's (k + 1)-row Gram would cost (k + 1)^2 P and
    convert every row again, and k distances one at a time k subtractions. The guard compares each later update of a
    round with the same first ones this way (Krum's neighbours, the copy check's). `origin`: a point the rows are
    taken from (the global model), so that the Gram's cancellation is relative to the changes' lengths, not the
    weights'. Kept only while the rows fit in `DISTANCE_CACHE_BYTES` (`fits`); past it, the callers measure as
    before."""

    def __init__(self, others: Sequence[np.ndarray], origin: np.ndarray | None = None) -> None:
        self.origin = origin
        self.rows = np.stack([self._from_origin(other) for other in others])
        self.norms = np.einsum("ij,ij->i", self.rows, self.rows)
        self._others = [weakref.ref(other) for other in others]  # which arrays the rows are (`among`)
        self._last: tuple[weakref.ref[np.ndarray], np.ndarray] | None = None  # the last update's distances

    @staticmethod
    def fits(count: int, size: int, limit: int = DISTANCE_CACHE_BYTES) -> bool:
        return count * size * 8 <= limit

    def __call__(self, update: np.ndarray, widened: UpdateChanges | None = None) -> np.ndarray:
        """(len(others),) squared distances from `update`, as `squared_distances` gives them (its Gram's form),
        read-only. `widened`: the round's changes (coordinator/compute.py `UpdateChanges`), which hold the update's
        change and its squared length where their global model is the rows' origin; else they are measured here.
        The last update's are kept (by its array's identity, a weak reference: an array that replaces a dead one at
        its address is no match), for a second caller that measures it against these rows (`among`)."""
        last = self._last
        if last is not None and last[0]() is update:
            return last[1]
        if widened is not None and widened.global_weights is self.origin:
            wide, squared = widened.of(update), widened.squared(update)
        else:
            wide = self._from_origin(update)
            squared = float(np.einsum("i,i->", wide, wide))
        # BLAS's gemv, unlike its dot of `compute.distance`, stayed the fastest beside busy cores: 8 rows of 31k and
        # of 1M values, 2 cores both busy, 0.08 and 8.2 ms against einsum's 0.28 and 12.5 (0.04 and 3.7 idle)
        products = self.rows @ wide
        distances = np.maximum(self.norms + squared - 2 * products, 0.0)
        distances.flags.writeable = False
        self._last = weakref.ref(update), distances
        return distances

    def among(self, others: Sequence[np.ndarray]) -> Callable[[np.ndarray, UpdateChanges | None], np.ndarray] | None:
        """Distances to `others` (some of the very arrays these rows were made of, measured from the same origin)
        read from these rows: the guard's copy check and Krum each measure a round's later updates against the
        round's first ones (all of them that claim samples, and Krum's kept ones of them), the same update one
        after the other, so the second reads the first's distances (a gemv, 4 % of the default guard's work on an
        update: docs/results.md, issue 57). None where one of `others` is not among them."""
        positions: list[int] = []
        for other in others:
            found = next((k for k, ref in enumerate(self._others) if ref() is other), None)
            if found is None:
                return None
            positions.append(found)
        chosen = np.array(positions, dtype=np.int64)

        def distances(update: np.ndarray, widened: UpdateChanges | None = None) -> np.ndarray:
            return self(update, widened)[chosen]
        return distances

    def _from_origin(self, weights: np.ndarray) -> np.ndarray:
        if self.origin is None:
            return np.asarray(weights, dtype=np.float64)
        return np.subtract(weights, self.origin, dtype=np.float64)


class CenteredClipping(Strategy):
    name = "centered-clip"
    built_from = BuiltFrom.WEIGHTS
    reads_more = False

    def __init__(self, radius: float = 1.0, iterations: int = 3, device: torch.device | str = "auto",
                 manifest: Manifest | None = None) -> None:
        """`radius`: tau in medians of the updates' distances from the starting centre; `iterations`: steps."""
        if not radius > 0 or iterations < 1:
            raise ValueError("radius must be > 0 and iterations >= 1")
        super().__init__(device, manifest)
        self.radius = float(radius)
        self.iterations = int(iterations)

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        validate_updates(global_weights, updates)
        rows = [as_tensor(u.weights, self.device) for u in updates]
        centre = sorted_mean([u.weights for u in updates], (len(updates) - 1) // 2, self.device).double()
        tau = None
        for _ in range(self.iterations):
            lengths = torch.stack([torch.linalg.vector_norm(row.double() - centre) for row in rows])
            if tau is None:
                tau = self.radius * float(torch.median(lengths))
            scales = (tau / lengths.clamp(min=1e-30)).clamp(max=1.0)
            step = torch.zeros_like(centre)
            for row, scale in zip(rows, scales):
                step += (row.double() - centre) * scale
            centre += step / len(rows)
        return AggregateResult(centre.float())
