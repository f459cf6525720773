"""The Trainer interface every backend implements, and the batching loop they share.

A backend supplies one optimisation step and one forward pass; epochs, shuffling, batching, metrics, the proximal
term and the last-layer importance score live here once, so two backends given the same weights and the same data
order take the same steps and give the same scores.
"""
from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from models.feature_stats import LayerStatistics, statistics_of
from models.manifest import LOSS_HEADS, OPTIONAL_GRAPHS, Manifest, class_head_positions

GRAD_NORM_MODES: tuple[str, ...] = ("last-layer", "exact")
# The buffers each optimiser carries from step to step (`OptimizerState`), at most: a backend may keep fewer (SGD
# without momentum keeps none, in torch and in the portable backend).
OPTIMIZER_BUFFERS: dict[str, tuple[str, ...]] = {"sgd": ("velocity",), "adamw": ("exp_avg", "exp_avg_sq")}
# Read-only weight buffers found finite, by identity, held weakly: whoever makes a buffer read-only promises that it
# never changes (the backends' `set_weights` read it in place on that promise), and a fleet worker's devices each set
# the one read-only array of a round's global model (edge_client/shared_models.py), which a device of the process
# has checked for NaN/Inf already; one look a process, not one a device a round (12 us for LeNet alone).
_finite_read_only: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_finite_lock = threading.Lock()


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    samples: int


@dataclass(frozen=True)
class Proximal:
    """A pull towards `reference` (flat float32 buffer, manifest order) that adds `mu * (w - reference)` to every
    step's gradient: the proximal term of FedProx-style local objectives, with whatever mu a strategy or a policy
    gives."""

    mu: float
    reference: np.ndarray


@dataclass(frozen=True)
class OptimizerState:
    """What an optimiser carries from step to step: its steps taken and its buffers by name (SGD's "velocity",
    AdamW's "exp_avg" and "exp_avg_sq"), each a flat float32 buffer of the parameters' size, manifest order."""

    steps: int
    buffers: dict[str, np.ndarray]


# What a parked trainer calls to have its weights and optimiser state back (`Trainer.park`), as last saved:
# reload(weights, state) reads only what is asked for (None for the other).
Reload = Callable[[bool, bool], tuple[np.ndarray | None, OptimizerState | None]]


@dataclass(frozen=True)
class LossInputs:
    """How a method shapes the training loss (models/loss.py), one row per sample given to fit(). Every field is
    optional; left out it takes its neutral value, which gives the plain batch-mean cross-entropy:

    - `sample_weights` (N,): each sample's weight in the batch mean (default ones);
    - `targets` (N, classes): soft or multi-hot targets instead of the one-hot labels;
    - `teacher_logits` (N, classes) with `teacher_weights` (N,): a teacher's raw logits and each sample's weight
      of the squared distance to them over the visible classes (an alignment or distillation term);
    - `soft_targets` (N, classes) with `soft_weights` (N,): a distribution and each sample's weight of the softmax
      cross-entropy against it, beside the head's own term (a KL distillation term, whatever the head);
    - `class_costs` (N, classes): each class's cost per sample, the loss adding the expected cost under the
      softmax (linear in the probabilities: a reverse cross-entropy, `reverse_ce_costs`);
    - `head`: "softmax-ce" or "sigmoid-bce" (one sigmoid per class, for multi-label or growing heads).

    Both backends take exactly these inputs: the ORT graphs have them as inputs (the manifest lists them)."""

    sample_weights: np.ndarray | None = None
    targets: np.ndarray | None = None
    teacher_logits: np.ndarray | None = None
    teacher_weights: np.ndarray | None = None
    head: str = "softmax-ce"
    soft_targets: np.ndarray | None = None
    soft_weights: np.ndarray | None = None
    class_costs: np.ndarray | None = None

    @property
    def plain(self) -> bool:
        """Whether only targets and sample weights shape this loss (the softmax head, every other term neutral):
        the plain loss (models/loss.py `plain_training_loss`)."""
        return (self.head == LOSS_HEADS[0] and self.teacher_weights is None and self.soft_weights is None
                and self.class_costs is None)

    def batch(self, idx: np.ndarray) -> LossInputs:
        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]

        return LossInputs(rows(self.sample_weights), rows(self.targets), rows(self.teacher_logits),
                          rows(self.teacher_weights), self.head, rows(self.soft_targets), rows(self.soft_weights),
                          rows(self.class_costs))


