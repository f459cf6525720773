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
learnt, the spec), replaced atomically; it is a holder of the device's budget. A new file that would not fit what M
leaves (while the old one is still there) is not written: the device keeps its previous ACGAN and counts
`acgan_dropped`; so is one whose write would take more than `acgan_share` of M's bytes, which stay the store's for
the next task's real data (an ACGAN whose replacement could never fit that share is refused at open, in one line: it
would be written once and never updated). And when a new task's real samples still do not fit beside the stored
ACGAN, the learner asks the policy to release its bytes (`release_bytes`): the ACGAN file goes (`acgan_released`),
real data first. Under a sample-only M (no `[store] max_bytes`) nothing bounds its bytes, as for pFedGRP's generator
bank. A file that does not load is removed (logged) and the ACGAN starts afresh.

Deviations from FedCIL (documented in docs/architecture.md): the classifier is the runtime's task model, not the
ACGAN's auxiliary head; the ACGAN stays on its device (FedCIL also averages generators on the server and
consolidates the global model with their samples, which needs a generator per client on the server: left out, as
Re-Fed's adaptation of FedCIL to its setting does not say which parts it kept); no feature-alignment term. It
needs torch for the ACGAN (the task model trains on any backend).
"""
from __future__ import annotations

import io
import logging
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.budget import directory_bytes, replace_peak, replacement_peak
from edge_client.policies.base import PolicyContext, RoundView, TrainingSet
from edge_client.policies.no_replay import NoReplay
from edgefil.durable import TEMP_SUFFIX, write_atomically

if TYPE_CHECKING:
    from edge_client.budget import DeviceBudget

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
    _path: Path | None = field(default=None, init=False, repr=False)
    _budget: DeviceBudget | None = field(default=None, init=False, repr=False)
    _block: int = field(default=4096, init=False, repr=False)  # the file system's block, read at open
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
        folder = Path(ctx.state_dir) / ACGAN_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / (ACGAN_FILE + TEMP_SUFFIX)).unlink(missing_ok=True)  # an interrupted save
        self._path = folder / ACGAN_FILE
        self._block = os.statvfs(folder).f_frsize
        self._budget = ctx.budget
        self._check_share(build_acgan(self._spec, 0))
        ctx.budget.register(ACGAN_HOLDER, self._bytes)
        if self._path.exists() and self._load() is None:
            log.warning("removing %s: it does not hold an ACGAN of this spec", self._path)
            self._path.unlink()

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

        from models.acgan import build_acgan, discriminator_loss, generator_loss

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
            fake = generator(torch.randn(len(real_y), self.latent_dim, generator=noise), fake_y)
            loss_d = discriminator_loss(discriminator(real_x), real_y, discriminator(fake.detach()), fake_y)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = generator_loss(discriminator(fake), fake_y)
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
        generator.eval()
        saved = self._save(generator, discriminator, {int(c) for c in classes})
        self._round.update(acgan_loss_d=float(loss_d.item()), acgan_loss_g=float(loss_g.item()),
                           acgan_dropped=float(not saved), acgan_bytes=float(self._bytes()))

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
        path = self._require_path()
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
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
        limit = self._share_limit()
        if limit is None:
            return
        size = len(self._file(*acgan, set(range(self._spec.num_classes))))
        peak = replacement_peak(size, self._block)
        if peak > limit:
            raise ValueError(
                f"policy fedcil: replacing its ACGAN (width {self.width}, {self.precision}, {size} bytes) peaks at "
                f"{peak} bytes, more than acgan_share {self.acgan_share} of [store] max_bytes leaves ({limit}); "
                f"lower width or raise max_bytes")

    def _share_limit(self) -> int | None:
        """The most bytes the ACGAN may take (`acgan_share` of M's); None without a byte limit."""
        if self._budget is None or self._budget.max_bytes is None:
            return None
        return int(self.acgan_share * self._budget.max_bytes)

    def _file(self, generator: Any, discriminator: Any, classes: set[int]) -> bytes:
        """The stored ACGAN's file: the spec, both networks as flat buffers at `precision`, the classes learnt."""
        from models.generators import flatten_module

        dtype = PRECISIONS[self.precision]
        buffer = io.BytesIO()
        np.savez(buffer, spec=np.asarray(self._spec_numbers(), dtype=np.int64),
                 generator=flatten_module(generator).astype(dtype),
                 discriminator=flatten_module(discriminator).astype(dtype),
                 classes=np.asarray(sorted(classes), dtype=np.int64))
        return buffer.getvalue()

    def _save(self, generator: Any, discriminator: Any, classes: set[int]) -> bool:
        """Replace the stored ACGAN if the new file fits what M leaves beside the old one."""
        data = self._file(generator, discriminator, classes)
        limit = self._share_limit()
        room = None if limit is None or self._budget is None else min(self._budget.room(ACGAN_HOLDER) or 0, limit)
        if room is not None and replace_peak(self._require_path().parent, len(data), self._block) > room:
            return False
        write_atomically(self._require_path(), data)
        return True

    def release_bytes(self, view: RoundView) -> bool:
        """The stored ACGAN goes when the new task's real samples would not fit beside it (counted in
        `acgan_released`); the next save writes a new one if it fits what the store then leaves."""
        path = self._require_path()
        if not path.exists():
            return False
        path.unlink()
        self._released = True
        return True

    def _bytes(self) -> int:
        return directory_bytes(self._require_path().parent, self._block)

    def _spec_numbers(self) -> list[int]:
        return [self._spec.num_classes, self.latent_dim, self.width, *self._spec.input_shape]

    def _require_path(self) -> Path:
        if self._path is None:
            raise RuntimeError("the fedcil policy is not open: the learner calls open() with its state folder")
        return self._path


def _load_flat(module: Any, flat: np.ndarray) -> None:
    from models.generators import load_module

    load_module(module, np.ascontiguousarray(flat, dtype=np.float32))
