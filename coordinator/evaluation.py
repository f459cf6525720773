"""Evaluation of the global model after each round, on the test set of every task seen so far.

Choice: the model is evaluated with the classes of tasks 0..t unmasked (those the federation has seen), as the
devices train; for domain-incremental scenarios every class is always seen, so nothing is masked.
"""
from __future__ import annotations

import numpy as np

from edge_client.trainers.pytorch import TorchTrainer
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

    def seen_mask(self, task: int) -> np.ndarray:
        mask = np.zeros(self.data.num_classes, dtype=np.float32)
        for t in self.data.tasks[: task + 1]:
            mask[list(t.classes)] = 1.0
        return mask
