"""Per-device rate limits: what one device's messages can make the coordinator do, whatever it sends.

Three things a device's message triggers cost the coordinator more than reading it (`[limits]` in the coordinator
file):

- a **registration** is handled in full (and, for a device selected in the open round that has not delivered, the
  round's weights go to it again): at most `registrations_per_minute` per device, in bursts of as many;
- a **request** is answered with payloads that may be large: at most `requests_per_minute` per device, in bursts
  of as many;
- a **resend** of the round's weights and message to one device (after it re-registers or comes back online):
  at most `resends_per_round` per device and round, however it asks.

Refused registrations and requests are counted as `rate` at the gate, resends that are not made as
`resend-limited`. An honest device registers once per connection and asks once or twice per round, so the defaults
are far above what it needs and far below what amplifies: without them, each 500-byte registration made the
coordinator send the whole model again. The rates are per device, so one device's flood never uses up another's.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RateLimits:
    """`[limits]`: the rates above (0 turns one off)."""

    registrations_per_minute: float = 6.0
    requests_per_minute: float = 30.0
    resends_per_round: int = 3

    def __post_init__(self) -> None:
        if self.registrations_per_minute < 0 or self.requests_per_minute < 0 or self.resends_per_round < 0:
            raise ValueError("[limits] rates must be >= 0 (0: no limit)")


@dataclass
class TokenBuckets:
    """One token bucket per key: `per_minute` tokens refill evenly, at most `per_minute` (>= 1) are saved up, each
    allowed event takes one. `per_minute = 0` allows everything."""

    per_minute: float
    clock: Callable[[], float] = time.monotonic
    _tokens: dict[str, float] = field(default_factory=dict)
    _at: dict[str, float] = field(default_factory=dict)

    def allow(self, key: str) -> bool:
        if not self.per_minute:
            return True
        now, capacity = self.clock(), max(self.per_minute, 1.0)
        saved = self._tokens.get(key, capacity) + (now - self._at.get(key, now)) * self.per_minute / 60.0
        self._at[key] = now
        if saved < 1.0:
            self._tokens[key] = saved
            return False
        self._tokens[key] = min(saved, capacity) - 1.0
        return True


@dataclass
class ResendBudget:
    """Resends per (device, round): the round's number resets it."""

    per_round: int
    _round: int = -1
    _made: Counter[str] = field(default_factory=Counter)

    def allow(self, device: str, round_: int) -> bool:
        if round_ != self._round:
            self._round, self._made = round_, Counter()
        if self.per_round and self._made[device] >= self.per_round:
            return False
        self._made[device] += 1
        return True
