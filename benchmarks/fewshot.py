"""Few-shot class-incremental learning on non-IID devices (SDD, shared/specs/fewshot-sdd.md): the paper's Tables
I-III at the embedded data's scale, every run a real fleet (coordinator, device daemons, a broker).

Scenario `digits-fewshot` (or `mnist1d-fewshot`, `fashion-fewshot`): the host learns 4 base classes centrally, then 3 sessions of
2-way 5-shot (5 images per class over all 5 devices), split by Dirichlet(alpha); one round per session (the
paper's R = 1). The same settings for every method: the same base model (the host's training, seeded), E local
epochs of SGD at lr 0.1 on the portable backend, the same device budget M. Columns:

- `sdd`: SDD (noise-aware replay, CSWA as Eq. 17 prints it, the generator's replay set);
- `sdd-ce`: SDD without noise-aware replay (plain CE on the replay samples, beta = 0);
- `sdd-fedavg`: SDD without CSWA (FedAvg of the whole model);
- `sdd-normalized`: SDD with CSWA normalised (a column of ours, not the paper's);
- `sdd-normalized-ce`: the same without noise-aware replay (NAGR's ablation where CSWA keeps the old classes);
- `sdd-nostats`: SDD without the statistics term (lambda_statistics = 0, no statistics sent): what the devices'
  feature statistics buy;
- `sdd-target`: SDD with TARGET's adversarial sign (omega = 1 where teacher and student agree);
- `sdd-bias-cswa`: SDD with the new classes' biases scaled with their rows by CSWA (the paper's W_new is weights
  only: by default the biases are averaged with W_old);
- `sdd-central-dp`, `sdd-fedavg-central-dp`: SDD and SDD without CSWA under central DP (`[privacy] mode =
  "central"`, clip `DP_CLIP`, noise multiplier `DP_SIGMA`, its noise from the seed), with no guard check that
  compares updates (the guard off: with one, the mean is noised as a whole). The generator learns from the released
  mean and the devices' noised mean statistics (coordinator/strategies/sdd.py); CSWA's rows are noised as a whole
  (sd 2 z C), FedAvg's mean as a sum (sd z C / 5). With 5 devices the mean's noise is z C sqrt(P) / 5 long against a
  change no longer than C: what user-level DP costs a fleet this small;
- `finetune-paper`: the paper's Finetune+FL: fine-tuning at SDD's two rates (the new head at lr, the rest at
  1e-3 lr), no replay, FedAvg;
- `finetune`: plain FedAvg fine-tuning (no replay, every parameter at lr);
- `refed`: Re-Fed with raw-sample replay within the same M (the few real samples of each session a device saw;
  the base session's never reached a device).

Prints per alpha the accuracy on all classes seen after each session (mean over seeds, %), the average over
sessions as the paper's tables, the paired difference of SDD against each column with a paired t-test, and the
generator's training time per session. Every run is a process of its own writing `fewshot.json` in its folder; a
finished run is read back, not repeated.

    .venv/bin/python benchmarks/fewshot.py [--seeds 0,1,2,3,4] [--alphas 1.0,0.1] [--scenario digits-fewshot]
        [--methods sdd,sdd-ce,...] [--parallel 2] [--out runs/fewshot]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

GENERATOR = {"generator_epochs": 10, "generator_iterations": 20, "generator_batch_size": 64, "warmup_epochs": 3,
             "replay_per_class": 40}
METHODS: dict[str, dict[str, Any]] = {
    "sdd": {"policy": {"name": "sdd"}, "strategy": {"name": "sdd", **GENERATOR}},
    "sdd-ce": {"policy": {"name": "sdd", "replay": "ce"}, "strategy": {"name": "sdd", **GENERATOR}},
    "sdd-fedavg": {"policy": {"name": "sdd"}, "strategy": {"name": "sdd", "aggregation": "fedavg", **GENERATOR}},
    "sdd-normalized": {"policy": {"name": "sdd"},
                       "strategy": {"name": "sdd", "aggregation": "cswa-normalized", **GENERATOR}},
    "sdd-normalized-ce": {"policy": {"name": "sdd", "replay": "ce"},
                          "strategy": {"name": "sdd", "aggregation": "cswa-normalized", **GENERATOR}},
    "sdd-nostats": {"policy": {"name": "sdd", "send_statistics": False},
                    "strategy": {"name": "sdd", "lambda_statistics": 0.0, **GENERATOR}},
    "sdd-target": {"policy": {"name": "sdd"}, "strategy": {"name": "sdd", "adversarial_sign": "target", **GENERATOR}},
    "sdd-bias-cswa": {"policy": {"name": "sdd"}, "strategy": {"name": "sdd", "new_bias": "cswa", **GENERATOR}},
    "finetune": {"policy": {"name": "none"}, "strategy": {"name": "fedavg"}},
    "sdd-central-dp": {"policy": {"name": "sdd"}, "strategy": {"name": "sdd", **GENERATOR}, "central_dp": True},
    "sdd-fedavg-central-dp": {"policy": {"name": "sdd"},
                              "strategy": {"name": "sdd", "aggregation": "fedavg", **GENERATOR}, "central_dp": True},
    "finetune-paper": {"policy": {"name": "sdd", "replay": "none", "send_statistics": False},
                       "strategy": {"name": "fedavg"}},
    "refed": {"policy": {"name": "refed"}, "strategy": {"name": "fedavg"}},
}
DEFAULT_METHODS = ("sdd", "sdd-ce", "sdd-fedavg", "finetune-paper", "finetune", "refed")
DP_CLIP, DP_SIGMA = 1.0, 1.0  # the central DP columns' clip and noise multiplier (privacy.py's defaults)
BUDGET_BYTES = 256 * 1024  # M for every method: SDD's replay set takes at most half (replay_share)
EPOCHS, LR, DEVICES = 10, 0.1, 5


def central_dp(seed: int) -> dict[str, Any]:
    """A central DP column's coordinator tables: DP at `DP_SIGMA`, its noise from the seed; the guard off."""
    from coordinator.guard_settings import OFF

    return {"privacy": {"mode": "central", "clip_norm": DP_CLIP, "noise_multiplier": DP_SIGMA, "noise_seed": seed},
            "guard": dict(OFF)}


