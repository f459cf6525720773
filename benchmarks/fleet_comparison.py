"""The demo over several seeds: Re-Fed caching, random caching and Fixed in the demo's regime (firmware_sim/demo.py:
E = 10, 4 rounds per task, M caching ~25 % of the old data at the last task, unweighted FedAvg for every run), 10
virtual devices of mixed profiles, the embedded broker, every run a real fleet.

Prints per dataset and method the final accuracy (the last round's, and the mean over the last task's last rounds as
the papers report it), the average incremental accuracy, the forgetting and the first task's accuracy after its own
rounds (mean ± std over seeds, %), then the paired difference Re-Fed - random per
seed with its mean, std and the share of seeds where Re-Fed leads: the demo must not rest on a lucky seed.

    .venv/bin/python benchmarks/fleet_comparison.py [--seeds 0,1,2,3,4] [--datasets digits-class,mnist1d-class]
        [--out runs/fleet-comparison]
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from edgefil.metrics import accuracy_matrix, average_accuracy, forgetting
from firmware_sim.demo import METHODS, DemoSettings, budget_for, run_methods

MODELS = {"digits-class": "lenet", "mnist1d-class": "cnn1d"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--datasets", default="digits-class")
    parser.add_argument("--out", default="runs/fleet-comparison")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    for preset in args.datasets.split(","):
        rows: dict[str, list[tuple[float, float, float, float, float]]] = {m: [] for m in METHODS}
        budgets = []
        for seed in seeds:
            settings = DemoSettings(preset=preset, model=MODELS[preset], seed=seed)
            budgets.append(budget_for(settings.scenario))
            runs = run_methods(Path(args.out) / preset / f"seed{seed}", settings)
            for method, results in runs.items():
                acc = accuracy_matrix(results["accuracy_matrix"])
                rows[method].append((average_accuracy(acc), results["last_rounds_accuracy"]["mean"],
                                     float(np.nanmean([average_accuracy(acc, t) for t in range(len(acc))])),
                                     forgetting(acc), float(acc[0, 0])))
        print(f"\n{preset}: 10 virtual devices (mixed profiles), seeds {seeds}, M = {budgets}; mean ± std, %")
        print(f"{'method':8s} {'final':>15s} {'last rounds':>15s} {'average':>15s} {'forgetting':>15s} "
              f"{'task 1 after':>15s}")
        for method, values in rows.items():
            table = np.array(values) * 100
            print(f"{method:8s} " + " ".join(f"{m:7.2f} ± {s:5.2f}" for m, s in zip(table.mean(0), table.std(0))))
        for column, words in ((0, "final accuracy"), (1, "last rounds' mean")):
            lead = (np.array(rows["refed"])[:, column] - np.array(rows["random"])[:, column]) * 100
            print(f"Re-Fed - random, {words} per seed: {' '.join(f'{d:+.2f}' for d in lead)}; "
                  f"mean {lead.mean():+.2f} ± {lead.std():.2f}, Re-Fed ahead in {int((lead > 0).sum())}/{len(lead)}")


if __name__ == "__main__":
    main()
