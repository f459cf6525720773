"""Where a learning method's failures stop: every call the coordinator makes into a strategy goes through here.

A strategy is a method's code running on data that devices chose: its attachments, its answers to requests. Nothing
it does, on its own or provoked by one device, may raise out of the coordinator's loop, or every `--resume` meets
the same update again and dies at the same round. So each call is contained, and each failure is turned into the
smallest loss that keeps the run going, counted under a reason and logged in one line:

- `inspect(update)`, `Fold.add(update)`: the update cannot be used. It is refused alone, counted under the
  `RefusedUpdate`'s reason, or `method-error` for anything else; a fold must refuse before it changes anything.
- `aggregate`, `Fold.result`: the rule failed on the round. There is no result: the previous global model stays and
  the round counts (`rule-failed`).
- `AggregateResult.refused`: the rule could not use one update's payloads and went on without them (counted under
  the reason it gives).
- `configure`, `answer`: the method cannot say anything this time: the device gets no method options, or an empty
  answer (`method-error`).
- `save`, `load`: the method's state is not written, or not read back; the run goes on, and the method starts from
  nothing on a resume (`method-error`).

A `Fold.add` that raises anything but a refusal (`RefusedUpdate`, or `ValueError` from `check_update`, which the
base class raises before `_add`) leaves its running aggregate in doubt: the fold is marked spoiled and the round
falls back as if the rule had failed on it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from coordinator.privacy import Release
from coordinator.strategies import AggregateResult, ClientUpdate, Fold, RefusedUpdate, RoundContext, Strategy
from coordinator.strategies.base import Pending

log = logging.getLogger("edgefil.coordinator")
RULE_FAILED = "rule-failed"  # the rule raised on a whole round: the previous global model stays
METHOD_ERROR = "method-error"  # a method's call raised something other than a refusal


def _settle(pending: Pending, wait: Callable[[float], None] | None) -> AggregateResult:
    result = pending.settle(wait)
    if result is None:
        raise RuntimeError(f"its pending round failed or was not done within {pending.wait_s:g} s")
    return result


def _described(err: BaseException) -> str:
    return f"{type(err).__name__}: {err!s:.200}"


class ContainedStrategy:
    """A strategy with every call contained (module docstring); `counters` are the run's."""

    def __init__(self, strategy: Strategy, counters: Counter[str]) -> None:
        self.strategy = strategy
        self.counters = counters

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def weighs_by_samples(self) -> bool:
        return self.strategy.weighs_by_samples

    def extra_releases(self, ctx: RoundContext) -> tuple[Release, ...]:
        """The rule's further DP mechanisms of round `ctx`; none where it cannot say (then it may run none: an
        undeclared one is refused, `RoundPrivacy`)."""
        try:
            return tuple(self.strategy.extra_releases(ctx))
        except Exception as err:
            self._count(RULE_FAILED, f"round {ctx.round}: the {self.name} rule could not declare its DP mechanisms",
                        err)
            return ()

    def _count(self, reason: str, what: str, err: BaseException) -> str:
        self.counters[reason] += 1
        log.warning("%s (%s): %s", what, reason, _described(err))
        log.debug("the %s rule raised", self.name, exc_info=err)
        return reason

    def _refusal(self, update: ClientUpdate, err: Exception) -> str:
        reason = err.reason if isinstance(err, RefusedUpdate) else METHOD_ERROR
        return self._count(reason, f"the {self.name} rule refused the update of {update.device}", err)

    def inspect(self, update: ClientUpdate) -> str | None:
        """None when the rule takes the update, else why it does not (counted and logged)."""
        try:
            self.strategy.inspect(update)
        except Exception as err:
            return self._refusal(update, err)
        return None

    def fold(self, global_weights: torch.Tensor) -> Fold | None:
        """The rule's running aggregate, or None (it holds the round); a rule whose `fold` raises holds it too."""
        try:
            return self.strategy.fold(global_weights)
        except Exception as err:
            self._count(METHOD_ERROR, f"the {self.name} rule could not start a running aggregate", err)
            return None

    def add(self, fold: Fold, update: ClientUpdate) -> tuple[str | None, bool]:
        """Fold one update in: (why it was refused or None, whether the fold is still sound)."""
        try:
            fold.add(update)
        except (RefusedUpdate, ValueError) as err:
            return self._refusal(update, err), True
        except Exception as err:
            return self._refusal(update, err), False
        return None, True

    def result(self, fold: Fold, number: int) -> AggregateResult | None:
        result = self._round(number, fold.result)
        return None if isinstance(result, Pending) else result

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate], ctx: RoundContext,
                  wait: Callable[[float], None] | None = None) -> AggregateResult | None:
        """The rule's result for the round; a `Pending` one is settled while `wait(seconds)` serves the devices."""
        result = self._round(ctx.round, lambda: self.strategy.aggregate(global_weights, updates, ctx))
        if isinstance(result, Pending):
            pending = result
            result = self._round(ctx.round, lambda: _settle(pending, wait))
        if isinstance(result, Pending):
            return None
        return result

    def _round(self, number: int, compute: Any) -> AggregateResult | Pending | None:
        """The rule's result for round `number`, its per-update refusals counted; None when it failed on the round."""
        try:
            result: AggregateResult | Pending = compute()
        except Exception as err:
            self._count(RULE_FAILED, f"round {number}: the {self.name} rule failed; the previous model stays", err)
            return None
        if isinstance(result, Pending):
            return result
        for device, reason in sorted(result.refused.items()):
            self.counters[reason] += 1
            log.warning("round %d: the %s rule could not use the payloads of %s (%s)", number, self.name, device,
                        reason)
        return result

    def configure(self, ctx: RoundContext, device: str) -> dict[str, Any]:
        """The method's instructions for one device's round message; none when it cannot give them."""
        try:
            return dict(self.strategy.configure(ctx, [device]).get(device, {}))
        except Exception as err:
            self._count(METHOD_ERROR, f"the {self.name} rule could not configure {device}'s round {ctx.round}", err)
            return {}

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        """The named payloads the method gives for a device's request; none when it cannot."""
        try:
            return dict(self.strategy.answer(device, names))
        except Exception as err:
            self._count(METHOD_ERROR, f"the {self.name} rule could not answer {device}", err)
            return {}

    def save(self, directory: Path) -> None:
        try:
            self.strategy.save(directory)
        except Exception as err:
            self._count(METHOD_ERROR, f"the {self.name} rule's state was not saved in {directory}", err)

    def load(self, directory: Path) -> None:
        try:
            self.strategy.load(directory)
        except Exception as err:
            self._count(METHOD_ERROR, f"the {self.name} rule's state in {directory} was not read back", err)
