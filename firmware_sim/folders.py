"""Real datasets read from a folder the user filled by hand (no network, ever).

Each loader uses torchvision's own dataset class with ``download=False`` so the on-disk layout is
exactly the one torchvision documents, then takes the whole ``.data`` array at once (no PIL
round-trip) and returns an :class:`~firmware_sim.array_dataset.ArrayDataset`: float32 in [0, 1],
channels first, int64 labels. torch/torchvision are imported lazily so this module imports on
devices that only have numpy.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .array_dataset import ArrayDataset

FOLDER_DATASETS: tuple[str, ...] = ("mnist", "emnist", "usps", "svhn", "cifar10", "cifar100")


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not (all) in the folder; the message lists every path to provide."""

    def __init__(self, name: str, root: Path, missing: list[Path]) -> None:
        self.name, self.root, self.missing = name, root, missing
        listing = "\n".join(f"  {p}" for p in missing)
        super().__init__(
            f"dataset {name!r} not found under {root}: missing {len(missing)} file(s):\n{listing}\n"
            f"Nothing is downloaded; put these files there (torchvision's layout) and retry."
        )


# --- one loader per on-disk family; each returns (x: (N, C, H, W) uint8, y: (N,) int64) --------

def _mnist_family(cls_name: str, transpose: bool = False, **kwargs: Any) -> Callable[[Path, bool], tuple]:
    def load(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
        import torchvision

        ds = getattr(torchvision.datasets, cls_name)(str(root), train=train, download=False, **kwargs)
        x = ds.data.numpy()  # (N, 28, 28) uint8
        if transpose:
            # EMNIST's idx files store every image transposed (column-major); torchvision hands
            # them back as stored, so swap H and W here to get upright digits like MNIST's.
            x = x.transpose(0, 2, 1)
        return x[:, None], ds.targets.numpy()

    return load


def _load_usps(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    from torchvision.datasets import USPS

    ds = USPS(str(root), train=train, download=False)  # data: (N, 16, 16) uint8, targets: list
    return ds.data[:, None], np.asarray(ds.targets)


def _load_svhn(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    from torchvision.datasets import SVHN

    class _SVHN(SVHN):
        # torchvision md5-checks the exact official .mat; accept any file in the same format.
        def _check_integrity(self) -> bool:
            return os.path.isfile(os.path.join(self.root, self.filename))

    ds = _SVHN(str(root), split="train" if train else "test", download=False)
    return ds.data, ds.labels  # data already (N, 3, 32, 32); labels already map 10 -> 0


def _load_cifar(cls_name: str) -> Callable[[Path, bool], tuple]:
    def load(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
        import torchvision

        base = getattr(torchvision.datasets, cls_name)

        # torchvision md5-checks every official batch (and the meta file); blanking the md5s makes
        # its own check_integrity() an existence check, so any pickle in CIFAR's format loads.
        class _Cifar(base):  # type: ignore[misc, valid-type]
            train_list = [[f, None] for f, _ in base.train_list]
            test_list = [[f, None] for f, _ in base.test_list]
            meta = {**base.meta, "md5": None}

        ds = _Cifar(str(root), train=train, download=False)
        return ds.data.transpose(0, 3, 1, 2), np.asarray(ds.targets)  # HWC -> CHW

    return load


@dataclass(frozen=True)
class _Spec:
    files: tuple[str, ...]  # every file the torchvision class opens, relative to root
    load: Callable[[Path, bool], tuple[np.ndarray, np.ndarray]]
    num_classes: int


_IDX = ("images-idx3-ubyte", "labels-idx1-ubyte")
_MNIST_RAW = tuple(f"{s}-{k}" for s in ("train", "t10k") for k in _IDX)
_EMNIST_RAW = tuple(f"emnist-digits-{s}-{k}" for s in ("train", "test") for k in _IDX)
_CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")

_SPECS: dict[str, _Spec] = {
    "mnist": _Spec(tuple(f"MNIST/raw/{f}" for f in _MNIST_RAW), _mnist_family("MNIST"), 10),
    "emnist": _Spec(
        tuple(f"EMNIST/raw/{f}" for f in _EMNIST_RAW), _mnist_family("EMNIST", transpose=True, split="digits"), 10
    ),
    "usps": _Spec(("usps.bz2", "usps.t.bz2"), _load_usps, 10),
    "svhn": _Spec(("train_32x32.mat", "test_32x32.mat"), _load_svhn, 10),
    "cifar10": _Spec(
        tuple(f"cifar-10-batches-py/{f}" for f in _CIFAR10_FILES), _load_cifar("CIFAR10"), 10
    ),
    "cifar100": _Spec(tuple(f"cifar-100-python/{f}" for f in ("train", "test", "meta")), _load_cifar("CIFAR100"), 100),
}
assert tuple(_SPECS) == FOLDER_DATASETS


def required_files(name: str, root: str | os.PathLike) -> list[Path]:
    """The paths `load_folder_dataset(name, root)` reads, so a user knows what to copy where."""
    if name not in _SPECS:
        raise ValueError(f"unknown folder dataset {name!r}; choose one of {FOLDER_DATASETS}")
    return [Path(root) / f for f in _SPECS[name].files]


def load_folder_dataset(name: str, root: str | os.PathLike) -> ArrayDataset:
    """Load train and test split of `name` from `root` (torchvision's layout, nothing downloaded).

    Raises DatasetNotFoundError listing every missing file before torchvision is even touched, so
    the user sees one clear list instead of a stack trace about the first file it tripped on.
    """
    root = Path(root).expanduser()  # torchvision expands "~" too
    paths = required_files(name, root)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DatasetNotFoundError(name, root, missing)
    spec = _SPECS[name]
    (x_tr, y_tr), (x_te, y_te) = (spec.load(root, train) for train in (True, False))
    return ArrayDataset(
        name=name,
        x_train=_to_unit_float(x_tr),
        y_train=np.ascontiguousarray(y_tr, dtype=np.int64),
        x_test=_to_unit_float(x_te),
        y_test=np.ascontiguousarray(y_te, dtype=np.int64),
        num_classes=spec.num_classes,
    )


def _to_unit_float(x: np.ndarray) -> np.ndarray:
    assert x.dtype == np.uint8 and x.ndim == 4, (x.dtype, x.shape)
    return np.ascontiguousarray(x, dtype=np.float32) / np.float32(255.0)


# ITU-R BT.601 luma weights: RGB -> grey the way a greyscale camera/scan would see it.
_LUMA = (0.299, 0.587, 0.114)


def to_common_shape(ds: ArrayDataset, shape: tuple[int, int, int], batch: int = 4096) -> ArrayDataset:
    """Resize (bilinear) and convert grey<->RGB so several domains share one input shape.

    Used for the Digit10 stream MNIST -> EMNIST(digits) -> USPS -> SVHN, whose raw shapes are
    (1,28,28), (1,28,28), (1,16,16), (3,32,32). Grey -> RGB repeats the channel; RGB -> grey takes
    the BT.601 luminance. Works in batches so a 70k-image set never needs a second full copy.
    """
    c, h, w = shape
    if tuple(ds.x_train.shape[1:]) == tuple(shape) and tuple(ds.x_test.shape[1:]) == tuple(shape):
        return ds
    return dataclasses.replace(ds, x_train=_reshape_images(ds.x_train, c, h, w, batch),
                               x_test=_reshape_images(ds.x_test, c, h, w, batch))


def _reshape_images(x: np.ndarray, c: int, h: int, w: int, batch: int) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    if x.ndim != 4 or x.shape[1] not in (1, 3) or c not in (1, 3):
        raise ValueError(f"expected (N, 1|3, H, W) images and 1 or 3 target channels, got {x.shape} -> {c}")
    out = np.empty((len(x), c, h, w), dtype=np.float32)
    luma = torch.tensor(_LUMA, dtype=torch.float32).view(1, 3, 1, 1)
    for i in range(0, len(x), batch):
        t = torch.from_numpy(np.ascontiguousarray(x[i:i + batch], dtype=np.float32))
        if t.shape[1] == 3 and c == 1:
            t = (t * luma).sum(dim=1, keepdim=True)
        if t.shape[-2:] != (h, w):
            # antialias only matters when shrinking (e.g. SVHN 32 -> 28); it avoids aliasing there.
            t = F.interpolate(t, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        # grey -> RGB: the (b, 1, h, w) result broadcasts over the 3 output channels.
        out[i:i + batch] = t.clamp(0.0, 1.0).numpy()  # not clamp_: t may alias x
    return out
