"""Central differential privacy: the accuracy it costs against the epsilon it buys (issue 59).

Every column runs the same fleet (`--devices` devices, every one selected each round unless `--fraction` says
less, `--rounds-per-task` rounds a task, E = 10 epochs of AdamW at 3e-3, random caching with the scenario's M,
unweighted FedAvg: `table1.py`'s regime) on the same class-incremental scenario; the DP columns add the coordinator's
`[privacy] mode = "central"` (coordinator/privacy.py: each update's change clipped to `--clip`, the mean over the
selected devices released with Gaussian noise of sd sigma x clip / selected) at each noise multiplier sigma of
`--sigmas`, and a clip-only column shows what clipping alone costs (sigma tiny: the noise is negligible and epsilon
meaningless). Printed per scenario: each column's final accuracy (mean ± std over the seeds, the last round and the
last task's last rounds), epsilon at delta 1e-5 after the run (RDP, as the runs account it), and each DP column
paired against the one without DP (paired t-test over the seeds). Every run is a fleet of its own
(`table1.run_jobs`), a finished one read back; a DP run draws its noise from its seed (`noise_seed`), so one seed
gives one table on any host.

The noise added to the mean has an L2 norm of about sigma x clip / selected x sqrt(parameters), against a mean
change no longer than the clip: DP-FedAvg needs many devices a round to learn at a useful epsilon, and a small fleet
shows it.

    .venv/bin/python benchmarks/privacy.py [--scenarios digits-class] [--seeds 0,1,2] [--devices 100]
        [--fraction 1.0] [--rounds-per-task 3] [--sigmas 0.3,1,3] [--clip 1.0] [--parallel 1] [--out runs/privacy]
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


def methods(sigmas: list[float], clip: float) -> dict[str, dict[str, Any]]:
    """The columns: FedAvg without DP, with the clip alone, and with central DP at each sigma."""
    def central(sigma: float) -> dict[str, Any]:
        return {"policy": RANDOM, "strategy": STRATEGY,
                "coordinator": {"privacy": {"mode": "central", "clip_norm": clip, "noise_multiplier": sigma}}}

    return {BASELINE: {"policy": RANDOM, "strategy": STRATEGY}, "clip-only": central(CLIP_ONLY_SIGMA),
            **{f"dp-sigma-{sigma:g}".replace(".", "_"): central(sigma) for sigma in sigmas}}  # names a fleet: no dot


def seeded_noise(job: Job) -> Job:
    """A DP column's noise drawn from the run's seed (`noise_seed`, experiments only): one seed, one table."""
    privacy = job.options.get("coordinator", {}).get("privacy")
    if privacy is None:
        return job
    coordinator = {**job.options["coordinator"], "privacy": {**privacy, "noise_seed": job.seed}}
    return dataclasses.replace(job, options={**job.options, "coordinator": coordinator})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="digits-class")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--sigmas", default="0.3,1,3")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--parallel", type=int, default=1, help="fleet runs at a time (each takes about 2 cores)")
    parser.add_argument("--out", default="runs/privacy")
    args = parser.parse_args()
    # what table1's plan reads besides: every run at the table's regime
    args.backend, args.epochs, args.lr = None, None, None
    args.scenario_option, args.learner_option, args.guard_option = [], [], []
    seeds = [int(s) for s in args.seeds.split(",")]
    columns = methods([float(s) for s in args.sigmas.split(",")], args.clip)
    print(f"central DP: {args.devices} devices, fraction {args.fraction}, {args.rounds_per_task} rounds a task, "
          f"clip {args.clip}, seeds {seeds}")
    for scenario in args.scenarios.split(","):
        jobs = [seeded_noise(job) for job in plan(scenario, seeds, columns, Path(args.out) / scenario, args)]
        results = run_jobs(jobs, args.parallel)
        finals = print_table(f"{scenario}: final accuracy (%), mean ± std over seeds", jobs, results)
        print("  epsilon at delta 1e-5 after the run (RDP; the same for every seed):")
        for method in columns:
            spent = [results[j.result_file].get("epsilon") for j in jobs
                     if j.method == method and j.result_file in results]
            known = [e for e in spent if e is not None]
            text = "no DP" if method == BASELINE else (f"{np.mean(known):.3g}" if known else "—")
            print(f"    {method:18s} {text}")
        for method in columns:
            if method != BASELINE and finals_of(jobs, results):
                print_paired(method, BASELINE, finals)


if __name__ == "__main__":
    main()
