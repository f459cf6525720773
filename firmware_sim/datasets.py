"""Datasets as plain numpy arrays: the embedded ones (no download) and real ones read from a local folder."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.cache import cache_dir

log = logging.getLogger("edgefil.datasets")


@dataclass(frozen=True)
class ArrayDataset:
    """One dataset (or one domain of a domain-incremental stream) held in memory.

    `x_*` are float32 with shape (N, *input_shape), channels first, scaled to [0, 1] for images;
    `y_*` are int64 class indices in [0, num_classes).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


# --- embedded datasets: generated or bundled, never downloaded --------------------------------

EMBEDDED_DATASETS: tuple[str, ...] = ("digits", "digits_domains", "mnist1d")
# Names whose loader returns a list[ArrayDataset] (one per domain, same labels) instead of one dataset.
DOMAIN_STREAMS: tuple[str, ...] = ("digits_domains", "digit10")
# Folder datasets making up Digit10, in the papers' order (MNIST -> EMNIST(digits) -> USPS -> SVHN).
DIGIT10_DOMAINS: tuple[str, ...] = ("mnist", "emnist", "usps", "svhn")
# Class counts known without loading anything (every one of these is the ten digits).
_DIGIT_DATASETS: tuple[str, ...] = (*EMBEDDED_DATASETS, "digit10")


def known_num_classes(name: str) -> int | None:
    """Number of classes of `name` when it is known before loading (lets a Scenario fail early)."""
    return 10 if name in _DIGIT_DATASETS else None


def _stratified_split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> ArrayDataset:
    """Seeded train/test split keeping every class's share equal in both halves."""
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return ArrayDataset(name, x_tr, y_tr, x_te, y_te, num_classes=int(y.max()) + 1)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits as (N, 1, 8, 8) float32 in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]
    return x, bunch.target.astype(np.int64)


def _splitter_version() -> str:
    """scikit-learn's version, whose splitter draws the digits split. Where it is not installed (a device install),
    the error importing it would give: the CLI names the extra that brings it, in one line."""
    try:
        return importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn") from None