def reverse_ce_costs(labels: np.ndarray, classes: np.ndarray, num_classes: int, log_zero: float,
                     weight: float = 1.0) -> np.ndarray:
    """The `class_costs` of a reverse cross-entropy, -weight * sum_{k in classes} p_k log t_k, against one-hot
    labels t with log 0 clamped to `log_zero` (< 0): -weight * log_zero for every class of `classes` but the
    label, 0 elsewhere, so the term is -weight * log_zero * (mass on `classes` off the label), at most
    -weight * log_zero. Symmetric cross-entropy (Wang et al. 2019) writes A = -4 in its text; its code clamps the
    one-hot target to 1e-4 (A = ln 1e-4 = -9.21)."""
    if not log_zero < 0:
        raise ValueError(f"log 0 must be clamped to a negative number, got {log_zero}")
    costs = np.zeros((len(labels), num_classes), dtype=np.float32)
    costs[:, np.asarray(classes, dtype=np.int64)] = -weight * log_zero
    costs[np.arange(len(labels)), np.asarray(labels, dtype=np.int64)] = 0.0
    return costs


def loss_arrays(
    y: np.ndarray, num_classes: int, loss: LossInputs | None, plain: bool = False
) -> tuple[np.ndarray, ...]:
    """The graph's loss inputs for one batch (models.manifest.LOSS_INPUT_NAMES: targets, sample_weights,
    teacher_logits, teacher_weights, soft_targets, soft_weights, class_costs, bce), each float32 and
    C-contiguous, neutral where `loss` leaves a field out; `plain`: the first two, all the plain loss reads."""
    loss = loss or LossInputs()
    n = len(y)
    if loss.targets is not None:
        targets = loss.targets
    else:
        targets = np.zeros((n, num_classes), dtype=np.float32)
        targets[np.arange(n), y] = 1.0
    weights = loss.sample_weights if loss.sample_weights is not None else np.ones(n, dtype=np.float32)
    if plain:
        return tuple(np.ascontiguousarray(a, dtype=np.float32) for a in (targets, weights))
    teacher = loss.teacher_logits if loss.teacher_logits is not None else np.zeros((n, num_classes), np.float32)
    teacher_weights = loss.teacher_weights if loss.teacher_weights is not None else np.zeros(n, dtype=np.float32)
    soft = loss.soft_targets if loss.soft_targets is not None else np.zeros((n, num_classes), np.float32)
    soft_weights = loss.soft_weights if loss.soft_weights is not None else np.zeros(n, dtype=np.float32)
    costs = loss.class_costs if loss.class_costs is not None else np.zeros((n, num_classes), np.float32)
    bce = np.array([float(LOSS_HEADS.index(loss.head))], dtype=np.float32)
    return tuple(np.ascontiguousarray(a, dtype=np.float32)
                 for a in (targets, weights, teacher, teacher_weights, soft, soft_weights, costs, bce))


