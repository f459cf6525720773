"""`fedcil`: the FedCIL baseline of Re-Fed's Table 1: each client keeps a small ACGAN (models/acgan.py) and
replays generated samples of its earlier classes instead of caching raw ones, within the device's byte budget.

A round:
1. The old real data go at every task switch (`rank` keeps nothing): the store holds the current task only.
2. The task model trains on the store's samples and, for each class the device saw before this task and the
   generator has learnt, `replay_per_class` generated samples labelled with the class they were conditioned on
   (0: as many as the current task's classes hold on average).
3. After it, the ACGAN takes `gan_steps` steps on the current task's real samples, warm-started from the stored
   generator and discriminator; the earlier classes come from a frozen copy of the previous generator (its own
   replay), so the generator keeps them. Then it is stored at `precision`.

Storage: one file, `fedcil/acgan.npz` in the state folder (generator and discriminator as flat buffers, the classes
learnt, the spec), a `BudgetedFile` of the device's budget (replaced atomically, within `acgan_share` of M's
bytes, which leaves the rest to the store for the next task's real data). A new file that would not fit (while the
old one is still there) is not written: the device keeps its previous ACGAN and counts `acgan_dropped`. An ACGAN
whose replacement could never fit that share is refused at open, in one line: it would be written once and never
updated. And when a new task's real samples still do not fit beside the stored ACGAN, the learner asks the policy
to release its bytes (`release_bytes`): the ACGAN file goes (`acgan_released`), real data first. Under a
sample-only M (no `[store] max_bytes`) nothing bounds its bytes, as for pFedGRP's generator bank. A file that does
not load is removed (logged) and the ACGAN starts afresh.

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
from typing import Any

import numpy as np

from edge_client.budget import BudgetedFile, replacement_peak
from edge_client.policies.base import PolicyContext, RoundView, TrainingSet
from edge_client.policies.no_replay import NoReplay
from edgefil.durable import read_npz

ACGAN_DIR = "fedcil"
ACGAN_FILE = "acgan.npz"
ACGAN_HOLDER = "acgan"  # its name among the budget's holders
PRECISIONS = {"float32": np.float32, "float16": np.float16}
log = logging.getLogger(__name__)


@dataclass
class FedCil(NoReplay):
    name = "fedcil"

    latent_dim: int = 16
    width: int = 16  # the DCGAN layers' base width (models/generators.py)
    gan_steps: int = 200  # ACGAN steps per round (one discriminator and one generator step each)
    gan_lr: float = 2e-4  # Adam, betas (0.5, 0.999), as DCGAN and ACGAN
    replay_per_class: int = 0  # generated samples per earlier class and round; 0: the current classes' mean count
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

        stored = self._load()
        old = [] if stored is None else sorted(set(view.seen_before_task().tolist()) & stored[2])
        self._round = {"replayed_samples": 0.0, "acgan_released": float(self._released)}
        self._released = False
        if stored is None or not old or not len(y):
            return TrainingSet(x, y)
        per_class = self.replay_per_class or int(round(len(y) / len(np.unique(y))))
        labels = np.repeat(np.asarray(old, dtype=np.int64), per_class)
        generator = self._generator(stored)
        noise = torch.Generator().manual_seed(int(view.rng.integers(2**31 - 1)))
        with torch.no_grad():
            made = generator(torch.randn(len(labels), self.latent_dim, generator=noise), torch.from_numpy(labels))
        self._round["replayed_samples"] = float(len(labels))
        return TrainingSet(np.concatenate([x, made.numpy().astype(np.float32)]), np.concatenate([y, labels]))

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        """`gan_steps` ACGAN steps on this task's real samples and the previous generator's earlier classes."""
        import torch

        from models.acgan import acgan_step, build_acgan

        if not len(y) or self.gan_steps == 0:
            return
        stored = self._load()
        seed = int(view.rng.integers(2**31 - 1))
        generator, discriminator = build_acgan(self._spec, seed)
        old: list[int] = []
        previous = None
        if stored is not None:
            _load_flat(generator, stored[0])
            _load_flat(discriminator, stored[1])
            old = sorted(stored[2] - set(np.unique(y).tolist()))
            previous = self._generator(stored) if old else None
        noise = torch.Generator().manual_seed(seed)
        opt_g = torch.optim.Adam(generator.parameters(), lr=self.gan_lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=self.gan_lr, betas=(0.5, 0.999))
        classes = np.asarray(sorted({*old, *np.unique(y).tolist()}), dtype=np.int64)
        batch = view.batch_size
        generator.train()
        loss_d = loss_g = torch.zeros(())
        for _ in range(self.gan_steps):
            pick = view.rng.choice(len(y), size=min(batch, len(y)), replace=False)
            real_x, real_y = torch.from_numpy(np.ascontiguousarray(x[pick])), torch.from_numpy(y[pick])
            if previous is not None:  # the earlier classes, from the previous generator, count as real
                replay_y = torch.from_numpy(view.rng.choice(np.asarray(old, dtype=np.int64), size=len(pick)))
                with torch.no_grad():
                    replay_x = previous(torch.randn(len(pick), self.latent_dim, generator=noise), replay_y)
                real_x, real_y = torch.cat([real_x, replay_x]), torch.cat([real_y, replay_y])
            fake_y = torch.from_numpy(view.rng.choice(classes, size=len(real_y)))
            z = torch.randn(len(real_y), self.latent_dim, generator=noise)
            loss_d, loss_g = acgan_step(generator, discriminator, opt_g, opt_d, real_x, real_y, z, fake_y)
        generator.eval()
        saved = self._held().write(self._encode(generator, discriminator, {int(c) for c in classes}))
        self._round.update(acgan_loss_d=float(loss_d.item()), acgan_loss_g=float(loss_g.item()),
                           acgan_dropped=float(not saved), acgan_bytes=float(self._held().bytes_on_disk()))

    def metrics(self) -> dict[str, float]:
        return dict(self._round)

    # --- the stored ACGAN -----------------------------------------------------------------------

    def _generator(self, stored: tuple[np.ndarray, np.ndarray, set[int]]) -> Any:
        from models.acgan import build_acgan

        generator, _ = build_acgan(self._spec, 0)
        _load_flat(generator, stored[0])
        return generator.eval()

    def _load(self) -> tuple[np.ndarray, np.ndarray, set[int]] | None:
        """(generator, discriminator, classes learnt) as stored, in float32; None when there is none or it does not
        load as this spec's."""
        stored = self._held().read()
        if stored is None:
            return None
        try:
            data = read_npz(stored)
            spec = data["spec"].tolist()
            flats = data["generator"].astype(np.float32), data["discriminator"].astype(np.float32)
            classes = set(data["classes"].tolist())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None
        if spec != self._spec_numbers() or [f.size for f in flats] != self._sizes or not all(
                np.isfinite(f).all() for f in flats):
            return None
        return flats[0], flats[1], classes

    def _check_share(self, acgan: tuple[Any, Any]) -> None:
        """Refuse, in one line, an ACGAN whose replacement (the new file written beside the old) can never fit its
        share of M's bytes: it would be written once and then never updated again (every later save dropped)."""
        held = self._held()
        size = len(self._encode(*acgan, set(range(self._spec.num_classes))))
        if not held.can_ever_hold(size):
            raise ValueError(
                f"policy fedcil: replacing its ACGAN (width {self.width}, {self.precision}, {size} bytes) peaks at "
                f"{replacement_peak(size, held.block)} bytes, more than acgan_share {self.acgan_share} of [store] "
                f"max_bytes leaves ({held.limit}); lower width or raise max_bytes")

    def _encode(self, generator: Any, discriminator: Any, classes: set[int]) -> bytes:
        """The stored ACGAN's file: the spec, both networks as flat buffers at `precision`, the classes learnt."""
        from models.generators import flatten_module

        dtype = PRECISIONS[self.precision]
        buffer = io.BytesIO()
        np.savez(buffer, spec=np.asarray(self._spec_numbers(), dtype=np.int64),
                 generator=flatten_module(generator).astype(dtype),
                 discriminator=flatten_module(discriminator).astype(dtype),
                 classes=np.asarray(sorted(classes), dtype=np.int64))
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