def load_digits_dataset(test_fraction: float = 0.25, seed: int = 0) -> ArrayDataset:
    """The 1,797 bundled 8x8 digits (10 classes), split train/test stratified and seeded.

    The split is kept under `cache_dir()` (keyed by the fraction, the seed and scikit-learn's version, whose
    splitter draws it): importing scikit-learn takes about 2 s, which every fleet worker paid at its start."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")

    def split() -> dict[str, np.ndarray]:
        data = _stratified_split("digits", *_digits_arrays(), test_fraction, seed)
        return {"x": data.x_train, "y": data.y_train, "x_test": data.x_test, "y_test": data.y_test}

    arrays = _cached_arrays("digits", {"test_fraction": float(test_fraction), "seed": int(seed),
                                       "scikit-learn": _splitter_version()}, split)
    return ArrayDataset("digits", arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"], num_classes=10)


def _rotate90(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # An exact quarter turn (counter-clockwise): no interpolation, so values stay in [0, 1] and no pixel is invented.
    return np.ascontiguousarray(np.rot90(x, k=1, axes=(-2, -1)))


def _invert(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return 1.0 - x


def _blur_and_noise(x: np.ndarray, rng: np.random.Generator, sigma: float, noise: float) -> np.ndarray:
    # A degraded-sensor domain (SVHN's role in Digit10): blur within each image only, then pixel noise.
    from scipy.ndimage import gaussian_filter

    blurred = gaussian_filter(x, sigma=(0, 0, sigma, sigma))
    return np.clip(blurred + rng.normal(0.0, noise, size=x.shape), 0.0, 1.0).astype(np.float32)


DomainTransform = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def _digit_domain_transforms(blur: float, noise: float) -> dict[str, DomainTransform]:
    """Domain name -> transform; each takes (images, rng) so the noisy one draws from a seeded generator."""
    return {
        "digits-original": lambda x, rng: x,
        "digits-rot90": _rotate90,
        "digits-inverted": _invert,
        "digits-noisy": lambda x, rng: _blur_and_noise(x, rng, blur, noise),
    }


def load_digits_domains(test_fraction: float = 0.25, seed: int = 0, disjoint: bool = True, blur: float = 0.7,
                        noise: float = 0.15) -> list[ArrayDataset]:
    """Four digit domains with the same 10 labels: original, rotated 90 degrees, inverted, blurred + noisy.

    A small offline stand-in for Digit10. With `disjoint` (default) the 1,797 images are first cut
    into four stratified, seeded, disjoint subsets (~450 each), one per domain, as in Digit10 where
    every domain has its own images: a later domain never shows a transformed copy of an image the
    model already trained on, and no test image of one domain is a train image of another.
    `disjoint=False` gives every domain all images (more data, but the domains share their content).

    `blur` (the Gaussian's sigma, pixels) and `noise` (the pixel noise's std) degrade the fourth domain. At the
    defaults it is hard: LeNet, an MLP and a small CNN trained centrally on all of it reach 0.82-0.93 on its test
    images; at blur 0.3 and noise 0.1, 0.98 (docs/results.md, issue 35).
    """
    from sklearn.model_selection import StratifiedKFold

    for name, value in (("blur", blur), ("noise", noise)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"digits_domains' {name} must be a finite number >= 0, got {value!r}")
    transforms = _digit_domain_transforms(blur, noise)

    x, y = _digits_arrays()
    names = list(transforms)
    if disjoint:
        folds = StratifiedKFold(n_splits=len(names), shuffle=True, random_state=seed).split(x, y)
        subsets = [idx for _, idx in folds]
    else:
        subsets = [np.arange(len(y))] * len(names)
    domains = []
    for d, (name, idx) in enumerate(zip(names, subsets)):
        x_d = transforms[name](x[idx], np.random.default_rng([seed, d]))
        domains.append(_stratified_split(name, x_d.astype(np.float32), y[idx], test_fraction, seed))
    return domains




def _cached_arrays(name: str, key_fields: dict[str, Any], make: Callable[[], dict[str, np.ndarray]]
                   ) -> dict[str, np.ndarray]:
    """The arrays `make()` gives, kept under `cache_dir()` as `<name>-<key>.npz`, the key a hash of `key_fields`
    (everything the arrays depend on): made once, read back by every later run and process. A cache that cannot
    be written (a read-only home) only costs the keeping, as for exported artifacts (models/cache.py)."""
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.npz"
    if path.is_file():
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    log.info("making %s (once: kept in %s) ...", name, path)
    arrays = make()
    try:
        _save_npz_atomically(path, **arrays)
    except OSError as err:
        log.warning("could not keep %s in %s: %s", name, path.parent, err)
    return arrays


def _save_npz_atomically(path: Path, **arrays: np.ndarray) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types the keyword arrays as allow_pickle
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextlib.contextmanager
def _global_rng_preserved() -> Iterator[None]:
    # mnist1d seeds the global `random` and `np.random` states; put the caller's back afterwards.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _generate_mnist1d(params: dict) -> dict[str, np.ndarray]:
    # make_dataset is the generator; mnist1d.data.get_dataset would try to download a pickle first.
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    vars(args).update(params)
    with _global_rng_preserved():
        data = make_dataset(args)
    return {k: data[k] for k in ("x", "y", "x_test", "y_test")}


def load_mnist1d(num_samples: int = 20_000, test_fraction: float = 0.2, seed: int = 0) -> ArrayDataset:
    """MNIST-1D generated offline: (N, 1, 40) float32 signals, 10 classes, seeded.

    The raw arrays are cached under `cache_dir()` keyed by every generator argument. The signals
    are not images, so instead of [0, 1] they are standardised with the train split's scalar mean
    and std (this also replaces the generator's own scaling, which used test samples too).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    params = {"num_samples": int(num_samples), "train_split": 1.0 - float(test_fraction), "seed": int(seed)}
    # The generator's version is part of the key: another release may draw different signals.
    raw = _cached_arrays("mnist1d", {**params, "mnist1d": importlib.metadata.version("mnist1d")},
                         lambda: _generate_mnist1d(params))
    mean, std = raw["x"].mean(), raw["x"].std()
    x_train, x_test = (((raw[k] - mean) / std).astype(np.float32)[:, None] for k in ("x", "x_test"))
    y_train, y_test = (raw[k].astype(np.int64) for k in ("y", "y_test"))
    return ArrayDataset("mnist1d", x_train, y_train, x_test, y_test, 10)


# --- one entry point by name -------------------------------------------------------------------

_EMBEDDED_LOADERS: dict[str, Callable[..., ArrayDataset | list[ArrayDataset]]] = {
    "digits": load_digits_dataset, "digits_domains": load_digits_domains, "mnist1d": load_mnist1d,
}
assert tuple(_EMBEDDED_LOADERS) == EMBEDDED_DATASETS


ARRAYS = "arrays"  # a user's own arrays (load_arrays)


def load_arrays(root: str, test_fraction: float = 0.25, seed: int = 0) -> ArrayDataset:
    """A user's own dataset as arrays: `root` is an .npz file or a folder of .npy files, holding `x` (N samples of
    any shape, channels first for images, float) and `y` (N int labels 0..K-1), and optionally `x_test` and
    `y_test`; without them a stratified `test_fraction` of the samples is the test set. ValueError in one line for
    anything else."""
    path = Path(root)
    arrays: dict[str, np.ndarray]
    if path.is_dir():
        files = {p.stem: p for p in path.glob("*.npy")}
        arrays = {k: np.load(files[k], allow_pickle=False) for k in ("x", "y", "x_test", "y_test") if k in files}
    elif path.is_file():
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in ("x", "y", "x_test", "y_test") if k in data.files}
    else:
        raise ValueError(f"{path}: no such file or folder (an .npz with x and y, or a folder with x.npy and y.npy)")
    if "x" not in arrays or "y" not in arrays:
        raise ValueError(f"{path}: needs arrays x and y (found {', '.join(sorted(arrays)) or 'none'})")
    pairs = [("x", "y")] + ([("x_test", "y_test")] if "x_test" in arrays and "y_test" in arrays else [])
    for xs, ys in pairs:
        if arrays[xs].ndim < 2 or arrays[ys].ndim != 1 or len(arrays[xs]) != len(arrays[ys]):
            raise ValueError(f"{path}: {xs} must be (N, ...) with one label per sample in {ys}, got "
                             f"{arrays[xs].shape} and {arrays[ys].shape}")
        if not np.issubdtype(arrays[ys].dtype, np.integer) or arrays[ys].min() < 0:
            raise ValueError(f"{path}: {ys} must hold integer class ids 0..K-1")
    x, y = arrays["x"].astype(np.float32), arrays["y"].astype(np.int64)
    if len(pairs) == 1:
        return _stratified_split(path.stem, x, y, test_fraction, seed)
    x_test, y_test = arrays["x_test"].astype(np.float32), arrays["y_test"].astype(np.int64)
    return ArrayDataset(path.stem, x, y, x_test, y_test, num_classes=int(max(y.max(), y_test.max())) + 1)


