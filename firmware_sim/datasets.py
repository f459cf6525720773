"""Datasets as plain numpy arrays: the embedded ones (no download), Fashion-MNIST as Debian packages it, and real
ones read from a local folder."""
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
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.durable import read_npz
from firmware_sim.array_dataset import ArrayDataset, stratified_split
from models.cache import cache_dir

log = logging.getLogger("edgefil.datasets")


# --- embedded datasets: generated or bundled, never downloaded --------------------------------

EMBEDDED_DATASETS: tuple[str, ...] = ("digits", "digits_domains", "mnist1d")
# Fashion-MNIST as Debian's package `dataset-fashion-mnist` installs it (scripts/setup installs it where missing), or
# a user's folder of the same four files (a scenario's data_root): packaged, never downloaded.
PACKAGED_DATASETS: tuple[str, ...] = ("fashion_mnist", "fashion_mnist_domains")
# Names whose loader returns a list[ArrayDataset] (one per domain, same labels) instead of one dataset.
DOMAIN_STREAMS: tuple[str, ...] = ("digits_domains", "digit10", "fashion_mnist_domains")
# Folder datasets making up Digit10, in the papers' order (MNIST -> EMNIST(digits) -> USPS -> SVHN).
DIGIT10_DOMAINS: tuple[str, ...] = ("mnist", "emnist", "usps", "svhn")
# Class counts known without loading anything (the ten digits, Fashion-MNIST's ten kinds of clothing).
_TEN_CLASS_DATASETS: tuple[str, ...] = (*EMBEDDED_DATASETS, *PACKAGED_DATASETS, "digit10")


def known_num_classes(name: str) -> int | None:
    """Number of classes of `name` when it is known before loading (lets a Scenario fail early)."""
    return 10 if name in _TEN_CLASS_DATASETS else None


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
        data = stratified_split("digits", *_digits_arrays(), test_fraction, seed)
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


