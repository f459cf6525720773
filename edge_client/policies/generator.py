"""`generator`: pFedGRP's generator replay (spec: shared/specs/pfedgrp.md, section 2).

Instead of caching raw samples the device keeps one small unconditional generator per class it has seen, in a
`GeneratorBank` beside the replay store, and every byte of the bank counts against the same budget M as the
store. A round:

1. The old real data go (the store keeps only the current task: `rank` keeps nothing).
2. Replay: `replay_counts` (label-quantity scaling) says how many samples of each old class to generate; they
   are trained on together with the new data (a plain union), with the alignment term against the previous
   personalized model on the samples of classes seen before (`lambda_align`, Eq. 6).
3. After the task model, the generators of this round's classes are trained on its real samples: a warm start
   from the device's own generator of the class, else from one the coordinator cached (another device's), else
   from scratch (`init_steps`; a warm start takes `transfer_steps`).
4. The bank stores them at `precision` (float32, float16 or int8). When one does not fit M the drop rule below
   decides; the budget is never exceeded.

Budget split (documented choice): the bank may take at most `bank_share` of M, so the store always keeps room
for the next round's real data; the store may take M less what the bank holds.

Drop rule (documented choice; the paper counts no storage): a class's new generator is written next to its old
one and replaces it atomically. If that would exceed M, the generators of other classes are evicted one at a
time, fewest samples seen first (they carry the least replay weight; ties: the lowest label), never a class of
the current round; if it still does not fit, the class keeps its previous generator (or none), and the drop is
counted in the round's metrics. A class without a generator is never sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from edge_client.policies.base import ReplayPolicy, Samples
from edge_client.policies.no_replay import NoReplay

if TYPE_CHECKING:
    from edge_client.generators.bank import GeneratorBank
    from edge_client.generators.record import GeneratorRecord
    from edge_client.learner import Learner

BANK_DIR = "generators"


def replay_counts(cumulative: np.ndarray, current: np.ndarray) -> np.ndarray:
    """pFedGRP's label-quantity scaling (Sec. 4.1): how many samples of each class to generate this round.

    `cumulative` counts every sample seen per class, this round's included; `current` counts this round's. The
    cumulative counts are scaled by s = max over this round's classes of current / cumulative, so one class's scaled
    count equals its real count; the supplement (scaled - real) is capped at the largest real class count and
    rounded half to even. A class new this round gets 0 (its scaled count is its real count), so its untrained
    generator is never sampled.
    """
    cumulative = np.asarray(cumulative, dtype=np.int64)
    current = np.asarray(current, dtype=np.int64)
    if cumulative.shape != current.shape or (current > cumulative).any() or (current < 0).any():
        raise ValueError("cumulative counts must include this round's counts, class by class")
    present = current > 0
    if not present.any():
        return np.zeros_like(current)
    scale = np.max(current[present] / cumulative[present])
    supplement = np.rint(scale * cumulative - current)
    return np.clip(supplement, 0, current.max()).astype(np.int64)


@dataclass
class GeneratorReplay(ReplayPolicy):
    name = "generator"
    keeps_old = False  # the old real data are deleted at every task switch

    kind: str = "vae"  # "vae" or "wgan-gp" (models/generators.py)
    precision: str = "float16"  # how the bank stores generators: float32, float16 or int8
    backend: str = "auto"  # generator training: "torch", "ort" (VAE only: ORT Training artifacts), or "auto": the
    # backend the device trains its task model with
    lambda_align: float = 1.0  # weight of the alignment term (the paper does not give it; its section 5 uses 1)
    init_steps: int = 200  # optimisation steps of a generator trained from scratch
    transfer_steps: int = 50  # steps of a warm-started one
    keep_auxiliary: bool = True  # also store the critic / encoder, for better warm starts (counts against M)
    bank_share: float = 0.5  # the most of M the generators may take; the rest stays the store's
    artifacts: str = ""  # generator artifact folder; "" = <model artifacts>/generator-<kind>
    _bank: GeneratorBank | None = field(default=None, init=False, repr=False)
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    rank = NoReplay.rank

    # --- the plugin hooks the learner calls ------------------------------------------------------

    def open(self, learner: Learner, state_dir: Path, model_artifacts: Path) -> None:
        from edge_client.generators.bank import GeneratorBank
        from edge_client.generators.sampler import OnnxSampler
        from edge_client.generators.training import make_generator_trainer

        if self.lambda_align > 0 and not learner.trainer.supports_alignment:
            raise ValueError("lambda_align > 0 needs a trainer with the alignment term (the torch backend); the ORT "
                             "backend's training graph has a cross-entropy loss only: set lambda_align = 0")
        folder = Path(self.artifacts) if self.artifacts else Path(model_artifacts).parent / f"generator-{self.kind}"
        if not (folder / "generator.json").exists():
            raise FileNotFoundError(f"no generator artifacts at {folder}: export them with `edgefil export "
                                    f"--generator {self.kind} --input-shape ... --out {folder}` (or set [policy] "
                                    f"artifacts)")
        self._sampler = OnnxSampler(folder)  # verifies the artifacts (generator.json, file hashes)
        self._spec = self._sampler.info.spec
        if not 0.0 < self.bank_share <= 1.0:
            raise ValueError(f"bank_share must lie in (0, 1], got {self.bank_share}")
        budget = learner.byte_budget
        limit = None if budget is None else (
            lambda: min(int(self.bank_share * budget), budget - learner.store.bytes_on_disk()))
        self._bank = GeneratorBank(Path(state_dir) / BANK_DIR, limit)
        backend = learner.trainer.backend if self.backend == "auto" else self.backend
        self._trainer = make_generator_trainer(self._spec, backend, folder)

    def storage_bytes(self) -> int:
        return self._bank.bytes_on_disk() if self._bank is not None else 0

    def replay_samples(self, learner: Learner) -> Samples | None:
        """This round's synthetic samples: `replay_counts` per class, from classes that have a generator."""
        bank = self._require_bank()
        counts = replay_counts(learner.state.label_counts, learner.state.task_counts)
        trained = set(bank.classes())
        parts = [(c, int(n)) for c, n in enumerate(counts) if n > 0 and c in trained]
        self._round = {"replayed_samples": float(sum(n for _, n in parts))}
        if not parts:
            return None
        xs = [self._sampler.sample(bank.get(c), n, learner.rng) for c, n in parts]
        y = np.concatenate([np.full(n, c, dtype=np.int64) for c, n in parts])
        return Samples(np.concatenate(xs), y, np.full(len(y), -1, dtype=np.int64))

    def after_training(self, learner: Learner, x: np.ndarray, y: np.ndarray,
                       offered: Mapping[int, GeneratorRecord]) -> None:
        """Train and store the generators of this round's classes (the drop rule of the module docstring)."""
        from edge_client.generators.record import GeneratorRecord, quantize

        bank = self._require_bank()
        classes = sorted(np.unique(y).tolist())
        dropped = own_starts = offered_starts = 0
        usable = {c: r for c, r in offered.items() if self._fits(r)}  # a cached generator of another model is no start
        for c in classes:
            own = bank.get(c) if c in bank.classes() else None
            start = own if own is not None else usable.get(c)
            steps = self.transfer_steps if start is not None else self.init_steps
            own_starts += own is not None
            offered_starts += own is None and start is not None
            sampler, auxiliary = self._trainer.train(x[y == c], start, steps, learner.rng)
            seen_before = own.trained_samples if own is not None else 0
            record = quantize(GeneratorRecord(
                label=c, spec=self._spec, precision="float32", sampler=sampler,
                auxiliary=auxiliary if self.keep_auxiliary else None,
                trained_samples=seen_before + int((y == c).sum()),
                steps=(start.steps if start is not None else 0) + steps,
            ), self.precision)
            if not self._put(bank, record, protected=classes, counts=learner.state.label_counts):
                dropped += 1
        self._round.update(generators=float(len(bank.classes())), generators_dropped=float(dropped),
                           generators_from_own=float(own_starts), generators_from_coordinator=float(offered_starts),
                           generator_bytes=float(bank.bytes_on_disk()))

    def wanted_generators(self, learner: Learner, cached: list[int]) -> list[int]:
        """Classes of this task the device has no generator of, among those the coordinator holds."""
        counts, have = learner.state.task_counts, set(self._require_bank().classes())
        return [c for c in cached if c < len(counts) and counts[c] > 0 and c not in have]

    def attachments(self, learner: Learner) -> dict[str, bytes]:
        """What the update carries besides the model: this task's generators, as stored (pFedGRP's upload)."""
        from edge_client.generators.record import encode_record

        bank = self._require_bank()
        stored = set(bank.classes())
        current = [c for c, n in enumerate(learner.state.task_counts) if n > 0 and c in stored]
        return {f"generator/{c}": encode_record(bank.get(c)) for c in current}

    def metrics(self) -> dict[str, float]:
        return dict(self._round)

    # --- the bank ---------------------------------------------------------------------------------

    def _put(self, bank: GeneratorBank, record: GeneratorRecord, protected: list[int], counts: list[int]) -> bool:
        from edge_client.generators.bank import BankFullError

        while True:
            try:
                bank.put(record)
                return True
            except BankFullError:
                victims = sorted((counts[c] if c < len(counts) else 0, c)
                                 for c in bank.classes() if c not in protected)
                if not victims:
                    return False
                bank.delete(victims[0][1])

    def _fits(self, record: GeneratorRecord) -> bool:
        try:
            self._sampler.check(record)
            return True
        except ValueError:
            return False

    def _require_bank(self) -> GeneratorBank:
        if self._bank is None:
            raise RuntimeError("the generator policy is not open: the learner calls open() with its state folder")
        return self._bank
