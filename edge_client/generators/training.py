"""Training one class's generator: the interface both backends implement, numpy only (which backend trains, and
building its trainer: edge_client/generators/choice.py).

`train` warm-starts from a stored record (its sampler, and its auxiliary model when kept, else a fresh one) or
starts from scratch, and returns the new flat buffers (`flatten_module` order). Optimizer state does not survive
a call: each class's training starts with fresh moments.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from models.generator_record import GeneratorRecord


class GeneratorTrainer(ABC):
    """Trains class generators of one spec. `losses` holds the per-step losses of the last `train` call (the VAE
    loss; the critic loss for WGAN-GP)."""

    spec: dict[str, Any]
    sampler_size: int
    auxiliary_size: int

    def __init__(self) -> None:
        self.losses: list[float] = []

    def train(self, x: np.ndarray, init: GeneratorRecord | None, steps: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        """Train on one class's samples x (N, *input_shape) for `steps` optimisation steps of the generator."""
        shape = tuple(self.spec["input_shape"])
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape[1:] != shape or len(x) == 0:
            raise ValueError(f"expected float32 samples of shape (N>0, {', '.join(map(str, shape))}), got "
                             f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
        if not np.isfinite(x).all():
            raise ValueError("the samples hold NaN or Inf")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, not {steps}")
        sampler = auxiliary = None
        if init is not None:
            if init.spec != self.spec:
                raise ValueError(f"the initial generator's spec {init.spec} is not this trainer's {self.spec}")
            if init.sampler.shape != (self.sampler_size,) or (
                    init.auxiliary is not None and init.auxiliary.shape != (self.auxiliary_size,)):
                raise ValueError("the initial generator's buffers do not fit its spec")
            sampler, auxiliary = init.sampler, init.auxiliary
        self.losses = []
        return self._fit(x, sampler, auxiliary, steps, rng)

    @abstractmethod
    def _fit(self, x: np.ndarray, sampler: np.ndarray | None, auxiliary: np.ndarray | None, steps: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        """Backend work on checked inputs; None buffers start fresh. Appends to `self.losses`."""


def batch_indices(n: int, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """One minibatch: `batch_size` distinct samples (all of them when the class has fewer)."""
    return rng.choice(n, size=min(batch_size, n), replace=False)
