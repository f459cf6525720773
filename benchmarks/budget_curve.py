"""Accuracy against the budget M in bytes: what each method is worth as the storage a device gives it shrinks.

Every method and baseline runs the same fleet (20 devices, active ratio 0.4, 8 rounds a task, E = 10 epochs of
AdamW at 3e-3, unweighted FedAvg unless the method has its own rule: `table1.py`'s regime) on the same
class-incremental scenario (`fashion-class` by default: Fashion-MNIST, 5 tasks of 2 classes) at the same M,
counted in bytes on the device's disk: `[store] max_bytes` = the bytes the raw store needs to hold M_f samples
(`table1.raw_store_bytes`, write peaks included), M_f = N_task (1 + f (T - 1)) for a share f of the old data cached
at the last task (`CACHED`: 2 % to 100 %), and the same sample limit M_f. Everything a device keeps for learning
counts in those bytes (edge_client/budget.py): raw samples, pFedGRP's generators, FedCIL's ACGAN, GLFC's old model,
its encoding network Gamma and its memory order. A method whose extra does not fit gives it up (GLFC's old model:
no relation distillation; a generator that does not fit is not kept) and says so in its metrics.

Columns (`METHODS`): Re-Fed's Table 1 as `table1.METHODS` defines it: FedAvg with random caching (the baseline
every column is paired against), FedProx, Fixed (the first task only), DANN, Shared (a head per task), Re-Fed,
reservoir sampling and GLFC with its proxy (Gamma the authors' LeNet); and the curve's own: random caching with M
split as reservoir sampling splits it (the newest task keeps its share of the stream, `new_share = "stream"`),
iCaRL+FL (herding and iCaRL's distillation), pFedGRP (per-class generators and its personalized rule; the global
model is what is measured), FedCIL (an ACGAN of width 8, Table 1's `fedcil-bytes`), and
fine-tuning without replay (M unused: the floor). Printed per budget: the final accuracy and the average
incremental accuracy (the mean over tasks of the accuracy on the tasks so far, the papers' "Avg."), mean ± std over
seeds, each paired against FedAvg at the same M with a paired t-test, and the mean diagonal (each task's accuracy
right after its own rounds), as markdown tables; and a plot (`--plot`). Every run is a fleet of its own (`table1.run_jobs`), a finished one read back.

    .venv/bin/python benchmarks/budget_curve.py [--scenario fashion-class] [--seeds 0,1,2,3,4]
        [--cached 0.02,0.05,0.1,0.25,1.0] [--methods fedavg,refed,...] [--parallel 1] [--out runs/budget]
        [--plot docs/img/budget-curve.png] [--no-run]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats
from table1 import GLFC_METHODS, MODELS, RANDOM, STRATEGY, Job, run_jobs
from table1 import METHODS as TABLE1

# Table 1's columns, as `table1.METHODS` defines them (one definition a method), and the curve's own: iCaRL+FL,
# pFedGRP, random caching split as the stream, fine-tuning, and FedCIL at the width that fits
METHODS: dict[str, dict[str, Any]] = {
    **{name: TABLE1[name] for name in ("fedavg", "fedprox", "fixed", "dann", "shared", "refed", "reservoir", "glfc")},
    # random caching with M split as a uniform sample of the stream splits it (`new_share = "stream"`): the newest
    # task keeps its share of everything seen, not all it brings; what reservoir sampling does beside its ranking
    "fedavg-stream": {"policy": {**RANDOM, "new_share": "stream"}},
    "icarl": GLFC_METHODS["icarl"],
    "pfedgrp": {"policy": {"name": "generator"}, "strategy": {"name": "pfedgrp"}},
    # FedCIL's ACGAN at width 8 (94 KB at float16 on 28x28), Table 1's `fedcil-bytes`: at its default width 16
    # (200 KB) replacing it does not fit half of the tightest M, which the fleet refuses before it starts
    "fedcil": TABLE1["fedcil-bytes"],
    "finetune": {"policy": {"name": "none"}, "strategy": STRATEGY},
}
CACHED = (0.02, 0.05, 0.1, 0.25, 1.0)
METRICS = {"final": "final accuracy", "average": "average incremental accuracy"}
DIAGONAL = "the mean diagonal: each task's accuracy right after its own rounds (whether it was learnt at all)"


def plan(scenario: str, seeds: list[int], methods: list[str], cached: list[float], out: Path) -> list[Job]:
    """One job per method, budget and seed, every one at equal bytes."""
    return [Job(scenario=scenario, seed=seed, method=method, options=dict(METHODS[method]),
                folder=str(out / f"cached{f}" / f"seed{seed}"), devices=20, fraction=0.4, rounds_per_task=8,
                cached=f, equal_bytes=True)
            for f in cached for seed in seeds for method in methods]


def collect(jobs: list[Job], results: dict[Path, dict[str, Any]]) -> dict[tuple[float, str], dict[str, list[float]]]:
    """(budget share, method) -> metric -> per-seed values (in seed order), and the bytes of that budget."""
    table: dict[tuple[float, str], dict[str, list[float]]] = {}
    for job in jobs:
        summary = results.get(job.result_file)
        if summary is None:
            continue
        row = table.setdefault((job.cached, job.method), {"seed": [], "final": [], "average": [], "diagonal": [],
                                                          "bytes": []})
        row["seed"].append(job.seed)
        row["final"].append(summary["final"])
        row["average"].append(summary["average"])
        row["diagonal"].append(100 * float(np.mean(summary["diagonal"])))
        row["bytes"].append(summary["max_bytes"])
    return table


def paired(a: dict[str, list[float]], b: dict[str, list[float]], metric: str) -> str:
    """a - b over the seeds both finished, mean ± std, how many a wins, the paired t-test's p."""
    common = sorted(set(a["seed"]) & set(b["seed"]))
    if len(common) < 2:
        return "—"
    x = np.array([a[metric][a["seed"].index(s)] for s in common])
    y = np.array([b[metric][b["seed"].index(s)] for s in common])
    diff = x - y
    p = stats.ttest_rel(x, y).pvalue if diff.std() > 0 else float("nan")
    return f"{diff.mean():+.1f} ± {diff.std():.1f} ({int((diff > 0).sum())}/{len(diff)}, p {p:.3f})"


