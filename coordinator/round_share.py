"""A share of a round taken apart from the coordinator's process: the gate, the round's checks and the round's
aggregation over the updates that one process receives, handed on as a partial aggregate at the round's close.

Two kinds of process hold one: an inbox worker (coordinator/inbox_workers.py: a process beside the coordinator in a
shared subscription to the fleet's updates) and a site's aggregator (coordinator/site_aggregator.py: a process at a
site, over the site's broker). Each is told of a round (`RoundOpening`), takes the updates that reach it (`take`),
says of each whether it took it (`Heard`: the coordinator counts a round's deliveries by these words), and at the
round's close hands on its share (`close`: a `PartialRound`), which the round's own aggregate merges
(`RoundAggregate.merge`) as if every update had come to it. What they differ in is only how the words and the share
travel: a pipe, or MQTT over a bridge.

What a share changes against one process, and what it does not:
- Rules that fold (FedAvg, FedProx) split exactly: the shares' folds merge into the round's. A rule that needs the
  whole round at once has nothing to merge; where its shares are meaningful groups (a site's devices) and the rule
  reads the weights only (the robust rules: `runs_per_share`), it runs on each share and again over the shares'
  results (`PartialRound.result`): a median of the sites' medians, which is not the fleet's median (sites only).
- Bounds that judge one update alone (its length against the fleet's path, its claims, its rows) are the same.
  Bounds that compare updates with the round's (the running medians of distances and sample counts, Krum's first
  `hold` updates and those scored against them, copies) compare each update with its share's: fewer updates, and
  for a site, its own devices' (a site of devices that look alike judges its outlier against them).
- The sum is float64 in every share and merged in float64: the model equals one process's to float64 rounding of
  the sum's order, which float32's rounding of the result hides (tested).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from coordinator.aggregation import PartialRound, RoundAggregate
from coordinator.containment import ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.inbox import Inbox, Update, UpdateRefused
from coordinator.influence import UNKNOWN_PATH, FleetPath, HeadLayout
from coordinator.rounds import OpenRound
from coordinator.strategies import RoundContext, Strategy, make_strategy


@dataclass(frozen=True)
class RoundOpening:
    """One round as a share takes it."""

    number: int
    task: int
    model: str  # the global model's blob id, which the devices' updates answer
    selected: tuple[str, ...]
    global_weights: np.ndarray
    ctx: RoundContext = RoundContext()
    path: FleetPath = UNKNOWN_PATH
    virtual_deadline_s: float | None = None  # virtual time: an update of more device seconds is late


@dataclass(frozen=True)
class Heard:
    """A share's word on one update: taken into its share of the open round (`reason` None), or why not. `source`
    names the share (an inbox worker's index, a site's name)."""

    source: str
    device: str
    round: int
    reason: str | None
    update: Update | None = None  # what the round's bookkeeping reads of it: its weights and attachments left out


def folds(strategy: Strategy) -> bool:
    """Whether the rule folds its rounds, which is what lets its updates be split into shares."""
    return strategy.fold(torch.zeros(1)) is not None


def runs_per_share(strategy: Strategy) -> bool:
    """Whether a rule that holds its rounds can run on each share and again over the shares' results: it reads an
    update's weights and samples only and sends the global model only (the robust rules)."""
    return not strategy.reads_more


def shares_refused(strategy: Strategy, secure: bool, central_dp: bool, reference_runs: bool, off: str,
                   per_share: bool = False) -> str | None:
    """Why a round cannot be split into shares this way (one line), or None; `off` is the setting that keeps the
    round in one process (e.g. "inbox_workers = 0"). `reference_runs`: the guard's calibration reference is on and
    the test data hold calibration samples for it. `per_share`: a holding rule may run per share (`runs_per_share`:
    sites, whose shares are their devices; an inbox worker's share is whatever the broker's turns give it)."""
    if secure:
        return f"secure aggregation sums the devices' masked vectors in the coordinator: set {off}"
    if central_dp:
        return f"central DP clips and counts every update in the coordinator: set {off}"
    if reference_runs:
        return (f"the guard's calibration reference is not run in a round's shares: set [guard] reference = \"off\" "
                f"to split the round without it, or {off}")
    if not folds(strategy) and not (per_share and runs_per_share(strategy)):
        return (f"the {strategy.name} rule needs a round's updates all at once; only rules that fold split"
                f"{', or robust rules per site' if per_share else ''}: set {off}")
    return None


