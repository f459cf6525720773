"""Running medians of what a round's updates measure: the bounds of coordinator/guard.py and
coordinator/influence.py are relative to them, and a stream asks them after every update."""
from __future__ import annotations

from bisect import insort
from collections.abc import Sequence


class RunningMedian:
    """The median of the values added so far, None when there is none; kept sorted as they come."""

    def __init__(self, values: Sequence[float] = ()) -> None:
        self.values: list[float] = sorted(float(v) for v in values if self.counts(v))

    @staticmethod
    def counts(value: float) -> bool:
        return True

    def add(self, value: float) -> None:
        if self.counts(value):
            insort(self.values, float(value))

    def value(self) -> float | None:
        n = len(self.values)
        if not n:
            return None
        middle = n // 2
        return self.values[middle] if n % 2 else (self.values[middle - 1] + self.values[middle]) / 2

    def lower(self) -> float | None:
        """The lower of the two middle values (the middle one of an odd count): with two, never the larger."""
        return self.values[(len(self.values) - 1) // 2] if self.values else None

    def below_top(self, share: float) -> float | None:
        """The value ranked just past the top `share` of the values (the (f+1)-th largest, f = share x n rounded
        down), None when there is none."""
        n = len(self.values)
        return self.values[n - 1 - int(share * n)] if n else None


class RunningTypical(RunningMedian):
    """The median of the values above 0 added so far (the updates that carry something)."""

    @staticmethod
    def counts(value: float) -> bool:
        return value > 0


def typical(values: Sequence[float]) -> float | None:
    """The median of the values above 0 (the updates that carry something), None when there is none."""
    return RunningTypical(values).value()
