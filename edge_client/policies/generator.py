"""`generator`: pFedGRP's generator replay (spec: shared/specs/pfedgrp.md, section 2).

Instead of caching raw samples the device keeps one small unconditional generator per class it has seen, in a
`GeneratorBank` beside the replay store, and every byte of the bank counts against the same budget M as the
store. A round:

1. The old real data go (the store keeps only the current task: `rank` keeps nothing).
2. Replay: `replay_counts` (label-quantity scaling) says how many samples of each old class to generate; they
   are trained on together with the new data (a plain union), with the alignment term against the previous
   personalized model (the coordinator's "personal" payload) on the samples of classes seen before
   (`lambda_align`, Eq. 6): the teacher term of the generic loss, so both trainer backends run it.
3. After the task model, the generators of this round's classes are trained on its real samples: a warm start
   from the device's own generator of the class, else from one the coordinator cached (another device's: the
   round's config lists the classes it holds, `generator_classes`; the device asks for those new to it as
   `generator/<class>` payloads while it trains), else from scratch (`init_steps`; a warm start takes
   `transfer_steps`).
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from edge_client.policies.base import AttachedValues, PolicyContext, ReplayPolicy, RoundView, TrainingSet
from edge_client.policies.no_replay import NoReplay
from edge_client.trainers.base import LossInputs
from models.generator_record import attachment_label, attachment_name
from models.manifest import FULL_GRADIENT

if TYPE_CHECKING:
    from edge_client.generators.bank import GeneratorBank
    from models.generator_record import GeneratorRecord

BANK_DIR = "generators"
BANK_HOLDER = "generators"  # the bank's name among the budget's holders
PERSONAL = "personal"  # the coordinator's payload holding this device's personalized model (float32 weights)


def replay_counts(cumulative: ArrayLike, current: ArrayLike) -> np.ndarray:
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

    kind: str = "vae"  # "vae", "conv-vae" or "wgan-gp" (models/generators.py)
    # how the bank stores generators: float32, float16 or int8. int8 by default: a generator sampled from its int8
    # weights is recognised as often as from its float32 ones (within 0.2 points), and at equal bytes the int8
    # bank without encoders holds every class where float16 with them holds 3-4 (docs/results-history.md, "Generators at
    # equal bytes")
    precision: str = "int8"
    backend: str = "auto"  # generator training: "torch", "ort" (VAE only: ORT Training artifacts), or "auto": the
    # backend the device trains its task model with, or torch when that is "portable" (no generator graphs yet)
    lambda_align: float = 1.0  # weight of the alignment term (the paper does not give it; its section 5 uses 1)
    # The paper's step counts (Sec. 5): 1000 from scratch, 100 warm-started. A VAE affords them on every profile
    # (ms per step at these sizes); a WGAN-GP takes n_critic + 1 passes a step, with a double backward, so a slow
    # device sets fewer (docs/generators.md gives the measured costs).
    init_steps: int = 1000  # optimisation steps of a generator trained from scratch
    transfer_steps: int = 100  # steps of a warm-started one
    # also store the critic / encoder, for better warm starts (counts against M: it doubles a VAE's record, and at
    # equal bytes the bank then holds too few classes to replay; measured with the precision above)
    keep_auxiliary: bool = False
    bank_share: float = 0.5  # the most of M the generators may take; the rest stays the store's
    artifacts: str = ""  # generator artifact folder; "" = <model artifacts>/generator-<kind>
    _bank: GeneratorBank | None = field(default=None, init=False, repr=False)
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _teacher: np.ndarray | None = field(default=None, init=False, repr=False)  # this round's personalized model
    _offered: dict[int, GeneratorRecord] = field(default_factory=dict, init=False, repr=False)
    _attached: list[GeneratorRecord] = field(default_factory=list, init=False, repr=False)  # what `attachments` gave

    rank = NoReplay.rank

    # --- the plugin hooks the learner calls ------------------------------------------------------

    @classmethod
    def export_artifacts(cls, options: Mapping[str, Any], model_artifacts: Path, seed: int = 0) -> None:
        """The generator artifacts `open` looks for (`<model artifacts>/../generator-<kind>`), exported when missing
        and the options name no folder of their own. Host only: it imports the exporter (torch, onnx)."""
        if options.get("artifacts"):
            return
        kind = str(options.get("kind", cls.kind))
        folder = Path(model_artifacts).parent / f"generator-{kind}"
        if (folder / "generator.json").is_file():
            return
        from models.generator_export import export_generator_artifacts
        from models.generators import default_spec
        from models.manifest import load_manifest

        shape = tuple(load_manifest(model_artifacts).input_shape)
        export_generator_artifacts(default_spec(kind, shape), folder, seed=seed)

    def trainer_graphs(self) -> frozenset[str]:
        """The alignment term (`lambda_align`) is a teacher's: the whole loss's gradient."""
        return frozenset({FULL_GRADIENT}) if self.lambda_align > 0 else frozenset()

    def open(self, ctx: PolicyContext) -> None:
        from edge_client.generators.bank import GeneratorBank
        from edge_client.generators.choice import BACKENDS as GENERATOR_BACKENDS
        from edge_client.generators.choice import make_generator_trainer
        from edge_client.generators.sampler import OnnxSampler

        folder = Path(self.artifacts) if self.artifacts else ctx.artifacts.parent / f"generator-{self.kind}"
        if not (folder / "generator.json").exists():
            raise FileNotFoundError(f"no generator artifacts at {folder}: export them with `edgefil export "
                                    f"--generator {self.kind} --input-shape ... --out {folder}` (or set [policy] "
                                    f"artifacts)")
        self._sampler = OnnxSampler(folder)  # verifies the artifacts (generator.json, file hashes)
        self._spec = self._sampler.info.spec
        if not 0.0 < self.bank_share <= 1.0:
            raise ValueError(f"bank_share must lie in (0, 1], got {self.bank_share}")
        budget = ctx.budget
        total = budget.max_bytes
        limit = None if total is None else (
            lambda: min(int(self.bank_share * total), budget.room(BANK_HOLDER) or 0))
        self._bank = GeneratorBank(Path(ctx.state_dir) / BANK_DIR, limit)
        budget.register(BANK_HOLDER, self._bank.bytes_on_disk)
        backend = self.backend
        if backend == "auto":  # the task model's backend where it trains generators (not "portable"), else torch
            backend = ctx.trainer.backend if ctx.trainer.backend in GENERATOR_BACKENDS else "torch"
        self._trainer = make_generator_trainer(self._spec, backend, folder)

    def requests(self, view: RoundView, config: Mapping[str, Any]) -> list[str]:
        """The coordinator's cached generators of this task's classes the device has none of."""
        counts, have = view.task_counts, set(self._require_bank().classes())
        cached = [c for c in config.get("generator_classes", []) if isinstance(c, int) and not isinstance(c, bool)]
        return [attachment_name(c) for c in cached if 0 <= c < len(counts) and counts[c] > 0 and c not in have]

    def receive(self, view: RoundView, payloads: Mapping[str, bytes]) -> None:
        """The personalized model (the teacher of this round's alignment term) and cached generators (warm
        starts); a payload that does not decode is ignored, logged by the caller's counters."""
        from models.generator_record import decode_record

        if PERSONAL in payloads:
            weights = np.frombuffer(payloads[PERSONAL], dtype="<f4")
            if weights.size == view.trainer.manifest.num_parameters and np.isfinite(weights).all():
                self._teacher = weights.astype(np.float32)
        for name, data in payloads.items():
            label = attachment_label(name)
            if label is not None:
                self._offered[label] = decode_record(bytes(data))

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        """The store's samples and this round's synthetic ones (`replay_counts` per class with a generator), with
        the alignment term on samples of classes seen before the task, when a teacher came."""
        bank = self._require_bank()
        counts = replay_counts(view.label_counts, view.task_counts)
        trained = set(bank.classes())
        parts = [(c, int(n)) for c, n in enumerate(counts) if n > 0 and c in trained]
        self._round = {"replayed_samples": float(sum(n for _, n in parts))}
        if parts:
            x = np.concatenate([x, *(self._sampler.sample(bank.get(c), n, view.rng) for c, n in parts)])
            y = np.concatenate([y, *(np.full(n, c, dtype=np.int64) for c, n in parts)])
        teacher, self._teacher = self._teacher, None
        applies = np.isin(y, view.seen_before_task()).astype(np.float32)
        if teacher is None or self.lambda_align <= 0 or not applies.any():  # t = 1: nothing seen before
            return TrainingSet(x, y)
        loss = LossInputs(teacher_logits=view.trainer.teacher_logits(teacher, x),
                          teacher_weights=np.float32(self.lambda_align) * applies)
        return TrainingSet(x, y, loss)

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        """Train and store the generators of this round's classes (the drop rule of the module docstring)."""
        from models.generator_record import GeneratorRecord, quantize

        bank = self._require_bank()
        offered, self._offered = self._offered, {}
        classes = sorted(np.unique(y).tolist())
        dropped = own_starts = offered_starts = 0
        usable = {c: r for c, r in offered.items() if self._fits(r)}  # a cached generator of another model is no start
        for c in classes:
            own = bank.get(c) if c in bank.classes() else None
            start = own if own is not None else usable.get(c)
            steps = self.transfer_steps if start is not None else self.init_steps
            own_starts += own is not None
            offered_starts += own is None and start is not None
            sampler, auxiliary = self._trainer.train(x[y == c], start, steps, view.rng)
            seen_before = own.trained_samples if own is not None else 0
            record = quantize(GeneratorRecord(
                label=c, spec=self._spec, precision="float32", sampler=sampler,
                auxiliary=auxiliary if self.keep_auxiliary else None,
                trained_samples=seen_before + int((y == c).sum()),
                steps=(start.steps if start is not None else 0) + steps,
            ), self.precision)
            if not self._put(bank, record, protected=classes, counts=view.label_counts):
                dropped += 1
        self._round.update(generators=float(len(bank.classes())), generators_dropped=float(dropped),
                           generators_from_own=float(own_starts), generators_from_coordinator=float(offered_starts),
                           generator_bytes=float(bank.bytes_on_disk()))

    def attaches(self) -> bool:
        return True

    def attachments(self, view: RoundView) -> dict[str, bytes]:
        """What the update carries besides the model: this task's generators, as stored (pFedGRP's upload)."""
        from models.generator_record import encode_record

        bank = self._require_bank()
        stored = set(bank.classes())
        self._attached = [bank.get(c) for c, n in enumerate(view.task_counts) if n > 0 and c in stored]
        return {attachment_name(record.label): encode_record(record) for record in self._attached}

    def attached_values(self) -> AttachedValues | None:
        """The generators' weights (sampler, then auxiliary where kept), one record after another; released, each
        record keeps its header (class, spec, the samples and steps it was trained with: metadata, as an update's
        sample count) and its precision."""
        from dataclasses import replace

        from models.generator_record import encode_record

        if not self._attached:
            return None
        records = list(self._attached)
        parts = [[r.sampler, *([] if r.auxiliary is None else [r.auxiliary])] for r in records]
        sizes = [len(a) for arrays in parts for a in arrays]

        def encode(values: np.ndarray) -> dict[str, bytes]:
            pieces = iter(np.split(values.astype(np.float32), np.cumsum(sizes)[:-1]))
            released = {}
            for record in records:
                sampler = next(pieces)
                auxiliary = None if record.auxiliary is None else next(pieces)
                released[attachment_name(record.label)] = encode_record(
                    replace(record, sampler=sampler, auxiliary=auxiliary))
            return released

        return AttachedValues(np.concatenate([a for arrays in parts for a in arrays]).astype(np.float64), encode)

    def releases_values(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return dict(self._round)

    # --- the bank ---------------------------------------------------------------------------------

    def _put(self, bank: GeneratorBank, record: GeneratorRecord, protected: list[int], counts: np.ndarray) -> bool:
        from edge_client.generators.bank import BankFullError

        while True:
            try:
                bank.put(record)
                return True
            except BankFullError:
                victims = sorted((int(counts[c]) if c < len(counts) else 0, c)
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
