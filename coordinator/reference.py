"""A trust reference the coordinator holds: each update is compared with the global model on calibration samples
of what the device says it trained on, samples no device and no test set has (the scenario's `calibration`, or
`calibration-<t>.npz` beside a deployment's test files).

Why what it trained on (issue 56): a device that brings classes no other device holds is far from the others and
points elsewhere, so every rule that compares updates with each other (Krum, distances, cosines) reads novelty as
attack. What an honest device's update does, whatever classes it brings, is make the model better on the data it
trained on. A reversed update, one trained on swapped labels, or one that undoes the round's step makes it worse
there. So the check asks one question of each update: does the mean cross-entropy of the calibration samples of its
classes, each class weighted by the samples the device trained on of it, rise above the global model's by more than
`reference_tolerance` nats? That is FLTrust's root data (Cao et al., NDSS 2021) used class by class, with a loss
instead of a direction to align with: Zeno (Xie et al., ICML 2019) scores an update by the loss it reaches on the
server's data over every class, which punishes a device for the classes it does not hold.

The mix an update is compared on: its `trained_counts` (the device's store when it trained: its new data and the
old samples it keeps; a device with no data for the task trains on its store and is compared on it). Measured on
digits (docs/results.md, issue 56), honest updates compared on that mix raised its loss by at most 1.4 nats in 1,100
updates but one (4.6), and 90 % of them lowered it; compared on the task's classes they held (`label_counts`), a device
with few samples of the task raised it by up to 7.8 (it trains mostly on its store). An update that sends no
`trained_counts` (an older device) is compared on the classes of the task it has seen, else on those of earlier
tasks, else on the task's classes evenly. A class's calibration samples are those of the latest task that brought
it (a domain-incremental task's own domain; a device's store there holds every domain it has seen, and at Dirichlet
0.1 this refused 8-15 % of honest updates: docs/results.md. Comparing a store by task as well as class is the fix
not yet made). The model is evaluated over the classes the device has seen (`mask_of`).

What it cannot see: an update that makes the mix it claims better and other classes worse (a head scaled up: what
the distance bounds and SDD's row bound are for), and a device that claims a mix it did not train on, which changes
what it is compared on but not that its update must make that mix better.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from coordinator.evaluation import Evaluator
from coordinator.strategies.base import ClientUpdate, RoundContext


class ClassReference:
    """One round's reference: the global model's calibration loss per class, taken once, then each update's."""

    def __init__(self, evaluator: Evaluator, calibration: dict[int, tuple[np.ndarray, np.ndarray]],
                 global_weights: np.ndarray, ctx: RoundContext, device_masks: bool = True) -> None:
        """`calibration`: class -> its samples (x, y), as `calibration_by_class` gives them; `device_masks`: the
        devices mask the classes they have not seen (their [learner]'s default; false where the round tells them
        the fleet's classes, `[client] known_classes`)."""
        self.evaluator = evaluator
        self.calibration = calibration
        self.ctx = ctx
        self.device_masks = device_masks
        self.global_weights = global_weights
        self.fleet_mask = tuple(c for c in ctx.seen_classes if c < evaluator.data.num_classes)
        self._baselines: dict[tuple[int, ...], dict[int, float]] = {}
        self.baseline = {c: loss for c, loss in self.losses(global_weights, sorted(calibration)).items()
                         if math.isfinite(loss)}  # a class the global model gives no finite answer on is not compared

    def loss_change(self, update: ClientUpdate) -> float:
        """How much the update raises the calibration loss of its mix above the global model's (negative: it lowers
        it), in nats, weighted by its samples of each class; inf when its model gives no finite answer."""
        classes, weights = self.compared_on(update)
        if not classes:
            return 0.0
        mask = self.mask_of(update)
        baseline = self._baseline(mask)
        if not all(math.isfinite(baseline.get(c, math.nan)) for c in classes):  # compared beyond what it has seen
            mask, baseline = self.fleet_mask, self.baseline
        losses = self.losses(update.weights, classes, mask)
        return sum(w * (losses[c] - baseline[c]) for c, w in zip(classes, weights)) / sum(weights)

    def mask_of(self, update: ClientUpdate) -> tuple[int, ...]:
        """The classes the update's device trained over: those it has seen (its `label_counts`, and what it trained
        on), as a device masks by default, or the fleet's classes so far where the devices do not mask so or that
        leaves fewer than two (over one class every model has a loss of 0: nothing would be compared). A device
        with one class of the task in its store, which masks the classes it has never seen, learns nothing of the
        fleet's others, and under the fleet's classes its model looked 17 nats worse on its own class (issue 56)."""
        if not self.device_masks:
            return self.fleet_mask
        own = {c for counts in (update.label_counts, update.trained_counts) for c, n in enumerate(counts)
               if n > 0 and c < self.evaluator.data.num_classes}
        return tuple(sorted(own)) if len(own) >= 2 else self.fleet_mask

    def _baseline(self, mask: tuple[int, ...]) -> dict[int, float]:
        """The global model's loss per class over `mask` (taken once a round for each mask)."""
        if mask == self.fleet_mask:
            return self.baseline
        if mask not in self._baselines:
            self._baselines[mask] = self.losses(self.global_weights, [c for c in mask if c in self.calibration], mask)
        return self._baselines[mask]

    def compared_on(self, update: ClientUpdate) -> tuple[list[int], list[float]]:
        """The classes an update is compared on, with their weights (module docstring)."""
        trained = [c for c, n in enumerate(update.trained_counts) if n > 0 and c in self.baseline]
        if trained:
            return trained, [float(update.trained_counts[c]) for c in trained]
        held = {c: float(n) for c, n in enumerate(update.label_counts) if n > 0 and c in self.baseline}
        for scope in (self.ctx.task_classes, self.ctx.seen_classes):
            chosen = [c for c in scope if c in held]
            if chosen:
                return chosen, [held[c] for c in chosen]
        chosen = [c for c in self.ctx.task_classes if c in self.baseline]
        return chosen, [1.0] * len(chosen)

    @torch.no_grad()
    def losses(self, weights: np.ndarray, classes: Sequence[int], mask: Sequence[int] | None = None
               ) -> dict[int, float]:
        """Mean cross-entropy of each class's calibration samples under `weights`, over the classes of `mask` (the
        fleet's so far by default; inf where it is not finite: a model that gives no answer is no better)."""
        try:
            self.evaluator.load(weights)
        except ValueError:
            return dict.fromkeys(classes, math.inf)
        shown = self.evaluator.mask(self.fleet_mask if mask is None else mask)
        classes = list(classes)
        if not classes:
            return {}
        x = np.concatenate([self.calibration[c][0] for c in classes])
        y = np.concatenate([self.calibration[c][1] for c in classes])
        per_sample = np.empty(len(y), np.float64)
        for start, logits in self.evaluator.logits(x, shown):  # one pass over every class compared
            target = torch.from_numpy(y[start:start + len(logits)]).to(self.evaluator.device)
            per_sample[start:start + len(target)] = F.cross_entropy(logits.float(), target, reduction="none").cpu()
        out = {}
        for c in classes:
            mean = float(per_sample[y == c].mean())
            out[c] = mean if math.isfinite(mean) else math.inf
        return out


def calibration_by_class(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Tasks 0..t's calibration sets (in task order) as class -> samples, each class's from the latest task that
    has it."""
    by_class: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for x, y in parts:
        for c in np.unique(y):
            picked = y == c
            by_class[int(c)] = (x[picked], np.asarray(y[picked], dtype=np.int64))
    return by_class