def iterate_batches(
    n: int, batch_size: int, rng: np.random.Generator | None
) -> Iterator[np.ndarray]:
    """Index batches over n samples: shuffled when an rng is given, in order otherwise. Keeps the last short batch."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def proximal_pull(stepped: np.ndarray, before: np.ndarray, proximal: Proximal, lr: float,
                  rate_scale: np.ndarray | None = None) -> np.ndarray:
    """`stepped - lr * s * mu * (before - reference)`: the proximal gradient applied after the optimiser's own
    step, at each parameter's rate (s = `rate_scale`, 1 without one).

    For SGD this is exactly a step on loss + mu/2 ||w - reference||^2. For AdamW it is a decoupled pull (like
    AdamW's decoupled weight decay): the term bypasses Adam's moment estimates. ORT runs its optimiser as one
    graph with no hook to edit gradients, so this form is the one both backends can take identically.
    """
    scale = np.float32(lr * proximal.mu)
    pull = scale * (before - proximal.reference)
    return stepped - (pull if rate_scale is None else rate_scale * pull)


def rescaled_step(before: np.ndarray, stepped: np.ndarray, rate_scale: np.ndarray) -> np.ndarray:
    """`before + s * (stepped - before)`: a step taken at the learning rate lr, retaken at lr * s per parameter.

    Exact for both optimisers, because neither one's state depends on the rate: SGD's velocity accumulates
    gradients and its step is lr * velocity; AdamW's moments accumulate gradients and its step is
    lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w), its decoupled decay scaling with the rate too. So
    this is what torch does with a parameter group at lr * s (torch.optim's groups scale whole tensors; a scale
    per value also reaches part of one, the new classes' rows of a head). The ORT backend's optimiser graph is
    ORT's own and takes one rate: it steps at lr and the step is rescaled here; the portable graphs take the
    scale as an input."""
    return before + rate_scale * (stepped - before)


def class_rate_scale(manifest: Manifest, classes: np.ndarray, scale: float, rest: float = 1.0) -> np.ndarray:
    """A rate scale (`Trainer.scaled_rates`): `scale` for the head's rows and biases of `classes`, `rest` for every
    other parameter (a new head trained fast over a slowly tuned backbone)."""
    rates = np.full(manifest.num_parameters, rest, dtype=np.float32)
    rates[class_head_positions(manifest.parameters, classes)] = scale
    return rates


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

    backend: str  # "ort", "portable" or "torch": what the device config's [trainer] backend names
    manifest: Manifest
    _learning_rate: float
    _rate_scale: np.ndarray | None = None

    @abstractmethod
    def get_weights(self) -> np.ndarray: ...

    @abstractmethod
    def set_weights(self, buffer: np.ndarray) -> None: ...

    def optimizer_state(self) -> OptimizerState | None:
        """The optimiser's state, to be saved with the weights; None where the backend does not hand it out (it
        then lives in memory only, and a restarted device starts it afresh). Default: None."""
        return None

    def set_optimizer_state(self, state: OptimizerState) -> None:
        """Take back a state `optimizer_state` gave (after a restart). Default: ignored, as the backend gives none."""

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Start the optimiser afresh on the weights it holds: its state (momentum, AdamW's moments) zero and its
        step count 0, the very steps a new optimiser would take; what a round asks for where every round's local
        training starts anew (`[client] fresh_optimizer`, edge_client/learner.py)."""

    def park(self, reload: Reload) -> bool:
        """Let the weights and the optimiser state go from memory until the next use, which takes them back from
        `reload(weights, state)` (the device's saved state): for an owner that has just saved them and will not
        train for a while (a device between rounds; a fleet worker hosts thousands). True when the backend parked;
        False where it keeps them (the default)."""
        return False

    def check_optimizer_state(self, state: OptimizerState, names: tuple[str, ...]) -> OptimizerState:
        """Refuse a state that is not this optimiser's: other buffer names, sizes, dtype, NaN, a negative count."""
        size = self.manifest.num_parameters
        if set(state.buffers) != set(names):
            raise ValueError(f"optimizer state holds {sorted(state.buffers)}, this optimizer keeps {sorted(names)}")
        for name, buffer in state.buffers.items():
            if buffer.dtype != np.float32 or buffer.shape != (size,) or not np.isfinite(buffer).all():
                raise ValueError(f"optimizer state {name!r} must be {size} finite float32 values, got "
                                 f"{buffer.dtype} {buffer.shape}")
        if state.steps < 0:
            raise ValueError(f"optimizer state has {state.steps} steps")
        return state

    @abstractmethod
    def _apply_learning_rate(self, lr: float) -> None:
        """Hand a new learning rate to the backend's optimiser (set_learning_rate records it here first)."""

    @abstractmethod
    def _step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> float:
        """The backend's optimiser step at the learning rate, nothing rescaled or pulled; returns the batch loss."""

    def train_step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None = None
    ) -> float:
        """One optimiser step on one batch, each parameter at its rate (`scaled_rates`); returns the batch's loss
        (models/loss.py, shaped by `loss`) before the step."""
        return self._fit_step(x, y, class_mask, loss, None)

    @abstractmethod
    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """Eval-mode forward pass: (mean loss, logits, penultimate features)."""

    @abstractmethod
    def _gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        """(batch loss, its float32 gradient in manifest order) of checked inputs; nothing else changes."""

    @abstractmethod
    def _exact_grad_norms(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, batch_size: int
    ) -> np.ndarray:
        """Squared norm of each sample's full-parameter gradient (float64); weights and optimiser stay as they were."""

    @property
    def learning_rate(self) -> float:
        """The step size of the next optimiser step; the proximal pull scales with it."""
        return self._learning_rate

    def set_learning_rate(self, lr: float) -> None:
        self._learning_rate = float(lr)
        self._apply_learning_rate(self._learning_rate)

    @property
    def rate_scale(self) -> np.ndarray | None:
        """Each parameter's learning rate as a multiple of `learning_rate` (flat, manifest order), or None: all
        at the learning rate."""
        return self._rate_scale

    @contextmanager
    def scaled_rates(self, scale: np.ndarray | None) -> Iterator[None]:
        """Train each parameter at `learning_rate * scale` (flat float32, manifest order, finite and >= 0; None:
        all at the rate) while inside; the scale before comes back on leaving. Every step honours it on every
        backend (`rescaled_step` says how it meets the optimisers): a method fine-tunes a new head fast and the
        rest slowly (`class_rate_scale` builds that one)."""
        previous = self._rate_scale
        self._set_rate_scale(None if scale is None else self._check_scale(scale))
        try:
            yield
        finally:
            self._set_rate_scale(previous)

    def _set_rate_scale(self, scale: np.ndarray | None) -> None:
        """Record the scale; a backend whose optimiser takes it itself also hands it over here."""
        self._rate_scale = scale

    def _check_scale(self, scale: np.ndarray) -> np.ndarray:
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if scale.shape != (self.manifest.num_parameters,):
            raise ValueError(f"a rate scale must have one value per parameter ({self.manifest.num_parameters}), "
                             f"got shape {scale.shape}")
        if not np.isfinite(scale).all() or (scale < 0).any():
            raise ValueError("a rate scale must be finite and >= 0")
        return scale

    def fit(
        self,
        x: np.ndarray,
        y: np.ndarray,
        epochs: int = 1,
        batch_size: int = 32,
        class_mask: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        proximal: Proximal | None = None,
        loss: LossInputs | None = None,
    ) -> float:
        """Train for `epochs` passes over (x, y); returns the mean training loss of the last epoch (without the
        proximal term). With `proximal`, every step is followed by `proximal_pull`; `loss` shapes each step's
        loss (per-sample weights, targets, a teacher, the head)."""
        x, y, mask, proximal, loss = self.fit_inputs(x, y, class_mask, proximal, loss)
        last = 0.0
        for _ in range(epochs):
            total = 0.0
            for idx in iterate_batches(len(y), batch_size, rng):
                step_loss = loss.batch(idx) if loss is not None else None
                total += self._fit_step(x[idx], y[idx], mask, step_loss, proximal) * len(idx)
            last = total / max(len(y), 1)
        return last

    def fit_inputs(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray | None = None, proximal: Proximal | None = None,
        loss: LossInputs | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Proximal | None, LossInputs | None]:
        """What fit() trains on, checked: the batch, the mask, the proximal term and the loss inputs, each refused in
        one line if it is not what this model takes. A policy with a training loop of its own starts from
        these, so its steps see exactly what fit()'s would."""
        x, y = self._check_batch(x, y)
        return (x, y, self.mask(class_mask), None if proximal is None else self._check_proximal(proximal),
                None if loss is None else self._check_loss(loss, len(y)))

    def _fit_step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None,
        proximal: Proximal | None,
    ) -> float:
        """One step: the backend's step, then the rate scale and the proximal pull through the weight buffer
        (`settle_step`). A backend whose optimiser takes both itself overrides this."""
        if proximal is None and self._rate_scale is None:
            return self._step(x, y, class_mask, loss)
        before = self.get_weights()
        value = self._step(x, y, class_mask, loss)
        self.settle_step(before, proximal)
        return value

    def settle_step(self, before: np.ndarray, proximal: Proximal | None) -> None:
        """Finish a step the optimiser took from the weights `before` at the learning rate: rescale it per
        parameter (`rescaled_step`, with a rate scale) and add the proximal pull (`proximal_pull`). A policy with
        a step of its own (one with an extra term) calls it after its step, so the step is every backend's."""
        stepped = self.get_weights()
        if self._rate_scale is not None:
            stepped = rescaled_step(before, stepped, self._rate_scale)
        if proximal is not None:
            stepped = proximal_pull(stepped, before, proximal, self.learning_rate, self._rate_scale)
        self.set_weights(stepped)

    def gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray | None = None, loss: LossInputs | None = None
    ) -> tuple[float, np.ndarray]:
        """The batch loss (models/loss.py, shaped by `loss`) and its gradient w.r.t. the flat weights, float32 in
        manifest order, at the current weights. Neither the weights nor the optimiser's state change: a caller
        can run an optimiser of its own on these (a policy's side model, say) without touching the task model's."""
        x, y = self._check_batch(x, y)
        if loss is not None:
            loss = self._check_loss(loss, len(y))
        return self._gradient(x, y, self.mask(class_mask), loss)

    def input_gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray | None = None, loss: LossInputs | None = None
    ) -> tuple[float, np.ndarray]:
        """The batch loss (models/loss.py, shaped by `loss`) and its gradient w.r.t. the inputs x (float32, x's
        shape), at the current weights, in train mode as `gradient`; nothing changes. What a method that moves
        samples needs (a prototype's refinement). ValueError on a backend whose artifacts have no such graph."""
        x, y = self._check_batch(x, y)
        if loss is not None:
            loss = self._check_loss(loss, len(y))
        return self._input_gradient(x, y, self.mask(class_mask), loss)

    @property
    def graphs(self) -> frozenset[str]:
        """The optional computations this trainer runs (`models.manifest.OPTIONAL_GRAPHS`: "gradient" for a step
        whose loss is not plain (`LossInputs.plain`), "input_gradient" for `input_gradient`, "sample_grad_norms" for
        `per_sample_grad_norms(mode="exact")`): a backend whose artifacts may lack their graphs says which it has,
        and the learner refuses a method that needs one it lacks (`ReplayPolicy.trainer_graphs`) when it opens. All
        of them by default."""
        return OPTIONAL_GRAPHS

    def _input_gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        raise ValueError(f"the {self.backend} backend computes no input gradients")

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
        """G(x_i) = ||grad_w l(f_w(x_i), y_i)||^2 per sample, float64 of shape (n,): what importance-based caching
        ranks by.

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

    def feature_statistics(self, x: np.ndarray, batch_size: int = 256) -> tuple[LayerStatistics, ...]:
        """Per-layer means and variances of x at this model (models/feature_stats.py: each input channel's, each
        penultimate feature's, from eval-mode forward passes): what a device may tell a server that inverts
        models about its data."""
        x, y = self._check_batch(x, np.zeros(len(x), dtype=np.int64))
        _, features = self.outputs(x, y, None, batch_size)
        return statistics_of(x, features)

    def mask(self, class_mask: np.ndarray | None) -> np.ndarray:
        """A float32 mask over all classes: ones (nothing hidden) unless a mask of seen classes is given."""
        if class_mask is None:
            return np.ones(self.manifest.num_classes, dtype=np.float32)
        mask = np.asarray(class_mask, dtype=np.float32)
        if mask.shape != (self.manifest.num_classes,):
            raise ValueError(f"class mask must have shape ({self.manifest.num_classes},), got {mask.shape}")
        return mask

    def check_weights(self, buffer: np.ndarray) -> np.ndarray:
        """Refuse a weight buffer of the wrong dtype, length, or with NaN/Inf, before it reaches the model. A
        read-only buffer is looked at for NaN/Inf once a process (`_finite_read_only`)."""
        buffer = np.asarray(buffer)
        expected = self.manifest.num_parameters
        if buffer.dtype != np.float32 or buffer.ndim != 1 or buffer.size != expected:
            raise ValueError(
                f"weights must be a flat float32 buffer of {expected} values, got {buffer.dtype} {buffer.shape}"
            )
        if buffer.flags.writeable or _finite_read_only.get(id(buffer)) is not buffer:
            if not np.isfinite(buffer).all():
                raise ValueError("weights contain NaN or Inf values")
            if not buffer.flags.writeable:
                with _finite_lock:
                    _finite_read_only[id(buffer)] = buffer
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

    def _check_loss(self, loss: LossInputs, n: int) -> LossInputs:
        """Refuse loss inputs of the wrong shape, with NaN/Inf, negative weights or an unknown head."""
        k = self.manifest.num_classes
        if loss.head not in LOSS_HEADS:
            raise ValueError(f"unknown loss head {loss.head!r}; choose one of {', '.join(LOSS_HEADS)}")
        checked: dict[str, np.ndarray | None] = {}
        for name, shape in (("sample_weights", (n,)), ("targets", (n, k)), ("teacher_logits", (n, k)),
                            ("teacher_weights", (n,)), ("soft_targets", (n, k)), ("soft_weights", (n,)),
                            ("class_costs", (n, k))):
            value = getattr(loss, name)
            if value is None:
                checked[name] = None
                continue
            array = np.ascontiguousarray(value, dtype=np.float32)
            if array.shape != shape:
                raise ValueError(f"loss input {name} must have shape {shape}, got {array.shape}")
            if not np.isfinite(array).all():
                raise ValueError(f"loss input {name} contains NaN or Inf values")
            if name not in ("teacher_logits", "class_costs") and (array < 0).any():
                raise ValueError(f"loss input {name} must be >= 0")
            checked[name] = array
        if (loss.teacher_logits is None) != (loss.teacher_weights is None):
            raise ValueError("a teacher term needs both teacher_logits and teacher_weights")
        if (loss.soft_targets is None) != (loss.soft_weights is None):
            raise ValueError("a soft-target term needs both soft_targets and soft_weights")
        return LossInputs(checked["sample_weights"], checked["targets"], checked["teacher_logits"],
                          checked["teacher_weights"], loss.head, checked["soft_targets"], checked["soft_weights"],
                          checked["class_costs"])

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