def report(table: dict[tuple[float, str], dict[str, list[float]]], cached: list[float], methods: list[str]) -> str:
    """The markdown tables: per metric, a row per method, a column per budget (KiB), mean ± std and the paired
    difference against FedAvg at the same M."""
    lines = []
    kib = {f: next((row["bytes"][0] for (g, _), row in table.items() if g == f), 0) / 1024 for f in cached}
    for metric, words in METRICS.items():
        lines.append(f"\n{words} (%), mean ± std over seeds; below it, the paired difference against FedAvg at the "
                     f"same M (method ahead in k of n seeds, paired t-test p)\n")
        lines.append("| method | " + " | ".join(f"M = {kib[f]:.0f} KiB ({f:.0%} of old data)" for f in cached) + " |")
        lines.append("|---|" + "---|" * len(cached))
        for method in methods:
            cells = []
            for f in cached:
                row = table.get((f, method))
                if row is None:
                    cells.append("—")
                    continue
                values = np.array(row[metric])
                text = f"{values.mean():.1f} ± {values.std():.1f}"
                base = table.get((f, "fedavg"))
                if method != "fedavg" and base is not None:
                    text += f"<br>{paired(row, base, metric)}"
                cells.append(text)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append(f"\n{DIAGONAL} (%, mean over seeds)\n")
    lines.append("| method | " + " | ".join(f"{kib[f]:.0f} KiB" for f in cached) + " |")
    lines.append("|---|" + "---|" * len(cached))
    for method in methods:
        cells = [f"{np.mean(table[(f, method)]['diagonal']):.1f}" if (f, method) in table else "—" for f in cached]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: dict[tuple[float, str], dict[str, list[float]]], cached: list[float], methods: list[str],
         path: Path, title: str) -> None:
    """Final and average incremental accuracy against M in KiB (log scale), mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    colours, markers = plt.get_cmap("tab20").colors, "os^vD<>ph*Xd"  # a dozen methods: no two lines alike
    for ax, (metric, words) in zip(axes, METRICS.items()):
        for i, method in enumerate(methods):
            points = [(table[(f, method)]["bytes"][0] / 1024, np.mean(table[(f, method)][metric]),
                       np.std(table[(f, method)][metric])) for f in cached if (f, method) in table]
            if not points:
                continue
            x, y, e = (np.array(v) for v in zip(*points))
            ax.errorbar(x, y, yerr=e, marker=markers[i % len(markers)], color=colours[i % len(colours)], capsize=3,
                        label=method)
        ax.set_xscale("log")
        ax.set_xlabel("M, KiB on the device's disk (log)")
        ax.set_title(words)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy on every task seen, %")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="center right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="fashion-class", choices=sorted(MODELS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--cached", default=",".join(str(f) for f in CACHED))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--parallel", type=int, default=1, help="fleet runs at a time (each takes about 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("runs/budget"))
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--no-run", action="store_true", help="report the runs finished so far, run none")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    cached = [float(f) for f in args.cached.split(",")]
    methods = args.methods.split(",")
    jobs = plan(args.scenario, seeds, methods, cached, args.out / args.scenario)
    results = ({job.result_file: json.loads(job.result_file.read_text()) for job in jobs if job.result_file.is_file()}
               if args.no_run else run_jobs(jobs, args.parallel))
    table = collect(jobs, results)
    title = (f"{args.scenario}: 20 devices, active ratio 0.4, 8 rounds a task, E = 10, seeds {seeds}; every method "
             f"at the same M in bytes")
    print(f"\nAccuracy against M, {title}")
    print(report(table, cached, methods))
    (args.out / args.scenario / "budget_curve.json").write_text(json.dumps(
        {f"{f}/{m}": row for (f, m), row in table.items()}, indent=1))
    if args.plot is not None:
        plot(table, cached, methods, args.plot, title)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
