"""The runtime's one format of a dataset held in memory (`ArrayDataset`), whichever loader made it
(firmware_sim/datasets.py by name, firmware_sim/folders.py from a local folder, firmware_sim/own_data.py from a
user's own data), and the seeded train/test split of data that come without one."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    class_names: tuple[str, ...] | None = None  # class id -> name, where the data name them (an image folder's)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def stratified_split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> ArrayDataset:
    """Seeded train/test split keeping every class's share equal in both halves."""
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return ArrayDataset(name, x_tr, y_tr, x_te, y_te, num_classes=int(y.max()) + 1)