def domain_transforms(dataset: str, prefix: str, blur: float, noise: float) -> dict[str, DomainTransform]:
    """Domain name -> transform (the names `prefix`-original, -rot90, -inverted, -noisy) of the domain stream
    `dataset`; each takes (images, rng) so the noisy one draws from a seeded generator."""
    for name, value in (("blur", blur), ("noise", noise)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{dataset}' {name} must be a finite number >= 0, got {value!r}")
    return {
        f"{prefix}-original": lambda x, rng: x,
        f"{prefix}-rot90": _rotate90,
        f"{prefix}-inverted": _invert,
        f"{prefix}-noisy": lambda x, rng: _blur_and_noise(x, rng, blur, noise),
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

    transforms = domain_transforms("digits_domains", "digits", blur, noise)

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
        domains.append(stratified_split(name, x_d.astype(np.float32), y[idx], test_fraction, seed))
    return domains



# --- Fashion-MNIST (packaged by Debian, never downloaded) ---------------------------------------------------------

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")  # where dataset-fashion-mnist puts it
FASHION_MNIST_FILES: dict[str, str] = {
    "x": "train-images-idx3-ubyte", "y": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST family's format: big-endian header, then uint8 values), gzipped or not; ValueError in
    one line for anything else."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable IDX file ({err})") from None
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = data[3]
    header = 4 + 4 * dims
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    if len(data) != header + math.prod(shape):
        raise ValueError(f"{path}: holds {len(data) - header} values, its header says {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def fashion_mnist_files(root: str | Path | None = None) -> dict[str, Path]:
    """The four files (each `<name>.gz` or `<name>`) under `root` (default: Debian's folder), by array name;
    FileNotFoundError in one line naming what is missing and how to get it."""
    folder = Path(root) if root is not None else FASHION_MNIST_ROOT
    found: dict[str, Path] = {}
    for key, name in FASHION_MNIST_FILES.items():
        for candidate in (folder / f"{name}.gz", folder / name):
            if candidate.is_file():
                found[key] = candidate
                break
    missing = [f"{FASHION_MNIST_FILES[k]}.gz" for k in FASHION_MNIST_FILES if k not in found]
    if missing:
        how = ("install Debian's dataset-fashion-mnist (scripts/setup does) or give data_root a folder of the four "
               "files" if root is None else "put Fashion-MNIST's four IDX files there (gzipped or not)")
        raise FileNotFoundError(f"Fashion-MNIST not found in {folder}: missing {', '.join(missing)}; {how}")
    return found


def _per_class(y: np.ndarray, n: int | None, rng: np.random.Generator) -> np.ndarray:
    """Positions of at most `n` samples of each class (a seeded draw, in their original order); all for None."""
    if n is None:
        return np.arange(len(y))
    picked = [rng.permutation(np.flatnonzero(y == c))[:n] for c in np.unique(y)]
    return np.sort(np.concatenate(picked))


def _fashion_arrays(root: str | Path | None, train_per_class: int | None, test_per_class: int | None, seed: int
                    ) -> dict[str, np.ndarray]:
    """Fashion-MNIST's arrays (N, 1, 28, 28) float32 in [0, 1] and int64 labels, each split cut to at most so many
    samples a class (seeded), kept under `cache_dir()` keyed by the files and the cut."""
    for name, value in (("train_per_class", train_per_class), ("test_per_class", test_per_class)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"fashion_mnist's {name} must be an integer >= 1, got {value!r}")
    files = fashion_mnist_files(root)
    stamp = {k: [str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime)] for k, p in files.items()}

    def make() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        raw = {k: read_idx(p) for k, p in files.items()}
        out: dict[str, np.ndarray] = {}
        for xs, ys, n in (("x", "y", train_per_class), ("x_test", "y_test", test_per_class)):
            if raw[xs].ndim != 3 or raw[ys].ndim != 1 or len(raw[xs]) != len(raw[ys]):
                raise ValueError(f"{files[xs]}, {files[ys]}: not images (N, H, W) with one label each")
            keep = _per_class(raw[ys], n, rng)
            out[xs] = (raw[xs][keep].astype(np.float32) / 255.0)[:, None]
            out[ys] = raw[ys][keep].astype(np.int64)
        return out

    return _cached_arrays("fashion-mnist", {"files": stamp, "train_per_class": train_per_class,
                                            "test_per_class": test_per_class, "seed": int(seed)}, make)


def load_fashion_mnist(root: str | Path | None = None, train_per_class: int | None = None,
                       test_per_class: int | None = None, seed: int = 0) -> ArrayDataset:
    """Fashion-MNIST (Xiao et al. 2017: 70,000 28x28 greyscale images of ten kinds of clothing, 60,000 to train,
    10,000 to test) from Debian's `dataset-fashion-mnist` or a folder of the same files (`root`), as (N, 1, 28, 28)
    float32 in [0, 1]. `train_per_class` and `test_per_class` cut each split to at most so many images a class, a
    seeded draw (`seed`): the benchmarks' scale on two cores; None keeps every image."""
    arrays = _fashion_arrays(root, train_per_class, test_per_class, seed)
    return ArrayDataset("fashion_mnist", arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"], num_classes=10)


def load_fashion_mnist_domains(root: str | Path | None = None, train_per_class: int | None = None,
                               test_per_class: int | None = None, seed: int = 0, disjoint: bool = True,
                               blur: float = 1.5, noise: float = 0.15) -> list[ArrayDataset]:
    """Four Fashion-MNIST domains with the same ten labels, as `load_digits_domains` makes of the digits: original,
    rotated 90 degrees, inverted, blurred + noisy (`blur`, the Gaussian's sigma in pixels, scaled to the larger
    image: 1.5 at 28x28 as 0.7 is at 8x8's). With `disjoint` (default) each domain gets its own stratified quarter
    of the train and of the test images (no image shows up in two domains); otherwise every domain has them all."""
    transforms = domain_transforms("fashion_mnist_domains", "fashion", blur, noise)
    arrays = _fashion_arrays(root, train_per_class, test_per_class, seed)
    rng = np.random.default_rng([seed, 1])
    parts: dict[str, list[np.ndarray]] = {}
    for split in ("y", "y_test"):
        y = arrays[split]
        if disjoint:
            by_class = [np.array_split(rng.permutation(np.flatnonzero(y == c)), len(transforms)) for c in np.unique(y)]
            parts[split] = [np.sort(np.concatenate([chunks[d] for chunks in by_class])) for d in range(len(transforms))]
        else:
            parts[split] = [np.arange(len(y))] * len(transforms)
    domains = []
    for d, (name, transform) in enumerate(transforms.items()):
        train, test = parts["y"][d], parts["y_test"][d]
        x = transform(arrays["x"][train], np.random.default_rng([seed, d, 0])).astype(np.float32)
        x_test = transform(arrays["x_test"][test], np.random.default_rng([seed, d, 1])).astype(np.float32)
        domains.append(ArrayDataset(name, x, arrays["y"][train], x_test, arrays["y_test"][test], num_classes=10))
    return domains


def _cached_arrays(name: str, key_fields: dict[str, Any], make: Callable[[], dict[str, np.ndarray]]
                   ) -> dict[str, np.ndarray]:
    """The arrays `make()` gives, kept under `cache_dir()` as `<name>-<key>.npz`, the key a hash of `key_fields`
    (everything the arrays depend on): made once, read back by every later run and process. A cache that cannot
    be written (a read-only home) only costs the keeping, as for exported artifacts (models/cache.py)."""
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.npz"
    if path.is_file():
        return read_npz(path)
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
_PACKAGED_LOADERS: dict[str, Callable[..., ArrayDataset | list[ArrayDataset]]] = {
    "fashion_mnist": load_fashion_mnist, "fashion_mnist_domains": load_fashion_mnist_domains,
}
assert tuple(_PACKAGED_LOADERS) == PACKAGED_DATASETS


ARRAYS = "arrays"  # a user's own data: arrays or a folder of images (firmware_sim/own_data.py)


def load_dataset(name: str, root: str | None = None, **options: Any) -> ArrayDataset | list[ArrayDataset]:
    """Load a dataset (or, for the names in DOMAIN_STREAMS, a list of domains) by name.

    Embedded datasets take their loader's keyword options and ignore `root`. Fashion-MNIST (`fashion_mnist`,
    `fashion_mnist_domains`) is read from `root` when given, else from where Debian's package puts it. Folder datasets
    (firmware_sim.folders.FOLDER_DATASETS) and `digit10` are read from `root`; `digit10` takes
    `shape=(C, H, W)` (default (1, 28, 28): MNIST's, greyscale, the cheaper input for a device). `arrays` is a
    user's own data at `root` (firmware_sim/own_data.py).
    """
    if name in _EMBEDDED_LOADERS:
        return _EMBEDDED_LOADERS[name](**options)
    if name in _PACKAGED_LOADERS:
        return _PACKAGED_LOADERS[name](root, **options)
    if name == ARRAYS:
        from . import own_data

        if root is None:
            raise ValueError(f"dataset \"arrays\" is read from data_root: {own_data.LAYOUTS}")
        return own_data.load_arrays(root, **options)
    from . import folders

    if name not in (*folders.FOLDER_DATASETS, "digit10"):
        known = (*EMBEDDED_DATASETS, *PACKAGED_DATASETS, *folders.FOLDER_DATASETS, "digit10", ARRAYS)
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
