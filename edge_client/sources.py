"""Where a device's data comes from, task by task: a folder of files on a real device. In simulation the fleet
hands the device a scenario's share instead (`firmware_sim.scenarios.ClientSource`), which satisfies `TaskSource`."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np


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
            with np.load(path, allow_pickle=False) as data:
                x, y = data["x"].astype(np.float32), data["y"].astype(np.int64)
        except Exception as err:  # np.load and the npz reader raise many types for a damaged or foreign file
            raise ValueError(f"{path} is not a task file of arrays x and y ({type(err).__name__}: {err})") from err
        if len(x) != len(y):
            raise ValueError(f"{path}: {len(x)} samples in x but {len(y)} labels in y")
        return x, y


def open_source(folder: Path | None) -> TaskSource:
    """The device config's `[data] folder`. (A simulated device's source is a scenario's share, which
    firmware_sim builds and hands to the device.)"""
    if folder is None:
        raise ValueError("[data] needs `folder`: the folder of task-<t>.npz files")
    return FolderSource(folder)
