"""Aggregation rules (the coordinator halves of learning methods) by name: the coordinator builds its strategy from
the configuration's name and options. Every module here is imported once and each `Strategy` subclass with a
`name` registers itself, so a new rule adds a file and touches nothing else."""
from __future__ import annotations

from typing import Any

import torch

from coordinator.strategies.base import (
    STRATEGIES,
    AggregateResult,
    ClientUpdate,
    RefusedUpdate,
    Strategy,
    validate_updates,
    weighted_mean,
)
from edgefil.registry import import_submodules
from models.manifest import Manifest

import_submodules(__name__, __path__)


def strategy_names() -> list[str]:
    return STRATEGIES.names()


def make_strategy(
    name: str, device: torch.device | str = "auto", manifest: Manifest | None = None, **options: Any
) -> Strategy:
    """The strategy registered as `name`, built with `options` (e.g. mu=0.1 for fedprox), the torch device and the
    model's manifest (rules that run models need it)."""
    return STRATEGIES.get(name)(device=device, manifest=manifest, **options)


__all__ = ["AggregateResult", "ClientUpdate", "RefusedUpdate", "Strategy", "make_strategy", "strategy_names",
           "validate_updates", "weighted_mean"]
