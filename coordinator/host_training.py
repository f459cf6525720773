"""A task the host learns itself: the coordinator trains the global model on data it holds, as one round.

A few-shot scenario's base session is large and centralised (the paper trains it on the server before any
client takes part). Its data reach the coordinator through its test sets (`TestSets.host_train`: a simulated
scenario's host-trained task, or `host-train-<t>.npz` in a deployment's test folder); for such a task no device is
selected: the coordinator trains the global model with torch on its own device (cuda when present), for `epochs`
of SGD with momentum, the rate divided by 10 at 60 % and 70 % of them (the paper's base schedule, 100 epochs
with steps at 60 and 70), and the result enters the round's aggregation as the update of "host", trusted (the
guard bounds what devices send, not the coordinator's own work). The rule then sees one update, as in any round,
and does what it does at a task's end (a generator's replay set for the base classes, say).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from models.manifest import Manifest

if TYPE_CHECKING:
    import torch

HOST = "host"  # the update's device name in the round's history


@dataclass(frozen=True)
class HostTraining:
    """`[host]`: epochs, lr, momentum, batch_size, seed (the batches' order)."""

    epochs: int = 20
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or not (math.isfinite(self.lr) and self.lr > 0) \
                or not 0 <= self.momentum < 1:
            raise ValueError("[host] epochs and batch_size must be >= 1, lr > 0 and momentum in [0, 1)")

    def train(self, manifest: Manifest, weights: np.ndarray, x: np.ndarray, y: np.ndarray,
              classes: tuple[int, ...], device: torch.device | Any) -> np.ndarray:
        """The global model trained on (x, y) with the classes seen so far visible; flat float32 weights. torch is
        imported here, not with the module: the coordinator file's `[host]` is checked before heavy imports."""
        import torch
        from torch.nn import functional as F

        from models.flat_weights import flatten_weights, load_flat_weights
        from models.zoo import build_for

        model = build_for(manifest)
        load_flat_weights(model, manifest, np.asarray(weights, dtype=np.float32))
        model = model.to(device).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)
        steps = [round(0.6 * self.epochs), round(0.7 * self.epochs)]
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, steps, gamma=0.1)
        mask = torch.zeros(manifest.num_classes, device=device)
        mask[list(classes)] = 1.0
        inputs, labels = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        order = np.random.default_rng(self.seed)
        for _ in range(self.epochs):
            permutation = torch.from_numpy(order.permutation(len(y))).to(device)
            for start in range(0, len(y), self.batch_size):
                batch = permutation[start:start + self.batch_size]
                loss = F.cross_entropy(model(inputs[batch], mask)[0], labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            schedule.step()
        return flatten_weights(model.cpu(), manifest)
