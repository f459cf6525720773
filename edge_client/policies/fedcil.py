"""`fedcil`: the FedCIL baseline of Re-Fed's Table 1: each client keeps a small ACGAN (models/acgan.py) and
replays generated samples of its earlier classes instead of caching raw ones, within the device's byte budget.

A round:
1. The old real data go at every task switch (`rank` keeps nothing): the store holds the current task only.
2. The task model trains on the store's samples and, for each class the device saw before this task and the
   generator has learnt, `replay_per_class` generated samples labelled with the class they were conditioned on
   (0: as many as the current task's classes hold on average).
3. After it, the ACGAN takes `gan_steps` steps on the current task's real samples, warm-started from the stored
   generator and discriminator; the earlier classes come from the replay generator (generated samples counted as
   real), so the generator keeps them. Then it is stored at `precision`.

The replay generator (`replay_from`), which draws the earlier classes for both the task model and the ACGAN, is by
default the generator as it stood when the device's current task began (`"task"`), frozen and kept for the whole
task: the authors' code (daiqing98/FedCIL) copies its `last_generator` in `next_task`, as Deep Generative Replay
keeps the previous scholar. It costs a second generator in M's bytes (stored in the same file, with the task it was
frozen for). `"round"` replays from the generator stored at the round's start instead: one generator fewer, but
within a task the earlier classes then pass through one more self-replay every round, and measured offline on
Fashion-MNIST (benchmarks/fedcil_freeze.py, docs/results.md) the old classes fade much faster (0.10 of them read
as their class against 0.26 at 2000 steps a round). A device's task switch is the first round it trains in a task
after another: a device that sat out a whole task freezes what it last learnt, which is all it has.

Storage: one file, `fedcil/acgan.npz` in the state folder (generator and discriminator as flat buffers, the classes
learnt, the spec, and under `replay_from = "task"` the replay generator, its classes and its task), a `BudgetedFile`
of the device's budget (replaced atomically, within `acgan_share` of M's bytes, which leaves the rest to the store
for the next task's real data). A new file that would not fit (while the old one is still there) is not written: the
device keeps its previous ACGAN and counts `acgan_dropped`. An ACGAN whose replacement could never fit that share is
refused at open, in one line: it would be written once and never updated. And when a new task's real samples still
do not fit beside the stored ACGAN, the learner asks the policy to release its bytes (`release_bytes`): the ACGAN
file goes (`acgan_released`), real data first. Under a sample-only M (no `[store] max_bytes`) nothing bounds its
bytes, as for pFedGRP's generator bank. A file that does not load is removed (logged) and the ACGAN starts afresh.

Deviations from FedCIL (documented in docs/architecture.md): the classifier is the runtime's task model, not the
ACGAN's auxiliary head; the ACGAN stays on its device (FedCIL also averages generators on the server and
consolidates the global model with their samples, which needs a generator per client on the server: left out, as
Re-Fed's adaptation of FedCIL to its setting does not say which parts it kept); no feature-alignment term. It
needs torch for the ACGAN (the task model trains on any backend).
"""
from __future__ import annotations

import io
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from edge_client.budget import BudgetedFile, replacement_peak
from edge_client.policies.base import PolicyContext, RoundView, TrainingSet
from edge_client.policies.no_replay import NoReplay
from edgefil.durable import read_npz

ACGAN_DIR = "fedcil"
ACGAN_FILE = "acgan.npz"
ACGAN_HOLDER = "acgan"  # its name among the budget's holders
PRECISIONS = {"float32": np.float32, "float16": np.float16}
REPLAY_FROM = ("task", "round")  # the replay generator: frozen when the device's task began, or at the round's start
log = logging.getLogger(__name__)


class StoredAcgan(NamedTuple):
    """The ACGAN file as loaded, in float32: the generator and discriminator being trained, the classes they have
    learnt, and the replay generator frozen at `replay_task`'s start with its classes (None under `"round"`, and
    before the device's second task)."""

    generator: np.ndarray
    discriminator: np.ndarray
    classes: set[int]
    replay: np.ndarray | None = None
    replay_classes: frozenset[int] = frozenset()
    replay_task: int = -1


