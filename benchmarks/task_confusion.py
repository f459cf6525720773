"""Where a class-incremental run's final model sends each task's test images: to a class of their own task, of an
earlier task, or of a later one. A method that learns a new task less (a low diagonal) either confuses it within the
task or reads it as the old classes; this tells which, from the runs' own last checkpoint (the global model whose
accuracy `results.json` reports), so no run is repeated.

    .venv/bin/python benchmarks/task_confusion.py --scenario fashion-glfc --seeds 0,1,2,3,4
        --runs runs/table1/glfc --methods glfc,glfc-no-crd,icarl,fedavg

`--runs` is the folder a `table1.py` table wrote (`<runs>/<scenario>/seed<k>/<method>/`).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from coordinator.checkpoint import load_latest
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.scenarios import PRESETS, build
from models.manifest import load_manifest


def final_model(run: Path, seed: int) -> TorchTrainer:
    """The run's final global model (its last checkpoint: the model whose accuracy `results.json` reports)."""
    found = load_latest(run / "checkpoint")
    if found is None:
        raise SystemExit(f"{run}: no checkpoint to read")
    trainer = TorchTrainer(load_manifest(run / "artifacts"), optimizer="adamw", lr=3e-3, seed=seed)
    trainer.set_weights(found[0].weights)
    return trainer


def predicted_classes(trainer: TorchTrainer, x: np.ndarray) -> np.ndarray:
    """The class `trainer`'s model gives each sample of `x`, over every class (no mask)."""
    _, logits, _ = trainer.forward(x, np.zeros(len(x), np.int64), trainer.mask(None))
    return np.asarray(logits.argmax(axis=1))


def task_of_predictions(run: Path, scenario: str, seed: int) -> np.ndarray:
    """Row t: the shares of task t's test images predicted as a class of task 0, 1, ... (rows sum to 1)."""
    data = build(dataclasses.replace(PRESETS[scenario], seed=seed))
    trainer = final_model(run, seed)
    tasks = len(data.tasks)
    task_of_class = np.full(trainer.manifest.num_classes, -1)
    for t in range(tasks):
        task_of_class[list(data.task_classes(t))] = t
    shares = np.zeros((tasks, tasks))
    for t in range(tasks):
        x, y = data.task_test(t)
        predicted = task_of_class[predicted_classes(trainer, x)]
        shares[t] = [np.mean(predicted == u) for u in range(tasks)]
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="fashion-glfc", choices=sorted(PRESETS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--methods", required=True)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.scenario}, seeds {seeds}: the share of task t's test images the final model assigns to a class of "
          "task u (rows t, columns u), mean over seeds")
    for method in args.methods.split(","):
        shares = np.mean([task_of_predictions(args.runs / args.scenario / f"seed{seed}" / method, args.scenario,
                                              seed) for seed in seeds], axis=0)
        rows = " | ".join(f"task {t}: " + " ".join(f"{v:.2f}" for v in row) for t, row in enumerate(shares))
        print(f"  {method:14s} {rows}")


if __name__ == "__main__":
    main()
