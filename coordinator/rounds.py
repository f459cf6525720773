"""Rounds: who is selected, what counts as a valid update for the open round, and when the round closes.

Choices (configurable in the coordinator config, documented in docs/protocol.md):
- Selection draws ceil(r * available) devices (at least the quorum, at most all available) with the run's seeded
  generator, so a resumed run draws as the original would have.
- A round closes when every selected device has delivered (or went offline), or at its deadline. Updates that
  arrive after the close are logged as late and dropped.
- A round here is one attempt: what it accepted goes on into the round's aggregation (coordinator/aggregation.py)
  at once, and it keeps only who delivered. A later attempt of the same round starts with those deliveries: they
  answer the same global model, and count towards its quorum whether or not their devices are selected again.
- In virtual time (simulated fleets), an update whose reported `device_seconds` (download + compute + upload on
  the emulated device) exceed the deadline is late too, however fast the host delivered it; and however slowly the
  host delivers it, it is not late: the round waits for every selected device (up to `wall_limit_s` of wall time, a
  safeguard), so which devices a round aggregates does not depend on the host's speed.
- A round with fewer updates than the quorum is not aggregated; it is run again (new selection) up to
  `max_attempts` times, after which the run stops with an error rather than go on with a stale model.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from coordinator.inbox import Update
from coordinator.secagg import Advertised

# why `OpenRound.offer` refuses an update: the round's own reasons, none of them a fault of the update's content
# ("between-rounds": none was open, which only an inbox worker says)
ROUND_REFUSALS = frozenset({"late", "wrong-round", "not-selected", "duplicate", "wrong-task", "between-rounds"})


def select(available: list[str], fraction: float, quorum: int, rng: np.random.Generator) -> list[str]:
    """ceil(fraction * |available|) devices, at least `quorum` (when that many are available), sorted: the names
    `available` holds, not copies (numpy's choice over the names made new strings each round, which a round's
    history entry kept: about 40 bytes a device a round); the same draw as that choice."""
    if not available:
        return []
    pool = sorted(available)
    k = min(len(pool), max(quorum, math.ceil(fraction * len(pool))))
    return sorted(pool[i] for i in rng.choice(len(pool), size=k, replace=False))


@dataclass
class OpenRound:
    """The round being collected: its identity, selection, deadline and the devices whose updates it accepted.

    The round keeps the selected devices it still waits for (`waiting`) as they answer, so `complete` and
    `awaits` cost the same at 10 devices as at 10,000: the coordinator asks after every message it handles, and
    recomputing from the selection made a round's messages cost O(N^2)."""

    number: int
    task: int
    model: str  # id (wire.blob_id) of the global weights the devices must start from
    selected: list[str]
    deadline: float  # time.monotonic() value
    virtual_deadline_s: float | None = None  # virtual time: the deadline in the devices' own seconds
    delivered: set[str] = field(default_factory=set)  # devices whose update was accepted (this or an earlier attempt)
    too_slow: set[str] = field(default_factory=set)  # answered, but past the deadline in device time
    gone: set[str] = field(default_factory=set)  # went offline before delivering: the round does not wait
    failed: dict[str, str] = field(default_factory=dict)  # said it cannot train this round, and why
    # of those, the ones that sit the round out as expected (away on their schedule, no data yet): not a problem
    sitting_out: set[str] = field(default_factory=set)
    waiting: set[str] = field(init=False)  # selected, and none of the above: what the round waits for

    def __post_init__(self) -> None:
        # each selected device's name as selected: what `delivered` keeps, so that a round's entry names its devices
        # with the strings the roster holds, not with one made from each update's topic
        self._chosen = {device: device for device in self.selected}
        self.waiting = set(self._chosen) - self.delivered - self.too_slow - self.gone - set(self.failed)

    @classmethod
    def open(
        cls, number: int, task: int, model: str, selected: list[str], deadline_s: float, virtual: bool = False,
        wall_limit_s: float | None = None,
    ) -> OpenRound:
        """In virtual time the deadline counts the devices' own seconds, and the wall clock closes the round only at
        `wall_limit_s` (a safeguard for a hung device; the deadline where none is given)."""
        wall = wall_limit_s if virtual and wall_limit_s is not None else deadline_s
        return cls(number, task, model, selected, time.monotonic() + wall, deadline_s if virtual else None)

    @property
    def complete(self) -> bool:
        """Every selected device has answered, failed or gone (one too slow in device time has answered too)."""
        return not self.waiting

    def awaits(self, device: str) -> bool:
        """Selected and not delivered (gone or failed included): a device whose return the round would take."""
        return device in self._chosen and device not in self.delivered

    def carry_over(self, delivered: set[str]) -> None:
        """Deliveries of the round's earlier attempt: they answer the same model, and count here."""
        self.delivered |= delivered
        self.waiting -= delivered

    def went_offline(self, device: str) -> None:
        if self.awaits(device):
            self.gone.add(device)
            self.waiting.discard(device)

    def came_back(self, device: str) -> bool:
        """A device is online again: if it had gone, the round waits for it once more (True)."""
        if device not in self.gone:
            return False
        self.gone.discard(device)
        if device not in self.too_slow and device not in self.failed:
            self.waiting.add(device)
        return True

    def failed_with(self, device: str, error: str, expected: bool = False) -> None:
        """The round does not wait for `device`, which said why; `expected`: it sits the round out as its
        surroundings say it will (away on its schedule, no data for the task yet), which is no fault."""
        if self.awaits(device):
            self.failed[device] = error
            self.waiting.discard(device)
            if expected:
                self.sitting_out.add(device)

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def missing(self) -> list[str]:
        return [d for d in self.selected if d not in self.delivered]

    def _too_slow(self, update: Update | Advertised) -> bool:
        limit = self.virtual_deadline_s
        return limit is not None and update.metrics.get("device_seconds", 0.0) > limit

    def offer(self, update: Update | Advertised, counts: Counter[str]) -> str | None:
        """Accept an update for this round (the caller passes it on to the round's aggregation); otherwise return
        why not (and count it under that reason)."""
        reason = None
        if update.round < self.number:
            reason = "late"
        elif update.round > self.number or update.model != self.model:
            reason = "wrong-round"
        elif update.device not in self._chosen:  # a dict: a list made a round of N updates cost O(N^2)
            reason = "not-selected"
        elif update.device in self.delivered:
            reason = "duplicate"
        elif update.task != self.task:
            reason = "wrong-task"
        elif self._too_slow(update):
            reason = "late"
            self.too_slow.add(update.device)
            self.waiting.discard(update.device)
        if reason is None:
            self.delivered.add(self._chosen[update.device])
            self.gone.discard(update.device)  # it came back in time after all
            self.waiting.discard(update.device)
        else:
            counts[reason] += 1
        return reason
