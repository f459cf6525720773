"""One client, no federation: every replay policy through the embedded class-incremental scenarios.

The budget is in the papers' regime: M = N_new + 10 % of the old data at the last task, i.e. M = task size x
(1 + 0.1 (n_tasks - 1)), so the cache is much smaller than the old data. Every policy gets the same model, initial
weights, optimiser, epochs and data order per seed; nothing is tuned per policy. Prints, over the seeds, the final
accuracy on all tasks' test sets and the forgetting.

    .venv/bin/python benchmarks/replay_policies.py [--seeds 0 1 2] [--epochs 10]
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from edge_client.budget import Budget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import make_policy
from edge_client.store import ReplayStore
from edge_client.trainers.ort import OrtTrainer
from edgefil.metrics import forgetting
from firmware_sim.scenarios import preset
from models.export import export_registered

SCENARIOS = {"digits-class": "lenet", "mnist1d-class": "cnn1d"}
POLICIES = [  # (label, policy name, options)
    ("random", "random", {}),
    ("reservoir", "reservoir", {}),
    ("class-balanced", "class-balanced", {}),
    ("herding", "herding", {}),
    ("refed (exact)", "refed", {"importance": "exact"}),
    ("refed (last-layer)", "refed", {"importance": "last-layer"}),
]


def run_one(scenario_name: str, seed: int, label_policy: tuple, epochs: int, work: Path) -> dict:
    label, policy_name, options = label_policy
    data = preset(scenario_name, n_clients=1, seed=seed).build()
    task_size = max(len(task.client_train(0)[1]) for task in data.tasks)
    budget = math.ceil(task_size * (1 + 0.1 * (len(data.tasks) - 1)))
    artifacts = work / f"{scenario_name}-{seed}"
    if not artifacts.exists():
        export_registered(SCENARIOS[scenario_name], data.num_classes, artifacts, input_shape=data.input_shape, seed=seed)
    trainer = OrtTrainer(artifacts, optimizer="adamw", lr=1e-3)
    store_dir = work / f"store-{scenario_name}-{seed}-{label}"
    with ReplayStore(store_dir, Budget(max_samples=budget), sample_shape=data.input_shape) as store:
        learner = Learner(trainer, store, make_policy(policy_name, **options), LearnerConfig(epochs=epochs), seed=seed)
        n = len(data.tasks)
        acc = np.zeros((n, n))
        start = time.perf_counter()
        for t, task in enumerate(data.tasks):
            learner.start_task(t, *task.client_train(0))
            learner.train()
            for j in range(t + 1):
                acc[t, j] = learner.evaluate(*data.tasks[j].test()).accuracy
        final = learner.evaluate(*data.seen_test(n - 1)).accuracy
        return {"final": final, "forgetting": forgetting(acc), "budget": budget, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for scenario_name in args.scenarios:
            rows = {p[0]: [run_one(scenario_name, seed, p, args.epochs, Path(tmp)) for seed in args.seeds] for p in POLICIES}
            budget = rows["random"][0]["budget"]
            print(f"\n{scenario_name}: 1 client, M = {budget} samples, {args.epochs} epochs per task, "
                  f"AdamW lr 1e-3, seeds {args.seeds}")
            print(f"{'policy':20s} {'final accuracy':>16s} {'forgetting':>14s} {'seconds':>8s}")
            for label, results in rows.items():
                final = np.array([r["final"] for r in results]) * 100
                forget = np.array([r["forgetting"] for r in results]) * 100
                seconds = np.mean([r["seconds"] for r in results])
                print(f"{label:20s} {final.mean():8.2f} ± {final.std():5.2f} {forget.mean():7.2f} ± {forget.std():4.2f} {seconds:8.1f}")


if __name__ == "__main__":
    main()
