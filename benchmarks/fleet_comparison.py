"""The fleet comparison of the demo over 3 seeds on the embedded digits and on MNIST-1D: Re-Fed caching, random
caching and Fixed at the same budget M, 10 virtual devices of mixed profiles, the embedded broker. Prints final
accuracy, average accuracy and forgetting (mean ± std over seeds) per dataset and method.

    .venv/bin/python benchmarks/fleet_comparison.py [--seeds 0,1,2] [--out runs/fleet-comparison]
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from edgefil.metrics import accuracy_matrix, average_accuracy, forgetting
from firmware_sim.demo import run_methods

DATASETS = {  # scenario, model, budget M (about 3-4 tasks' share of one device's data)
    "digits-class": ({"preset": "digits-class"}, "lenet", 100),
    "mnist1d-class": ({"preset": "mnist1d-class"}, "cnn1d", 1000),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/fleet-comparison")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    table: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for name, (scenario, model, budget) in DATASETS.items():
        for seed in seeds:
            runs = run_methods(Path(args.out) / name / f"seed{seed}", scenario, model=model, budget=budget, seed=seed)
            for method, results in runs.items():
                acc = accuracy_matrix(results["accuracy_matrix"])
                table.setdefault((name, method), []).append(
                    (average_accuracy(acc), float(np.nanmean([average_accuracy(acc, t) for t in range(len(acc))])),
                     forgetting(acc))
                )
    print(f"\n10 virtual devices (mixed profiles), 5 tasks x 3 rounds, seeds {seeds}; mean ± std, %")
    print(f"{'dataset':15s} {'method':8s} {'M':>5s} {'final':>15s} {'average':>15s} {'forgetting':>15s}")
    for (name, method), rows in table.items():
        values = np.array(rows) * 100
        cells = " ".join(f"{m:7.2f} ± {s:5.2f}" for m, s in zip(values.mean(0), values.std(0)))
        print(f"{name:15s} {method:8s} {DATASETS[name][2]:5d} {cells}")


if __name__ == "__main__":
    main()
