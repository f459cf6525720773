"""Where a device's data comes from, task by task: a folder of files on a real device. In simulation the fleet
hands the device a scenario's share instead (`firmware_sim.client_shares.ClientSource`), which satisfies
`TaskSource`."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from edgefil.durable import read_npz


class TaskSource(Protocol):
    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples (x float32, y int64) the device receives for `task`."""


class FolderSource:
    """`task-<t>.npz` files with arrays `x` and `y`, dropped into a folder by whatever collects the data."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"data folder {self.folder} does not exist")

    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        path = self.folder / f"task-{task}.npz"
        if not path.is_file():
            raise FileNotFoundError(f"no data for task {task}: {path} is missing")
        try:
            data = read_npz(path)
            x, y = data["x"].astype(np.float32), data["y"].astype(np.int64)
        except Exception as err:  # np.load and the npz reader raise many types for a damaged or foreign file
            raise ValueError(f"{path} is not a task file of arrays x and y ({type(err).__name__}: {err})") from err
        if len(x) != len(y):
            raise ValueError(f"{path}: {len(x)} samples in x but {len(y)} labels in y")
        return x, y


def check_task_data(x: np.ndarray, y: np.ndarray, input_shape: tuple[int, ...], num_classes: int, task: int) -> None:
    """ValueError, in one line, for a task's data the model cannot learn from: the device refuses to train on them
    and says why (its status "error"), instead of training on whatever survives and reporting an update."""
    if len(y) == 0:
        raise ValueError(f"task {task}'s data hold no samples")
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise ValueError(f"task {task}'s samples have shape {tuple(x.shape[1:])}, the model takes "
                         f"{tuple(input_shape)} (edgefil data split writes a model's input format)")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"task {task}'s labels are not one per sample: y has shape {y.shape} for {len(x)} samples")
    outside = np.unique(y[(y < 0) | (y >= num_classes)])
    if outside.size:
        raise ValueError(f"task {task}'s labels {outside[:5].tolist()} are not classes of the model "
                         f"(0..{num_classes - 1})")
    if not np.isfinite(x).all():
        raise ValueError(f"task {task}'s samples hold NaN or infinite values")


def open_source(folder: Path | None) -> TaskSource:
    """The device config's `[data] folder`. (A simulated device's source is a scenario's share, which
    firmware_sim builds and hands to the device.)"""
    if folder is None:
        raise ValueError("[data] needs `folder`: the folder of task-<t>.npz files")
    return FolderSource(folder)
