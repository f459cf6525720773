"""The Strategy interface: one class per aggregation rule, the arithmetic in small pure functions.

A strategy is the coordinator's half of a learning method. It turns the round's device updates into the next global
model (`aggregate`) and may add per-device instructions to the round-start message (`configure`, e.g. FedProx's
mu). Both learn which round they serve from one `RoundContext` (its number, the task, the task's classes and those
seen so far, the round within the task), as Flower hands its strategies `server_round`. Weights are one flat
float32 buffer per model in manifest order, as the devices send them; aggregation runs in torch on the strategy's
device (cuda when present).

A rule whose result is a running sum of the updates says so by returning a `Fold` from `fold`: the coordinator
then adds each update as it arrives and lets it go, so a round costs the memory of one model whatever the number
of devices. A rule that needs every update at once (a coordinate-wise rule, a personalized rule) returns None,
the default: the coordinator holds the round's updates, up to a configured maximum, and calls `aggregate`.

Methods that reach further plug in through the same interface, and the coordinator never names them:
- an update's raw attachments (named byte strings from the device's policy) reach `inspect` when the update
  arrives (refuse it with `RefusedUpdate`) and `aggregate` with the round;
- a device's request for named payloads is answered by `answer`, at once, rounds open or not;
- `aggregate` may run any computation per round and return per-device models (`personalized`, sent as the
  device's "personal" payload and evaluated as its model), per-device named payloads (`payloads`: synthetic
  samples, ...), sent with the device's next round, and named payloads for every device (`broadcast`: an old
  model), sent once to the fleet and kept by each device until they change;
- `aggregate` whose work takes minutes (a generator trained from the round's models) returns a `Pending`: the
  rest of the round runs as a `BackgroundJob` and the coordinator keeps serving its devices until it finishes;
- `save` / `load` keep the rule's state across a `--resume`.

Every call runs contained (coordinator/containment.py): a rule refuses what it cannot use rather than fail on it,
and whatever it raises still cannot stop the run. `inspect` checks an update's payloads against what the fleet
sends and bounds what they cost before anything is built from them; `aggregate` that cannot use one update's
payloads goes on without them and names it in `AggregateResult.refused`; a rule that raises on a whole round loses
that round (the previous global model stays), not the run. A `Fold` refuses an update by raising before it changes
its running aggregate.

Strategies register by name as their classes are defined; every module of this package is imported, so a new
rule adds a file here and touches nothing else.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from coordinator.background import BackgroundJob, Deadline
from coordinator.compute import resolve_device
from coordinator.privacy import BuiltFrom, Release, RoundPrivacy
from edgefil.registry import Registry
from models.manifest import Manifest


@dataclass(frozen=True)
class ClientUpdate:
    """One device's result of a round. `weights` may be a read-only view of the network payload."""

    device: str
    weights: np.ndarray
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    label_counts: Sequence[int] = ()  # samples the device has seen per class
    attachments: Mapping[str, bytes] = field(default_factory=dict)  # named byte strings from the device's policy
    trained_counts: Sequence[tuple[int, int, int]] = ()  # (task, class, samples) of what it trained on (its store)


@dataclass(frozen=True)
class RoundContext:
    """The round a rule configures or aggregates: its number (1-based, as on the wire), the task it trains, the
    classes that task brings and those of tasks 0..task (from the coordinator's test sets: a deployment's test
    folder or a simulated scenario), and how far into the task it is (`round_in_task`, 1-based, of
    `rounds_per_task`). The default is the first round of a one-task run with no classes known: a rule used outside
    a run (a benchmark, a test of its arithmetic)."""

    round: int = 1
    task: int = 0
    task_classes: tuple[int, ...] = ()
    seen_classes: tuple[int, ...] = ()
    round_in_task: int = 1
    rounds_per_task: int = 1
    # Central DP as the rule's `aggregate` sees the round (coordinator/privacy.py), None without it (and in
    # `configure`): the model's release and the rule's further mechanisms
    privacy: RoundPrivacy | None = field(default=None, compare=False)

    @property
    def starts_task(self) -> bool:
        """The first round of its task: the devices meet the task's data in it."""
        return self.round_in_task == 1

    @property
    def ends_task(self) -> bool:
        """The last round of its task: its global model is the one the next task starts from."""
        return self.round_in_task >= self.rounds_per_task


OUTSIDE_A_RUN = RoundContext()


