"""A user's own data, the `arrays` dataset (`edgefil data split --from`, `edgefil init --from`, a scenario's
`dataset = "arrays"` with its `data_root`), in any of three layouts:

    my-data.npz                      arrays x and y, optionally x_test and y_test
    my-data/x.npy, y.npy, ...        the same arrays as .npy files in a folder
    my-images/<class>/<image>        a folder per class (the usual layout, torchvision's ImageFolder's), or with
    my-images/train/<class>/...      train/ and test/ folders of the same classes
    my-images/test/<class>/...

Whatever the layout, what comes out is the runtime's one format (`ArrayDataset`): float32 channels first, images
in [0, 1], int64 class ids 0..K-1. What the reader changed to get there is logged in one line each, so that a user
sees it: channels-last arrays (N, H, W, C) transposed, 8- or 16-bit pixels scaled, images of other sizes resized
to the most common size. Classes of an image folder are numbered in the sorted order of their folders' names
(ImageFolder's rule) and keep their names (`ArrayDataset.class_names`, written into classes.json). Without a test
set (x_test, or test/), a stratified `test_fraction` of the samples is held out. Anything else is refused in one
line (ValueError) that names the layouts.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.durable import read_npy, read_npz
from firmware_sim.array_dataset import ArrayDataset, stratified_split

log = logging.getLogger("edgefil.datasets")

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".pgm", ".ppm"})
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})  # PIL's modes with one channel of intensity
CHANNELS = (1, 3, 4)  # what a channel axis of an image array holds: grey, RGB, RGBA
LAYOUTS = ("an .npz with x and y, a folder with x.npy and y.npy, or a folder of images with one subfolder per "
           "class")


def load_arrays(root: str, test_fraction: float = 0.25, seed: int = 0) -> ArrayDataset:
    """The user's dataset at `root`, in whichever of the module's layouts it is."""
    path = Path(root)
    if path.is_file():
        return _from_arrays(path, {k: v for k, v in read_npz(path).items() if k in ("x", "y", "x_test", "y_test")},
                            test_fraction, seed)
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder ({LAYOUTS})")
    arrays = {p.stem: p for p in path.glob("*.npy") if p.stem in ("x", "y", "x_test", "y_test")}
    if arrays:
        return _from_arrays(path, {k: read_npy(p) for k, p in arrays.items()}, test_fraction, seed)
    return _from_image_folders(path, test_fraction, seed)


def _from_arrays(path: Path, arrays: dict[str, np.ndarray], test_fraction: float, seed: int) -> ArrayDataset:
    if "x" not in arrays or "y" not in arrays:
        raise ValueError(f"{path}: needs arrays x and y (found {', '.join(sorted(arrays)) or 'none'})")
    pairs = [("x", "y")] + ([("x_test", "y_test")] if "x_test" in arrays and "y_test" in arrays else [])
    for xs, ys in pairs:
        if arrays[xs].ndim < 2 or arrays[ys].ndim != 1 or len(arrays[xs]) != len(arrays[ys]):
            raise ValueError(f"{path}: {xs} must be (N, ...) with one label per sample in {ys}, got "
                             f"{arrays[xs].shape} and {arrays[ys].shape}")
        if not np.issubdtype(arrays[ys].dtype, np.integer) or arrays[ys].min() < 0:
            raise ValueError(f"{path}: {ys} must hold integer class ids 0..K-1")
    x = _channels_first(path, _unit_float(path, arrays["x"]))
    y = arrays["y"].astype(np.int64)
    if len(pairs) == 1:
        return stratified_split(path.stem, x, y, test_fraction, seed)
    x_test = _channels_first(path, _unit_float(path, arrays["x_test"]), quiet=True)
    if x_test.shape[1:] != x.shape[1:]:
        raise ValueError(f"{path}: x_test's samples are {x_test.shape[1:]}, x's {x.shape[1:]}")
    y_test = arrays["y_test"].astype(np.int64)
    return ArrayDataset(path.stem, x, y, x_test, y_test, num_classes=int(max(y.max(), y_test.max())) + 1)


def _unit_float(path: Path, x: np.ndarray) -> np.ndarray:
    """float32; 8- and 16-bit unsigned pixels scaled to [0, 1] (said), any other type kept as it is."""
    if x.dtype in (np.uint8, np.uint16):
        top = np.iinfo(x.dtype).max
        log.info("%s: x holds %s pixels: scaled to [0, 1] (divided by %d)", path, x.dtype, top)
        return (x / np.float32(top)).astype(np.float32)
    return x.astype(np.float32)


def _channels_first(path: Path, x: np.ndarray, quiet: bool = False) -> np.ndarray:
    """Images as (N, C, H, W): an (N, H, W, C) array, whose last axis holds 1, 3 or 4 channels where the second
    does not, is transposed (said). Anything else is kept as it is: (N, C, L) signals, (N, F) features."""
    if x.ndim == 4 and x.shape[-1] in CHANNELS and x.shape[1] not in CHANNELS:
        if not quiet:
            log.info("%s: x is channels last %s: read as channels first %s", path, tuple(x.shape[1:]),
                     (x.shape[3], x.shape[1], x.shape[2]))
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return x


def _from_image_folders(root: Path, test_fraction: float, seed: int) -> ArrayDataset:
    train, test = root / "train", root / "test"
    split = train.is_dir() and test.is_dir() and bool(_class_folders(train)) and bool(_class_folders(test))
    classes = _class_folders(train if split else root)
    if not classes:
        raise ValueError(f"{root}: no arrays and no class folders with images in it ({LAYOUTS})")
    names = tuple(sorted(classes))
    files = [(p, k) for k, name in enumerate(names) for p in classes[name]]
    test_files: list[tuple[Path, int]] = []
    if split:
        held = _class_folders(test)
        unknown = sorted(set(held) - set(names))
        if unknown:
            raise ValueError(f"{test}: class folder {unknown[0]!r} is not among train/'s ({', '.join(names)})")
        test_files = [(p, names.index(name)) for name in sorted(held) for p in held[name]]
    x_all, y_all = _read_images(root, files + test_files)
    x, y = x_all[:len(files)], y_all[:len(files)]
    if split:
        data = ArrayDataset(root.name, x, y, x_all[len(files):], y_all[len(files):], num_classes=len(names))
    else:
        data = stratified_split(root.name, x, y, test_fraction, seed)
    log.info("%s: %d images of %d classes (%s), %s", root, len(files) + len(test_files), len(names),
             ", ".join(names), f"{len(test_files)} of them in test/" if split else
             f"{len(data.y_test)} held out for the test set")
    return ArrayDataset(data.name, data.x_train, data.y_train, data.x_test, data.y_test, len(names), names)


def _class_folders(root: Path) -> dict[str, list[Path]]:
    """Each subfolder of `root` that holds image files, with them, sorted by name."""
    found = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if images:
            found[folder.name] = images
    return found


def _read_images(root: Path, files: list[tuple[Path, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every image as (C, H, W) float32 in [0, 1]: greyscale where every image is, else RGB; all at the most common
    size (the others resized, said)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError(f"{root}: reading images needs Pillow (pip install pillow), which is not installed") from None
    headers: list[tuple[str, tuple[int, int]]] = []
    for path, _ in files:
        try:
            with Image.open(path) as image:
                headers.append((image.mode, image.size))
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"{path}: not an image Pillow can read ({err})") from None
    mode = "L" if all(m in GREY_MODES for m, _ in headers) else "RGB"
    size, _ = Counter(s for _, s in headers).most_common(1)[0]
    resized = sum(s != size for _, s in headers)
    if resized:
        log.info("%s: %d of %d images resized to %dx%d (the most common size)", root, resized, len(files), *size[::-1])
    x = np.empty((len(files), 1 if mode == "L" else 3, size[1], size[0]), np.float32)
    for i, (path, _) in enumerate(files):
        with Image.open(path) as image:
            pixels = _pixels(image, mode, size)
        x[i] = pixels if pixels.ndim == 3 else pixels[None]
    return x, np.array([k for _, k in files], np.int64)


def _pixels(image: Any, mode: str, size: tuple[int, int]) -> np.ndarray:
    """One image's pixels in [0, 1], channels first: 16- and 32-bit greyscale scaled by 65535, the rest by 255."""
    from PIL import Image

    if image.size != size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    if image.mode in ("I", "I;16") and mode == "L":
        return np.clip(np.asarray(image, np.float32) / 65535.0, 0.0, 1.0)
    pixels = np.asarray(image.convert(mode), np.float32) / 255.0
    return pixels.transpose(2, 0, 1) if pixels.ndim == 3 else pixels
