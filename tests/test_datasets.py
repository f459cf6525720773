"""Embedded datasets (digits, digit domains, MNIST-1D) and the load_dataset dispatcher."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from firmware_sim import datasets
from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import load_dataset

REPO = Path(__file__).resolve().parents[1]
N_DIGITS = 1797
SMALL_MNIST1D = 1000  # generation is ~1 s per 1,000 samples; keep the tests fast


@pytest.fixture(autouse=True)
def _cache_in_tmp(monkeypatch, tmp_path_factory):
    # One cache for the whole session (so generated MNIST-1D is shared), never the user's own.
    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path_factory.getbasetemp() / "edgefil-cache"))


def _check_arrays(ds: ArrayDataset, feature_shape: tuple[int, ...]) -> None:
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert x.shape == (len(y), *feature_shape)
        assert set(np.unique(y)) == set(range(ds.num_classes))
    assert ds.input_shape == feature_shape


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in np.ascontiguousarray(x, dtype=np.float32)}


# --- digits --------------------------------------------------------------------------------------

def test_digits_shapes_range_and_stratified_split():
    ds = load_dataset("digits", test_fraction=0.3, seed=1)
    _check_arrays(ds, (1, 8, 8))
    assert ds.num_classes == 10
    assert len(ds.y_train) + len(ds.y_test) == N_DIGITS
    assert len(ds.y_test) == pytest.approx(0.3 * N_DIGITS, abs=1)
    for x in (ds.x_train, ds.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
    # stratified: every class keeps (about) the overall test share
    train_counts, test_counts = np.bincount(ds.y_train), np.bincount(ds.y_test)
    np.testing.assert_allclose(test_counts / (train_counts + test_counts), 0.3, atol=0.02)
    assert not _rows(ds.x_train) & _rows(ds.x_test)


def test_digits_split_is_seeded():
    a, b, c = (datasets.load_digits_dataset(seed=s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert _rows(a.x_test) != _rows(c.x_test)


def test_digits_split_is_kept_and_read_back_without_scikit_learn(monkeypatch, tmp_path):
    """The split made once is kept in the cache; a later load reads the same arrays without splitting again, in a
    fresh process without importing scikit-learn (2 s a fleet worker paid at its start); another seed is another
    entry."""
    import subprocess
    import sys

    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path))
    made = datasets.load_digits_dataset(seed=3)
    assert len(list(tmp_path.glob("digits-*.npz"))) == 1

    def fail(*args):
        raise AssertionError("split again")

    monkeypatch.setattr(datasets, "stratified_split", fail)
    kept = datasets.load_digits_dataset(seed=3)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(made, name), getattr(kept, name))
    with pytest.raises(AssertionError, match="split again"):
        datasets.load_digits_dataset(seed=4)
    probe = ("import sys; from firmware_sim.datasets import load_digits_dataset; d = load_digits_dataset(seed=3); "
             "print(len(d.y_train), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(made.y_train)), "False"]


def test_digits_load_where_the_cache_cannot_be_written(monkeypatch, tmp_path):
    """Before the split was cached, a host without a writable cache loaded the digits: it still does."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("EDGEFIL_CACHE", str(blocked / "cache"))
    assert len(datasets.load_digits_dataset(seed=2).y_train) + len(datasets.load_digits_dataset(seed=2).y_test) \
        == N_DIGITS


# --- digit domains -------------------------------------------------------------------------------

def test_digit_domains_shapes_and_labels():
    domains = load_dataset("digits_domains")
    assert [d.name for d in domains] == ["digits-original", "digits-rot90", "digits-inverted", "digits-noisy"]
    for d in domains:
        _check_arrays(d, (1, 8, 8))
        assert d.num_classes == 10
        assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0


