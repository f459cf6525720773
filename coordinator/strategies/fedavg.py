"""FedAvg (McMahan et al. 2017): the global model is the sample-weighted mean of the device models.

Unweighted (1/|S| per device) is Re-Fed's server rule. When every device reports zero samples, the weighted rule
has no weights to use and falls back to the unweighted mean rather than refusing the round.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from coordinator.strategies.base import AggregateResult, ClientUpdate, Strategy, validate_updates, weighted_mean
from models.manifest import Manifest


def fedavg_coefficients(num_samples: Sequence[int], weighted: bool) -> list[float]:
    """n_k / sum(n) when weighted and some n_k > 0, else 1 / len(num_samples); computed in float64."""
    total = sum(int(n) for n in num_samples)
    if weighted and total > 0:
        return [int(n) / total for n in num_samples]
    return [1.0 / len(num_samples)] * len(num_samples)


class FedAvg(Strategy):
    name = "fedavg"

    def __init__(
        self, weighted: bool = True, device: torch.device | str = "auto", manifest: Manifest | None = None
    ) -> None:
        super().__init__(device, manifest)
        self.weighted = weighted

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> AggregateResult:
        validate_updates(global_weights, updates)
        coefficients = fedavg_coefficients([u.num_samples for u in updates], self.weighted)
        return AggregateResult(weighted_mean([u.weights for u in updates], coefficients, self.device))
