"""firmware_sim.folders: tiny files in each dataset's real on-disk format, loaded back.

Every writer below produces the format the official files use (idx, libsvm-in-bz2, MATLAB .mat,
Python pickles), so these tests pin both our layout table and torchvision's parsing of it.
"""
from __future__ import annotations

import bz2
import importlib.util
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.folders import (
    FOLDER_DATASETS,
    DatasetNotFoundError,
    load_folder_dataset,
    to_common_shape,
)

needs_torchvision = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="torchvision (host extra) not installed"
)

N_TRAIN, N_TEST = 6, 4

# The layout each loader must ask for, written out independently of the module's own table.
EXPECTED_FILES: dict[str, list[str]] = {
    "mnist": [
        "MNIST/raw/train-images-idx3-ubyte",
        "MNIST/raw/train-labels-idx1-ubyte",
        "MNIST/raw/t10k-images-idx3-ubyte",
        "MNIST/raw/t10k-labels-idx1-ubyte",
    ],
    "emnist": [
        "EMNIST/raw/emnist-digits-train-images-idx3-ubyte",
        "EMNIST/raw/emnist-digits-train-labels-idx1-ubyte",
        "EMNIST/raw/emnist-digits-test-images-idx3-ubyte",
        "EMNIST/raw/emnist-digits-test-labels-idx1-ubyte",
    ],
    "usps": ["usps.bz2", "usps.t.bz2"],
    "svhn": ["train_32x32.mat", "test_32x32.mat"],
    "cifar10": [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)]
    + ["cifar-10-batches-py/test_batch", "cifar-10-batches-py/batches.meta"],
    "cifar100": ["cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"],
}


# --- writers for the real formats ------------------------------------------------------------

def write_idx(path: Path, arr: np.ndarray) -> None:
    """IDX (LeCun): big-endian magic 0x0000 08 <ndim> (08 = uint8), one big-endian int32 per dim."""
    assert arr.dtype == np.uint8
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x00000800 | arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    path.write_bytes(header + arr.tobytes())


