"""The Strategy interface: one class per aggregation rule, the arithmetic in small pure functions.

A strategy turns the round's device updates into the next global model (`aggregate`) and may add per-device
instructions to the round-start message (`configure`, e.g. FedProx's mu). Weights are one flat float32 buffer per
model in manifest order, as the devices send them; aggregation runs in torch on the strategy's device.

Personalized and class-wise rules (pFedGRP, GLFC-like) plug in through the same interface: they return per-device
models in `AggregateResult.personalized` next to the global one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch

from coordinator.compute import as_tensor, resolve_device


@dataclass(frozen=True)
class ClientUpdate:
    """One device's result of a round. `weights` may be a read-only view of the network payload."""

    device: str
    weights: np.ndarray
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    label_counts: Sequence[int] = ()  # samples the device has seen per class (generator replay reports them)
    generators: Mapping[int, Any] = field(default_factory=dict)  # class -> GeneratorRecord uploaded this round


@dataclass
class AggregateResult:
    global_weights: torch.Tensor
    personalized: dict[str, torch.Tensor] = field(default_factory=dict)


class Strategy(ABC):
    name: ClassVar[str]
    needs_manifest: ClassVar[bool] = False  # built with the model's manifest (rules that evaluate models)

    def __init__(self, device: torch.device | str = "auto") -> None:
        self.device = resolve_device(str(device))

    def cached_generators(self, classes: Sequence[int]) -> dict[int, bytes]:
        """Encoded generators the rule holds for these classes (answers a device's request); none by default."""
        return {}

    def save(self, directory: Path) -> None:
        """Write what the rule keeps across rounds beside the run's checkpoint (nothing by default)."""

    def load(self, directory: Path) -> None:
        """Read back what `save` wrote (a resumed run)."""

    def configure(self, round: int, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per-device instructions added to each round-start message (e.g. {"mu": 0.01}); default: {} for each."""
        return {device: {} for device in devices}

    @abstractmethod
    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> AggregateResult:
        """The next global model (on self.device) from this round's updates; implementations call
        validate_updates first."""


def validate_updates(global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> None:
    """Refuse a round no rule can aggregate: no updates, a weight buffer of the wrong dtype or length (or not
    contiguous), a negative sample count, or one device reporting twice. Checks metadata only, never the weights."""
    if global_weights.ndim != 1 or global_weights.dtype != torch.float32:
        raise ValueError(f"global weights must be a flat float32 tensor, got shape {tuple(global_weights.shape)} "
                         f"and dtype {global_weights.dtype}")
    if not updates:
        raise ValueError("no updates to aggregate")
    size = global_weights.numel()
    seen: set[str] = set()
    for update in updates:
        w = update.weights
        if w.ndim != 1 or w.dtype != np.float32 or w.size != size or not w.flags.c_contiguous:
            raise ValueError(f"update from {update.device!r}: expected {size} contiguous float32 weights, got shape "
                             f"{w.shape}, dtype {w.dtype}, strides {w.strides}")
        if isinstance(update.num_samples, bool) or not isinstance(update.num_samples, (int, np.integer)) \
                or update.num_samples < 0:
            raise ValueError(f"update from {update.device!r}: num_samples must be an int >= 0, "
                             f"got {update.num_samples!r}")
        if update.device in seen:
            raise ValueError(f"device {update.device!r} sent more than one update this round")
        seen.add(update.device)


def weighted_mean(updates: Sequence[np.ndarray], coefficients: Sequence[float], device: torch.device) -> torch.Tensor:
    """sum_k c_k * u_k as a new float32 tensor on `device` (never a view of an update, even for one update); the
    caller normalises the coefficients.

    Updates are folded one at a time into a single accumulator, so memory stays at one model whatever the number of
    clients, and on the CPU every update is read once, in place (no stacking, no copy). On a GPU each update is
    copied to the device once, just before it is folded.
    """
    if not updates or len(updates) != len(coefficients):
        raise ValueError(f"need one coefficient per update and at least one update, got {len(updates)} updates "
                         f"and {len(coefficients)} coefficients")
    size = updates[0].size
    if any(u.size != size for u in updates):
        raise ValueError("updates differ in length")
    acc = torch.empty(size, dtype=torch.float32, device=device)
    torch.mul(as_tensor(updates[0], device), float(coefficients[0]), out=acc)
    for update, c in zip(updates[1:], coefficients[1:]):
        acc.add_(as_tensor(update, device), alpha=float(c))
    return acc
