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

The mix an update is compared on: its `trained_counts` (the device's store when it trained, by task and class: its
new data and the old samples it keeps; a device with no data for the task trains on its store and is compared on
it). Measured on digits (docs/results.md, issue 56), honest updates compared on that mix raised its loss by at most
1.4 nats in 1,100 updates but one (4.6), and 90 % of them lowered it; compared on the task's classes they held
(`label_counts`), a device with few samples of the task raised it by up to 7.8 (it trains mostly on its store). An
update that sends no `trained_counts` (an older device) is compared on the classes of the task it has seen, else on
those of earlier tasks, else on the task's classes evenly. Each part of the mix is compared on the calibration
samples of its own task and class (a domain-incremental task's own domain), else on those of the latest task that
brought the class: compared on the current domain alone, a store that holds every domain it has seen looked worse
when it kept the old ones and let the new one slip, and at Dirichlet 0.1 8-15 % of honest updates were refused
(docs/results.md). The model is evaluated over the classes the device has seen (`mask_of`).

A claim it cannot compare is refused rather than compared on something else: samples of a class the run has not
reached (none of tasks 0..t brings it, so there are no calibration samples of it, and no test set has it). No
honest device holds one in any scenario of firmware_sim (class-incremental, domain-incremental, flowing, few-shot,
client dynamics: checked for every device and task); a device whose data follow another class order than the
coordinator's is misconfigured (the coordinator warns of it: `class-mismatch`). Label flipping all to all (y -> 9 -
y) on class-incremental digits claims classes no task has brought yet in the first 2-4 of 5 tasks (by the seed's
class order); compared on the task's classes instead, which its masked training barely touches, it passed in 9-11 of
its 15 rounds and cost 6.9 points (docs/results.md, issue 56). Nor can a device hold samples of the round's task
(`trained_counts`' task is the task of the round that brought them) of a class that task does not bring: refused
too (`misplaced-classes`; checked the same way). There the flipped labels name old classes, on which the global
model has forgotten so much by the last task that a flipped update was not much worse than it: refused for the
claim in most of its last task's rounds, it took 16.6 points off one seed (issue 56). A device that numbers its
tasks itself (`[learner] detect_new_tasks`) records its own task ids, which need not be the coordinator's: with
this reference, let the coordinator name the tasks.

What it cannot see: an update that makes the mix it claims better and other classes worse (a head scaled up: what
the distance bounds and SDD's row bound are for), and a device that claims a mix it did not train on, which changes
what it is compared on but not that its update must make that mix better.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from coordinator.evaluation import Evaluator
from coordinator.strategies.base import ClientUpdate, RoundContext

Part = tuple[int, int]  # (task, class): the calibration samples of a class in one task (its domain there)


@dataclass(frozen=True)
class LossChange:
    """An update's calibration loss on its mix against the global model's, in nats, each part weighted by the update's
    samples of it: `net`, the whole change (negative: it lowers it; what the reference refuses on), and `gained`, the
    parts it lowered alone (at most 0; what the trust weight counts, `[guard] trust_on`)."""

    net: float
    gained: float


NO_CHANGE = LossChange(0.0, 0.0)  # an update compared on nothing


class ClassReference:
    """One round's reference: the global model's calibration loss per part, taken once, then each update's."""

    def __init__(self, evaluator: Evaluator, calibration: dict[Part, tuple[np.ndarray, np.ndarray]],
                 global_weights: np.ndarray, ctx: RoundContext, device_masks: bool = True) -> None:
        """`calibration`: (task, class) -> its samples (x, y), as `calibration_by_part` gives them; `device_masks`:
        the devices mask the classes they have not seen (their [learner]'s default; false where the round tells them
        the fleet's classes, `[client] known_classes`)."""
        self.evaluator = evaluator
        self.calibration = calibration
        self.ctx = ctx
        self.device_masks = device_masks
        self.global_weights = global_weights
        self.fleet_mask = tuple(c for c in ctx.seen_classes if c < evaluator.data.num_classes)
        self._latest = {part[1]: part for part in sorted(calibration)}  # each class's latest task
        self._baselines: dict[tuple[int, ...], dict[Part, float]] = {}
        self.baseline = {part: loss for part, loss in self.losses(global_weights, sorted(calibration)).items()
                         if math.isfinite(loss)}  # a part the global model gives no finite answer on is not compared

    def loss_change(self, update: ClientUpdate) -> LossChange:
        """How much the update raises the calibration loss of its mix above the global model's (negative: it lowers
        it), in nats, weighted by its samples of each part, and how much of it the parts it lowered make; inf when
        its model gives no finite answer."""
        parts, weights = self.compared_on(update)
        if not parts:
            return NO_CHANGE
        mask = self.mask_of(update)
        baseline = self._baseline(mask)
        if not all(math.isfinite(baseline.get(p, math.nan)) for p in parts):  # compared beyond what it has seen
            mask, baseline = self.fleet_mask, self.baseline
        losses = self.losses(update.weights, parts, mask)
        changes = [w * (losses[p] - baseline[p]) for p, w in zip(parts, weights)]
        return LossChange(sum(changes) / sum(weights), sum(min(c, 0.0) for c in changes) / sum(weights))

    def unreached(self, update: ClientUpdate) -> list[int]:
        """The classes the update claims samples of (`label_counts`, `trained_counts`) that none of the run's tasks
        so far brings (module docstring); none when the round names no classes."""
        if not self.ctx.seen_classes:
            return []
        return sorted(held_classes(update).difference(self.ctx.seen_classes))

    def misplaced(self, update: ClientUpdate) -> list[int]:
        """The classes the update claims samples of under the round's task (`trained_counts`) that the task does not
        bring (module docstring); none when the round names no task classes."""
        if not self.ctx.task_classes:
            return []
        claimed = {c for task, c, n in update.trained_counts if task == self.ctx.task and n > 0}
        return sorted(claimed.difference(self.ctx.task_classes))

    def mask_of(self, update: ClientUpdate) -> tuple[int, ...]:
        """The classes the update's device trained over: those it has seen (its `label_counts`, and what it trained
        on), as a device masks by default, or the fleet's classes so far where the devices do not mask so or that
        leaves fewer than two (over one class every model has a loss of 0: nothing would be compared). A device
        with one class of the task in its store, which masks the classes it has never seen, learns nothing of the
        fleet's others, and under the fleet's classes its model looked 17 nats worse on its own class (issue 56)."""
        if not self.device_masks:
            return self.fleet_mask
        own = {c for c in held_classes(update) if c < self.evaluator.data.num_classes}
        return tuple(sorted(own)) if len(own) >= 2 else self.fleet_mask

    def _baseline(self, mask: tuple[int, ...]) -> dict[Part, float]:
        """The global model's loss per part over `mask` (taken once a round for each mask)."""
        if mask == self.fleet_mask:
            return self.baseline
        if mask not in self._baselines:
            self._baselines[mask] = self.losses(self.global_weights, [p for p in self.calibration if p[1] in mask],
                                                mask)
        return self._baselines[mask]

    def part_of(self, task: int, class_: int) -> Part | None:
        """The calibration samples a class the device holds of a task is compared on: that task's, else the latest
        task's that has the class (a deployment that kept none for that task), None when none has it."""
        return (task, class_) if (task, class_) in self.baseline else self._latest.get(class_)

    def compared_on(self, update: ClientUpdate) -> tuple[list[Part], list[float]]:
        """The parts an update is compared on, with their weights (module docstring)."""
        weights: dict[Part, float] = {}
        for task, class_, n in update.trained_counts:
            part = self.part_of(task, class_) if n > 0 else None
            if part in self.baseline:
                weights[part] = weights.get(part, 0.0) + float(n)
        if weights:
            return list(weights), list(weights.values())
        held = {c: float(n) for c, n in enumerate(update.label_counts) if n > 0}
        compared = {c: part for c in self.ctx.seen_classes if (part := self.part_of(self.ctx.task, c)) in self.baseline}
        for scope in (self.ctx.task_classes, self.ctx.seen_classes):
            chosen = [c for c in scope if c in held and c in compared]
            if chosen:
                return [compared[c] for c in chosen], [held[c] for c in chosen]
        chosen = [c for c in self.ctx.task_classes if c in compared]
        return [compared[c] for c in chosen], [1.0] * len(chosen)

    @torch.no_grad()
    def losses(self, weights: np.ndarray, parts: Sequence[Part], mask: Sequence[int] | None = None
               ) -> dict[Part, float]:
        """Mean cross-entropy of each part's calibration samples under `weights`, over the classes of `mask` (the
        fleet's so far by default; inf where it is not finite: a model that gives no answer is no better)."""
        parts = list(parts)
        try:
            self.evaluator.load(weights)
        except ValueError:
            return dict.fromkeys(parts, math.inf)
        shown = self.evaluator.mask(self.fleet_mask if mask is None else mask)
        if not parts:
            return {}
        x = np.concatenate([self.calibration[p][0] for p in parts])
        y = np.concatenate([self.calibration[p][1] for p in parts])
        per_sample = np.empty(len(y), np.float64)
        for start, logits in self.evaluator.logits(x, shown):  # one pass over every part compared
            target = torch.from_numpy(y[start:start + len(logits)]).to(self.evaluator.device)
            per_sample[start:start + len(target)] = F.cross_entropy(logits.float(), target, reduction="none").cpu()
        out, start = {}, 0
        for p in parts:
            mean = float(per_sample[start:start + len(self.calibration[p][1])].mean())
            start += len(self.calibration[p][1])
            out[p] = mean if math.isfinite(mean) else math.inf
        return out


def held_classes(update: ClientUpdate) -> set[int]:
    """The classes the update's device says it has held samples of: those it has seen (`label_counts`) and those
    it trained on (`trained_counts`)."""
    return {c for c, n in enumerate(update.label_counts) if n > 0} | {c for _, c, n in update.trained_counts if n > 0}


def calibration_by_part(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[Part, tuple[np.ndarray, np.ndarray]]:
    """Tasks 0..t's calibration sets (in task order) as (task, class) -> samples."""
    return {(t, int(c)): (x[y == c], np.asarray(y[y == c], dtype=np.int64))
            for t, (x, y) in enumerate(parts) for c in np.unique(y)}