def test_digit_domains_are_the_documented_transforms():
    # With shared images the split is the same in every domain, so each domain is its transform.
    original, rotated, inverted, noisy = datasets.load_digits_domains(disjoint=False)
    for d in (rotated, inverted, noisy):
        np.testing.assert_array_equal(d.y_train, original.y_train)
        np.testing.assert_array_equal(d.y_test, original.y_test)
    np.testing.assert_array_equal(rotated.x_train, np.rot90(original.x_train, axes=(-2, -1)))
    np.testing.assert_allclose(inverted.x_train, 1.0 - original.x_train)
    # blurred + noisy: clearly changed, yet still the same digits
    diff = np.abs(noisy.x_train - original.x_train).mean()
    corr = np.corrcoef(noisy.x_train.ravel(), original.x_train.ravel())[0, 1]
    assert diff > 0.05 and corr > 0.7


def test_digit_domains_blur_and_noise_set_the_fourth_domain_only():
    default = datasets.load_digits_domains(disjoint=False)
    mild = datasets.load_digits_domains(disjoint=False, blur=0.3, noise=0.1)
    clean = datasets.load_digits_domains(disjoint=False, blur=0, noise=0)
    for d, m in zip(default[:3], mild[:3]):
        np.testing.assert_array_equal(d.x_train, m.x_train)
    np.testing.assert_allclose(clean[3].x_train, default[0].x_train, atol=1e-6)  # nothing left to degrade
    distance = lambda d: np.abs(d[3].x_train - d[0].x_train).mean()  # noqa: E731
    assert 0 < distance(mild) < distance(default)


@pytest.mark.parametrize("option", [{"blur": -0.1}, {"noise": float("nan")}, {"noise": True}, {"blur": "0.3"}])
def test_digit_domains_refuse_a_bad_degradation(option):
    with pytest.raises(ValueError, match="digits_domains' (blur|noise) must be a finite number >= 0"):
        datasets.load_digits_domains(**option)


def test_digit_domains_differ_from_each_other():
    domains = datasets.load_digits_domains()
    means = [np.concatenate([d.x_train, d.x_test]).mean(axis=0) for d in domains]
    for i in range(len(means)):
        for j in range(i + 1, len(means)):
            assert np.abs(means[i] - means[j]).mean() > 0.02, (domains[i].name, domains[j].name)


def test_digit_domains_disjoint_images():
    original, rotated, inverted, noisy = datasets.load_digits_domains(seed=3)
    every = lambda d: np.concatenate([d.x_train, d.x_test])  # noqa: E731
    assert sum(len(every(d)) for d in (original, rotated, inverted, noisy)) == N_DIGITS
    seen = _rows(every(original))
    unrotated = np.rot90(every(rotated), k=-1, axes=(-2, -1))
    assert not seen & _rows(unrotated)
    assert not seen & _rows(1.0 - every(inverted))
    assert not _rows(unrotated) & _rows(1.0 - every(inverted))


# --- MNIST-1D ------------------------------------------------------------------------------------

def test_mnist1d_shapes_and_standardisation():
    ds = load_dataset("mnist1d", num_samples=SMALL_MNIST1D, test_fraction=0.25, seed=0)
    _check_arrays(ds, (1, 40))
    assert ds.num_classes == 10
    assert len(ds.y_train) + len(ds.y_test) == SMALL_MNIST1D
    assert len(ds.y_test) == SMALL_MNIST1D // 4
    assert abs(float(ds.x_train.mean())) < 1e-4 and float(ds.x_train.std()) == pytest.approx(1.0, abs=1e-4)
    assert abs(float(ds.x_test.mean())) < 0.2  # same statistics, not refitted on the test split


def _no_network(*args, **kwargs):
    raise AssertionError("MNIST-1D generation tried to open a socket")


def test_mnist1d_generation_is_offline_deterministic_and_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(socket, "socket", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()

    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path / "a"))
    a = datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=5)
    assert len(list((tmp_path / "a").glob("mnist1d-*.npz"))) == 1
    assert not list((tmp_path / "a").glob("*.tmp"))
    np.testing.assert_array_equal(np.random.get_state()[1], before)  # the caller's global RNG is untouched

    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path / "b"))
    b = datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=5)  # generated afresh, not read from "a"
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)

    c = datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=6)
    assert not np.array_equal(a.x_train, c.x_train)


