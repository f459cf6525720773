"""A round's aggregation: where the accepted updates of one round go, and what memory they hold.

A rule that folds (`Strategy.fold`: FedAvg, FedProx) gets each update as it arrives, through the guard's stream
(`coordinator.guard.BoundedStream`), and the update is let go: the round holds the rule's running sum and the
guard's first `hold` updates, whatever the number of devices. A rule that needs every update at once (median,
trimmed mean, pFedGRP) holds them until the round closes; then the guard bounds them together and the rule
aggregates them. It holds at most `max_held_mib` (the coordinator file) of update bytes per round: an update beyond
that is refused, counted as `held-limit` and logged, rather than let the coordinator's memory grow with the fleet
(the first update of a round is always taken).

Under central differential privacy (coordinator/privacy.py) each update's change is clipped as it comes, before
the guard and the rule, and weighs the same as every other; the rule's result is then released with noise, as that
module says, unless the rule released it itself through its round's `RoundPrivacy` (`RoundContext.privacy`: GLFC
and SDD build what they send on from the released model).

Under secure aggregation (coordinator/secagg.py) the round gets no update of any one device: each attempt's secure
session adds the sum of its devices' updates, as one update the rule folds (`add_sum`).

Updates that arrive in the later attempt of a round that missed its quorum go into the same aggregation: they
answer the same global model.

The rule is called through its containment (coordinator/containment.py): an update the rule cannot fold is
refused alone, and a rule that fails on the round, or uses no update at all, gives no result: the coordinator keeps
the previous global model. Personalized models that are not finite are dropped (counted as
`personalized-nonfinite`): their devices get the global model, as devices the rule gave none.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from coordinator.compute import as_tensor
from coordinator.containment import RULE_FAILED, ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.guard_settings import GuardSettings
from coordinator.influence import UNKNOWN_PATH, FleetPath, HeadLayout
from coordinator.privacy import CentralPrivacy, RoundCount, RoundPrivacy
from coordinator.reference import ClassReference
from coordinator.secagg import SecureSum
from coordinator.strategies import AggregateResult, ClientUpdate, Fold, RoundContext
from coordinator.strategies.base import OUTSIDE_A_RUN, PartialFold

log = logging.getLogger("edgefil.coordinator")


@dataclass(frozen=True)
class Used:
    """What the round's history keeps of an update the rule used (after the bounds): not its weights."""

    device: str
    num_samples: int
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class PartialRound:
    """One round's aggregation of part of its updates, handed on to the round's own (`RoundAggregate.merge`): an
    inbox worker's or a site's share (coordinator/round_share.py). What its guard and rule counted travel with it.
    A folding rule's share is its partial fold, which merges as if its updates had come to the round; a holding
    rule's share (a site's, where the rule runs per site: coordinator/sites.py) is the rule's result over its
    updates, which the round's rule then takes as one more update (`result`)."""

    fold: PartialFold | None  # None: it folded no update
    sound: bool  # False: its fold failed on an update, so the round's aggregate is in doubt
    used: tuple[Used, ...]
    counters: Mapping[str, int]
    from_devices: int  # the updates it was given (central DP counts them) ...
    within_clip: int  # ... and those central DP's clip left whole
    seconds: float
    result: ClientUpdate | None = None  # a holding rule's result over the share (its samples: theirs), or None


SECURE_SUM = "secure-sum"  # the device name of a secure session's sum, where a rule sees it as one update


def _update_bytes(update: ClientUpdate) -> int:
    return int(update.weights.nbytes) + sum(len(data) for data in update.attachments.values())


