"""`sdd`: SDD's device half (spec: shared/specs/fewshot-sdd.md, Sec. 2.1): noise-aware generative replay (NAGR)
and two-rate fine-tuning. The server half is `coordinator/strategies/sdd.py`.

1. No real sample of an earlier session is kept (`keeps_old = False`, as the paper: its buffer is synthetic
   only). The replay set is the coordinator's broadcast `sdd/replay` (synthetic samples of every earlier
   session); the device keeps what fits its share of M (`replay_share`, class-balanced, the newest session's
   samples first to go when a class must shrink) in one `BudgetedFile`, so the synthetic samples it holds count
   against M like everything else.
2. At the start of each session the held samples are relabelled by the old model (the global model the session
   starts from): y* = argmax over the classes seen before the session (ERDFR's relabelling, recomputed every
   session: the labels follow the model the device must not forget).
3. From the second session on, local training draws fresh replay samples for every batch (as many as the batch
   has real ones, uniformly from the held set) and trains on L_new + k (alpha CE + beta RCE) (Eqs. 1-3):
   CE on the real samples, and on the replay samples symmetric cross-entropy against y*, the softmax over every
   class seen and both sums over the old classes C_B, log 0 clamped to `log_zero` (SCE's code: ln 1e-4; its text
   says -4). The reverse term is the loss's class-cost term (`reverse_ce_costs`), so every backend runs it.
   `replay = "ce"` drops the reverse term (beta = 0): the ablation "SDD without noise-aware replay"; `replay =
   "none"` trains on the real samples alone, at the two rates below: with a FedAvg strategy, the paper's
   Finetune+FL (its baselines fine-tune at the incremental sessions' rates and average; Sec. IV-A).
4. The new classes' head (the session's classes: those the round names, `task_classes`, and the device's own)
   trains at `new_head_rate` times the trainer's rate, every other parameter at `rest_rate` times it
   (`Trainer.scaled_rates`): with [trainer] lr = 0.1 the defaults are the paper's 0.1 and 1e-4, with or without a
   replay set. The base session trains every parameter at the rate, with the plain loss.
5. After local training the device attaches its feature statistics (`models/feature_stats.py`: its real
   samples of the session under its trained model) for the generator's statistics term, when it holds at least
   `MIN_SAMPLES` of them (one sample's statistics are that sample's features); `send_statistics = false` sends
   none.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_client.budget import BudgetedFile
from edge_client.policies.base import (
    AttachedValues,
    PolicyContext,
    ReplayPolicy,
    RoundView,
    Samples,
    TrainingSet,
)
from edge_client.trainers.base import LossInputs, Proximal, class_rate_scale, iterate_batches, reverse_ce_costs
from models.feature_stats import MIN_SAMPLES, STATISTICS, LayerStatistics, encode_statistics
from models.manifest import FULL_GRADIENT
from models.sdd import REPLAY, decode_replay, encode_replay

log = logging.getLogger(__name__)
REPLAY_MODES = ("sce", "ce", "none")
REPLAY_HOLDER = "sdd-replay"


@dataclass
class Sdd(ReplayPolicy):
    name = "sdd"
    keeps_old = False

    # "sce": alpha CE + beta RCE on the replay samples; "ce": plain CE (beta = 0); "none": no replay, the two rates
    # alone (the paper's Finetune+FL with a FedAvg strategy)
    replay: str = "sce"
    alpha: float = 1.0
    beta: float = 1.0
    k: float = 1.0  # the replay term's weight (Eq. 3)
    log_zero: float = math.log(1e-4)  # A: log 0 clamped (SCE's code; its text: -4)
    new_head_rate: float = 1.0  # the new classes' head, times the trainer's rate
    rest_rate: float = 1e-3  # every other parameter, times the trainer's rate
    replay_share: float = 0.5  # the most of M's bytes the synthetic samples may take
    send_statistics: bool = True
    _file: BudgetedFile | None = field(default=None, init=False, repr=False)
    _held: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)
    _labels: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False)  # (task, y*)
    _statistics: tuple[LayerStatistics, ...] | None = field(default=None, init=False, repr=False)
    _changed: float = field(default=0.0, init=False, repr=False)  # the share of y* unlike the generated labels
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {', '.join(REPLAY_MODES)}, got {self.replay!r}")
        for name in ("alpha", "beta", "k", "new_head_rate", "rest_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.log_zero < 0:
            raise ValueError(f"log_zero (log 0 clamped) must be negative, got {self.log_zero}")
        if not 0.0 < self.replay_share <= 1.0:
            raise ValueError(f"replay_share must lie in (0, 1], got {self.replay_share}")

    def trainer_graphs(self) -> frozenset[str]:
        """Every step weighs its replayed samples and costs their classes (`fit`): the whole loss's gradient."""
        return frozenset({FULL_GRADIENT})

    def open(self, ctx: PolicyContext) -> None:
        self._file = BudgetedFile(ctx.budget, REPLAY_HOLDER, Path(ctx.state_dir) / "sdd" / "replay.bin",
                                  share=self.replay_share)
        stored = self._file.read()
        if stored is not None:
            manifest = ctx.trainer.manifest
            try:
                self._held = decode_replay(stored, manifest.input_shape, manifest.num_classes)
            except ValueError as err:  # a damaged file: the next broadcast writes it again
                log.warning("policy sdd: the stored replay set is unreadable (%s); it is dropped", err)
                self._file.remove()

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return np.empty(0, dtype=np.int64)  # no real sample of an earlier session is kept

    def receive(self, view: RoundView, payloads: Mapping[str, bytes]) -> None:
        data = payloads.get(REPLAY)
        if data is None or self._file is None:
            return
        manifest = view.trainer.manifest
        try:
            x, y = decode_replay(bytes(data), manifest.input_shape, manifest.num_classes)
        except ValueError as err:
            log.warning("policy sdd: a replay payload is refused: %s", err)
            return
        kept = self._fit_into_budget(x, y)
        if kept is not None:
            self._held, self._labels = kept, None
            self._round["replay_held"] = float(len(kept[1]))

    def _fit_into_budget(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The most class-balanced prefix of the set (each class's first samples) whose file fits the share of M:
        halved per class until it does; None when not even one sample per class fits (the old set stays)."""
        assert self._file is not None
        per_class = int(np.bincount(y).max()) if len(y) else 0
        while per_class >= 1:
            keep = np.sort(np.concatenate([np.flatnonzero(y == c)[:per_class] for c in np.unique(y)]))
            if self._file.write(encode_replay(x[keep], y[keep])):
                return x[keep], y[keep]
            per_class //= 2
        log.warning("policy sdd: not one synthetic sample per class fits its share of M; the old set stays")
        return None

    def fit(self, view: RoundView, batch: TrainingSet, epochs: int, proximal: Proximal | None) -> float:
        """The base session: the default training. Later sessions: the module docstring's steps 2-4, batch by batch,
        the replay samples left out where the device holds none or `replay = "none"` (the two rates stay). The old
        classes are those the device saw before the session and those of its replay set (a base session the host
        trained left the device no sample of its own), all visible beside the device's own; the new ones are the
        session's (those the round names, and the device's own)."""
        if view.task == 0:
            return super().fit(view, batch, epochs, proximal)
        trainer = view.trainer
        k = trainer.manifest.num_classes
        new = np.union1d(np.flatnonzero(view.task_counts > 0), np.asarray(view.task_classes, dtype=np.int64))
        replay = self._held if self.replay != "none" and view.global_weights is not None else None
        held = np.unique(replay[1]) if replay is not None else np.zeros(0, np.int64)
        old = np.setdiff1d(np.union1d(view.seen_before_task(), held), new)
        mask = np.zeros(k, np.float32) if view.class_mask is not None else np.ones(k, np.float32)
        if view.class_mask is not None:
            mask[np.flatnonzero(view.class_mask)] = 1.0
            mask[old] = 1.0
        x_replay, y_star = (batch.x[:0], batch.y[:0]) if replay is None else (replay[0], self._relabelled(view, old))
        scale = class_rate_scale(trainer.manifest, new, self.new_head_rate, rest=self.rest_rate)
        beta = self.beta if self.replay == "sce" else 0.0
        last = 0.0
        with trainer.scaled_rates(scale):
            for _ in range(epochs):
                total = 0.0
                for idx in iterate_batches(len(batch.y), view.batch_size, view.rng):
                    pick = view.rng.integers(len(y_star), size=len(idx)) if len(y_star) else idx[:0]
                    x = np.concatenate([batch.x[idx], x_replay[pick]])  # fresh replay samples every batch
                    y = np.concatenate([batch.y[idx], y_star[pick]])
                    n_real = len(idx)
                    weights = np.ones(len(y), np.float32)
                    weights[n_real:] = self.alpha * self.k
                    costs = np.zeros((len(y), k), np.float32)
                    if len(pick):
                        costs[n_real:] = reverse_ce_costs(y_star[pick], old, k, self.log_zero, weight=beta * self.k)
                    loss = LossInputs(sample_weights=weights, class_costs=costs)
                    total += trainer.fit(x, y, epochs=1, batch_size=len(y), class_mask=mask, proximal=proximal,
                                         loss=loss) * n_real
                last = total / max(len(batch.y), 1)
        if replay is not None:
            self._round.update(relabelled_unlike_generated=self._changed)
        return last

    def _relabelled(self, view: RoundView, old: np.ndarray) -> np.ndarray:
        """y* of the held samples under the session's old model (module docstring, 2), once per session."""
        assert self._held is not None and view.global_weights is not None
        if self._labels is None or self._labels[0] != view.task:
            logits = view.trainer.teacher_logits(view.global_weights, self._held[0])
            y_star = old[logits[:, old].argmax(1)]
            self._changed = float((y_star != self._held[1]).mean())
            self._labels = (view.task, y_star)
        return self._labels[1]

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        self._statistics = None
        if self.send_statistics and len(x) >= MIN_SAMPLES:
            self._statistics = tuple(view.trainer.feature_statistics(x))

    def attachments(self, view: RoundView) -> dict[str, bytes]:
        return {} if self._statistics is None else {STATISTICS: encode_statistics(self._statistics)}

    def attaches(self) -> bool:
        return self.send_statistics

    def attached_values(self) -> AttachedValues | None:
        """The statistics' means and variances, each layer's in turn; released, a variance below zero is taken as 0
        (the counts are not released: they travel as they are, as the update's sample count does)."""
        if self._statistics is None:
            return None
        layers = self._statistics
        sizes = [len(s.mean) for s in layers]

        def encode(values: np.ndarray) -> dict[str, bytes]:
            released, at = [], 0
            for layer, size in zip(layers, sizes):
                mean, var = values[at:at + size], np.maximum(values[at + size:at + 2 * size], 0.0)
                released.append(LayerStatistics(layer.name, mean.astype(np.float32), var.astype(np.float32),
                                                layer.count))
                at += 2 * size
            return {STATISTICS: encode_statistics(released)}

        return AttachedValues(np.concatenate([np.r_[s.mean, s.var] for s in layers]).astype(np.float64), encode)

    def releases_values(self) -> bool:
        return True

    def release_bytes(self, view: RoundView) -> bool:
        """The synthetic samples go when a new session's real samples do not fit beside them (real data first)."""
        if self._file is None or not self._file.remove():
            return False
        self._held, self._labels = None, None
        return True

    def metrics(self) -> dict[str, float]:
        numbers, self._round = self._round, {}
        return numbers