@dataclass
class AggregateResult:
    global_weights: torch.Tensor
    personalized: dict[str, torch.Tensor] = field(default_factory=dict)  # device -> its own model
    payloads: dict[str, dict[str, bytes]] = field(default_factory=dict)  # device -> named payloads for next round
    # named payloads for every device, sent once and kept by the devices until they change (coordinator/broadcast.py)
    broadcast: dict[str, bytes] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> what the rule measured of it
    # device -> why the rule could not use that update's payloads this round (it went on without them; counted)
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class Pending:
    """A round a rule finishes off the coordinator's loop: `job` (started by the rule) computes the round's
    AggregateResult. The coordinator serves its devices while it runs, for at most `wait_s` seconds; a job that
    fails, or is not done by then, loses the round as a failing rule does (its late result is dropped)."""

    job: BackgroundJob[AggregateResult]
    wait_s: float

    def settle(self, wait: Callable[[float], None] | None = None) -> AggregateResult | None:
        """The job's result once it is done; `wait(seconds)` passes the time meanwhile (the coordinator pumps its
        messages; by default, outside a run, the job is simply joined). None: it failed or ran out of time."""
        deadline = Deadline(self.wait_s)
        while self.job.running and not deadline.passed():
            if wait is None:
                self.job.wait(deadline.left())
            else:
                wait(min(PENDING_POLL_S, deadline.left()))
        return None if self.job.running else self.job.take()


PENDING_POLL_S = 0.05  # how often the coordinator looks at a pending round between its messages
# A pending round's wait beyond its job's own budget: what the job does after its budgeted work (evaluating models,
# aggregating) before it hands the round back
PENDING_MARGIN_S = 30.0


def settled(result: AggregateResult | Pending) -> AggregateResult:
    """A rule's result outside a run (a benchmark, a test): a pending one waited for; ValueError if it failed."""
    if isinstance(result, AggregateResult):
        return result
    done = result.settle()
    if done is None:
        raise ValueError("the rule's pending round failed or ran out of time")
    return done


