"""Asynchronous rounds: the model moves every K updates, whichever devices they come from (FedBuff: Nguyen et al.,
"Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

Devices train at their own pace: a device that is free gets the current global model and trains it; its update is
taken when it comes, into the buffer of the round open then, and once the buffer holds `buffer` (K) updates the round
closes and the model moves, with no round waiting for its slowest device. An update trained on the model of round r
and taken in round R is `R - r` moves stale; more than `max_staleness` and it is refused ("stale"), else it goes into
the round as the round's global model plus its change, weighed by s(staleness):

    w' = g_R + s(tau) (w - g_r),    s(tau) = (1 + tau) ** -staleness_exponent     (FedBuff's polynomial s)

so a rule that reads an update's weights and samples (FedAvg, FedProx, the robust rules, the guard's bounds) works on
it unchanged, and FedAvg of the buffer is g_R + sum_i n_i s(tau_i) (w_i - g_{r_i}) / sum_i n_i: FedBuff's step with
its server learning rate 1 and the updates weighed by their samples as FedAvg weighs them (FedBuff weighs each
update alike: with equal samples the two are the same). A rule that reads more than the weights (pFedGRP's
personalised models, GLFC's and SDD's attachments) needs every device on one model: refused in one line.

Choices the paper leaves open, each configurable where it is a number:
- A device trains a round's model once: one whose update went into the open round's buffer trains again once the
  model has moved (no device fills a buffer alone).
- At most `concurrency` devices train at once (0: every available one); the free device given work first is the one
  whose last work is oldest. Measured (docs/results.md, "Asynchronous rounds"): with every device at work the fast
  ones fill the buffers and the slowest ones' work comes back too stale to count, so their data go unlearnt; a
  limit near the buffer's size gave the accuracy of synchronous rounds of as many updates in half their time.
- An update of an earlier task's round is taken as any stale one, within `max_staleness`: it carries what its device
  learnt of that task (a synchronous round drops it as late).
- A round closes at K updates; at its deadline (`deadline_s`: wall seconds, or in virtual time fleet seconds since it
  opened) with at least the quorum (`min_clients`, at most K); or when no device is left to train its model (every
  free one trained it) with at least the quorum. Fewer (on the wall clock, after `max_attempts` deadlines):
  QuorumError.

Virtual time (simulated fleets): the devices report the device seconds of their work, and an update's time on the
fleet's clock is when its work was given plus those. Updates are taken in that order, not as the host delivers them:
the schedule takes the earliest reported one only once no given work is still out (work given later cannot finish
earlier), so the run is the same on any host when the devices' times are modelled (`compute = "modelled"` in a fleet
file). A device away at the time its work is given (its availability on the fleet's clock) is given work again
`away_retry_s` fleet seconds later. On the wall clock updates are taken as they arrive.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from coordinator.strategies import Strategy

MODES = ("off", "buffered")
STALE = "stale"  # why an update is refused: trained on a model more than max_staleness moves old


@dataclass(frozen=True)
class AsynchronousSettings:
    """`[asynchronous]` of the coordinator file."""

    mode: Literal["off", "buffered"] = "off"
    buffer: int = 10  # K: the updates a round takes before the model moves
    max_staleness: int = 4  # an update more than this many moves stale is refused
    staleness_exponent: float = 0.5  # s(tau) = (1 + tau)^-a (FedBuff's 0.5); 0: every update weighs alike
    concurrency: int = 0  # devices training at once, at most; 0: every available device
    away_retry_s: float = 60.0  # virtual time: fleet seconds before a device away when given work is given it again

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.buffer < 1 or self.max_staleness < 0 or self.concurrency < 0:
            raise ValueError("buffer must be >= 1, max_staleness and concurrency >= 0")
        if not (0 <= self.staleness_exponent < math.inf and 0 < self.away_retry_s < math.inf):
            raise ValueError("staleness_exponent must be >= 0 and away_retry_s > 0, both finite")

    @property
    def on(self) -> bool:
        return self.mode == "buffered"

    def weight(self, staleness: int) -> float:
        """s(tau): how much of its change an update `staleness` moves stale keeps."""
        return float((1 + staleness) ** -self.staleness_exponent)


@dataclass
class Work:
    """A device's work out: the round whose model it trains, that model's id, and when it was given."""

    round: int
    model: str
    given_s: float  # on the fleet's clock
    wall_deadline: float  # time.monotonic(): a device silent this long is given up on (virtual time's safeguard)


@dataclass(order=True)
class Done:
    """A device's work ended at `at_s` on the fleet's clock: with its update, or without (it sat the work out)."""

    at_s: float
    device: str  # ties: by device id, not by the order the host happened to deliver them
    round: int = field(compare=False)
    update: Any = field(compare=False, default=None)  # the gate's Update, or None


class BufferedSchedule:
    """Who trains what, and which finished work the open round takes next (the module docstring). Holds the global
    models of the last `max_staleness` + 1 rounds, which stale updates are rebased from."""

    def __init__(self, settings: AsynchronousSettings, virtual: bool, wall_limit_s: float, clock_s: float = 0.0,
                 ) -> None:
        self.settings, self.virtual, self.wall_limit_s = settings, virtual, wall_limit_s
        self.clock_s = clock_s  # the fleet's clock: the last taken work's end (virtual), or wall seconds (real)
        self._wall_zero = time.monotonic() - clock_s
        self.out: dict[str, Work] = {}  # work given and not yet ended
        self._ending: set[str] = set()  # devices whose work ended and is not yet taken: busy until then
        self.last: dict[str, int] = {}  # device -> the latest round it was given work of, or its update taken in
        self._done: list[Done] = []  # ended, not yet taken (a heap by time)
        self._models: dict[int, np.ndarray] = {}  # round -> the global model its work starts from
        # whether a device may have come free since work was last given (`to_give` reads every available device:
        # asked after every message a round handles, that was O(devices) a message)
        self.changed = True
        self._look_after = math.inf  # time.monotonic() of the earliest wall deadline of the work out (`overdue`)

    # --- the model ---------------------------------------------------------------------------------

    def opened(self, round_: int, weights: np.ndarray) -> None:
        """Round `round_` opens on `weights`: kept while updates of it may still be taken."""
        self._models[round_] = weights
        self.changed = True
        for old in [r for r in self._models if r < round_ - self.settings.max_staleness]:
            del self._models[old]

    def rebased(self, weights: np.ndarray, trained_in: int, round_: int) -> tuple[np.ndarray, int] | None:
        """An update trained on round `trained_in`'s model, as it goes into round `round_` (the module docstring),
        and its staleness; None when it is too stale (or its model is no longer held: a resumed run's)."""
        staleness = round_ - trained_in
        base = self._models.get(trained_in)
        if base is None or staleness > self.settings.max_staleness:
            return None
        if staleness == 0:
            return weights, 0
        change = (weights.astype(np.float64) - base) * self.settings.weight(staleness)
        return (self._models[round_] + change).astype(np.float32), staleness

    # --- work --------------------------------------------------------------------------------------

    def to_give(self, available: Iterable[str], round_: int) -> list[str]:
        """The available devices to give round `round_`'s work now: free, and not yet given it; the ones whose last
        work is oldest first, at most `concurrency` out at once."""
        self.changed = False
        free = sorted((self.last.get(d, 0), d) for d in available
                      if d not in self.out and d not in self._ending and self.last.get(d, 0) < round_)
        busy = len(self.out) + len(self._ending)  # work out, and work ended but not yet taken (still at it)
        room = len(free) if not self.settings.concurrency else max(self.settings.concurrency - busy, 0)
        return [d for _, d in free[:room]]

    def give(self, device: str, round_: int, model: str) -> None:
        self.out[device] = work = Work(round_, model, self.clock_s, time.monotonic() + self.wall_limit_s)
        self._look_after = min(self._look_after, work.wall_deadline)
        self.last[device] = round_

    def ended(self, device: str, round_: int, update: Any = None, seconds: float = 0.0,
              again_after_s: float | None = None) -> bool:
        """The device's work of `round_` ended: with its `update` (`seconds`: its device seconds), or without
        (`again_after_s`: it sat the work out, and may be given work of the same round after that many fleet
        seconds; None: not before the model moves). False when no such work was out (the caller refuses it)."""
        work = self.out.get(device)
        if work is None or work.round != round_:
            return False
        del self.out[device]
        if update is None and again_after_s is not None:
            self.last[device] = round_ - 1
            seconds = again_after_s
        at = work.given_s + seconds if self.virtual else time.monotonic() - self._wall_zero
        heapq.heappush(self._done, Done(at, device, round_, update))
        self._ending.add(device)  # on the fleet's clock it is still at work until then
        return True

    def lost(self, device: str) -> None:
        """The device went away with its work (offline, restarted): it is given the round's work again when back."""
        work = self.out.pop(device, None)
        if work is not None:
            self.last[device] = work.round - 1
        self.changed = True

    def overdue(self) -> list[str]:
        """Devices silent past the wall-clock safeguard with their work: given up on (`lost`) and returned."""
        now = time.monotonic()
        if now < self._look_after:  # asked after every message: the work out is read only once one may be late
            return []
        late = [d for d, work in self.out.items() if work.wall_deadline < now]
        for device in late:
            self.lost(device)
        self._look_after = min((work.wall_deadline for work in self.out.values()), default=math.inf)
        return late

    def next_done(self, before_s: float = math.inf) -> Done | None:
        """The finished work to take next, ending before `before_s` on the fleet's clock; in virtual time none while
        work is out (it may end earlier). Taking it moves the fleet's clock to its end."""
        if not self._done or (self.virtual and self.out) or self._done[0].at_s >= before_s:
            return None
        done = heapq.heappop(self._done)
        self.clock_s = max(self.clock_s, done.at_s)
        self._ending.discard(done.device)
        self.changed = True
        return done

    def past(self, deadline_s: float) -> bool:
        """Whether the fleet's clock is past `deadline_s`: on the wall clock, now; in virtual time, once no work is out
        and the earliest ended work ends at or after it (the clock then stands at the deadline)."""
        if not self.virtual:
            return self.now_s() >= deadline_s
        if self.out or (self._done and self._done[0].at_s < deadline_s):
            return False
        self.clock_s = max(self.clock_s, deadline_s)
        return True

    def now_s(self) -> float:
        """The fleet's clock now: the last taken work's end (virtual time), or the wall seconds of the run."""
        return self.clock_s if self.virtual else time.monotonic() - self._wall_zero

    @property
    def idle(self) -> bool:
        """No work out and none finished untaken: the open round gets nothing more unless work is given."""
        return not self.out and not self._done

    def taken(self, device: str, round_: int) -> None:
        """The device's update went into round `round_`'s buffer: it trains again once the model has moved."""
        self.last[device] = max(self.last.get(device, 0), round_)


def asynchronous_refused(strategy: Strategy, secure: bool, central_dp: bool, shares: bool) -> str | None:
    """Why a run cannot be asynchronous (one line), or None: what needs every device on one model, or the round's
    updates in one place at one close."""
    if strategy.reads_more:
        return (f"the {strategy.name} rule reads more of an update than its weights (personalised models, "
                f"attachments), which needs every device on one model: set [asynchronous] mode = \"off\"")
    if secure or central_dp:
        return "secure aggregation and central DP count a round's devices as one cohort: set [asynchronous] mode = " \
               "\"off\""
    if shares:
        return "inbox workers and sites fold a round's updates apart, not in the order their work ended: set " \
               "[asynchronous] mode = \"off\""
    return None
