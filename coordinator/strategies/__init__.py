"""Aggregation rules (the coordinator halves of learning methods) by name: the coordinator builds its strategy from
the configuration's name and options. Every module here is imported once and each `Strategy` subclass with a
`name` registers itself, so a new rule adds a file and touches nothing else."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch

from coordinator.strategies.base import (
    AggregateResult, ClientUpdate, RefusedUpdate, Strategy, registered_strategies, validate_updates, weighted_mean,
)
from models.manifest import Manifest

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def strategy_names() -> list[str]:
    return sorted(registered_strategies())


def make_strategy(
    name: str, device: torch.device | str = "auto", manifest: Manifest | None = None, **options: Any
) -> Strategy:
    """The strategy registered as `name`, built with `options` (e.g. mu=0.1 for fedprox), the torch device and the
    model's manifest (rules that run models need it)."""
    strategies = registered_strategies()
    if name not in strategies:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(strategy_names())}")
    return strategies[name](device=device, manifest=manifest, **options)


__all__ = ["AggregateResult", "ClientUpdate", "RefusedUpdate", "Strategy", "make_strategy", "strategy_names",
           "validate_updates", "weighted_mean"]
