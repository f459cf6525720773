"""FedProx (Li et al. 2020): devices add the proximal term mu/2 ||w - w_global||^2 to their local objective.

The term lives on the devices (edge_client's `Proximal`); the server only tells them mu each round and
aggregates as FedAvg does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from coordinator.strategies.base import RoundContext
from coordinator.strategies.fedavg import FedAvg
from models.manifest import Manifest


class FedProx(FedAvg):
    name = "fedprox"

    def __init__(
        self, mu: float = 0.01, weighted: bool = True, device: torch.device | str = "auto",
        manifest: Manifest | None = None,
    ) -> None:
        if not (math.isfinite(mu) and mu >= 0):
            raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
        super().__init__(weighted=weighted, device=device, manifest=manifest)
        self.mu = float(mu)

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        return {device: {"mu": self.mu} for device in devices}