def test_mnist1d_cache_hit_does_not_regenerate(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path))
    first = datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=0)

    def fail(params):
        raise AssertionError(f"regenerated {params}")

    monkeypatch.setattr(datasets, "_generate_mnist1d", fail)
    again = datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=0)
    np.testing.assert_array_equal(first.x_test, again.x_test)
    with pytest.raises(AssertionError, match="regenerated"):  # other arguments: another cache entry
        datasets.load_mnist1d(num_samples=SMALL_MNIST1D, seed=1)


def test_mnist1d_rejects_bad_test_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.load_mnist1d(num_samples=SMALL_MNIST1D, test_fraction=1.0)


# --- Fashion-MNIST (Debian's package, or a folder of the same files) -----------------------------

needs_fashion = pytest.mark.skipif(not (datasets.FASHION_MNIST_ROOT / "train-images-idx3-ubyte.gz").is_file(),
                                   reason="dataset-fashion-mnist is not installed (scripts/setup installs it)")


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    import gzip

    data = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape) + array.tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def _fashion_folder(folder: Path, per_class: int = 6, gz: bool = True) -> dict[str, np.ndarray]:
    """A small Fashion-MNIST look-alike in the package's layout: 10 classes, `per_class` train and test images."""
    rng = np.random.default_rng(0)
    arrays = {"x": rng.integers(0, 256, (10 * per_class, 28, 28), dtype=np.uint8),
              "y": np.repeat(np.arange(10, dtype=np.uint8), per_class),
              "x_test": rng.integers(0, 256, (10 * per_class, 28, 28), dtype=np.uint8),
              "y_test": np.tile(np.arange(10, dtype=np.uint8), per_class)}
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in datasets.FASHION_MNIST_FILES.items():
        _write_idx(folder / (name + (".gz" if gz else "")), arrays[key], gz)
    return arrays


@needs_fashion
def test_fashion_mnist_is_read_from_the_debian_package():
    data = load_dataset("fashion_mnist")
    _check_arrays(data, (1, 28, 28))
    assert (len(data.y_train), len(data.y_test)) == (60_000, 10_000)
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    cut = load_dataset("fashion_mnist", train_per_class=30, test_per_class=10, seed=1)
    assert np.bincount(cut.y_train).tolist() == [30] * 10 and np.bincount(cut.y_test).tolist() == [10] * 10
    assert _rows(cut.x_train) <= _rows(data.x_train)  # a draw of the real images, not new ones


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_is_read_from_a_users_folder_of_the_same_files(tmp_path, gz):
    arrays = _fashion_folder(tmp_path / "fmnist", gz=gz)
    data = load_dataset("fashion_mnist", root=str(tmp_path / "fmnist"))
    np.testing.assert_array_equal(data.x_train[:, 0], arrays["x"].astype(np.float32) / 255)
    np.testing.assert_array_equal(data.y_test, arrays["y_test"].astype(np.int64))
    again = load_dataset("fashion_mnist", root=str(tmp_path / "fmnist"), train_per_class=2, seed=3)
    same = load_dataset("fashion_mnist", root=str(tmp_path / "fmnist"), train_per_class=2, seed=3)
    np.testing.assert_array_equal(again.x_train, same.x_train)  # a seeded draw
    assert np.bincount(again.y_train).tolist() == [2] * 10 and len(again.y_test) == 60


