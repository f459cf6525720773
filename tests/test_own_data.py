"""A user's own data (firmware_sim/own_data.py): a folder of images with a subfolder per class, .npz and .npy
arrays (channels last and 8-bit pixels detected and said), each refused in one line where it cannot be read; split
by `edgefil data split --from`, set up by `edgefil init --from`, and federated by the fleet that init wrote."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fleet_harness import CEILING_S
from PIL import Image

from firmware_sim.datasets import load_dataset
from firmware_sim.own_data import load_arrays

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("ankle", "bag", "coat", "dress", "hat", "jumper", "mitten", "scarf", "shirt", "sock")


def image_folder(root: Path, per_class: int, size: tuple[int, int] = (28, 28), mode: str = "L",
                 classes: tuple[str, ...] = CLASSES, seed: int = 0) -> Path:
    """`per_class` images a class in root/<class>/: class k is a bright bar at row 2k + 2 over noise, so that
    a small model tells them apart in a few rounds."""
    rng = np.random.default_rng(seed)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 60, (size[1], size[0]), dtype=np.uint8)
            pixels[2 * k + 2: 2 * k + 4] = 250
            image = Image.fromarray(pixels, "L")
            image.convert(mode).save(root / name / f"{i:03d}.png")
    return root


def test_a_class_per_folder_image_set_is_read_with_its_class_names_in_sorted_order(tmp_path):
    root = image_folder(tmp_path / "clothes", 8, classes=("sock", "coat", "bag"))
    data = load_arrays(str(root))
    assert data.class_names == ("bag", "coat", "sock") and data.num_classes == 3
    assert data.x_train.shape[1:] == (1, 28, 28) and data.x_train.dtype == np.float32
    assert len(data.y_train) + len(data.y_test) == 24 and sorted(np.bincount(data.y_test)) == [2, 2, 2]
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    # the folders were written in the order sock, coat, bag (bars at rows 2, 4, 6): the ids follow the names'
    # order, and each sample's bar says which folder it came from
    sock, bag = data.x_train[data.y_train == 2], data.x_train[data.y_train == 0]
    assert sock[:, 0, 2:4].mean() > 0.9 and bag[:, 0, 6:8].mean() > 0.9


def test_colour_images_and_other_sizes_are_read_as_rgb_at_the_most_common_size_and_said(tmp_path, caplog):
    root = image_folder(tmp_path / "rgb", 6, size=(12, 10), mode="RGB", classes=("a", "b"))
    Image.new("RGB", (30, 40), (255, 0, 0)).save(root / "a" / "big.png")
    with caplog.at_level(logging.INFO, logger="edgefil.datasets"):
        data = load_arrays(str(root))
    assert data.x_train.shape[1:] == (3, 10, 12)  # channels first, H x W of the 12x10 images
    assert "1 of 13 images resized to 10x12 (the most common size)" in caplog.text


def test_train_and_test_folders_are_kept_as_the_user_split_them(tmp_path):
    image_folder(tmp_path / "set" / "train", 5, classes=("x", "y"))
    image_folder(tmp_path / "set" / "test", 2, classes=("x", "y"), seed=1)
    data = load_arrays(str(tmp_path / "set"))
    assert (len(data.y_train), len(data.y_test), data.class_names) == (10, 4, ("x", "y"))
    image_folder(tmp_path / "bad" / "train", 2, classes=("x", "y"))
    image_folder(tmp_path / "bad" / "test", 2, classes=("x", "z"))
    with pytest.raises(ValueError, match=r"class folder 'z' is not among train/'s \(x, y\)"):
        load_arrays(str(tmp_path / "bad"))


def test_channels_last_and_8_bit_arrays_are_read_as_the_runtime_format_and_said(tmp_path, caplog):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (20, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "hwc.npz", x=x, y=np.arange(20) % 2)
    with caplog.at_level(logging.INFO, logger="edgefil.datasets"):
        data = load_arrays(str(tmp_path / "hwc.npz"))
    assert data.x_train.shape[1:] == (3, 16, 16) and data.x_train.max() <= 1.0
    assert "x holds uint8 pixels: scaled to [0, 1]" in caplog.text
    assert "x is channels last (16, 16, 3): read as channels first (3, 16, 16)" in caplog.text
    both = np.concatenate([data.x_train, data.x_test])
    assert np.allclose(np.sort(both.ravel()), np.sort((x.transpose(0, 3, 1, 2) / 255.0).ravel()))
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", rng.random((12, 1, 8, 8)).astype(np.float32))  # channels first already
    np.save(tmp_path / "npy" / "y.npy", np.arange(12) % 3)
    assert load_arrays(str(tmp_path / "npy")).x_train.shape[1:] == (1, 8, 8)


@pytest.mark.parametrize("make, message", [
    (lambda root: root.mkdir(), "no arrays and no class folders with images in it (an .npz with x and y"),
    (lambda root: (root / "a").mkdir(parents=True) or (root / "a" / "1.png").write_bytes(b"not a png"),
     "1.png: not an image Pillow can read"),
    (lambda root: np.savez(root, x=np.zeros((4, 2))), "needs arrays x and y (found x)"),
])
def test_data_that_cannot_be_read_are_refused_in_one_line(tmp_path, make, message):
    root = tmp_path / "data"
    make(root)
    path = root if root.exists() else root.with_suffix(".npz")
    with pytest.raises(ValueError) as err:
        load_dataset("arrays", str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def edgefil(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgefil.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=CEILING_S)


def test_an_image_folder_is_split_set_up_by_init_and_federated(tmp_path):
    """The path a user takes with their own images: `data split --from` (the class names in classes.json and on
    the console), `init --from` (the first federation's files, its fleet file on the same data), and the fleet
    run of that file, whose devices learn each task."""
    images = image_folder(tmp_path / "clothes", 40)
    split = edgefil("data", "split", "--from", str(images), "--tasks", "2", "--classes-per-task", "5",
                    "--devices", "a,b", "--out", str(tmp_path / "data"))
    assert split.returncode == 0, split.stderr
    record = json.loads((tmp_path / "data" / "classes.json").read_text())
    assert record["class_names"] == list(CLASSES) and record["input_shape"] == [1, 28, 28]
    first = record["tasks"][0]["classes"][0]
    assert f"{first} ({CLASSES[first]})" in split.stdout
    assert "400 images of 10 classes" in split.stderr

    lab = tmp_path / "lab"
    init = edgefil("init", str(lab), "--from", str(images), "--tasks", "2", "--classes-per-task", "5",
                   "--devices", "a,b")
    assert init.returncode == 0, init.stderr
    assert f"edgefil data split --from {images} --tasks 2 --classes-per-task 5 --devices a,b" in init.stdout
    assert "--classes 10 --input-shape 1,28,28" in init.stdout
    run = edgefil("fleet", "run", str(lab / "fleet.toml"))
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((lab / "rehearsal" / "results.json").read_text())
    assert results["outcome"] == "complete"
    matrix = results["accuracy_matrix"]
    assert all(matrix[t][t] > 0.5 for t in range(2)), matrix  # each task learnt (chance: 0.2 within a task)
