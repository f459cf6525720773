"""The per-device rates (coordinator/limits.py) against a clock the test moves."""
from __future__ import annotations

import pytest

from coordinator.limits import RateLimits, ResendBudget, TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_burst_then_its_rate_per_key():
    clock = Clock()
    buckets = TokenBuckets(6.0, clock)
    assert [buckets.allow("a") for _ in range(8)] == [True] * 6 + [False] * 2
    assert buckets.allow("b")  # another device's bucket is full
    clock.now += 10.0  # one token (6 a minute)
    assert buckets.allow("a") and not buckets.allow("a")
    clock.now += 3600.0  # saved up to the burst, no more
    assert sum(buckets.allow("a") for _ in range(10)) == 6


def test_refused_attempts_do_not_postpone_the_refill():
    clock = Clock()
    buckets = TokenBuckets(60.0, clock)
    for _ in range(60):
        buckets.allow("a")
    for _ in range(1000):  # a flood while empty
        clock.now += 0.0005
        buckets.allow("a")
    clock.now += 0.5  # 1.0 s since it emptied: one token back
    assert buckets.allow("a")


def test_zero_turns_a_limit_off_and_resends_are_counted_per_round():
    assert all(TokenBuckets(0.0).allow("a") for _ in range(1000))
    budget = ResendBudget(2)
    assert [budget.allow("a", 5) for _ in range(3)] == [True, True, False]
    assert budget.allow("b", 5)
    assert budget.allow("a", 6)  # a new round
    assert all(ResendBudget(0).allow("a", 1) for _ in range(100))
    with pytest.raises(ValueError):
        RateLimits(requests_per_minute=-1)