def write_usps(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """libsvm lines "label idx:val ..." (label 1..10, values in [-1, 1]), bzip2-compressed."""
    lines = [
        f"{lab} " + " ".join(f"{j + 1}:{v:.6f}" for j, v in enumerate(img.ravel()))
        for img, lab in zip(images, labels)
    ]
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def write_svhn(path: Path, images_nchw: np.ndarray, labels: np.ndarray) -> None:
    """SVHN cropped-digits .mat: X (32, 32, 3, N) uint8, y (N, 1) double with 10 meaning digit 0."""
    from scipy.io import savemat

    savemat(str(path), {"X": images_nchw.transpose(2, 3, 1, 0), "y": labels.reshape(-1, 1).astype(np.float64)})


def write_pickle(path: Path, obj: dict) -> None:
    # The official batches are Python 2 pickles with str keys; torchvision reads them with
    # encoding="latin1", so keys arrive as str ("data", "labels"), which is what we write.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=2))


def rand_images(rng: np.random.Generator, n: int, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)


# --- fixtures: each writes a tiny dataset and returns what was written --------------------------

def make_mnist(root: Path, rng: np.random.Generator, emnist: bool = False) -> dict[str, np.ndarray]:
    """Upright images + labels; for EMNIST the file holds them transposed, as the real files do."""
    out = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        imgs, labs = rand_images(rng, n, (28, 28)), rng.integers(0, 10, size=n, dtype=np.uint8)
        if emnist:
            raw, prefix = root / "EMNIST" / "raw", f"emnist-digits-{split}"
            write_idx(raw / f"{prefix}-images-idx3-ubyte", np.ascontiguousarray(imgs.transpose(0, 2, 1)))
            write_idx(raw / f"{prefix}-labels-idx1-ubyte", labs)
        else:
            raw, prefix = root / "MNIST" / "raw", "train" if split == "train" else "t10k"
            write_idx(raw / f"{prefix}-images-idx3-ubyte", imgs)
            write_idx(raw / f"{prefix}-labels-idx1-ubyte", labs)
        out[f"x_{split}"], out[f"y_{split}"] = imgs, labs
    return out


def make_usps(root: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for split, n, fname in (("train", N_TRAIN, "usps.bz2"), ("test", N_TEST, "usps.t.bz2")):
        vals = rng.uniform(-1.0, 1.0, size=(n, 16, 16))
        labs = rng.integers(1, 11, size=n)
        labs[0] = 10  # label 10 is digit 9 in USPS' 1-based labels
        write_usps(root / fname, vals, labs)
        out[f"x_{split}"], out[f"y_{split}"] = vals, labs
    return out


def make_svhn(root: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        imgs = rand_images(rng, n, (3, 32, 32))
        labs = rng.integers(1, 11, size=n)
        labs[0] = 10  # SVHN's 10 means the digit 0
        write_svhn(root / f"{split}_32x32.mat", imgs, labs)
        out[f"x_{split}"], out[f"y_{split}"] = imgs, labs
    return out


def make_cifar10(root: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    folder = root / "cifar-10-batches-py"
    x_tr, y_tr = rand_images(rng, N_TRAIN, (3, 32, 32)), rng.integers(0, 10, size=N_TRAIN)
    x_te, y_te = rand_images(rng, N_TEST, (3, 32, 32)), rng.integers(0, 10, size=N_TEST)
    bounds = [0, 2, 3, 4, 5, 6]  # 6 training images spread over the 5 batches, in order
    for i in range(5):
        sl = slice(bounds[i], bounds[i + 1])
        write_pickle(folder / f"data_batch_{i + 1}", {"data": x_tr[sl].reshape(-1, 3072), "labels": y_tr[sl].tolist()})
    write_pickle(folder / "test_batch", {"data": x_te.reshape(-1, 3072), "labels": y_te.tolist()})
    write_pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}


def make_cifar100(root: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    folder = root / "cifar-100-python"
    out = {}
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        imgs, labs = rand_images(rng, n, (3, 32, 32)), rng.integers(0, 100, size=n)
        labs[0] = 99
        write_pickle(folder / split, {"data": imgs.reshape(n, 3072), "fine_labels": labs.tolist(),
                                      "coarse_labels": (labs // 5).tolist()})
        out[f"x_{split}"], out[f"y_{split}"] = imgs, labs
    write_pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                                   "coarse_label_names": [f"k{i}" for i in range(20)]})
    return out


MAKERS = {
    "mnist": make_mnist,
    "emnist": lambda root, rng: make_mnist(root, rng, emnist=True),
    "usps": make_usps,
    "svhn": make_svhn,
    "cifar10": make_cifar10,
    "cifar100": make_cifar100,
}


def check_common(ds: ArrayDataset, name: str, shape: tuple[int, int, int], num_classes: int) -> None:
    assert isinstance(ds, ArrayDataset) and ds.name == name and ds.num_classes == num_classes
    assert ds.x_train.shape == (N_TRAIN, *shape) and ds.x_test.shape == (N_TEST, *shape)
    assert ds.input_shape == shape
    for x in (ds.x_train, ds.x_test):
        assert x.dtype == np.float32 and x.min() >= 0.0 and x.max() <= 1.0
    for y in (ds.y_train, ds.y_test):
        assert y.dtype == np.int64 and y.min() >= 0 and y.max() < num_classes


# --- loaders ----------------------------------------------------------------------------------

@needs_torchvision
def test_mnist_roundtrip(tmp_path: Path) -> None:
    w = make_mnist(tmp_path, np.random.default_rng(0))
    ds = load_folder_dataset("mnist", tmp_path)
    check_common(ds, "mnist", (1, 28, 28), 10)
    np.testing.assert_array_equal(ds.x_train[:, 0], w["x_train"] / np.float32(255))
    np.testing.assert_array_equal(ds.x_test[:, 0], w["x_test"] / np.float32(255))
    np.testing.assert_array_equal(ds.y_train, w["y_train"])
    np.testing.assert_array_equal(ds.y_test, w["y_test"])


@needs_torchvision
def test_emnist_digits_are_transposed_upright(tmp_path: Path) -> None:
    w = make_mnist(tmp_path, np.random.default_rng(1), emnist=True)
    ds = load_folder_dataset("emnist", tmp_path)
    check_common(ds, "emnist", (1, 28, 28), 10)
    upright = w["x_train"] / np.float32(255)
    assert not np.array_equal(upright, upright.transpose(0, 2, 1))  # else the check below proves nothing
    np.testing.assert_array_equal(ds.x_train[:, 0], upright)
    np.testing.assert_array_equal(ds.x_test[:, 0], w["x_test"] / np.float32(255))
    np.testing.assert_array_equal(ds.y_train, w["y_train"])
    np.testing.assert_array_equal(ds.y_test, w["y_test"])


@needs_torchvision
def test_usps_roundtrip(tmp_path: Path) -> None:
    w = make_usps(tmp_path, np.random.default_rng(2))
    ds = load_folder_dataset("usps", tmp_path)
    check_common(ds, "usps", (1, 16, 16), 10)
    for split in ("train", "test"):
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        # torchvision maps [-1, 1] to uint8 0..255 (truncating), so allow one grey level.
        np.testing.assert_allclose(x[:, 0], (w[f"x_{split}"] + 1) / 2, atol=1 / 255 + 1e-6, rtol=0)
        np.testing.assert_array_equal(y, w[f"y_{split}"] - 1)
    assert ds.y_train[0] == 9


@needs_torchvision
def test_svhn_roundtrip_label_10_is_zero(tmp_path: Path) -> None:
    w = make_svhn(tmp_path, np.random.default_rng(3))
    ds = load_folder_dataset("svhn", tmp_path)
    check_common(ds, "svhn", (3, 32, 32), 10)
    for split in ("train", "test"):
        np.testing.assert_array_equal(getattr(ds, f"x_{split}"), w[f"x_{split}"] / np.float32(255))
        np.testing.assert_array_equal(getattr(ds, f"y_{split}"), w[f"y_{split}"] % 10)
    assert ds.y_train[0] == 0 and ds.y_test[0] == 0


@needs_torchvision
@pytest.mark.parametrize("name, num_classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_roundtrip(tmp_path: Path, name: str, num_classes: int) -> None:
    w = MAKERS[name](tmp_path, np.random.default_rng(4))
    ds = load_folder_dataset(name, tmp_path)
    check_common(ds, name, (3, 32, 32), num_classes)
    for split in ("train", "test"):
        np.testing.assert_array_equal(getattr(ds, f"x_{split}"), w[f"x_{split}"] / np.float32(255))
        np.testing.assert_array_equal(getattr(ds, f"y_{split}"), w[f"y_{split}"])


# --- missing files ----------------------------------------------------------------------------

def test_expected_files_cover_every_dataset() -> None:
    assert set(EXPECTED_FILES) == set(FOLDER_DATASETS) == set(MAKERS)


@pytest.mark.parametrize("name", FOLDER_DATASETS)
def test_empty_folder_names_every_missing_file(tmp_path: Path, name: str) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_folder_dataset(name, tmp_path)
    err = info.value
    assert isinstance(err, FileNotFoundError)
    msg = str(err)
    assert repr(name) in msg and str(tmp_path) in msg
    for rel in EXPECTED_FILES[name]:
        assert str(tmp_path / rel) in msg, rel
    assert sorted(err.missing) == sorted(tmp_path / rel for rel in EXPECTED_FILES[name])


@pytest.mark.parametrize("name", FOLDER_DATASETS)
def test_one_missing_file_is_the_only_one_listed(tmp_path: Path, name: str) -> None:
    pytest.importorskip("scipy")  # the SVHN writer needs it
    MAKERS[name](tmp_path, np.random.default_rng(5))
    gone = tmp_path / EXPECTED_FILES[name][-1]
    gone.unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_folder_dataset(name, tmp_path)
    assert info.value.missing == [gone]
    assert str(gone) in str(info.value)
    others = [str(tmp_path / rel) for rel in EXPECTED_FILES[name][:-1]]
    assert not any(o + "\n" in str(info.value) + "\n" for o in others)


def test_unknown_name_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fashion"):
        load_folder_dataset("fashion", tmp_path)


def test_module_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['torchvision'] = None\n"
        "import firmware_sim.folders as f; assert f.FOLDER_DATASETS[0] == 'mnist'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --- to_common_shape --------------------------------------------------------------------------

def _toy(x_train: np.ndarray, x_test: np.ndarray) -> ArrayDataset:
    return ArrayDataset("toy", x_train, np.arange(len(x_train), dtype=np.int64) % 10,
                        x_test, np.arange(len(x_test), dtype=np.int64) % 10, 10)


@needs_torchvision
def test_to_common_shape_grey_to_rgb_upsample() -> None:
    rng = np.random.default_rng(6)
    grey = rng.uniform(0, 1, size=(5, 1, 16, 16)).astype(np.float32)
    const = np.full((2, 1, 16, 16), 0.25, dtype=np.float32)
    ds = _toy(grey, const)
    before = grey.copy()
    out = to_common_shape(ds, (3, 32, 32))
    assert out.x_train.shape == (5, 3, 32, 32) and out.x_test.shape == (2, 3, 32, 32)
    assert out.x_train.dtype == np.float32 and out.x_train.min() >= 0 and out.x_train.max() <= 1
    np.testing.assert_array_equal(out.x_train[:, 0], out.x_train[:, 1])  # grey repeated
    np.testing.assert_array_equal(out.x_train[:, 0], out.x_train[:, 2])
    np.testing.assert_allclose(out.x_test, 0.25, atol=1e-6)  # constant stays constant
    # 2x upsampling keeps each image's mean and its coarse content (2x2 block means ~ originals).
    np.testing.assert_allclose(out.x_train.mean(axis=(1, 2, 3)), grey.mean(axis=(1, 2, 3)), atol=0.02)
    blocks = out.x_train[:, 0].reshape(5, 16, 2, 16, 2).mean(axis=(2, 4))
    assert np.corrcoef(blocks.ravel(), grey[:, 0].ravel())[0, 1] > 0.8
    np.testing.assert_array_equal(out.y_train, ds.y_train)
    assert out.num_classes == 10 and out.name == "toy"
    np.testing.assert_array_equal(grey, before)  # input untouched


@needs_torchvision
def test_to_common_shape_rgb_to_grey_downsample_uses_luminance() -> None:
    x = np.zeros((3, 3, 32, 32), dtype=np.float32)
    for c in range(3):
        x[c, c] = 1.0  # pure red, green, blue images
    ramp = np.broadcast_to(np.linspace(0, 1, 32, dtype=np.float32), (1, 3, 32, 32)).copy()
    out = to_common_shape(_toy(x, ramp), (1, 28, 28))
    assert out.x_train.shape == (3, 1, 28, 28) and out.x_test.shape == (1, 1, 28, 28)
    np.testing.assert_allclose(out.x_train.mean(axis=(1, 2, 3)), [0.299, 0.587, 0.114], atol=1e-5)
    row = out.x_test[0, 0, 14]
    assert np.all(np.diff(row) > 0) and row[0] < 0.05 and row[-1] > 0.95  # a ramp stays a ramp
    assert np.abs(out.x_test[0, 0] - out.x_test[0, 0, :1]).max() < 1e-6  # rows stay identical


@needs_torchvision
def test_to_common_shape_same_shape_is_identity_and_digit10_shapes_meet(tmp_path: Path) -> None:
    x = np.random.default_rng(7).uniform(0, 1, size=(2, 1, 28, 28)).astype(np.float32)
    ds = _toy(x, x[:1])
    assert to_common_shape(ds, (1, 28, 28)) is ds
    shapes = {to_common_shape(d, (3, 32, 32)).input_shape for d in (
        ds, _toy(x[:, :, :16, :16], x[:1, :, :16, :16]),
        _toy(np.zeros((2, 3, 32, 32), np.float32), np.zeros((1, 3, 32, 32), np.float32)))}
    assert shapes == {(3, 32, 32)}
