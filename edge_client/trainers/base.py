"""The Trainer interface every backend implements, and the batching loop they share.

A backend supplies one optimisation step and one forward pass; epochs, shuffling, batching and metrics live here
once, so two backends given the same weights and the same data order take the same steps.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from models.manifest import Manifest


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    samples: int


def iterate_batches(
    n: int, batch_size: int, rng: np.random.Generator | None
) -> Iterator[np.ndarray]:
    """Index batches over n samples: shuffled when an rng is given, in order otherwise. Keeps the last short batch."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


class Trainer(ABC):
    """Trains one model on a device. Weights cross the boundary as one flat float32 buffer (manifest order)."""

    manifest: Manifest

    @abstractmethod
    def get_weights(self) -> np.ndarray: ...

    @abstractmethod
    def set_weights(self, buffer: np.ndarray) -> None: ...

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None: ...

    @abstractmethod
    def train_step(self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray) -> float:
        """One optimiser step on one batch; returns the batch's mean loss before the step."""

    @abstractmethod
    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """Eval-mode forward pass: (mean loss, logits, penultimate features)."""

    def fit(
        self,
        x: np.ndarray,
        y: np.ndarray,
        epochs: int = 1,
        batch_size: int = 32,
        class_mask: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
    ) -> float:
        """Train for `epochs` passes over (x, y); returns the mean training loss of the last epoch."""
        x, y = self._check_batch(x, y)
        mask = self.mask(class_mask)
        last = 0.0
        for _ in range(epochs):
            total = 0.0
            for idx in iterate_batches(len(y), batch_size, rng):
                total += self.train_step(x[idx], y[idx], mask) * len(idx)
            last = total / max(len(y), 1)
        return last

    def evaluate(
        self, x: np.ndarray, y: np.ndarray, batch_size: int = 256, class_mask: np.ndarray | None = None
    ) -> EvalResult:
        x, y = self._check_batch(x, y)
        mask = self.mask(class_mask)
        loss_sum, correct = 0.0, 0
        for idx in iterate_batches(len(y), batch_size, None):
            loss, logits, _ = self.forward(x[idx], y[idx], mask)
            loss_sum += loss * len(idx)
            correct += int((logits.argmax(axis=1) == y[idx]).sum())
        n = max(len(y), 1)
        return EvalResult(loss=loss_sum / n, accuracy=correct / n, samples=len(y))

    def mask(self, class_mask: np.ndarray | None) -> np.ndarray:
        """A float32 mask over all classes: ones (nothing hidden) unless a mask of seen classes is given."""
        if class_mask is None:
            return np.ones(self.manifest.num_classes, dtype=np.float32)
        mask = np.asarray(class_mask, dtype=np.float32)
        if mask.shape != (self.manifest.num_classes,):
            raise ValueError(f"class mask must have shape ({self.manifest.num_classes},), got {mask.shape}")
        return mask

    def check_weights(self, buffer: np.ndarray) -> np.ndarray:
        """Refuse a weight buffer of the wrong dtype, length, or with NaN/Inf, before it reaches the model."""
        buffer = np.asarray(buffer)
        expected = self.manifest.num_parameters
        if buffer.dtype != np.float32 or buffer.ndim != 1 or buffer.size != expected:
            raise ValueError(
                f"weights must be a flat float32 buffer of {expected} values, got {buffer.dtype} {buffer.shape}"
            )
        if not np.isfinite(buffer).all():
            raise ValueError("weights contain NaN or Inf values")
        return np.ascontiguousarray(buffer)

    def _check_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.ascontiguousarray(y, dtype=np.int64)
        if x.shape[1:] != self.manifest.input_shape:
            raise ValueError(f"inputs must have shape (N, {self.manifest.input_shape}), got {x.shape}")
        if y.shape != (len(x),):
            raise ValueError(f"labels must have shape ({len(x)},), got {y.shape}")
        if len(y) and (y.min() < 0 or y.max() >= self.manifest.num_classes):
            raise ValueError(f"labels must lie in [0, {self.manifest.num_classes})")
        return x, y