class RefusedUpdate(ValueError):
    """An update the rule cannot use (e.g. an attachment that does not decode); `reason` is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


STRATEGIES: Registry[Strategy] = Registry("strategy")  # every aggregation rule by its config name


class Strategy(ABC):
    """One aggregation rule. Every constructor takes the rule's options, `device` (the torch device) and `manifest`
    (the model's, for rules that run models; `make_strategy` always passes it)."""

    name: ClassVar[str]
    # What the global model is built from, which sets how central DP's noise is calibrated (coordinator/privacy.py):
    # the (weighted) mean of the updates' weights (MEAN), their weights alone in any other way (WEIGHTS: a robust
    # rule), or more of them (MORE, the default: an attachment, a synthetic set). A rule whose options change it
    # sets it on the instance.
    built_from: BuiltFrom = BuiltFrom.MORE
    # Whether the rule reads more of an update than its weights and sample count (attachments) or sends more than the
    # global model (broadcasts, payloads, personalized models). Secure aggregation cannot give it what it reads;
    # central DP's noise on the model does not cover what it sends, so such a rule runs under central DP only where
    # it says how it noises the rest (`central_dp_refused`, `extra_releases`, `RoundContext.privacy`).
    reads_more: ClassVar[bool] = True
    # Whether the rule makes model inputs of its own (a reconstruction of a device's sample, a generator's samples):
    # such a rule takes `input_range`, the data's [low, high] its inputs are made within, which the coordinator sets
    # to its test data's range where the rule's options leave it out (`Coordinator`; such rules' fleets on MNIST-1D,
    # whose signals span about [-4.6, 4.7], made them within [0, 1] unless the file said otherwise).
    makes_inputs: ClassVar[bool] = False

    def __init__(self, device: torch.device | str = "auto", manifest: Manifest | None = None) -> None:
        self.manifest = manifest
        self.device = resolve_device(str(device))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            STRATEGIES.add(cls.name, cls)

    @classmethod
    def central_dp_refused(cls, options: Mapping[str, Any]) -> str | None:
        """Why this rule with these options cannot run under central DP (one line), or None. A rule that reads or
        sends more than the weights (`reads_more`) is refused unless it overrides this: it then noises what it
        sends through its round's `RoundContext.privacy`, with every further mechanism declared in
        `extra_releases`."""
        if not cls.reads_more:
            return None
        return (f"mode = \"central\" noises the global model: {cls.name} sends more than it (per-device models, "
                f"payloads or a broadcast built from the updates), which that noise would not cover; use local DP "
                f"on the devices (mode = \"local\" in their [privacy]), which noises everything an update carries")

    def extra_releases(self, ctx: RoundContext) -> tuple[Release, ...]:
        """The Gaussian mechanisms round `ctx` runs under central DP besides the model's release (the accountant
        counts each, and the budget is checked for them before the round); none by default."""
        return ()

    def inspect(self, update: ClientUpdate) -> None:
        """Check an arriving update's attachments; raise RefusedUpdate to drop it (default: accept any)."""

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        """The named payloads asked for that the rule can give (a device's request); none by default."""
        return {}

    def save(self, directory: Path) -> None:
        """Write what the rule keeps across rounds beside the run's checkpoint (nothing by default)."""

    def load(self, directory: Path) -> None:
        """Read back what `save` wrote (a resumed run)."""

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per-device instructions added to each round-start message (e.g. {"mu": 0.01}); default: {} for each."""
        return {device: {} for device in devices}

    @property
    def weighs_by_samples(self) -> bool:
        """Whether a mean rule weighs an update by the samples it claims (True, the default) or weighs every update
        alike. Under secure aggregation the devices apply the weights themselves, before masking
        (coordinator/secagg.py), so the rule's choice travels with each secure round."""
        return True

    def fold(self, global_weights: torch.Tensor) -> Fold | None:
        """A running aggregate for one round, to which updates are added as they arrive; None (the default): the
        rule needs the whole round at once, in `aggregate`."""
        return None

    @abstractmethod
    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult | Pending:
        """The next global model (on self.device) from the updates of round `ctx`; implementations call
        validate_updates first. A `Pending` finishes the round off the coordinator's loop."""


@dataclass(frozen=True)
class PartialFold:
    """What a fold of part of a round's updates hands on, to be merged into another fold of the same round and
    rule (`Fold.merge`): an inbox worker's share of the updates, a site's devices. `state` is the rule's own
    (numpy arrays and numbers: it pickles and crosses a process or the network); `devices` are the updates it
    took, so that no device counts twice."""

    rule: str
    size: int
    devices: frozenset[str]
    state: Mapping[str, Any]


class Fold(ABC):
    """One round of a rule that aggregates as updates arrive: `add` each update (it is not kept), then `result`.
    A fold can also be split: folds of disjoint parts of a round, each handed on as a `partial` and `merge`d into
    one, give that one's result as if every update had been added to it (to float64 rounding of the sum's order).
    Every folding rule implements both (`_partial`, `_merge`): it is what lets a round's updates be folded in more
    than one process (coordinator/inbox_workers.py)."""

    def __init__(self, global_weights: torch.Tensor) -> None:
        check_global(global_weights)
        self.size = global_weights.numel()
        self.seen: set[str] = set()

    def add(self, update: ClientUpdate) -> None:
        """Take one update into the running aggregate (checked first, as validate_updates checks a round)."""
        check_update(self.size, update, self.seen)
        self.seen.add(update.device)
        self._add(update)

    def result(self) -> AggregateResult:
        if not self.seen:
            raise ValueError("no updates to aggregate")
        return self._result()

    def partial(self) -> PartialFold:
        """This fold's updates so far, to be merged into another fold of the round (this one is spent)."""
        return PartialFold(type(self).__name__, self.size, frozenset(self.seen), self._partial())

    def merge(self, part: PartialFold) -> None:
        """Take another fold's updates of the same round and rule in, as if each had been added here; refused
        (ValueError) for another rule's or model's part, or one that shares a device with this fold."""
        if part.rule != type(self).__name__ or part.size != self.size:
            raise ValueError(f"a {part.rule} part of {part.size} values cannot be merged into a {type(self).__name__} "
                             f"of {self.size}")
        twice = self.seen & part.devices
        if twice:
            raise ValueError(f"devices folded twice in one round: {sorted(twice)[:5]}")
        self._merge(part.state)
        self.seen |= part.devices

    @abstractmethod
    def _add(self, update: ClientUpdate) -> None: ...

    @abstractmethod
    def _result(self) -> AggregateResult: ...

    @abstractmethod
    def _partial(self) -> Mapping[str, Any]: ...

    @abstractmethod
    def _merge(self, state: Mapping[str, Any]) -> None: ...


def check_global(global_weights: torch.Tensor) -> None:
    if global_weights.ndim != 1 or global_weights.dtype != torch.float32:
        raise ValueError(f"global weights must be a flat float32 tensor, got shape {tuple(global_weights.shape)} "
                         f"and dtype {global_weights.dtype}")


def check_update(size: int, update: ClientUpdate, seen: set[str]) -> None:
    """Refuse an update no rule can use: a weight buffer of the wrong dtype or length (or not contiguous), a
    negative sample count, or a device already heard this round (`seen`). Checks metadata only, never the weights."""
    w = update.weights
    if w.ndim != 1 or w.dtype != np.float32 or w.size != size or not w.flags.c_contiguous:
        raise ValueError(f"update from {update.device!r}: expected {size} contiguous float32 weights, got shape "
                         f"{w.shape}, dtype {w.dtype}, strides {w.strides}")
    if isinstance(update.num_samples, bool) or not isinstance(update.num_samples, (int, np.integer)) \
            or update.num_samples < 0:
        raise ValueError(f"update from {update.device!r}: num_samples must be an int >= 0, "
                         f"got {update.num_samples!r}")
    if update.device in seen:
        raise ValueError(f"device {update.device!r} sent more than one update this round")


def validate_updates(global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> None:
    """Refuse a round no rule can aggregate: no updates, or an update `check_update` refuses."""
    check_global(global_weights)
    if not updates:
        raise ValueError("no updates to aggregate")
    seen: set[str] = set()
    for update in updates:
        check_update(global_weights.numel(), update, seen)
        seen.add(update.device)


def aggregate_by_folding(fold: Fold, updates: Sequence[ClientUpdate]) -> AggregateResult:
    """A folding rule's whole-round `aggregate`: the same arithmetic as the coordinator's streaming path."""
    if not updates:
        raise ValueError("no updates to aggregate")
    for update in updates:
        fold.add(update)
    return fold.result()