def load_dataset(name: str, root: str | None = None, **options: Any) -> ArrayDataset | list[ArrayDataset]:
    """Load a dataset (or, for the names in DOMAIN_STREAMS, a list of domains) by name.

    Embedded datasets take their loader's keyword options and ignore `root`. Folder datasets
    (firmware_sim.folders.FOLDER_DATASETS) and `digit10` are read from `root`; `digit10` takes
    `shape=(C, H, W)` (default (1, 28, 28): MNIST's, greyscale, the cheaper input for a device). `arrays` is a
    user's own arrays at `root` (load_arrays).
    """
    if name in _EMBEDDED_LOADERS:
        return _EMBEDDED_LOADERS[name](**options)
    if name == ARRAYS:
        if root is None:
            raise ValueError("dataset \"arrays\" is read from data_root: an .npz with x and y, or a folder of them")
        return load_arrays(root, **options)
    from . import folders

    if name not in (*folders.FOLDER_DATASETS, "digit10"):
        known = (*EMBEDDED_DATASETS, *folders.FOLDER_DATASETS, "digit10", ARRAYS)
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(known)}")
    if root is None:
        raise ValueError(
            f"dataset {name!r} is read from a local folder and nothing is downloaded: pass root=<folder> "
            f"(a Scenario's data_root); firmware_sim.folders.required_files() lists the files it needs"
        )
    if name != "digit10":
        if options:
            raise TypeError(f"folder dataset {name!r} takes no options, got {sorted(options)}")
        return folders.load_folder_dataset(name, root)
    return _load_digit10(root, **options)


def _load_digit10(root: str, shape: Sequence[int] = (1, 28, 28)) -> list[ArrayDataset]:
    from . import folders

    c, h, w = (int(s) for s in shape)
    return [folders.to_common_shape(folders.load_folder_dataset(d, root), (c, h, w)) for d in DIGIT10_DOMAINS]