class RoundAggregate:
    """One round's updates on their way into the rule: `add` each accepted update, `close` once for the result."""

    def __init__(self, strategy: ContainedStrategy, bounds: GuardSettings, global_weights: np.ndarray,
                 counters: Counter[str], max_held_bytes: int, ctx: RoundContext = OUTSIDE_A_RUN,
                 reference: ClassReference | None = None, path: FleetPath = UNKNOWN_PATH,
                 heads: HeadLayout | None = None, privacy: CentralPrivacy | None = None) -> None:
        """`ctx`: the round, as the rule sees it; `reference`: the guard's calibration reference (None: none);
        `path`: where the fleet's global model has been, as far as the guard's bounds ask; `heads`: the model's
        head layout, for the guard's row bound (None: none); `privacy`: central DP's clip and release (None:
        off)."""
        self.strategy = strategy
        self.bounds = UpdateBounds.of(bounds)
        self.global_weights = global_weights
        self.counters = counters
        self.max_held_bytes = max_held_bytes
        self.ctx = ctx
        self.reference = reference
        self.path = path
        self.heads = heads
        self.privacy = privacy
        self.privacy_spent: dict[str, Any] = {}  # what the round's history entry keeps of a DP release
        self._count = RoundCount(0, 0)  # the round's devices, as central DP counts them (set at the close)
        self._round_privacy: RoundPrivacy | None = None
        self._from_devices = 0  # updates `add` took (a round the host trained alone releases nothing of devices')
        self._within_clip = 0  # of those, the ones central DP's clip left whole (adaptive clipping counts them)
        self.number = ctx.round
        self.used: list[Used] = []
        self._summed_samples = 0  # the samples of the secure sums folded (`add_sum`), whose devices' are not known
        self.secure_counts: dict[str, int] = {}  # what the secure sessions' stages saw, for the round's history
        self.refused_sum: str | None = None  # why a secure session's sum was refused (a device lied), if one was
        self.seconds = 0.0  # spent bounding and aggregating, as updates arrive and at the close
        self._fold = fold = strategy.fold(as_tensor(global_weights, strategy.device))
        self._sound = True  # False once a fold raised while changing its running aggregate
        self._stream = None if fold is None else self.bounds.stream(
            global_weights, self._folding_into(fold), counters, reference, path, heads)
        self._held: list[ClientUpdate] = []
        self._held_bytes = 0
        self._trusted: list[ClientUpdate] = []  # the coordinator's own (a host-trained round): not bounded
        self._share_results: list[ClientUpdate] = []  # holding rules' results over shares (`merge`): not bounded
        self._merged_used: list[Used] = []  # ... and what they were made from

    @property
    def folds(self) -> bool:
        return self._fold is not None

    def add(self, update: ClientUpdate) -> None:
        started = time.perf_counter()
        try:
            self._from_devices += 1
            if self.privacy is not None:  # clipped first: the guard and the rule see what the noise covers
                clipped, within = self.privacy.clip(update.weights, self.global_weights)
                self._within_clip += within
                update = replace(update, weights=clipped, num_samples=1)
            if self._stream is not None:
                self._stream.add(update)
            else:
                self._hold(update)
        finally:
            self.seconds += time.perf_counter() - started

    def add_trusted(self, update: ClientUpdate) -> None:
        """The coordinator's own update (coordinator/host_training.py): the rule gets it, the guard does not bound
        it (the guard bounds what devices send)."""
        if self._fold is not None:
            refused, self._sound = self.strategy.add(self._fold, update)
            if refused is None:
                self.used.append(_used(update))
        else:
            self._trusted.append(update)

    def add_sum(self, summed: SecureSum, global_weights: np.ndarray, parts: Mapping[str, Mapping[str, float]],
                counts: Mapping[str, int]) -> None:
        """A secure session's sum: the rule folds the survivors' weighted mean, g + their mean change, as one update
        of their summed weight in samples; no bound sees it (secure aggregation runs with none). `parts`: what each
        survivor said of its update (its metrics), for the round's history; `counts`: the session's stages."""
        for stage, count in counts.items():
            self.secure_counts[stage] = self.secure_counts.get(stage, 0) + count
        samples = round(summed.samples)
        if samples <= 0:  # every device claimed nothing: the previous model stays
            return
        update = ClientUpdate(SECURE_SUM, (global_weights + summed.mean_change).astype(np.float32), samples)
        if self._fold is None:  # a mean whose fold failed to start (contained): it takes the sum at the close
            self._trusted.append(update)
            return
        refused, self._sound = self.strategy.add(self._fold, update)
        if refused is None:
            self.used.extend(Used(device, 0, dict(metrics)) for device, metrics in sorted(parts.items()))
            self._summed_samples += samples

    def sum_refused(self, reason: str, counts: Mapping[str, int]) -> None:
        """A secure session whose sum a lying device spoilt (coordinator/secagg.py, LIES): nothing of it goes to the
        rule, and a round with no other sum keeps its previous model (`close` gives None, `refused_sum` says why)."""
        for stage, count in counts.items():
            self.secure_counts[stage] = self.secure_counts.get(stage, 0) + count
        self.refused_sum = reason

    def partial(self, name: str = "share") -> PartialRound:
        """The round's updates so far, bounded and folded, to be merged into the round's own aggregate in another
        process (`merge`); this one is spent. A holding rule's share is its result over them, as one update named
        `name` of their summed samples (None where the rule used none)."""
        if self._fold is None or self._stream is None:
            started = time.perf_counter()
            outcome = self._result(None) if self._held else None  # a share of no update has no result
            self.seconds += time.perf_counter() - started
            if outcome is not None and not isinstance(outcome, AggregateResult):
                raise ValueError(f"the {self.strategy.name} rule finishes its rounds off the loop: no share of it")
            result = None if outcome is None or not self.used else ClientUpdate(
                name, outcome.global_weights.detach().cpu().numpy().astype(np.float32), self.samples)
            return PartialRound(None, True, tuple(self.used), dict(self.counters), self._from_devices,
                                self._within_clip, self.seconds, result)
        started = time.perf_counter()
        self._stream.close()
        fold = self._fold.partial() if self._sound and self._fold.seen else None
        self.seconds += time.perf_counter() - started
        return PartialRound(fold, self._sound, tuple(self.used), dict(self.counters), self._from_devices,
                            self._within_clip, self.seconds)

    def merge(self, part: PartialRound) -> None:
        """Another process's share of this round (`partial`), folded in as if its updates had come here; its counts
        added to the round's. A part the fold cannot take (another model's, a device twice) is refused alone
        (`partial-refused`); a part whose fold failed leaves the round's aggregate in doubt, as a failed update
        does here."""
        started = time.perf_counter()
        try:
            self.counters.update(part.counters)
            self._from_devices += part.from_devices
            self._within_clip += part.within_clip
            if part.result is not None:  # a holding rule's result over the share: one more update for the rule
                if self._fold is not None:
                    raise ValueError(f"the {self.strategy.name} rule folds: a share's result is not its")
                self._share_results.append(part.result)
                self._merged_used.extend(part.used)
                return
            if self._fold is None:
                raise ValueError(f"the {self.strategy.name} rule holds its rounds: a partial aggregate is not its")
            if not part.sound:
                self._sound = False
                return
            if part.fold is None:
                return
            try:
                self._fold.merge(part.fold)
            except ValueError as err:
                self.counters["partial-refused"] += 1
                log.warning("round %d: a partial aggregate of %d updates refused: %s", self.number, len(part.used),
                            err)
                return
            self.used.extend(part.used)
        finally:
            self.seconds += time.perf_counter() - started

    @property
    def samples(self) -> int:
        """The samples the round's result learnt from (as the updates claimed them)."""
        return sum(u.num_samples for u in self.used) + self._summed_samples

    def close(self, wait: Callable[[float], None] | None = None, selected: int = 0, eligible: int = 0
              ) -> AggregateResult | None:
        """The rule's result for the round; None when it failed on it or used no update (counted and logged). A rule
        that finishes its round off the loop (`Pending`) is waited for with `wait(seconds)`, the coordinator's
        message pump. Under central DP the result is the released model: `selected` devices of `eligible` were
        asked for an update this round (by all its attempts: they feed this one aggregate)."""
        started = time.perf_counter()
        try:
            self._count = RoundCount(selected, eligible, self._from_devices, self._within_clip)
            self._round_privacy = None
            result = self._result(wait)
            if result is not None and self.privacy is not None and self._from_devices:
                privacy = self._round_privacy or self._privacy_for_round()
                if privacy.spent is None:  # the rule did not release the model itself
                    released = privacy.release(result.global_weights.detach().cpu().numpy())
                    result.global_weights = torch.from_numpy(released)
                self.privacy_spent = dict(privacy.spent or {})
        finally:
            self.seconds += time.perf_counter() - started
        if result is not None:
            _drop_nonfinite_personalized(result, self.counters)
        return result

    def _result(self, wait: Callable[[float], None] | None) -> AggregateResult | None:
        if self.refused_sum is not None and not self.used and not self._trusted:
            return None  # the round's one secure sum was refused: the rule has nothing to aggregate
        if self._stream is not None and self._fold is not None:
            self._stream.close()
            if not self._sound:
                self.counters[RULE_FAILED] += 1
                log.warning("round %d: the %s rule's running aggregate is in doubt after a failed update; the "
                            "previous model stays", self.number, self.strategy.name)
                return None
            return self.strategy.result(self._fold, self.number)
        held = sorted(self._held, key=lambda update: update.device)  # the network's order is no order: the devices'
        bounded = [*self._trusted,
                   *self.bounds.apply(self.global_weights, held, self.counters, reference=self.reference,
                                      path=self.path, heads=self.heads)]
        self.used = [*self._merged_used, *(_used(update) for update in bounded)]
        bounded = [*self._share_results, *bounded]
        self._held, self._held_bytes, self._trusted, self._share_results = [], 0, [], []
        ctx = self.ctx
        if self.privacy is not None and self._from_devices:
            ctx = replace(ctx, privacy=self._privacy_for_round())
        return self.strategy.aggregate(as_tensor(self.global_weights, self.strategy.device), bounded, ctx, wait)

    def _privacy_for_round(self) -> RoundPrivacy:
        """Central DP's part of this round as the rule sees it (`RoundContext.privacy`), made once."""
        assert self.privacy is not None
        if self._round_privacy is None:
            self._round_privacy = RoundPrivacy(self.privacy, self.global_weights, len(self.used), self._count,
                                               self.number, self.strategy.extra_releases(self.ctx))
        return self._round_privacy

    def _folding_into(self, fold: Fold) -> Callable[[ClientUpdate], None]:
        def take(update: ClientUpdate) -> None:
            if not self._sound:
                return
            refused, self._sound = self.strategy.add(fold, update)
            if refused is None:
                self.used.append(_used(update))
        return take

    def _hold(self, update: ClientUpdate) -> None:
        size = _update_bytes(update)
        if self._held and self._held_bytes + size > self.max_held_bytes:
            self.counters["held-limit"] += 1
            log.warning("update of %s refused: the %s rule holds every update of a round and %d of them (%.0f MiB) "
                        "reach max_held_mib", update.device, self.strategy.name, len(self._held),
                        self._held_bytes / 2**20)
            return
        self._held.append(update)
        self._held_bytes += size


def _drop_nonfinite_personalized(result: AggregateResult, counters: Counter[str]) -> None:
    """A personalized model that is not finite goes nowhere: its device gets the global model."""
    for device in [d for d, weights in result.personalized.items() if not bool(torch.isfinite(weights).all())]:
        del result.personalized[device]
        counters["personalized-nonfinite"] += 1
        log.warning("the personalized model of %s is not finite: it gets the global model", device)


def _used(update: ClientUpdate) -> Used:
    return Used(update.device, update.num_samples, dict(update.metrics))
