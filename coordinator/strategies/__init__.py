"""Aggregation rules by name: the coordinator builds its strategy from the configuration's name and options."""
from __future__ import annotations

from typing import Any

import torch

from coordinator.strategies.base import AggregateResult, ClientUpdate, Strategy, validate_updates, weighted_mean
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedprox import FedProx

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg, FedProx)}


def make_strategy(name: str, device: torch.device | str = "auto", **options: Any) -> Strategy:
    """The strategy registered as `name`, built with `options` (e.g. mu=0.1 for fedprox)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name](device=device, **options)


__all__ = ["STRATEGIES", "AggregateResult", "ClientUpdate", "FedAvg", "FedProx", "Strategy", "make_strategy",
           "validate_updates", "weighted_mean"]
