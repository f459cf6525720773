"""Generator replay against raw replay at equal bytes: where, if anywhere, do pFedGRP's generators earn their bytes?

One device learns the class-incremental embedded digits or MNIST-1D (5 tasks of 2 classes, all of each task's
training data) with the runtime's own learner, store and policies: E = 10 epochs of AdamW (3e-3) a task, the seen-
class mask, the same model, initial weights and data order for every method. Every method gets the same byte budget
M (`[store] max_bytes`, no sample limit) and nothing else: the random cache fills it with raw samples (the newest
task first, then a uniform sample of the old), the `generator` policy keeps the newest task's samples in the store
and one generator per class in its bank (at most `bank_share`, half, of M; the drop rule evicts when they do not
fit), replaying them with the alignment term against the model of the task before (what the coordinator's
personalized model is in a fleet).

The budgets are those under which the raw store holds the newest task and 5 %, 25 % (the fleets' M) or 100 % of the
old data at the last task (`table1.raw_store_bytes`). Generators: the MLP and the conv VAE at int8 without their
encoder (the smallest record), trained the paper's 1000 steps from scratch or 4x longer; the MLP VAE at float16, and
at the policy's defaults (`vae-shipped`). Printed per dataset and
budget: the final accuracy on every task's test set (mean ± std over seeds), the generators the bank held at the
end, the raw samples the store held, and generator - raw per seed with a paired t-test.

    .venv/bin/python benchmarks/generator_bytes.py [--datasets digits,mnist1d] [--seeds 0,1,2]
        [--cached 0.05,0.25,1.0] [--methods raw,vae,conv-vae,conv-vae-long] [--parallel 2]
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats
from table1 import raw_store_bytes

DATASETS = {"digits": ("digits-class", "lenet"), "mnist1d": ("mnist1d-class", "cnn1d")}
GENERATOR = {"name": "generator", "precision": "int8", "keep_auxiliary": False}
METHODS: dict[str, dict[str, Any]] = {
    "raw": {"name": "random"},
    "vae": {**GENERATOR, "kind": "vae"},
    "conv-vae": {**GENERATOR, "kind": "conv-vae"},
    "vae-long": {**GENERATOR, "kind": "vae", "init_steps": 4000, "transfer_steps": 400},
    "vae-float16": {**GENERATOR, "kind": "vae", "precision": "float16"},
    "vae-shipped": {"name": "generator"},  # the policy's defaults
    "conv-vae-long": {**GENERATOR, "kind": "conv-vae", "init_steps": 4000, "transfer_steps": 400},
}
EPOCHS = 10


def run(dataset: str, method: str, seed: int, cached: float, folder: Path) -> dict[str, Any]:
    """One device through the five tasks; its final accuracy and what it held at the end."""
    import torch

    from edge_client.budget import Budget
    from edge_client.learner import Learner, LearnerConfig
    from edge_client.policies import POLICIES, make_policy
    from edge_client.store import ReplayStore
    from edge_client.trainers.pytorch import TorchTrainer
    from firmware_sim.scenarios import preset
    from models.export import export_registered
    from models.manifest import load_manifest

    torch.set_num_threads(1)
    scenario, model = DATASETS[dataset]
    data = preset(scenario, n_clients=1, seed=seed).build()
    task_size = max(len(task.client_train(0)[1]) for task in data.tasks)
    samples = math.ceil(task_size * (1 + cached * (len(data.tasks) - 1)))
    budget = raw_store_bytes(tuple(data.input_shape), samples)
    artifacts = folder / "artifacts"
    export_registered(model, data.num_classes, artifacts, data.input_shape, seed=seed, backends=("torch",),
                      cache=True)
    options = dict(METHODS[method])
    name = options.pop("name")
    POLICIES.get(name).export_artifacts(options, artifacts, seed=seed)
    trainer = TorchTrainer(load_manifest(artifacts), optimizer="adamw", lr=3e-3, seed=seed)
    store = ReplayStore(folder / "store", Budget(max_bytes=budget), tuple(data.input_shape))
    learner = Learner(trainer, store, make_policy(name, **options), LearnerConfig(epochs=EPOCHS), seed=seed)
    learner.open_policy(folder, artifacts)
    started = time.perf_counter()
    teacher = None
    for t, task in enumerate(data.tasks):
        learner.start_task(t, *task.client_train(0))
        if teacher is not None:
            learner.policy.receive(learner.view(), {"personal": teacher.tobytes()})
        learner.train()
        learner.finish_round()
        teacher = learner.trainer.get_weights()
    final = learner.evaluate(*data.seen_test(len(data.tasks) - 1)).accuracy
    bank = getattr(learner.policy, "_bank", None)
    return {"final": 100 * final, "budget": budget, "budget_samples": samples, "stored": len(learner.store),
            "generators": len(bank.classes()) if bank is not None else 0,
            "held": learner.budget.used(), "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="digits,mnist1d")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--cached", default="0.05,0.25,1.0")
    parser.add_argument("--methods", default="raw,vae,conv-vae,conv-vae-long")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", default="runs/generator-bytes")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job = json.loads(args.job)
        with tempfile.TemporaryDirectory() as tmp:
            result = run(job["dataset"], job["method"], job["seed"], job["cached"], Path(tmp))
        Path(job["file"]).write_text(json.dumps(result))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    cached = [float(c) for c in args.cached.split(",")]
    methods = args.methods.split(",")
    jobs = [{"dataset": d, "method": m, "seed": s, "cached": c,
             "file": str(Path(args.out) / d / f"cached{c}" / f"seed{s}" / f"{m}.json")}
            for d in args.datasets.split(",") for c in cached for s in seeds for m in methods]
    pending = [j for j in jobs if not Path(j["file"]).is_file()]
    print(f"{len(jobs) - len(pending)} of {len(jobs)} runs done; running {len(pending)}, {args.parallel} at a time",
          flush=True)
    running: list[tuple[dict[str, Any], subprocess.Popen[bytes]]] = []
    while pending or running:
        while pending and len(running) < args.parallel:
            job = pending.pop(0)
            Path(job["file"]).parent.mkdir(parents=True, exist_ok=True)
            with open(job["file"] + ".log", "wb") as log:
                running.append((job, subprocess.Popen([sys.executable, __file__, "--job", json.dumps(job)],
                                                      stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1.0)
        for job, process in list(running):
            if process.poll() is not None:
                running.remove((job, process))
                state = "ok" if Path(job["file"]).is_file() else f"FAILED (see {job['file']}.log)"
                print(f"  {job['dataset']} cached {job['cached']} seed {job['seed']} {job['method']}: {state}",
                      flush=True)
    results = {(j["dataset"], j["cached"], j["seed"], j["method"]): json.loads(Path(j["file"]).read_text())
               for j in jobs if Path(j["file"]).is_file()}
    for dataset in args.datasets.split(","):
        for c in cached:
            rows = {m: [results[(dataset, c, s, m)] for s in seeds if (dataset, c, s, m) in results] for m in methods}
            first = next((r[0] for r in rows.values() if r), None)
            if first is None:
                continue
            print(f"\n{dataset}, M = {first['budget'] / 1024:.0f} KiB (the raw store of {first['budget_samples']} "
                  f"samples: the newest task and {c:.0%} of the old data), seeds {seeds}; final accuracy, %")
            for method, values in rows.items():
                if not values:
                    continue
                finals = [v["final"] for v in values]
                print(f"  {method:14s} {np.mean(finals):6.2f} ± {np.std(finals):5.2f}   "
                      f"({' '.join(f'{f:.1f}' for f in finals)})   generators {np.mean([v['generators'] for v in values]):4.1f}"
                      f"   raw samples {np.mean([v['stored'] for v in values]):6.1f}   held "
                      f"{np.mean([v['held'] for v in values]) / 1024:6.0f} KiB   {np.mean([v['seconds'] for v in values]):5.0f} s")
            for method in methods:
                if method == "raw" or len(rows[method]) != len(rows["raw"]) or len(rows[method]) < 2:
                    continue
                a, b = [v["final"] for v in rows[method]], [v["final"] for v in rows["raw"]]
                diff = np.subtract(a, b)
                test = stats.ttest_rel(a, b)
                print(f"  {method} - raw: {' '.join(f'{d:+.1f}' for d in diff)}; mean {diff.mean():+.2f} ± "
                      f"{diff.std():.2f}, paired t = {test.statistic:.2f}, p = {test.pvalue:.3f}")


if __name__ == "__main__":
    main()
