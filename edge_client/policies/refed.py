"""`refed`: Re-Fed's importance caching (CVPR 2024, spec: shared/specs/refed.md; Algorithm 2 of the supplement).

At a task switch a personalized informative model (PIM) v starts from the latest global weights w and takes
plain gradient steps on the device's previous samples with the proximal term inside the gradient (Eq. 3):

    v <- v - eta * (grad l(v) + q(lambda) (v - w)),    q(lambda) = (1 - lambda) / (2 lambda)

After every PIM epoch p each sample's squared gradient norm G^p (Eq. 4) is recorded. The importance is
sum_p G^p / p (early emphasis, Eq. 5, the default) or sum_p G^p (average); late emphasis is, as the supplement's
E.3 defines it, the early-emphasis ranking reversed. The samples ranked first are cached.

The PIM is its own optimiser: it asks the trainer for gradients only (`Trainer.gradient`) and keeps v in a numpy
buffer, so the task model's weights and its optimiser's state (AdamW moments, SGD momentum) are exactly as they
were afterwards, on every backend, and the proximal term is exact rather than a pull after an Adam step.

Choices the paper leaves open (all configurable):
- the loss is the mini-batch mean with q applied as given (`batch_size` samples per step). The paper writes the
  sum over the M samples in one step; next to a sum of M gradients q in (0, inf) would hardly matter and lambda
  could not do what its Table 2 varies, so each step is per-sample scaled;
- an "iteration" p is one PIM epoch over the previous samples (scoring after every mini-batch would cost one
  scoring pass per batch);
- `pim_epochs` = 40, the supplement's value; `pim_tolerance` > 0 stops earlier, once an epoch lowers the PIM's
  mean loss by less than that fraction (the affordable schedule on small devices);
- `pim_lr` is the PIM's own step size (the paper uses the task's learning rate with SGD; our task models default
  to AdamW, whose lr would barely move an SGD PIM);
- the PIM is re-initialised from the latest global model at every switch;
- `importance = "exact"` takes every parameter's gradient; "last-layer" the head's in closed form (spec section 6),
  a cheap lower bound whose agreement with "exact" `benchmarks/importance_modes.py` measures on trained models;
- `heads`: the supplement's "multi-task learning structure" treats "all previous layers before the last
  fully-connected layer as share layers" and uses "two different fully-connected layers" for "the auxiliary
  classifier result and target classification result". With `heads = "two"` the PIM is that auxiliary classifier:
  a head of its own on the task model's shared layers, started from the target head, so only the last layer moves
  (v's shared layers stay the global model's) and the importance is taken through it. The paper does not say more
  (whether the auxiliary head is trained in the rounds too); "one" (the default) moves the whole PIM, as Eq. 3
  reads. Measured side by side in docs/results-history.md ("Re-Fed's PIM").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from edge_client.policies.base import ReplayPolicy, RoundView, Samples
from edge_client.trainers.base import Trainer, iterate_batches
from models.manifest import class_head_positions

log = logging.getLogger(__name__)
WEIGHTINGS = ("early", "average", "late")


def emphasis(p: int, weighting: str) -> float:
    """Weight of PIM epoch p (1-based) in the importance sum; "late" sums as "early" and reverses the ranking."""
    if weighting in ("early", "late"):
        return 1.0 / p
    if weighting == "average":
        return 1.0
    raise ValueError(f"unknown weighting {weighting!r}; choose one of {WEIGHTINGS}")


def proximal_coefficient(lam: float) -> float:
    """q(lambda) = (1 - lambda) / (2 lambda): lambda -> 0 keeps the PIM at the global model, -> 1 frees it."""
    if not 0.0 < lam < 1.0:
        raise ValueError(f"lambda must lie in (0, 1), got {lam}")
    return (1.0 - lam) / (2.0 * lam)


def check_pim_step(lam: float, lr: float) -> None:
    """Refuse, in one line, a PIM whose proximal step alone diverges: Eq. 3 multiplies v - w by 1 - lr q(lambda) at
    every step, so lr q >= 2 makes the distance to the global model grow without bound (NaN within the PIM's
    epochs). Steps below that bound can still diverge on a steep loss; `train_pim` stops such a run."""
    q = proximal_coefficient(lam)
    if lr * q >= 2.0:
        raise ValueError(f"pim_lr {lr:g} with lam {lam:g} diverges: the PIM's proximal step pim_lr * q(lam) = "
                         f"{lr * q:.3g} must stay below 2 (q = (1 - lam) / (2 lam) = {q:.3g}); take pim_lr < "
                         f"{2.0 / q:.3g} or a larger lam")


@dataclass(frozen=True)
class PimRun:
    """What one PIM run did: epochs run, its mean loss per epoch, its final drift ||v - w|| / ||w||, and whether it
    diverged (a loss or a score stopped being finite: the epochs before it are kept)."""

    epochs: int
    losses: tuple[float, ...]
    drift: float
    diverged: bool = False


def pim_step(v: np.ndarray, gradient: np.ndarray, reference: np.ndarray, lr: float, q: float) -> np.ndarray:
    """One step of Eq. 3: v - lr * (gradient + q (v - reference)), in float32."""
    return (v - np.float32(lr) * (gradient + np.float32(q) * (v - reference))).astype(np.float32, copy=False)


HEADS = ("one", "two")


def train_pim(
    trainer: Trainer, old: Samples, view: RoundView, lam: float, lr: float, epochs: int, tolerance: float,
    mode: str, movable: np.ndarray | None = None,
) -> tuple[list[np.ndarray], PimRun]:
    """Run the PIM from view.global_weights (the trainer's weights before any arrived) on `old`; the per-sample
    squared gradient norms after each epoch, and what the run did. The trainer's weights are set as the PIM moves
    and restored afterwards. `movable`: positions in the flat buffer the PIM moves (None: all of them; the
    auxiliary head of `heads = "two"`); the others stay the global model's.

    A run that diverges (an epoch's loss or scores not finite; a configuration that must is refused by
    `check_pim_step`) stops there and keeps the epochs before it; when not even the first epoch is finite, the
    scores are the samples' gradient norms under the global model (the PIM's start), so a ranking always exists."""
    q = proximal_coefficient(lam)
    saved = trainer.get_weights()
    reference = np.asarray(saved if view.global_weights is None else view.global_weights, dtype=np.float32)
    v = reference.copy()
    norms: list[np.ndarray] = []
    losses: list[float] = []
    diverged = False
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            for _ in range(epochs):
                total = 0.0
                for idx in iterate_batches(len(old), view.batch_size, view.rng):
                    trainer.set_weights(v)
                    loss, gradient = trainer.gradient(old.x[idx], old.y[idx], view.class_mask)
                    if movable is None:
                        step = pim_step(v, gradient, reference, lr, q)
                    else:
                        step = v.copy()
                        step[movable] = pim_step(v[movable], gradient[movable], reference[movable], lr, q)
                    total += loss * len(idx)
                    if not (np.isfinite(total) and np.isfinite(step).all()):
                        diverged = True  # v stays the last finite point: the drift reported is where it got
                        break
                    v = step
                if diverged:
                    break
                trainer.set_weights(v)
                scores = trainer.per_sample_grad_norms(old.x, old.y, mode=mode, class_mask=view.class_mask)
                if not np.isfinite(scores).all():
                    diverged = True
                    break
                norms.append(scores)
                losses.append(total / max(len(old), 1))
                if tolerance > 0 and len(losses) > 1 and losses[-2] - losses[-1] < tolerance * abs(losses[-2]):
                    break
        if not norms:
            trainer.set_weights(reference)
            norms.append(trainer.per_sample_grad_norms(old.x, old.y, mode=mode, class_mask=view.class_mask))
    finally:
        trainer.set_weights(saved)
    drift = float(np.linalg.norm(v - reference) / max(float(np.linalg.norm(reference)), 1e-12))
    if diverged:
        log.warning("Re-Fed's PIM diverged after %d finite epochs (pim_lr %g, lam %g): ranking on those (lower "
                    "pim_lr)", len(losses), lr, lam)
    return norms, PimRun(len(losses), tuple(losses), drift, diverged)


@dataclass
class ReFed(ReplayPolicy):
    name = "refed"

    lam: float = 0.5
    pim_epochs: int = 40
    pim_lr: float = 0.01
    pim_tolerance: float = 0.0
    weighting: str = "early"
    importance: str = "exact"  # or "last-layer": the closed form on the head (spec section 6)
    heads: str = "one"  # "two": the PIM is an auxiliary head on the shared layers (the supplement's structure)
    last_pim: PimRun | None = field(default=None, init=False, repr=False)
    _unreported: PimRun | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        proximal_coefficient(self.lam)
        emphasis(1, self.weighting)
        if self.pim_epochs < 1:
            raise ValueError(f"pim_epochs must be at least 1, got {self.pim_epochs}")
        if not (np.isfinite(self.pim_lr) and self.pim_lr > 0):
            raise ValueError(f"pim_lr must be a positive number, got {self.pim_lr}")
        check_pim_step(self.lam, self.pim_lr)
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {', '.join(map(repr, HEADS))}, got {self.heads!r}")
        if not (np.isfinite(self.pim_tolerance) and self.pim_tolerance >= 0):
            raise ValueError(f"pim_tolerance must be >= 0, got {self.pim_tolerance}")

    def trainer_graphs(self) -> frozenset[str]:
        """"exact" importance takes every parameter's per-sample gradient."""
        return frozenset({"sample_grad_norms"}) if self.importance == "exact" else frozenset()

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        order = np.argsort(-self.importance_scores(old, view), kind="stable")
        return (order[::-1] if self.weighting == "late" else order)[:keep]

    def importance_scores(self, old: Samples, view: RoundView) -> np.ndarray:
        """I(x_i) = sum_p emphasis(p) * G^p(x_i) over the PIM's epochs (the device's model is left as it was)."""
        movable = None
        if self.heads == "two":
            manifest = view.trainer.manifest
            movable = class_head_positions(manifest.parameters, np.arange(manifest.num_classes))
        norms, self.last_pim = train_pim(view.trainer, old, view, self.lam, self.pim_lr, self.pim_epochs,
                                         self.pim_tolerance, self.importance, movable)
        self._unreported = self.last_pim
        importance = np.zeros(len(old), dtype=np.float64)
        for p, scores in enumerate(norms, start=1):
            importance += emphasis(p, self.weighting) * scores
        return importance

    def metrics(self) -> dict[str, float]:
        """The PIM run since the last report, once: its epochs and drift."""
        run, self._unreported = self._unreported, None
        return {} if run is None else {"pim_epochs": float(run.epochs), "pim_drift": run.drift,
                                       "pim_diverged": float(run.diverged)}