def test_fashion_mnist_missing_or_damaged_says_so_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing train-images-idx3-ubyte.gz, .*t10k-labels") as err:
        load_dataset("fashion_mnist", root=str(tmp_path))
    assert "\n" not in str(err.value)
    _fashion_folder(tmp_path / "bad")
    (tmp_path / "bad" / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz: not a readable IDX file"):
        load_dataset("fashion_mnist", root=str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="train_per_class must be an integer >= 1"):
        load_dataset("fashion_mnist", root=str(tmp_path / "bad"), train_per_class=0)


def test_fashion_mnist_domains_are_disjoint_transformed_quarters(tmp_path):
    _fashion_folder(tmp_path / "fmnist", per_class=8)
    domains = load_dataset("fashion_mnist_domains", root=str(tmp_path / "fmnist"))
    assert [d.name for d in domains] == ["fashion-original", "fashion-rot90", "fashion-inverted", "fashion-noisy"]
    original = load_dataset("fashion_mnist", root=str(tmp_path / "fmnist"))
    for d in domains:
        assert np.bincount(d.y_train).tolist() == [2] * 10 and np.bincount(d.y_test).tolist() == [2] * 10
    assert _rows(domains[0].x_train) <= _rows(original.x_train)
    seen = [_rows(np.rot90(domains[1].x_train, k=-1, axes=(-2, -1))), _rows(1.0 - domains[2].x_train)]
    assert not (_rows(domains[0].x_train) & seen[0]) and not (seen[0] & seen[1])  # no image in two domains


# --- dispatcher ----------------------------------------------------------------------------------

def test_load_dataset_passes_options_to_the_loader():
    a, b = load_dataset("digits", test_fraction=0.5), datasets.load_digits_dataset(test_fraction=0.5)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert len(a.y_test) == pytest.approx(N_DIGITS / 2, abs=1)


def test_unknown_dataset_lists_known_names():
    with pytest.raises(ValueError, match="unknown dataset 'nope'") as err:
        load_dataset("nope")
    for name in ("digits", "digits_domains", "mnist1d", "cifar10", "digit10"):
        assert name in str(err.value)


@pytest.mark.parametrize("name", ["mnist", "cifar100", "digit10"])
def test_folder_dataset_without_root_says_what_to_pass(name):
    with pytest.raises(ValueError, match="root="):
        load_dataset(name)


def _fake_folders(monkeypatch) -> list[tuple]:
    """Replace firmware_sim.folders by a recorder; returns the list of calls made to it."""
    calls: list[tuple] = []

    def load_folder_dataset(name, root):
        calls.append(("load", name, root))
        x = np.zeros((4, 1, 2, 2), np.float32)
        return ArrayDataset(name, x, np.arange(4) % 2, x, np.arange(4) % 2, num_classes=2)

    def to_common_shape(ds, shape):
        calls.append(("shape", ds.name, shape))
        x = np.zeros((4, *shape), np.float32)
        return ArrayDataset(ds.name, x, ds.y_train, x, ds.y_test, ds.num_classes)

    fake = types.SimpleNamespace(
        FOLDER_DATASETS=("mnist", "emnist", "usps", "svhn", "cifar10", "cifar100"),
        load_folder_dataset=load_folder_dataset,
        to_common_shape=to_common_shape,
    )
    monkeypatch.setitem(sys.modules, "firmware_sim.folders", fake)
    monkeypatch.setattr("firmware_sim.folders", fake, raising=False)
    return calls


def test_folder_dataset_is_read_from_root(monkeypatch):
    calls = _fake_folders(monkeypatch)
    ds = load_dataset("svhn", root="/data/x")
    assert ds.name == "svhn" and calls == [("load", "svhn", "/data/x")]
    with pytest.raises(TypeError, match="takes no options"):
        load_dataset("svhn", root="/data/x", seed=1)


def test_digit10_is_four_folder_domains_in_one_shape(monkeypatch):
    calls = _fake_folders(monkeypatch)
    stream = load_dataset("digit10", root="/d", shape=[3, 32, 32])
    assert [d.name for d in stream] == ["mnist", "emnist", "usps", "svhn"]
    assert all(d.input_shape == (3, 32, 32) for d in stream)
    assert [c for c in calls if c[0] == "load"] == [("load", n, "/d") for n in ("mnist", "emnist", "usps", "svhn")]
    assert {c[2] for c in calls if c[0] == "shape"} == {(3, 32, 32)}


def test_import_and_embedded_loading_do_not_need_torch(tmp_path):
    code = (
        "import sys\n"
        "import firmware_sim.datasets as d\n"
        "heavy = {'torch', 'sklearn', 'scipy', 'mnist1d', 'matplotlib'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        f"d.load_dataset('digits_domains'); d.load_dataset('mnist1d', num_samples={SMALL_MNIST1D})\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = {**os.environ, "EDGEFIL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
