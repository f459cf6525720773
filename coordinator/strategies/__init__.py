"""Aggregation rules by name: the coordinator builds its strategy from the configuration's name and options."""
from __future__ import annotations

from typing import Any

import torch

from coordinator.strategies.base import AggregateResult, ClientUpdate, Strategy, validate_updates, weighted_mean
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedprox import FedProx
from coordinator.strategies.pfedgrp import PFedGRP
from models.manifest import Manifest

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg, FedProx, PFedGRP)}


def make_strategy(
    name: str, device: torch.device | str = "auto", manifest: Manifest | None = None, **options: Any
) -> Strategy:
    """The strategy registered as `name`, built with `options` (e.g. mu=0.1 for fedprox); rules that evaluate
    models (pfedgrp) also get the model's `manifest`."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    cls = STRATEGIES[name]
    if cls.needs_manifest:
        if manifest is None:
            raise ValueError(f"strategy {name!r} needs the model's manifest")
        return cls(manifest, device=device, **options)
    return cls(device=device, **options)


__all__ = ["STRATEGIES", "AggregateResult", "ClientUpdate", "FedAvg", "FedProx", "PFedGRP", "Strategy", "make_strategy",
           "validate_updates", "weighted_mean"]