def run_one(scenario: str, method: str, alpha: float, seed: int, out: Path) -> dict[str, Any]:
    """One fleet; its results, with what the table needs, written to out/fewshot.json."""
    from edge_client.config import StoreSettings, TrainerSettings
    from firmware_sim.datasets import load_dataset
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig
    from firmware_sim.scenarios import PRESETS, preset

    spec = METHODS[method]
    data = load_dataset(PRESETS[scenario].dataset, **PRESETS[scenario].dataset_options)
    strategy = dict(spec["strategy"])
    if strategy["name"] == "sdd":
        strategy["input_range"] = [float(data.x_train.min()), float(data.x_train.max())]
    config = FleetConfig(
        name=f"fs{seed}", out=out / "run", devices=DEVICES, workers=1,
        model="cnn1d" if len(data.input_shape) == 2 else "lenet", seed=seed, broker="auto", scenario={"preset": scenario, "alpha": alpha, "seed": seed},
        policy=spec["policy"], store=StoreSettings(max_bytes=BUDGET_BYTES),
        trainer=TrainerSettings(backend="portable", optimizer="sgd", lr=LR), client={"epochs": EPOCHS},
        strategy=strategy, coordinator={"rounds_per_task": 1, "min_clients": DEVICES, "deadline_s": 900.0,
                                        "wait_for_devices_s": 120.0, "host": {"epochs": 20, "seed": seed},
                                        **(central_dp(seed) if spec.get("central_dp") else {})},
    )
    started = time.perf_counter()
    results = Fleet(config).run()
    built = preset(scenario, alpha=alpha, seed=seed).build()
    sizes = [len(task.test_indices) for task in built.tasks]
    matrix = results["accuracy_matrix"]
    seen = [float(np.average(row, weights=sizes[: len(row)])) for row in matrix]  # all classes seen so far
    history = results["history"]
    record = {
        "scenario": scenario, "method": method, "alpha": alpha, "seed": seed, "accuracy_matrix": matrix,
        "seen_accuracy": seen, "average": float(np.mean(seen)), "wall_s": time.perf_counter() - started,
        "generator_s": [h.get("rule_metrics", {}).get("generator", {}).get("generator_s") for h in history],
        "held_bytes": max((m.get("stored_bytes", 0) for h in history for m in h["metrics"].values()), default=0),
        "rounds": results["rounds_completed"], "epsilon": results.get("epsilon"),
    }
    (out / "fewshot.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--alphas", default="1.0,0.1")
    parser.add_argument("--scenario", default="digits-fewshot")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/fewshot"))
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a worker: scenario,method,alpha,seed,folder
    args = parser.parse_args()
    if args.job:
        scenario, method, alpha, seed, folder = args.job.split(",")
        run_one(scenario, method, float(alpha), int(seed), Path(folder))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    methods = args.methods.split(",")
    jobs = [(m, a, s, args.out / args.scenario / f"alpha{a:g}" / m / f"seed{s}")
            for a in alphas for s in seeds for m in methods]
    running: list[subprocess.Popen] = []
    for method, alpha, seed, folder in jobs:
        if (folder / "fewshot.json").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        while len(running) >= args.parallel:
            running = [p for p in running if p.poll() is None]
            time.sleep(1)
        log = open(folder / "run.log", "w")
        running.append(subprocess.Popen([sys.executable, __file__, "--job",
                                         f"{args.scenario},{method},{alpha},{seed},{folder}"],
                                        stdout=log, stderr=subprocess.STDOUT))
    for process in running:
        process.wait()
    report(jobs, methods, alphas)


