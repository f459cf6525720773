"""What an update that passed every bound that refuses (coordinator/guard.py) may still do, bounded instead of
refused: how far it steps back toward the fleet's first global model, and how long it makes a class's head row.

Both are attacks that a rule comparing updates as wholes cannot see, because they move a sliver of the model or one
direction of it, in an honest update's company (issue 56, docs/results.md):

- **The way back** (`way_back = "clip"`, the default; "off"): each update's step back toward the first global model
  g0, its change's component along u = (g0 - g) / |g0 - g|, is cut to the round's median step back plus
  `way_back_slack` (0.25 by default) times the round's median change length (both over the updates that claim
  samples); what it does across u stays. The slack, because honest steps back spread about the median by about a
  quarter of a change's length either way (at 20 devices, 5th to 95th percentile -0.29 to +0.24) and cutting every
  honest update above the median cost a fleet of 20 4.4 points against FedAvg; drift's lies 0.6-0.8 lengths above it.
  `drift` (firmware_sim/adversary.py: an honest update plus its own length along u) passed every other bound and took
  8.7 points from the class-incremental digits fleet at 1 of 4; it keeps its honest part. Honest updates step back too
  (a new task's training forgets some of the old ones) and differ in how far: the one direction's median is what the
  round's majority did along it, as coordinate-wise median (Yin et al. 2018) takes it for every coordinate. One-sided:
  a step further from the start is bounded by the distance bound, and is what learning does.
- **Head rows** (`row_factor`; 1.25 by default, 0: off): each update's head row of class c (head.weight's row and
  head.bias's entry, models.manifest.class_head_positions) is at most `row_factor` times the lower median of the
  lengths of the round's rows of c from the updates that claim c (their `trained_counts`, else `label_counts`), or the
  global model's row of c where that is longer: longer, it is scaled back onto that length, whoever sent it. Never
  under the global model's row, because the rows of a class the round trains little on (an old class, kept by replay)
  shrink in every honest update, and cutting them to the shortest forgets the class faster. A row sets how strongly
  the model answers its class, so a device that scales its own classes' rows (`head-scale`: x2) takes the model's
  answers over from every other class while it moves the model a sliver and makes its own classes' calibration loss
  lower; SDD's CSWA has this bound of its own (coordinator/strategies/sdd.py `row_lengths_bound`). Compared among the
  devices that trained on the class only: a class that one device brings is bounded by its own row, which it is within
  (novelty stays free, and a device alone with a class can scale it: what no comparison with peers can see), and a
  device that did not train on a class cannot make its row longer than the one that did. The lower median, because
  with two claimants the upper one may be the scaled one. A class no update claims (one the fleet has not met) has no
  bound.

Each bound changes the update it acts on (a new array) and counts it (`pulled-back`, `row-clipped`); neither refuses.
They act last, after the bounds that refuse, which judge what a device sent. A round's updates held together are
bounded by the medians over all of them; in a stream each later one by the medians over those so far, itself
included (`RoundInfluence` learns as they come). A device that claims no samples counts for nothing: it is neither
measured nor changed.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.compute import UpdateChanges
from coordinator.medians import RunningMedian
from coordinator.strategies.base import ClientUpdate
from models.manifest import HEAD_WEIGHT, ParameterInfo, class_head_positions

log = logging.getLogger("edgefil.coordinator")


@dataclass(frozen=True)
class FleetPath:
    """Where the fleet's global model g has been, for the bounds that read it, in float64: the last global step
    g - g' (the guard's `min_progress`; g' the global model before g) and the unit way back to the first global
    model g0, (g0 - g) / |g0 - g| (`way_back`). None where it is not known or not asked for."""

    last_step: np.ndarray | None = None
    way_back: np.ndarray | None = None


UNKNOWN_PATH = FleetPath()


@dataclass(frozen=True)
class HeadLayout:
    """Where each class's head row (its row of head.weight, then its entry of head.bias) lies in the flat weights."""

    rows: tuple[np.ndarray, ...]  # by class

    @classmethod
    def of(cls, parameters: Sequence[ParameterInfo]) -> HeadLayout | None:
        """The model's layout; None for a model without head.weight and head.bias."""
        num_classes = next((p.shape[0] for p in parameters if p.name == HEAD_WEIGHT), None)
        if num_classes is None:
            return None
        try:
            return cls(tuple(class_head_positions(parameters, [c]) for c in range(num_classes)))
        except ValueError:
            return None

    @functools.cached_property
    def table(self) -> np.ndarray:
        """The rows as one (classes, row length) array of positions."""
        return np.stack(self.rows)

    def lengths(self, weights: np.ndarray) -> list[float]:
        """Each class's head row's length in float64, every row in one pass (a round bounds each update's rows:
        one row at a time cost 4-7x as much), with the same floats as `_length` of each row."""
        block = weights[self.table]
        return np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64)).tolist()


def claimed_classes(update: ClientUpdate) -> set[int]:
    """The classes the update says it trained on: its `trained_counts` with samples, else (an older device) the
    classes it has seen (`label_counts`)."""
    trained = {c for _, c, n in update.trained_counts if n > 0}
    return trained or {c for c, n in enumerate(update.label_counts) if n > 0}