@dataclass(frozen=True)
class SharePlan:
    """What a share of a fleet's rounds is made with: the gate's and the aggregation's settings."""

    fleet: str
    roster: frozenset[str]  # the devices whose updates it may take
    manifest: str  # the artifacts' digest devices register with (`Inbox`)
    num_parameters: int
    rule: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    guard: GuardSettings = GuardSettings()
    heads: HeadLayout | None = None  # the model's head rows, for the guard's row bound and Krum's comparison
    max_held_bytes: int = 1 << 30


class RoundShare:
    """One share's state: its gate, and the open round's checks and aggregation (on the CPU, one thread: the
    shares are the parallelism; the merge runs where the rule runs)."""

    def __init__(self, plan: SharePlan, source: str) -> None:
        self.plan = plan
        self.source = source
        self.inbox = Inbox(plan.fleet, set(plan.roster), plan.manifest, plan.num_parameters)
        self.round: OpenRound | None = None
        self.aggregate: RoundAggregate | None = None
        self.counters: Counter[str] = Counter()

    def open(self, opening: RoundOpening) -> None:
        """A round, or a later attempt of the open one: its share so far stays, its deliveries count."""
        delivered = self.round.delivered if self.round is not None else set()
        self.round = OpenRound(opening.number, opening.task, opening.model, list(opening.selected), math.inf,
                               opening.virtual_deadline_s)
        if self.aggregate is not None and self.aggregate.number == opening.number:
            self.round.carry_over(delivered)
            return
        self.inbox.drop_partial_updates(before_round=opening.number)
        self.counters = Counter()
        plan = self.plan
        rule = ContainedStrategy(make_strategy(plan.rule, device="cpu", **plan.options), self.counters)
        ctx = dataclasses.replace(opening.ctx, round=opening.number)  # the round the aggregate closes as
        self.aggregate = RoundAggregate(rule, plan.guard, opening.global_weights, self.counters, plan.max_held_bytes,
                                        ctx, path=opening.path, heads=plan.heads)

    def close(self, number: int | None) -> PartialRound | None:
        """The share of round `number` (None: this share holds no aggregate of it); the share is spent."""
        aggregate, self.aggregate, self.round = self.aggregate, None, None
        if aggregate is None or aggregate.number != number:
            return None
        self.counters.update(self.inbox.rejections)
        self.inbox.rejections.clear()
        return aggregate.partial(name=f"share:{self.source}")

    def take(self, topic: str, payload: bytes | bytearray | memoryview) -> Heard | None:
        """One message on a device's update topic: the word to say of the update it completes (None: a chunk of
        one still on its way, or a message the gate refused that names no update)."""
        event = self.inbox.accept(topic, payload)
        if isinstance(event, UpdateRefused):
            return Heard(self.source, event.device, event.round, event.reason)
        if isinstance(event, Update):
            return self._offer(event)
        return None

    def _offer(self, update: Update) -> Heard:
        """The round's checks and the rule's inspection, then the round's aggregation (the guard, the fold)."""
        if self.round is None or self.aggregate is None:
            self.counters["late"] += 1
            reason: str | None = "between-rounds"
        else:
            reason = self.aggregate.strategy.inspect(update.for_strategy()) or self.round.offer(update, self.counters)
        if reason is None and self.aggregate is not None:
            self.aggregate.add(update.for_strategy())
        said = dataclasses.replace(update, weights=np.empty(0, np.float32), attachments={})
        return Heard(self.source, update.device, update.round, reason, said)


class RoundShares(Protocol):
    """Whoever holds shares of the coordinator's rounds (coordinator/inbox_workers.py's workers, coordinator/sites.py's
    sites), as the round loop drives them: `start`, then per round `open`, `heard` as words come, `close` for the
    shares (None where one is lost, counted in `counters`); `stop` at the end."""

    @property
    def pids(self) -> list[int]: ...  # the processes on this host that do the work (a benchmark reads their CPU)

    def start(self) -> None: ...

    def open(self, opening: RoundOpening) -> None: ...

    def heard(self, timeout: float | None = None) -> Heard | None: ...

    def close(self, counters: Counter[str] | None = None) -> list[PartialRound | None]: ...

    def stop(self) -> None: ...
