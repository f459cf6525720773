"""The Trainer interface every backend implements, and the batching loop they share.

A backend supplies one optimisation step and one forward pass; epochs, shuffling, batching, metrics, the proximal
term and the last-layer importance score live here once, so two backends given the same weights and the same data
order take the same steps and give the same scores.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from models.manifest import Manifest

GRAD_NORM_MODES: tuple[str, ...] = ("last-layer", "exact")


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    samples: int


@dataclass(frozen=True)
class Proximal:
    """A pull towards `reference` (flat float32 buffer, manifest order) that adds `mu * (w - reference)` to every
    step's gradient: FedProx's term, and Re-Fed's PIM with mu = q(lambda) = (1 - lambda) / (2 lambda)."""

    mu: float
    reference: np.ndarray


@dataclass(frozen=True)
class Alignment:
    """pFedGRP's knowledge-transfer term (Eq. 6): `weight * MSE(student logits, teacher logits)` on the samples whose
    label the device had seen before this round (`applies` = 1), added to each sample's cross-entropy. Logits are
    compared raw (unmasked), over the classes the step's class mask leaves visible; the batch loss is the mean over
    the batch of CE_i + weight * applies_i * MSE_i, i.e. Eq. 6's sum divided by the batch size."""

    weight: float
    teacher_logits: np.ndarray  # (N, num_classes), one row per sample given to fit(), from the teacher's raw logits
    applies: np.ndarray  # (N,) float32 of 0/1

    def batch(self, idx: np.ndarray) -> Alignment:
        return Alignment(self.weight, self.teacher_logits[idx], self.applies[idx])