def along(widened: UpdateChanges, weights: np.ndarray, unit: np.ndarray) -> tuple[float, float]:
    """<w - g, unit> and |w - g| in float64 (einsum, not BLAS: coordinator/compute.py `distance` says why)."""
    return float(np.einsum("i,i->", widened.of(weights), unit)), widened.length(weights)


class RoundInfluence:
    """One round's influence bounds (module docstring): `bound` the updates, a stream's one at a time; the medians
    learn from each batch before any of it is bounded."""

    def __init__(self, widened: UpdateChanges, way_back: np.ndarray | None, way_back_slack: float,
                 heads: HeadLayout | None, row_factor: float) -> None:
        """`way_back`: the unit way back to the first global model (None: not bounded) and `way_back_slack` how far
        beyond the median step back an update may go, in the round's median change lengths; `heads`: the model's
        head layout and `row_factor` its bound (None or 0: not bounded); `widened`: the round's changes from its
        global model g (`UpdateChanges`)."""
        self.widened = widened
        self.global_weights = widened.global_weights
        self.way_back = way_back
        self.way_back_slack = way_back_slack
        self.heads = heads if row_factor > 0 else None
        self.row_factor = row_factor
        self.backs = RunningMedian()  # the steps back so far
        self.lengths = RunningMedian()  # the lengths of the changes so far
        self.rows: dict[int, RunningMedian] = {}  # class -> the lengths of its rows from updates that claim it
        self.global_lengths: dict[int, float] = {}  # class -> the length of the global model's row
        # class -> how long its row may be (`_rows_bounded`), inf for a class none claimed: changed only where a
        # claimant is learnt, so an update is held against every class's bound at once, not a class at a time
        self.limits: list[float] = [math.inf] * (len(self.heads.rows) if self.heads is not None else 0)

    def bound(self, updates: Sequence[ClientUpdate], counters: Counter[str]) -> list[ClientUpdate]:
        # each update's head-row lengths, measured once: the medians learn from them, then each update is bounded
        lengths = [self._row_lengths(u) for u in updates]
        for update, rows in zip(updates, lengths):
            self._learn_rows(update, rows)
        rowed = [self._rows_bounded(u, rows, counters) for u, rows in zip(updates, lengths)]
        steps = [self._learn_step(u) for u in rowed]
        return [self._stepped_back(u, step, counters) for u, step in zip(rowed, steps)]

    def _row_lengths(self, update: ClientUpdate) -> list[float]:
        """The update's head-row lengths by class; none where its rows are not bounded."""
        if self.heads is None or update.num_samples <= 0:
            return []
        return self.heads.lengths(update.weights)

    def _learn_rows(self, update: ClientUpdate, lengths: list[float]) -> None:
        if not lengths:
            return
        for c in claimed_classes(update):
            if c < len(lengths):
                claimants = self.rows.setdefault(c, RunningMedian())
                claimants.add(lengths[c])
                self.limits[c] = self.row_factor * max(claimants.lower() or 0.0, self._global_length(c))

    def _rows_bounded(self, update: ClientUpdate, lengths: list[float], counters: Counter[str]) -> ClientUpdate:
        """The update with each class row at most `row_factor` x the lower median of its claimants' (a class one
        device claims: its own row's length, which it is within); a new array where one was longer
        (`row-clipped`)."""
        if self.heads is None or not lengths or not any(map(operator.gt, lengths, self.limits)):
            return update
        weights: np.ndarray | None = None
        for c in self.rows:
            positions, limit, length = self.heads.rows[c], self.limits[c], lengths[c]
            if length <= limit:
                continue
            if weights is None:
                weights = np.array(update.weights, dtype=np.float32)
            weights[positions] *= np.float32(limit / length)
            log.debug("update of %s: its head row of class %d (%.3g) clipped to %.3g", update.device, c, length, limit)
        if weights is None:
            return update
        counters["row-clipped"] += 1
        return dataclasses.replace(update, weights=weights)

    def _global_length(self, c: int) -> float:
        if c not in self.global_lengths:
            assert self.heads is not None
            self.global_lengths[c] = _length(self.global_weights[self.heads.rows[c]])
        return self.global_lengths[c]

    def _learn_step(self, update: ClientUpdate) -> float:
        if self.way_back is None or update.num_samples <= 0:
            return 0.0
        step, length = along(self.widened, update.weights, self.way_back)
        self.backs.add(step)
        self.lengths.add(length)
        return step

    def _stepped_back(self, update: ClientUpdate, back: float, counters: Counter[str]) -> ClientUpdate:
        """The update, its step back toward the first global model (`back`) at most the round's median step back
        plus `way_back_slack` times its median change length: what lies beyond is taken off that one direction
        (`pulled-back`; a new array)."""
        median = self.backs.value()
        if self.way_back is None or median is None or update.num_samples <= 0:
            return update
        most = median + self.way_back_slack * (self.lengths.value() or 0.0)
        if back <= most:
            return update
        counters["pulled-back"] += 1
        log.debug("update of %s pulled back: it stepped %.3g back toward the first global model, the round's median "
                  "is %.3g and the bound %.3g", update.device, back, median, most)
        weights = (update.weights.astype(np.float64) + (most - back) * self.way_back).astype(np.float32)
        return dataclasses.replace(update, weights=weights)


def _length(values: np.ndarray) -> float:
    return math.sqrt(float(np.einsum("i,i->", values, values, dtype=np.float64)))
