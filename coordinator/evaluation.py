"""Evaluation after each round: the global model on the test set of every task seen so far, and a model on one
client's own test set (pFedGRP's per-client accuracy a_k^t, weighted into IAA).

The test data come through `TestSets`: a folder of test files in a deployment (`FolderTestSets`), or the
scenario's test sets when a simulated fleet builds the scenario (`firmware_sim.scenarios.ScenarioData` has the
same shape) and hands them to the coordinator, which never imports the simulator.

Choice: a model is evaluated with the classes seen so far unmasked, as the devices train: for the per-task
accuracies the classes of tasks 0..t (those the federation has seen; for domain-incremental scenarios every
class, so nothing is masked), for a client's accuracy the classes of its own tasks 0..t. A client's model is
thus not penalised for classes it has never been shown, and the global model is scored on a client's history
the same way.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from edgefil.durable import read_npz
from edgefil.metrics import instant_average_accuracy
from models.flat_weights import load_flat_weights
from models.manifest import Manifest
from models.zoo import build_for

EVAL_BATCH = 512


class TestSets(Protocol):
    """The data the coordinator evaluates on: per task a test set and the classes the task brings; with
    `per_client` (flowing data) also each client's own test data and how much it trained on."""

    @property
    def num_classes(self) -> int: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def n_tasks(self) -> int: ...

    @property
    def per_client(self) -> bool: ...

    def describe(self) -> dict[str, Any]:
        """What results.json records as the run's data."""

    def task_classes(self, t: int) -> tuple[int, ...]: ...

    def task_test(self, t: int) -> tuple[np.ndarray, np.ndarray]: ...

    def client_seen_test(self, k: int, t: int) -> tuple[np.ndarray, np.ndarray]: ...

    def client_seen_classes(self, k: int, t: int) -> tuple[int, ...]: ...

    def client_samples_seen(self, k: int, t: int) -> int: ...

    def host_train(self, t: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The train data of a task the host learns itself (coordinator/host_training.py), None for a task the
        devices learn."""

    def calibration(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Task t's calibration samples, apart from its test set and from every device (the guard's reference,
        coordinator/reference.py); empty when there are none."""


def input_range(data: TestSets) -> tuple[float, float]:
    """[low, high] of every task's test inputs: the data's range, for a rule that makes inputs of its own and is not
    told it (`Strategy.makes_inputs`); (0, 1), the image sets' range, where no task holds a test sample."""
    parts = [x for x, _ in (data.task_test(t) for t in range(data.n_tasks)) if x.size]
    if not parts:
        return 0.0, 1.0
    return min(float(x.min()) for x in parts), max(float(x.max()) for x in parts)


class FolderTestSets:
    """A deployment's test data: `test-<t>.npz` files (arrays `x` float32, `y` int64), one per task, in a folder
    the operator keeps, read once. A task's classes are the labels its test set holds. No per-client data. A task
    the host learns itself has its train data beside them, `host-train-<t>.npz`."""

    per_client = False

    def __init__(self, folder: str | Path, manifest: Manifest) -> None:
        self.folder = Path(folder)
        self.num_classes = manifest.num_classes
        self.input_shape = tuple(manifest.input_shape)
        files = sorted(self.folder.glob("test-*.npz"))
        paths = [self.folder / f"test-{t}.npz" for t in range(len(files))]
        missing = [p.name for p in paths if not p.is_file()]
        if not files or missing:
            raise FileNotFoundError(f"{self.folder}: expected test-0.npz, test-1.npz, ... (one per task); "
                                    f"{'none found' if not files else 'missing ' + ', '.join(missing)}")
        self._tests = [_load_test(p) for p in paths]
        self._calibration = [self._read_calibration(t) for t in range(len(paths))]  # read once, as the tests

    @property
    def n_tasks(self) -> int:
        return len(self._tests)

    def describe(self) -> dict[str, Any]:
        return {"test_data": str(self.folder), "n_tasks": self.n_tasks}

    def task_test(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self._tests[t]

    def task_classes(self, t: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unique(self._tests[t][1]))

    def client_seen_test(self, k: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError("a test-set folder has no per-client data")

    def client_seen_classes(self, k: int, t: int) -> tuple[int, ...]:
        raise NotImplementedError("a test-set folder has no per-client data")

    def client_samples_seen(self, k: int, t: int) -> int:
        raise NotImplementedError("a test-set folder has no per-client data")

    def host_train(self, t: int) -> tuple[np.ndarray, np.ndarray] | None:
        """`host-train-<t>.npz` (arrays x, y) beside the test files: task t is learnt by the host."""
        path = self.folder / f"host-train-{t}.npz"
        return _load_test(path) if path.is_file() else None

    def calibration(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """`calibration-<t>.npz` (arrays x, y) beside the test files, samples the operator keeps apart from the
        test set and from every device; empty when there is no such file."""
        return self._calibration[t]

    def _read_calibration(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        path = self.folder / f"calibration-{t}.npz"
        if path.is_file():
            return _load_test(path)
        return np.empty((0, *self.input_shape), np.float32), np.empty(0, np.int64)


def _load_test(path: Path) -> tuple[np.ndarray, np.ndarray]:
    data = read_npz(path)
    return data["x"].astype(np.float32), data["y"].astype(np.int64)


class Evaluator:
    def __init__(self, data: TestSets, manifest: Manifest, device: str = "cpu") -> None:
        if manifest.num_classes != data.num_classes or tuple(manifest.input_shape) != tuple(data.input_shape):
            raise ValueError(
                f"model {manifest.model} ({manifest.num_classes} classes, input {manifest.input_shape}) does not "
                f"fit the test data ({data.num_classes} classes, input {data.input_shape})"
            )
        self.data = data
        self.manifest = manifest
        self.device = torch.device(device)
        self.model = build_for(manifest).to(self.device).eval()

    def accuracies(self, weights: np.ndarray, task: int) -> list[float]:
        """Accuracy on the test set of each task 0..task, with the classes seen up to `task` unmasked."""
        self.load(weights)
        mask = self.seen_mask(task)
        return [self._accuracy(*self.data.task_test(j), mask) for j in range(task + 1)]

    def client_accuracy(self, weights: np.ndarray, client: int, t: int) -> float:
        """a_k^t: accuracy of `weights` (the client's personalised model, or the global one) on the client's test
        parts of tasks 0..t, with the client's classes of tasks 0..t unmasked."""
        self.load(weights)
        mask = self.mask(self.data.client_seen_classes(client, t))
        return self._accuracy(*self.data.client_seen_test(client, t), mask)

    def iaa(self, accuracies: Mapping[int, float], t: int) -> float:
        """IAA^t (Eq. 9) over the clients in `accuracies` (client -> a_k^t), each weighted by the train samples
        it has received in tasks 0..t."""
        clients = sorted(accuracies)
        return instant_average_accuracy([accuracies[k] for k in clients],
                                        [self.data.client_samples_seen(k, t) for k in clients])

    def seen_mask(self, task: int) -> np.ndarray:
        return self.mask(c for t in range(task + 1) for c in self.data.task_classes(t))

    def mask(self, classes: Iterable[int]) -> np.ndarray:
        mask = np.zeros(self.data.num_classes, dtype=np.float32)
        mask[list(classes)] = 1.0
        return mask

    def load(self, weights: np.ndarray) -> None:
        """`weights` into the evaluated model (ValueError when not finite)."""
        buffer = np.asarray(weights, dtype=np.float32)
        if not np.isfinite(buffer).all():
            raise ValueError("weights contain NaN or Inf values")
        load_flat_weights(self.model, self.manifest, buffer)

    @torch.no_grad()
    def _accuracy(self, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> float:
        """Share of samples whose masked arg-max logit is the label (0 for an empty set)."""
        if not len(y):
            return 0.0
        correct = 0
        for start, logits in self.logits(x, mask):
            correct += int((logits.cpu().numpy().argmax(1) == y[start:start + len(logits)]).sum())  # first max wins
        return correct / len(y)

    @torch.no_grad()
    def logits(self, x: np.ndarray, mask: np.ndarray) -> Iterator[tuple[int, torch.Tensor]]:
        """The loaded model's masked logits of `x`, a batch of EVAL_BATCH at a time, each with its first row."""
        mask_t = torch.from_numpy(mask).to(self.device)
        for start in range(0, len(x), EVAL_BATCH):
            xb = torch.from_numpy(np.ascontiguousarray(x[start:start + EVAL_BATCH], dtype=np.float32))
            yield start, self.model(xb.to(self.device), mask_t)[0]
