"""FedAvg (McMahan et al. 2017): the global model is the sample-weighted mean of the device models.

Unweighted (1/|S| per device) is Re-Fed's server rule. When every device reports zero samples, the weighted rule
has no weights to use and falls back to the unweighted mean rather than refusing the round.

The mean is a running sum (`WeightedFold`): the coordinator adds each update as it arrives and lets it go, so a
round of 1000 devices costs the memory of one model, not of 1000.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from coordinator.compute import RunningSum
from coordinator.privacy import BuiltFrom
from coordinator.strategies.base import (
    OUTSIDE_A_RUN,
    AggregateResult,
    ClientUpdate,
    Fold,
    RoundContext,
    Strategy,
    aggregate_by_folding,
)
from models.manifest import Manifest


class WeightedFold(Fold):
    """sum_k c_k w_k / sum_k c_k, with c_k = n_k (weighted, once some n_k > 0) or 1 (unweighted, or while every
    count so far is 0: the plain mean, replaced by the weighted sum at the first update with samples).

    The sum is one float64 total on the strategy's device (`RunningSum`), so the result does not depend (to float32
    precision) on the order the updates arrive in: two runs of one configuration aggregate alike however the
    network ordered their updates, and a float32 sum of 1000 updates loses no digits.
    """

    def __init__(self, global_weights: torch.Tensor, weighted: bool, device: torch.device) -> None:
        super().__init__(global_weights)
        self.weighted = weighted
        self.sum = RunningSum(self.size, device)
        self.coefficients = 0.0  # sum of the c_k in `sum`
        self.by_samples = False  # whether `sum` is the sample-weighted sum

    def _add(self, update: ClientUpdate) -> None:
        n = int(update.num_samples)
        if self.weighted and n > 0:
            if not self.by_samples:  # the plain mean of sample-less updates so far gives way
                self.sum.clear()
                self.coefficients, self.by_samples = 0.0, True
            coefficient = float(n)
        elif self.by_samples:
            return  # no samples: no weight
        else:
            coefficient = 1.0
        self.sum.add(update.weights, coefficient)
        self.coefficients += coefficient

    def _result(self) -> AggregateResult:
        return AggregateResult(self.sum.divided(self.coefficients))

    def _partial(self) -> dict[str, Any]:
        return {"sum": self.sum.values(), "coefficients": self.coefficients, "by_samples": self.by_samples}

    def _merge(self, state: Mapping[str, Any]) -> None:
        """Another fold's sum, under `_add`'s rule: a sample-weighted part replaces a plain mean of sample-less
        updates here, and a plain part adds nothing to a sample-weighted sum."""
        if state["by_samples"] and not self.by_samples:
            self.sum.clear()
            self.coefficients, self.by_samples = 0.0, True
        elif self.by_samples and not state["by_samples"]:
            return
        self.sum.add_wide(np.asarray(state["sum"], dtype=np.float64))
        self.coefficients += float(state["coefficients"])


class FedAvg(Strategy):
    name = "fedavg"
    built_from = BuiltFrom.MEAN  # a subclass that reads attachments or aggregates otherwise says so
    reads_more = False

    def __init__(
        self, weighted: bool = True, device: torch.device | str = "auto", manifest: Manifest | None = None
    ) -> None:
        super().__init__(device, manifest)
        self.weighted = weighted

    @property
    def weighs_by_samples(self) -> bool:
        return self.weighted

    def fold(self, global_weights: torch.Tensor) -> WeightedFold | None:
        """The running mean; None for a subclass that overrides `aggregate` (a method built on FedAvg that reads
        the round's attachments or gives payloads): its `aggregate` must see the whole round, so it holds it."""
        if type(self).aggregate is not FedAvg.aggregate:
            return None
        return WeightedFold(global_weights, self.weighted, self.device)

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        return aggregate_by_folding(WeightedFold(global_weights, self.weighted, self.device), updates)
