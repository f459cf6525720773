"""`shared`: the "Shared" baseline of Re-Fed's Table 1 (supplement B): the layers before the last fully connected
layer are shared, and each task has a head of its own.

The model's head already has one row per class, so a task's head is the rows of the task's classes: training a
sample with a softmax over its own task's classes only (never against another task's) is exactly a separate
fully connected head per task on a shared trunk. Every batch holds samples of one task and trains under that
task's class mask, so it runs on every trainer backend with the plain loss. The cache is random, as FedAvg's.

At test time the task is not given (class-incremental evaluation): the global model predicts the argmax over
every head's logits, heads that were never trained against each other. That is the baseline's known weakness and
what the table measures.

Choices the paper leaves open (documented here and in docs/architecture.md):
- a task's classes are the labels among the store's samples of that task (a device knows no others);
- the batches of one epoch are cut within each task and then shuffled together, so every task's head trains in
  every epoch;
- in a domain-incremental scenario the tasks share one label space, every task's head is the whole head, and
  Shared trains exactly as FedAvg with a random cache (one head per domain would need a head per task and class).
"""
from __future__ import annotations

import numpy as np

from edge_client.policies.base import RoundView, TrainingSet
from edge_client.policies.random_cache import RandomCache
from edge_client.trainers.base import Proximal, iterate_batches


class PerTaskHeads(RandomCache):
    name = "shared"

    def fit(self, view: RoundView, batch: TrainingSet, epochs: int, proximal: Proximal | None) -> float:
        """E epochs of single-task batches, each under its task's class mask (its head's rows)."""
        tasks = view.stored_tasks()
        if len(tasks) != len(batch.y):
            raise ValueError("the shared baseline trains on the store's samples as they are (no extra samples)")
        masks = {}
        for task in np.unique(tasks):
            mask = np.zeros(view.trainer.manifest.num_classes, dtype=np.float32)
            mask[np.unique(batch.y[tasks == task])] = 1.0
            masks[int(task)] = mask
        last = 0.0
        for _ in range(epochs):
            steps = [(task, members[idx]) for task in masks
                     for members in [np.flatnonzero(tasks == task)]
                     for idx in iterate_batches(len(members), view.batch_size, view.rng)]
            total = 0.0
            for k in view.rng.permutation(len(steps)):
                task, idx = steps[k]
                total += len(idx) * view.trainer.fit(
                    batch.x[idx], batch.y[idx], epochs=1, batch_size=len(idx), class_mask=masks[task],
                    proximal=proximal, loss=None if batch.loss is None else batch.loss.batch(idx),
                )
            last = total / max(len(batch.y), 1)
        return last