@dataclass
class FedCil(NoReplay):
    name = "fedcil"

    latent_dim: int = 16
    width: int = 16  # the DCGAN layers' base width (models/generators.py)
    gan_steps: int = 200  # ACGAN steps per round (one discriminator and one generator step each)
    gan_lr: float = 2e-4  # Adam, betas (0.5, 0.999), as DCGAN and ACGAN
    replay_per_class: int = 0  # generated samples per earlier class and round; 0: the current classes' mean count
    replay_from: str = "task"  # REPLAY_FROM: the replay generator frozen at the task switch (authors') or each round
    precision: str = "float16"  # how the stored ACGAN's weights are kept: float32 or float16
    # The most of M's bytes the ACGAN may take, its replacement's write peak included; the rest stays the store's,
    # so the next task's real data always find room (as pFedGRP's bank_share). Without it, an ACGAN that fits M
    # can leave the store too little for a task: the device then trains on nothing (seen at 160 KiB on digits).
    acgan_share: float = 0.5
    _spec: Any = field(default=None, init=False, repr=False)
    _file: BudgetedFile | None = field(default=None, init=False, repr=False)
    _sizes: list[int] = field(default_factory=list, init=False, repr=False)  # flat lengths: generator, discriminator
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _released: bool = field(default=False, init=False, repr=False)  # release_bytes gave the ACGAN up this round

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.replay_from not in REPLAY_FROM:
            raise ValueError(f"replay_from must be one of {', '.join(REPLAY_FROM)}, got {self.replay_from!r}")
        for name in ("latent_dim", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gan_steps < 0 or self.replay_per_class < 0:
            raise ValueError("gan_steps and replay_per_class must be >= 0")
        if not (np.isfinite(self.gan_lr) and self.gan_lr > 0):
            raise ValueError(f"gan_lr must be finite and > 0, got {self.gan_lr}")

    def open(self, ctx: PolicyContext) -> None:
        if not 0.0 < self.acgan_share <= 1.0:
            raise ValueError(f"acgan_share must lie in (0, 1], got {self.acgan_share}")
        try:
            from models.acgan import AcganSpec
        except ImportError as err:
            raise ValueError(f"policy fedcil trains its ACGAN with torch, not installed here ({err})") from None
        manifest = ctx.trainer.manifest
        self._spec = AcganSpec(tuple(manifest.input_shape), manifest.num_classes, self.latent_dim, self.width)
        self._spec.layers()  # refuses an input shape the DCGAN layers cannot take, in one line
        from models.acgan import build_acgan
        from models.generators import flat_entries

        self._sizes = [sum(v.numel() for _, v in flat_entries(m)) for m in build_acgan(self._spec, 0)]
        self._file = BudgetedFile(ctx.budget, ACGAN_HOLDER, Path(ctx.state_dir) / ACGAN_DIR / ACGAN_FILE,
                                  share=self.acgan_share)
        self._check_share(build_acgan(self._spec, 0))
        if self._file.exists() and self._load() is None:
            log.warning("removing %s: it does not hold an ACGAN of this spec", self._file.path)
            self._file.remove()

    # --- the round ------------------------------------------------------------------------------

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        """The store's samples and generated ones of the earlier classes the ACGAN has learnt."""
        import torch

        replay = self._replay(view, self._load())
        old = [] if replay is None else sorted(set(view.seen_before_task().tolist()) & replay[1])
        self._round = {"replayed_samples": 0.0, "acgan_released": float(self._released)}
        self._released = False
        if replay is None or not old or not len(y):
            return TrainingSet(x, y)
        per_class = self.replay_per_class or int(round(len(y) / len(np.unique(y))))
        labels = np.repeat(np.asarray(old, dtype=np.int64), per_class)
        generator = self._generator(replay[0])
        noise = torch.Generator().manual_seed(int(view.rng.integers(2**31 - 1)))
        with torch.no_grad():
            made = generator(torch.randn(len(labels), self.latent_dim, generator=noise), torch.from_numpy(labels))
        self._round["replayed_samples"] = float(len(labels))
        return TrainingSet(np.concatenate([x, made.numpy().astype(np.float32)]), np.concatenate([y, labels]))

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        """`gan_steps` ACGAN steps on this task's real samples and the replay generator's earlier classes."""
        import torch

        from models.acgan import build_acgan, train_acgan

        if not len(y) or self.gan_steps == 0:
            return
        stored = self._load()
        replay = self._replay(view, stored)
        seed = int(view.rng.integers(2**31 - 1))
        generator, discriminator = build_acgan(self._spec, seed)
        if stored is not None:
            _load_flat(generator, stored.generator)
            _load_flat(discriminator, stored.discriminator)
        # the earlier classes: under "round" those the stored generator learnt but this round's data do not bring;
        # under "task" all the frozen generator learnt (in a domain-incremental stream the same labels in their
        # earlier domains)
        old = [] if replay is None else sorted(replay[1] - (set(np.unique(y).tolist()) if self.replay_from == "round"
                                                             else set()))
        previous = self._generator(replay[0]) if old and replay is not None else None
        known = set() if stored is None else stored.classes
        classes = np.asarray(sorted({*known, *old, *np.unique(y).tolist()}), dtype=np.int64)
        loss_d, loss_g = train_acgan(generator, discriminator, x, y, classes, self.gan_steps, view.batch_size,
                                     self.gan_lr, view.rng, torch.Generator().manual_seed(seed), previous, old)
        frozen = None if self.replay_from == "round" else self._frozen(view, stored)
        saved = self._held().write(self._encode(generator, discriminator, {int(c) for c in classes}, frozen))
        self._round.update(acgan_loss_d=float(loss_d.item()), acgan_loss_g=float(loss_g.item()),
                           acgan_dropped=float(not saved), acgan_bytes=float(self._held().bytes_on_disk()))

    def metrics(self) -> dict[str, float]:
        return dict(self._round)

    # --- the stored ACGAN -----------------------------------------------------------------------

    def _frozen(self, view: RoundView, stored: StoredAcgan | None) -> tuple[np.ndarray, frozenset[int], int] | None:
        """The replay generator of this task under `"task"`: the stored one when it was frozen for this task, else
        (the device's first round of a task) the generator as the device ends its previous task; None before any."""
        if stored is None:
            return None
        if stored.replay is not None and stored.replay_task == view.task:
            return stored.replay, stored.replay_classes, view.task
        return stored.generator, frozenset(stored.classes), view.task

    def _replay(self, view: RoundView, stored: StoredAcgan | None) -> tuple[np.ndarray, frozenset[int]] | None:
        """The generator the earlier classes are drawn from this round and the classes it has learnt."""
        if stored is None:
            return None
        if self.replay_from == "round":
            return stored.generator, frozenset(stored.classes)
        frozen = self._frozen(view, stored)
        return None if frozen is None else frozen[:2]

    def _generator(self, flat: np.ndarray) -> Any:
        from models.acgan import build_acgan

        generator, _ = build_acgan(self._spec, 0)
        _load_flat(generator, flat)
        return generator.eval()

    def _load(self) -> StoredAcgan | None:
        """The ACGAN as stored, in float32; None when there is none or it does not load as this spec's."""
        stored = self._held().read()
        if stored is None:
            return None
        try:
            data = read_npz(stored)
            spec = data["spec"].tolist()
            flats = [data["generator"].astype(np.float32), data["discriminator"].astype(np.float32)]
            classes = set(data["classes"].tolist())
            sizes = list(self._sizes)
            if "replay" in data:
                flats.append(data["replay"].astype(np.float32))
                sizes.append(self._sizes[0])
                replay_classes, replay_task = frozenset(data["replay_classes"].tolist()), int(data["replay_task"])
        except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile):
            return None
        if spec != self._spec_numbers() or [f.size for f in flats] != sizes or not all(
                np.isfinite(f).all() for f in flats):
            return None
        if len(flats) == 2:
            return StoredAcgan(flats[0], flats[1], classes)
        return StoredAcgan(flats[0], flats[1], classes, flats[2], replay_classes, replay_task)

    def _check_share(self, acgan: tuple[Any, Any]) -> None:
        """Refuse, in one line, an ACGAN whose replacement (the new file written beside the old) can never fit its
        share of M's bytes: it would be written once and then never updated again (every later save dropped)."""
        held = self._held()
        from models.generators import flatten_module

        every = set(range(self._spec.num_classes))
        frozen = None if self.replay_from == "round" else (flatten_module(acgan[0]), frozenset(every), 0)
        size = len(self._encode(*acgan, every, frozen))
        if not held.can_ever_hold(size):
            raise ValueError(
                f"policy fedcil: replacing its ACGAN (width {self.width}, {self.precision}, {size} bytes) peaks at "
                f"{replacement_peak(size, held.block)} bytes, more than acgan_share {self.acgan_share} of [store] "
                f"max_bytes leaves ({held.limit}); lower width or raise max_bytes")

    def _encode(self, generator: Any, discriminator: Any, classes: set[int],
                frozen: tuple[np.ndarray, frozenset[int], int] | None = None) -> bytes:
        """The stored ACGAN's file: the spec, both networks as flat buffers at `precision`, the classes learnt, and
        the replay generator with its classes and task when there is one."""
        from models.generators import flatten_module

        dtype = PRECISIONS[self.precision]
        arrays: dict[str, Any] = {"spec": np.asarray(self._spec_numbers(), dtype=np.int64),
                                  "generator": flatten_module(generator).astype(dtype),
                                  "discriminator": flatten_module(discriminator).astype(dtype),
                                  "classes": np.asarray(sorted(classes), dtype=np.int64)}
        if frozen is not None:
            arrays.update(replay=frozen[0].astype(dtype), replay_classes=np.asarray(sorted(frozen[1]), dtype=np.int64),
                          replay_task=np.asarray(frozen[2], dtype=np.int64))
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    def release_bytes(self, view: RoundView) -> bool:
        """The stored ACGAN goes when the new task's real samples would not fit beside it (counted in
        `acgan_released`); the next save writes a new one if it fits what the store then leaves."""
        if not self._held().remove():
            return False
        self._released = True
        return True

    def _spec_numbers(self) -> list[int]:
        return [self._spec.num_classes, self.latent_dim, self.width, *self._spec.input_shape]

    def _held(self) -> BudgetedFile:
        if self._file is None:
            raise RuntimeError("the fedcil policy is not open: the learner calls open() with its state folder")
        return self._file


def _load_flat(module: Any, flat: np.ndarray) -> None:
    from models.generators import load_module

    load_module(module, np.ascontiguousarray(flat, dtype=np.float32))