def old_and_new(record: dict[str, Any]) -> list[tuple[float, float]]:
    """After each few-shot session: the accuracy on the classes of the sessions before (weighted by their test
    sets' sizes) and on the session's own (the paper's Fig. 6 split)."""
    from firmware_sim.scenarios import preset

    built = preset(record["scenario"], alpha=record["alpha"], seed=record["seed"]).build()
    sizes = [len(task.test_indices) for task in built.tasks]
    return [(float(np.average(row[:-1], weights=sizes[: len(row) - 1])), float(row[-1]))
            for row in record["accuracy_matrix"][1:]]


def report(jobs: list, methods: list[str], alphas: list[float]) -> None:
    records: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for method, alpha, _seed, folder in jobs:
        path = folder / "fewshot.json"
        if path.is_file():
            records.setdefault((method, alpha), []).append(json.loads(path.read_text()))
        else:
            print(f"missing: {folder} (see its run.log)")
    for alpha in alphas:
        print(f"\nalpha = {alpha:g}: accuracy (%) on all classes seen after each session, mean ± std over seeds")
        for method in methods:
            runs = sorted(records.get((method, alpha), []), key=lambda r: r["seed"])
            if not runs:
                continue
            seen = np.array([r["seen_accuracy"] for r in runs]) * 100
            avg = np.array([r["average"] for r in runs]) * 100
            cells = " ".join(f"{m:5.1f}" for m in seen.mean(0))
            spent = [r["epsilon"] for r in runs if r.get("epsilon") is not None]
            print(f"  {method:15s} {cells} | avg {avg.mean():5.1f} ± {avg.std(ddof=1) if len(avg) > 1 else 0:4.1f}"
                  f"  (n={len(runs)}, held ≤ {max(r['held_bytes'] for r in runs) / 1024:.0f} KiB"
                  f"{f', epsilon {np.mean(spent):.3g} at delta 1e-5' if spent else ''})")
            split = np.array([old_and_new(r) for r in runs]).mean(0) * 100  # (sessions - 1, 2)
            print(f"  {'':15s} old/new classes after each session: "
                  + "  ".join(f"{o:4.1f}/{n:4.1f}" for o, n in split))
        base = {r["seed"]: r["average"] for r in records.get(("sdd", alpha), [])}
        for method in methods:
            if method == "sdd":
                continue
            other = {r["seed"]: r["average"] for r in records.get((method, alpha), [])}
            common = sorted(set(base) & set(other))
            if len(common) < 2:
                continue
            diff = np.array([base[s] - other[s] for s in common]) * 100
            p = stats.ttest_rel([base[s] for s in common], [other[s] for s in common]).pvalue
            print(f"  sdd - {method:15s} {diff.mean():+6.2f} ± {diff.std(ddof=1):5.2f} points (paired t, n="
                  f"{len(common)}, p = {p:.3f})")
        times = [t for r in records.get(("sdd", alpha), []) for t in r["generator_s"] if t is not None]
        if times:
            print(f"  generator training per session (CPU): {np.mean(times):.1f} s (min {min(times):.1f}, "
                  f"max {max(times):.1f})")


if __name__ == "__main__":
    main()