def iterate_batches(
    n: int, batch_size: int, rng: np.random.Generator | None
) -> Iterator[np.ndarray]:
    """Index batches over n samples: shuffled when an rng is given, in order otherwise. Keeps the last short batch."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def proximal_pull(stepped: np.ndarray, before: np.ndarray, proximal: Proximal, lr: float) -> np.ndarray:
    """`stepped - lr * mu * (before - reference)`: the proximal gradient applied after the optimiser's own step.

    For SGD this is exactly a step on loss + mu/2 ||w - reference||^2. For AdamW it is a decoupled pull (like
    AdamW's decoupled weight decay): the term bypasses Adam's moment estimates. ORT runs its optimiser as one
    graph with no hook to edit gradients, so this form is the one both backends can take identically.
    """
    scale = np.float32(lr * proximal.mu)
    return stepped - scale * (before - proximal.reference)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64; masked logits (about -1e9) come out as exactly 0."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def last_layer_grad_norms(logits: np.ndarray, features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Squared norm of each sample's cross-entropy gradient w.r.t. the linear head (weight and bias), in closed form.

    The logit gradient is p - onehot(y); the weight gradient is its outer product with the head input h, so
    ||dL/dW||^2 + ||dL/db||^2 = ||p - onehot(y)||^2 * (||h||^2 + 1), from one forward pass and no backward pass.
    """
    residual = softmax(logits)
    residual[np.arange(len(y)), y] -= 1.0
    features = features.astype(np.float64)
    return (residual**2).sum(axis=1) * ((features**2).sum(axis=1) + 1.0)


class Trainer(ABC):
    """Trains one model on a device. Weights cross the boundary as one flat float32 buffer (manifest order)."""

    backend: str  # "ort" or "torch": what the device config's [trainer] backend names
    manifest: Manifest
    _learning_rate: float
    supports_alignment: bool = True  # whether train_step takes an Alignment term

    @abstractmethod
    def get_weights(self) -> np.ndarray: ...

    @abstractmethod
    def set_weights(self, buffer: np.ndarray) -> None: ...

    @abstractmethod
    def _apply_learning_rate(self, lr: float) -> None:
        """Hand a new learning rate to the backend's optimiser (set_learning_rate records it here first)."""

    @abstractmethod
    def train_step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, alignment: Alignment | None = None
    ) -> float:
        """One optimiser step on one batch; returns the batch's mean loss before the step (with the alignment term
        when one is given)."""

    @abstractmethod
    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """Eval-mode forward pass: (mean loss, logits, penultimate features)."""

    @abstractmethod
    def _exact_grad_norms(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, batch_size: int
    ) -> np.ndarray:
        """Squared norm of each sample's full-parameter gradient (float64), leaving weights and optimiser as they were."""

    @property
    def learning_rate(self) -> float:
        """The step size of the next optimiser step; the proximal pull scales with it."""
        return self._learning_rate

    def set_learning_rate(self, lr: float) -> None:
        self._learning_rate = float(lr)
        self._apply_learning_rate(self._learning_rate)

    def fit(
        self,
        x: np.ndarray,
        y: np.ndarray,
        epochs: int = 1,
        batch_size: int = 32,
        class_mask: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        proximal: Proximal | None = None,
        alignment: Alignment | None = None,
    ) -> float:
        """Train for `epochs` passes over (x, y); returns the mean training loss of the last epoch (without the
        proximal term). With `proximal`, every step is followed by `proximal_pull`; with `alignment`, each step's
        loss carries its term."""
        x, y = self._check_batch(x, y)
        mask = self.mask(class_mask)
        if proximal is not None:
            proximal = self._check_proximal(proximal)
        if alignment is not None:
            alignment = self._check_alignment(alignment, len(y))
        last = 0.0
        for _ in range(epochs):
            total = 0.0
            for idx in iterate_batches(len(y), batch_size, rng):
                before = self.get_weights() if proximal is not None else None
                step_alignment = alignment.batch(idx) if alignment is not None else None
                total += self.train_step(x[idx], y[idx], mask, step_alignment) * len(idx)
                if proximal is not None:
                    self.set_weights(proximal_pull(self.get_weights(), before, proximal, self.learning_rate))
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

    def per_sample_grad_norms(
        self,
        x: np.ndarray,
        y: np.ndarray,
        mode: str = "last-layer",
        class_mask: np.ndarray | None = None,
        batch_size: int = 256,
    ) -> np.ndarray:
        """G(x_i) = ||grad_w l(f_w(x_i), y_i)||^2 per sample (Re-Fed Eq. 4), float64 of shape (n,).

        "last-layer" takes the gradient w.r.t. the head only, in closed form from eval forward passes of
        `batch_size` samples: cheap, and a lower bound of "exact". "exact" takes every parameter (a backward pass
        per sample); `batch_size` bounds the torch backend's per-sample gradients held at once (batch_size x
        parameters floats). Neither mode changes the weights or the optimiser state.
        """
        if mode not in GRAD_NORM_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(GRAD_NORM_MODES)}")
        x, y = self._check_batch(x, y)
        mask = self.mask(class_mask)
        if mode == "exact":
            return self._exact_grad_norms(x, y, mask, batch_size)
        logits, features = self.outputs(x, y, mask, batch_size)
        return last_layer_grad_norms(logits, features, y)

    def outputs(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray | None = None, batch_size: int = 256
    ) -> tuple[np.ndarray, np.ndarray]:
        """Eval-mode (logits, penultimate features) for all of x, computed `batch_size` samples at a time."""
        x, y = self._check_batch(x, y)
        mask = self.mask(class_mask)
        parts = [self.forward(x[idx], y[idx], mask)[1:] for idx in iterate_batches(len(y), batch_size, None)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

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

    def _check_proximal(self, proximal: Proximal) -> Proximal:
        """Refuse a negative or non-finite mu, or a reference that is not a valid weight buffer, before training."""
        if not (np.isfinite(proximal.mu) and proximal.mu >= 0):
            raise ValueError(f"proximal mu must be finite and >= 0, got {proximal.mu}")
        return Proximal(float(proximal.mu), self.check_weights(proximal.reference))

    def teacher_logits(self, teacher: np.ndarray, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Raw (unmasked) eval-mode logits of the model with `teacher` weights on x; this trainer's weights are
        restored afterwards."""
        saved = self.get_weights()
        try:
            self.set_weights(teacher)
            return self.outputs(x, np.zeros(len(x), dtype=np.int64), None, batch_size)[0]
        finally:
            self.set_weights(saved)

    def _check_alignment(self, alignment: Alignment, n: int) -> Alignment:
        if not (np.isfinite(alignment.weight) and alignment.weight >= 0):
            raise ValueError(f"alignment weight must be finite and >= 0, got {alignment.weight}")
        logits = np.ascontiguousarray(alignment.teacher_logits, dtype=np.float32)
        applies = np.ascontiguousarray(alignment.applies, dtype=np.float32)
        if logits.shape != (n, self.manifest.num_classes) or applies.shape != (n,):
            raise ValueError(f"alignment needs teacher logits of shape ({n}, {self.manifest.num_classes}) and "
                             f"one 0/1 flag per sample, got {logits.shape} and {applies.shape}")
        if not np.isfinite(logits).all():
            raise ValueError("teacher logits contain NaN or Inf values")
        return Alignment(float(alignment.weight), logits, applies)

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
