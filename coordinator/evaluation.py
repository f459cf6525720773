"""Evaluation after each round: the global model on the test set of every task seen so far, and a model on one
client's own test set (pFedGRP's per-client accuracy a_k^t, weighted into IAA).

Choice: a model is evaluated with the classes seen so far unmasked, as the devices train: for the per-task
accuracies the classes of tasks 0..t (those the federation has seen; for domain-incremental scenarios every
class, so nothing is masked), for a client's accuracy the classes of its own tasks 0..t. A client's model is
thus not penalised for classes it has never been shown, and the global model is scored on a client's history
the same way.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.metrics import instant_average_accuracy
from firmware_sim.scenarios import ScenarioData
from models.manifest import Manifest


class Evaluator:
    def __init__(self, data: ScenarioData, manifest: Manifest, device: str = "cpu") -> None:
        if manifest.num_classes != data.num_classes or tuple(manifest.input_shape) != tuple(data.input_shape):
            raise ValueError(
                f"model {manifest.model} ({manifest.num_classes} classes, input {manifest.input_shape}) does not "
                f"fit the scenario ({data.num_classes} classes, input {data.input_shape})"
            )
        self.data = data
        self.trainer = TorchTrainer(manifest, device=device)

    def accuracies(self, weights: np.ndarray, task: int) -> list[float]:
        """Accuracy on the test set of each task 0..task, with the classes seen up to `task` unmasked."""
        self.trainer.set_weights(weights)
        mask = self.seen_mask(task)
        return [
            self.trainer.evaluate(*self.data.tasks[j].test(), class_mask=mask).accuracy for j in range(task + 1)
        ]

    def client_accuracy(self, weights: np.ndarray, client: int, t: int) -> float:
        """a_k^t: accuracy of `weights` (the client's personalised model, or the global one) on the client's test
        parts of tasks 0..t, with the client's classes of tasks 0..t unmasked."""
        self.trainer.set_weights(weights)
        mask = self._mask(self.data.client_seen_classes(client, t))
        return self.trainer.evaluate(*self.data.client_seen_test(client, t), class_mask=mask).accuracy

    def iaa(self, accuracies: Mapping[int, float], t: int) -> float:
        """IAA^t (Eq. 9) over the clients in `accuracies` (client -> a_k^t), each weighted by the train samples
        it has received in tasks 0..t."""
        clients = sorted(accuracies)
        return instant_average_accuracy([accuracies[k] for k in clients],
                                        [self.data.client_samples_seen(k, t) for k in clients])

    def seen_mask(self, task: int) -> np.ndarray:
        return self._mask(c for t in self.data.tasks[: task + 1] for c in t.classes)

    def _mask(self, classes: Iterable[int]) -> np.ndarray:
        mask = np.zeros(self.data.num_classes, dtype=np.float32)
        mask[list(classes)] = 1.0
        return mask
