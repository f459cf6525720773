"""Re-Fed's Table 1 at small scale on the embedded data, every run a real fleet (coordinator, device daemons, the
embedded broker): class-incremental digits and MNIST-1D, domain-incremental digits (four domains, as Digit10 is
four digit datasets), 20 devices with active ratio 0.4, the demo's regime for every method (firmware_sim/demo.py:
E = 10 of AdamW at 3e-3, 3 rounds per task, M caching ~25 % of the old data at the last task, unweighted FedAvg).
Devices run at the host's speed (no emulated profiles): this measures learning, and a slow profile's deadline
would drop the devices of the costlier methods (FedCIL's ACGAN) and bias the comparison.

Columns (`--methods`): FedAvg (random cache), FedProx, Fixed, DANN+FL, Shared, FedCIL, Re-Fed, Re-Fed with class
quotas, reservoir sampling; GLFC has a slot and comes with its own issue. Reservoir at *equal new-data use* is the
random cache (both keep a uniform sample of the old data; plain reservoir also drops part of each new task).

Prints per scenario the final accuracy (mean ± std over seeds, %) per method, then the paired difference Re-Fed -
FedAvg per seed with a paired t-test. `--table emphasis` runs Table 10 instead (Re-Fed with early / average / late
emphasis), `--table budget` Table 4 (FedAvg and Re-Fed as M caches 10 / 25 / 50 % of the old data).

    .venv/bin/python benchmarks/table1.py [--seeds 0,1,2,3,4] [--scenarios digits-class,mnist1d-class,digits-domain]
        [--methods fedavg,refed,...] [--table methods|emphasis|budget] [--out runs/table1]
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from edgefil.metrics import accuracy_matrix, average_accuracy
from firmware_sim.demo import REFED, STRATEGY, DemoSettings, budget_for, run_methods
from firmware_sim.scenarios import PRESETS

MODELS = {"digits-class": "lenet", "mnist1d-class": "cnn1d", "digits-domain": "lenet"}
RANDOM = {"name": "random"}
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"policy": RANDOM},
    "fedprox": {"policy": RANDOM, "strategy": {**STRATEGY, "name": "fedprox", "mu": 0.01}},
    "fixed": {"policy": RANDOM, "coordinator": {"train_tasks": 1}},
    "dann": {"policy": {"name": "dann"}, "backend": "torch"},
    "shared": {"policy": {"name": "shared"}},
    "fedcil": {"policy": {"name": "fedcil"}},
    "refed": {"policy": REFED},
    "refed-quotas": {"policy": {**REFED, "group_by": "class"}},
    "reservoir": {"policy": {"name": "reservoir"}},
}
SLOTS = {"glfc": "its own issue (federated class-incremental GLFC)"}
EMPHASIS = {f"refed-{w}": {"policy": {**REFED, "weighting": w}} for w in ("early", "average", "late")}
CACHED = (0.10, 0.25, 0.50)  # Table 4: the share of old data M caches at the last task


def run(scenario: str, seeds: list[int], methods: Mapping[str, Mapping[str, Any]], out: Path, devices: int,
        fraction: float, cached: float = 0.25) -> dict[str, list[float]]:
    """Final accuracy (%) per method and seed."""
    finals: dict[str, list[float]] = {m: [] for m in methods}
    for seed in seeds:
        settings = DemoSettings(devices=devices, fraction=fraction, emulated=False, preset=scenario, model=MODELS[scenario],
                                tasks=PRESETS[scenario].n_tasks, seed=seed)
        settings = dataclasses.replace(settings, budget=budget_for(settings.scenario, cached))
        for method, results in run_methods(out / f"seed{seed}", settings, methods).items():
            finals[method].append(100 * average_accuracy(accuracy_matrix(results["accuracy_matrix"])))
    return finals


def print_table(title: str, finals: Mapping[str, list[float]], slots: Mapping[str, str] = {}) -> None:
    print(f"\n{title}")
    for method, values in finals.items():
        print(f"  {method:14s} {np.mean(values):6.2f} ± {np.std(values):5.2f}   ({' '.join(f'{v:.2f}' for v in values)})")
    for method, why in slots.items():
        print(f"  {method:14s} {'—':>15s}   ({why})")


def print_paired(a: str, b: str, finals: Mapping[str, list[float]]) -> None:
    if a not in finals or b not in finals or len(finals[a]) < 2:
        return
    diff = np.array(finals[a]) - np.array(finals[b])
    test = stats.ttest_rel(finals[a], finals[b])
    print(f"  {a} - {b}: {' '.join(f'{d:+.2f}' for d in diff)}; mean {diff.mean():+.2f} ± {diff.std():.2f}, "
          f"{a} ahead in {int((diff > 0).sum())}/{len(diff)}, paired t = {test.statistic:.2f}, p = {test.pvalue:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--scenarios", default="digits-class,mnist1d-class,digits-domain")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--table", choices=("methods", "emphasis", "budget"), default="methods")
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=0.4)
    parser.add_argument("--out", default="runs/table1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    where = f"{args.devices} devices, active ratio {args.fraction}, seeds {seeds}; final accuracy, %, mean ± std"
    for scenario in args.scenarios.split(","):
        out = Path(args.out) / args.table / scenario
        if args.table == "methods":
            methods = {m: METHODS[m] for m in args.methods.split(",")}
            finals = run(scenario, seeds, methods, out, args.devices, args.fraction)
            print_table(f"Table 1, {scenario}: {where}", finals, SLOTS)
            print_paired("refed", "fedavg", finals)
        elif args.table == "emphasis":
            finals = run(scenario, seeds, EMPHASIS, out, args.devices, args.fraction)
            print_table(f"Table 10, {scenario}: {where}", finals)
            print_paired("refed-early", "refed-average", finals)
            print_paired("refed-average", "refed-late", finals)
        else:
            for cached in CACHED:
                finals = run(scenario, seeds, {"fedavg": METHODS["fedavg"], "refed": METHODS["refed"]},
                             out / f"cached{cached}", args.devices, args.fraction, cached)
                print_table(f"Table 4, {scenario}, M caching {cached:.0%} of the old data: {where}", finals)
                print_paired("refed", "fedavg", finals)


if __name__ == "__main__":
    main()
