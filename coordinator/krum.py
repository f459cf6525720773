"""Krum selection (Blanchard et al. 2017, Multi-Krum): which of a round's updates lie farther from their nearest
neighbours than the others do, compared on what neither update's classes own. The guard (coordinator/guard.py) runs
it in rounds without a calibration reference; its module docstring says why and what was measured."""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch

from coordinator.compute import UpdateChanges, distance
from coordinator.influence import HeadLayout, claimed_classes
from coordinator.strategies.base import ClientUpdate
from coordinator.strategies.robust import DistancesTo, squared_distances

log = logging.getLogger("edgefil.coordinator")
CPU = torch.device("cpu")


def krum_scores(updates: Sequence[np.ndarray], neighbours: int,
                others: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """Each update's Krum score: the sum of its squared distances to its `neighbours` nearest others (among
    `others`, when given, else among the updates themselves)."""
    if others is None:
        return scored(squared_distances(updates, CPU).numpy(), neighbours, among_themselves=True)
    distances = squared_distances([*updates, *others], CPU).numpy()[: len(updates), len(updates):]
    return scored(distances, neighbours, among_themselves=False)


def scored(distances: np.ndarray, neighbours: int, among_themselves: bool) -> np.ndarray:
    """Krum scores from squared distances (a row an update): the sum of each row's `neighbours` smallest, past its
    own 0 where the columns are the updates themselves."""
    skip = 1 if among_themselves else 0
    return np.sort(distances, axis=1)[:, skip:neighbours + skip].sum(1)


def compared_distances(updates: Sequence[ClientUpdate], heads: HeadLayout | None,
                       others: Sequence[ClientUpdate] | None = None, origin: np.ndarray | None = None) -> np.ndarray:
    """Squared distances between updates (a row an update, a column one of `others`, else of the updates
    themselves), each pair compared on what neither's classes own (`krum_compare = "classes"`): the head row of a
    class either of the two claims (`claimed_classes`) is left out, and the body and the rows of the classes neither
    trained on are compared. A class's row is what its holders' data make of it: a device that brings a class no
    other holds differs from the others by that row (issue 56: Krum refused an honest device alone with its classes
    in 10 of 10 rounds), and one that holds one of a session's two classes learns that class's row against the old
    classes only, not against the other (SDD's few-shot sessions: compared on the rows of the classes both held,
    such a device was still refused). What an update that undoes the round's learning changes is the body, which
    every pair compares; the rows are bounded by the row bound (coordinator/influence.py). `heads` None: the whole
    updates (`"whole"`); `origin`: what the head rows left out are measured from (`ClaimedRows`)."""
    columns = list(updates if others is None else others)
    rows = len(updates)
    every = list(updates) + ([] if others is None else columns)
    full = squared_distances([u.weights for u in every], CPU).numpy()
    distances = full[:rows, :rows] if others is None else full[:rows, rows:]
    return without_claimed_rows(distances, updates, columns, heads, origin)


def without_claimed_rows(distances: np.ndarray, updates: Sequence[ClientUpdate], columns: Sequence[ClientUpdate],
                         heads: HeadLayout | None, origin: np.ndarray | None = None) -> np.ndarray:
    """`compared_distances`' whole squared distances (a row an update, a column one of `columns`) less what the head
    rows of the classes either of a pair claims contribute, measured from `origin` (`ClaimedRows`); as they are with
    `heads` None."""
    return distances if heads is None else ClaimedRows(columns, heads, origin).subtract(distances, updates)


CLAIMS_KEPT = 1024  # the sets of claims a round's `ClaimedRows` keeps what it compares for: 16 KB each at 1000 classes
# and a `hold` of 8, a bound on the round's memory where every device claims other classes


class ClaimedRows:
    """What `without_claimed_rows` takes out of distances to a fixed set of `columns`: their claims and their
    float64 head rows of each class, read once. A round's Krum selection measures every later update against the
    same kept ones, and each time stacked their rows of each class claimed afresh, a class at a time: on MNIST-1D's
    cnn1d, updates of 3 samples of its 10 classes, over half the coordinator's work on an update (docs/results.md,
    issue 57). The classes are taken in order, so that a pair's distance is the same float however its claims were
    made. The rows held are the kept ones' heads, a part of what their `DistancesTo` rows hold."""

    def __init__(self, columns: Sequence[ClientUpdate], heads: HeadLayout, origin: np.ndarray | None = None) -> None:
        """`origin`: the weights the head rows are measured from (the round's global model; None: zero), so that
        the products' cancellation is relative to the rows' changes, not to the rows (`DistancesTo`'s origin)."""
        self.heads = heads
        self.columns = list(columns)
        claims = [claimed_classes(u) for u in self.columns]
        self.claimed = {c for c in set().union(*claims) if c < len(heads.rows)}
        # (classes, columns): whether each column claims each class
        self._claiming = np.array([[c in claim for claim in claims] for c in range(len(heads.rows))])
        self._origin = None if origin is None else origin[heads.table].astype(np.float64)  # (classes, row)
        # the columns' head rows from the origin, (classes, columns, row) in float64 (`hold` heads at most), and
        # their squared lengths (classes, columns)
        self._rows = np.stack([self._from_origin(u.weights[heads.table]) for u in self.columns], axis=1)
        self._lengths = np.einsum("ckr,ckr->ck", self._rows, self._rows)
        self._by_claims: dict[tuple[int, ...], tuple[np.ndarray | None, np.ndarray, np.ndarray]] = {}

    def subtract(self, distances: np.ndarray, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """`distances` (a row an update, a column one of the columns) less each pair's claimed classes' rows."""
        if not len(updates):
            return np.maximum(distances, 0.0)
        return np.stack([self.subtracted(row, update) for row, update in zip(distances, updates)])

    def subtracted(self, distances: np.ndarray, update: ClientUpdate) -> np.ndarray:
        """One update's row of `subtract`: its distance to each column less the rows of the classes either claims,
        each |own - row|^2 as |own|^2 + |row|^2 - 2 own.row (the columns' squared lengths summed once for a set
        of claims), all its classes in a few calls: numpy's calls, not the arithmetic, were this row's cost (a
        quarter of the default guard's work on an update; docs/results.md, issue 57)."""
        classes, left_out, their_lengths = self._compared(tuple(sorted(claimed_classes(update))))
        if len(left_out):
            table, rows = (self.heads.table, self._rows) if classes is None else (self.heads.table[classes],
                                                                                   self._rows[classes])
            own = self._from_origin(update.weights[table], classes)  # (classes, row)
            products = np.matmul(rows, own[:, :, None])[:, :, 0]  # (classes, columns)
            own_lengths = np.einsum("cr,cr->c", own, own)
            distances = distances - (own_lengths @ left_out + their_lengths
                                     - 2.0 * np.einsum("ck,ck->k", left_out, products))
        return np.maximum(distances, 0.0)

    def _from_origin(self, rows: np.ndarray, classes: np.ndarray | None = None) -> np.ndarray:
        """Head rows (classes, row: those of `classes`, every class where None) from the origin, in float64."""
        if self._origin is None:
            return rows.astype(np.float64)
        return np.subtract(rows, self._origin if classes is None else self._origin[classes], dtype=np.float64)

    def _compared(self, mine: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """For an update claiming `mine` (in order): the classes either it or a column claims, in order (None where
        that is every class: the columns' rows are then read as they are, not copied), which of its pairs with the
        columns leave each out (classes, columns: 1.0 or 0.0), and the squared lengths of the rows each column leaves
        out, summed. Kept by claims, CLAIMS_KEPT sets at most: a round's updates claim a few sets of classes where there
        are few, and each is a few bytes a class."""
        known = self._by_claims.get(mine)
        if known is not None:
            return known
        own = {c for c in mine if c < len(self.heads.rows)}  # a class past the head's has no row
        classes = np.array(sorted(self.claimed | own), dtype=np.int64)
        mine_too = np.array([c in own for c in classes.tolist()], dtype=bool)[:, None]
        left_out = (self._claiming[classes] | mine_too).astype(np.float64)
        compared = (None if len(classes) == len(self._rows) else classes, left_out,
                    np.einsum("ck,ck->k", left_out, self._lengths[classes]))
        if len(self._by_claims) < CLAIMS_KEPT:
            self._by_claims[mine] = compared
        return compared


def krum_outliers(distances: np.ndarray, share: float) -> set[int]:
    """The positions of the f = share x n (rounded down) worst Krum-scored of n updates (`distances`: their squared
    distances among themselves), scored against their max(1, n - f - 2) nearest others; none with f = 0 or n <= 2."""
    n = len(distances)
    f = int(share * n)
    if n <= 2 or f == 0:
        return set()
    scores = scored(distances, max(1, n - f - 2), among_themselves=True)
    return set(np.argsort(scores, kind="stable")[n - f:].tolist())


def learnt_nothing(update: ClientUpdate, global_weights: np.ndarray | None) -> bool:
    """The update is the global model as it was and claims no samples: what an honest device whose training left the
    model unchanged sends (edgefil's edge_client/device.py `_claims`). No attack (it is the global model), and it says
    nothing of what the round learns. False where `global_weights` is None (not known)."""
    return (global_weights is not None and update.num_samples == 0
            and (update.weights is global_weights or np.array_equal(update.weights, global_weights)))


class KrumSelection:
    """A round's Krum selection (coordinator/guard.py's docstring): the f worst-scored of its first `hold` updates
    are refused, and each later update is refused when its score against the kept ones is worse than the worst of
    theirs. With a head layout, updates are compared on what neither one's classes own (`compared_distances`).

    An update that learnt nothing (`learnt_nothing`) is neither scored nor a reference, and the first `hold` are
    the first `hold` that learnt something: devices with little data answer first, and in a 2000-device fleet the
    first 8 arrivals were mostly such; the kept ones' worst score was 0 and their spread 0, and every update after
    them that learnt something was refused (606 of 2000 in round 1, all its learners; docs/security.md).
    `global_weights` None: every update is scored."""

    def __init__(self, share: float, hold: int, radius: float = 0.0, heads: HeadLayout | None = None,
                 floor: float = 0.0, global_weights: np.ndarray | None = None) -> None:
        self.share = share
        self.global_weights = global_weights
        self.hold = hold
        self.radius = radius  # `krum_radius`: 0 takes none back
        self.floor = floor  # `krum_floor`, in the round's median distances from the global model
        self.heads = heads  # None: whole updates compared (`krum_compare = "whole"`)
        self.neighbours: list[ClientUpdate] = []  # the first updates that were kept, for the round
        # a later update's distances to them (None: streamed)
        self._distances_to: Callable[[np.ndarray, UpdateChanges | None], np.ndarray] | None = None
        self._claimed_rows: ClaimedRows | None = None  # their claims and head rows (None: whole updates compared)
        self.worst = math.inf  # the worst of their scores among themselves
        self.centre: np.ndarray | None = None  # the mean of the first updates Krum kept (float64)
        self.claimed: set[int] = set()  # the classes any of them claims
        self.reach = 0.0  # how far from it an update is taken back: `radius` x the farthest kept one, or the floor

    def select(self, updates: list[ClientUpdate], counters: Counter[str],
               typical_distance: float | None = None, known_rows: DistancesTo | None = None) -> list[ClientUpdate]:
        """The updates a round keeps, in order: the first `hold` that learnt something less their outliers (those
        within reach of the kept ones taken back), each later one kept, and every one that learnt nothing.
        `typical_distance`: the round's median distance from the global model, for `krum_floor` (None: no floor);
        `known_rows`: rows of the round's first updates from its global model that a later update is measured
        against anyway (the copy check's), which serve here where they hold the kept ones (`DistancesTo.among`)."""
        if not self.share:
            return updates
        learnt = [u for u in updates if not learnt_nothing(u, self.global_weights)]
        first, later = learnt[: self.hold], {id(u) for u in learnt[self.hold:]}
        self.reach = self.floor * (typical_distance or 0.0)
        among = compared_distances(first, self.heads, origin=self.global_weights) if len(first) > 2 else None
        outliers = krum_outliers(among, self.share) if among is not None else set()
        if (self.radius or self.floor) and len(first) - len(outliers) >= 2:
            self._place([u for k, u in enumerate(first) if k not in outliers])
            outliers = {k for k in outliers if not self._within_reach(first[k])}
        kept_at = [k for k in range(len(first)) if k not in outliers]
        kept = [first[k] for k in kept_at]
        for k in sorted(outliers):
            self._refused(first[k], counters)
        refused = {id(first[k]) for k in outliers}
        if len(kept) >= 2:
            self.neighbours = kept
            size = kept[0].weights.size
            fits = DistancesTo.fits(len(kept), size)
            shared = None
            if known_rows is not None and known_rows.origin is self.global_weights:
                shared = known_rows.among([u.weights for u in kept])
            self._distances_to = shared or (
                DistancesTo([u.weights for u in kept], self.global_weights) if fits else None)
            self._claimed_rows = (ClaimedRows(kept, self.heads, self.global_weights) if self.heads is not None
                                  else None)
            distances = (among[np.ix_(kept_at, kept_at)] if among is not None
                         else compared_distances(kept, self.heads, origin=self.global_weights))
            self.worst = float(scored(distances, self._nearest(), among_themselves=True).max())
        return [u for u in updates if id(u) not in refused and (id(u) not in later or self.takes(u, counters))]

    def takes(self, update: ClientUpdate, counters: Counter[str], widened: UpdateChanges | None = None) -> bool:
        """A later update: kept unless its score against the kept first ones is worse than any of theirs and it
        lies beyond reach of them. `widened`: the round's changes from the global model, where the caller has them
        (`UpdateChanges`)."""
        if not self.neighbours or learnt_nothing(update, self.global_weights):
            return True
        if self._distances_to is not None:
            distances = self._distances_to(update.weights, widened)[None, :]
        else:  # the kept ones' rows did not fit: the whole distances streamed again
            distances = compared_distances([update], None, others=self.neighbours)
        if self._claimed_rows is not None:  # their claimed rows left out as the round read them
            distances = self._claimed_rows.subtracted(distances[0], update)[None, :]
        if float(scored(distances, self._nearest(), among_themselves=False)[0]) <= self.worst:
            return True
        if self._within_reach(update):
            return True
        self._refused(update, counters)
        return False

    def _place(self, kept: Sequence[ClientUpdate]) -> None:
        """The kept updates' mean, and the reach: `radius` x the farthest of them from it, at least the floor."""
        centre = np.zeros(kept[0].weights.size, np.float64)
        for update in kept:
            centre += update.weights
        centre /= len(kept)
        self.centre = centre
        self.claimed = set().union(*(claimed_classes(u) for u in kept)) if self.heads is not None else set()
        self.reach = max(self.reach, self.radius * max(self._from_centre(u) for u in kept))

    def _from_centre(self, update: ClientUpdate) -> float:
        """The update's distance from the centre, compared as `compared_distances` compares two updates: without
        the rows of the classes it or any kept update claims."""
        assert self.centre is not None
        squared = distance(self.centre, update.weights) ** 2
        if self.heads is not None:
            classes = sorted(c for c in claimed_classes(update) | self.claimed if c < len(self.heads.rows))
            positions = self.heads.table[classes]
            for apart in ((update.weights[positions].astype(np.float64) - self.centre[positions]) ** 2).sum(-1):
                squared -= float(apart)
        return math.sqrt(max(squared, 0.0))

    def _within_reach(self, update: ClientUpdate) -> bool:
        return self.centre is not None and self._from_centre(update) <= self.reach

    def _nearest(self) -> int:
        return max(1, len(self.neighbours) - 2)

    @staticmethod
    def _refused(update: ClientUpdate, counters: Counter[str]) -> None:
        counters["krum-outlier"] += 1
        log.warning("update of %s dropped: farther from the round's other updates than they are from each other "
                    "(Krum)", update.device)
