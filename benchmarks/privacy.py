"""Central differential privacy: the accuracy it costs against the epsilon it buys (issue 59).

Every column runs the same fleet (`--devices` devices, every one selected each round unless `--fraction` says
less, `--rounds-per-task` rounds a task, E = 10 epochs of AdamW at 3e-3, random caching with the scenario's M,
`table1.py`'s regime) on the same class-incremental scenario, behind the same guard: `table1.py`'s with its distance
bounds off too, so that no bound judges an update by the round's others (coordinator/privacy.py: with one, the mean
could only be noised as a whole, 2m times more). The columns:
- `no-dp`: unweighted FedAvg;
- `clip-only`: `[privacy] mode = "central"` with the clip `--clip` and a negligible noise multiplier (1e-4): what
  clipping alone costs (its epsilon means nothing);
- `dp-sigma-<z>`: central DP at each noise multiplier z of `--sigmas` (each update's change clipped to `--clip`, the
  mean over the selected devices released with noise of sd z x clip / selected);
- `adaptive-sigma-<z>`: the same with adaptive clipping (`clipping = "adaptive"` from `--clip`, toward the median
  update length) at each z of `--adaptive-sigmas`;
- `median` and `median-dp-sigma-<z>`: the coordinate-wise median without DP and with it at each z of
  `--median-sigmas` (the rule's change clipped to the clip and noised as a whole, sd z x 2 clip: what DP costs a
  robust rule).
Printed per scenario: each column's final accuracy (mean ± std over the seeds, the last round and the last task's
last rounds), epsilon at delta 1e-5 after the run (RDP, as the runs account it) with the last round's clip and noise
sd, and each column paired against `no-dp` (paired t-test over the seeds). Every run is a fleet of its own
(`table1.run_jobs`), a finished one read back; a DP run draws its noise from its seed (`noise_seed`), so one seed
gives one table on any host.

The noise added to the mean has an L2 norm of about z x clip / selected x sqrt(parameters), against a mean change no
longer than the clip: DP-FedAvg needs many devices a round to learn at a useful epsilon, and a small fleet shows it.

    .venv/bin/python benchmarks/privacy.py [--scenarios digits-class] [--seeds 0,1,2] [--devices 100]
        [--fraction 1.0] [--rounds-per-task 3] [--sigmas 0.3,1,3] [--adaptive-sigmas 1] [--median-sigmas 1]
        [--clip 1.0] [--parallel 1] [--out runs/privacy]
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from table1 import RANDOM, STRATEGY, Job, finals_of, plan, print_paired, print_table, run_jobs

BASELINE = "no-dp"
CLIP_ONLY_SIGMA = 1e-4  # noise this small changes nothing measurable: the clip's own cost
MEDIAN = {"name": "median"}
# over table1's guard (its size bounds): the distance bounds off too, so that none compares an update with the others
PER_UPDATE_GUARD = [("norm_bound", "off"), ("free_rider_factor", 0.0)]


def methods(sigmas: list[float], adaptive: list[float], median: list[float], clip: float
            ) -> dict[str, dict[str, Any]]:
    """The columns (the module's docstring); a fleet's name has no dot."""
    def central(sigma: float, rule: dict[str, Any] = STRATEGY, **more: Any) -> dict[str, Any]:
        return {"policy": RANDOM, "strategy": rule, "coordinator": {"privacy": {
            "mode": "central", "clip_norm": clip, "noise_multiplier": sigma, **more}}}

    def name(prefix: str, sigma: float) -> str:
        return f"{prefix}-sigma-{sigma:g}".replace(".", "_")

    return {BASELINE: {"policy": RANDOM, "strategy": STRATEGY}, "clip-only": central(CLIP_ONLY_SIGMA),
            **{name("dp", sigma): central(sigma) for sigma in sigmas},
            **{name("adaptive", sigma): central(sigma, clipping="adaptive") for sigma in adaptive},
            **({"median": {"policy": RANDOM, "strategy": MEDIAN}} if median else {}),
            **{name("median-dp", sigma): central(sigma, MEDIAN) for sigma in median}}


def seeded_noise(job: Job) -> Job:
    """A DP column's noise drawn from the run's seed (`noise_seed`, experiments only): one seed, one table."""
    privacy = job.options.get("coordinator", {}).get("privacy")
    if privacy is None:
        return job
    coordinator = {**job.options["coordinator"], "privacy": {**privacy, "noise_seed": job.seed}}
    return dataclasses.replace(job, options={**job.options, "coordinator": coordinator})


def floats(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="digits-class")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--sigmas", default="0.3,1,3")
    parser.add_argument("--adaptive-sigmas", default="1", help="adaptive clipping's columns ('': none)")
    parser.add_argument("--median-sigmas", default="1", help="the median's DP columns ('': none, nor the median)")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--parallel", type=int, default=1, help="fleet runs at a time (each takes about 2 cores)")
    parser.add_argument("--out", default="runs/privacy")
    args = parser.parse_args()
    # what table1's plan reads besides: every run at the table's regime, behind the per-update guard
    args.backend, args.epochs, args.lr = None, None, None
    args.scenario_option, args.learner_option, args.guard_option = [], [], PER_UPDATE_GUARD
    seeds = [int(s) for s in args.seeds.split(",")]
    columns = methods(floats(args.sigmas), floats(args.adaptive_sigmas), floats(args.median_sigmas), args.clip)
    print(f"central DP: {args.devices} devices, fraction {args.fraction}, {args.rounds_per_task} rounds a task, "
          f"clip {args.clip}, seeds {seeds}")
    for scenario in args.scenarios.split(","):
        jobs = [seeded_noise(job) for job in plan(scenario, seeds, columns, Path(args.out) / scenario, args)]
        results = run_jobs(jobs, args.parallel)
        finals = print_table(f"{scenario}: final accuracy (%), mean ± std over seeds", jobs, results)
        print("  epsilon at delta 1e-5 after the run (RDP; the same for every seed), and the last round's release "
              "(mean over the seeds):")
        for method in columns:
            done = [results[j.result_file] for j in jobs if j.method == method and j.result_file in results]
            spent = [r["epsilon"] for r in done if r.get("epsilon") is not None]
            last = [r["privacy"] for r in done if r.get("privacy")]
            text = "no DP" if method in (BASELINE, "median") else (f"{np.mean(spent):.3g}" if spent else "—")
            if last:
                text += (f"   {last[0]['calibration']}: clip {np.mean([p['clip_norm'] for p in last]):.3g}, noise sd "
                         f"{np.mean([p['noise_sd'] for p in last]):.3g}")
            print(f"    {method:22s} {text}")
        for method in columns:
            if method != BASELINE and finals_of(jobs, results):
                print_paired(method, BASELINE, finals)


if __name__ == "__main__":
    main()
