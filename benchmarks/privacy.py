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
  robust rule);
- `local-sigma-<z>`: local DP on every device (edge_client/privacy.py: its change clipped to the clip, noise of sd
  z x 2 clip added before it leaves) at each z of `--local-sigmas`, with FedAvg. Its mean carries noise of sd
  2 z clip / sqrt(selected) a weight, far longer than the model: the coordinator's check of exploded models
  (`[checkpoint] explode_factor`) would refuse every round, so these columns alone raise it (`LOCAL_EXPLODE`).
Printed per scenario: each column's final accuracy (mean ± std over the seeds, the last round and the last task's
last rounds), epsilon at delta 1e-5 after the run (RDP, as the runs account it) with the last round's clip and noise
sd, each column paired against `no-dp` (paired t-test over the seeds), and what a membership-inference attack
achieves on its last global model (`membership_attack`) and on a device's update (`update_attack`). Every run is a fleet of its own
(`table1.run_jobs`), a finished one read back; a DP run draws its noise from its seed (`noise_seed`), so one seed
gives one table on any host.

The noise added to the mean has an L2 norm of about z x clip / selected x sqrt(parameters), against a mean change no
longer than the clip: DP-FedAvg needs many devices a round to learn at a useful epsilon, and a small fleet shows it.

    .venv/bin/python benchmarks/privacy.py [--scenarios digits-class] [--seeds 0,1,2] [--devices 100]
        [--fraction 1.0] [--rounds-per-task 3] [--sigmas 0.3,1,3] [--adaptive-sigmas 1] [--median-sigmas 1]
        [--local-sigmas 1] [--clip 1.0] [--parallel 1] [--out runs/privacy]
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from table1 import RANDOM, STRATEGY, Job, finals_of, plan, print_paired, print_table, run_jobs

BASELINE = "no-dp"
CLIP_ONLY_SIGMA = 1e-4  # noise this small changes nothing measurable: the clip's own cost
MEDIAN = {"name": "median"}
# over table1's guard (its size bounds): the distance bounds off too, so that none compares an update with the others
PER_UPDATE_GUARD = [("norm_bound", "off"), ("free_rider_factor", 0.0)]
LOCAL_EXPLODE = 1e6  # the local DP columns' [checkpoint] explode_factor: their noise is the model's length many times


def methods(sigmas: list[float], adaptive: list[float], median: list[float], local: list[float], clip: float
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
            **{name("median-dp", sigma): central(sigma, MEDIAN) for sigma in median},
            **{name("local", sigma): {"policy": RANDOM, "strategy": STRATEGY,
                                      "privacy": {"mode": "local", "clip_norm": clip, "noise_multiplier": sigma},
                                      "coordinator": {"checkpoint": {"explode_factor": LOCAL_EXPLODE}}}
               for sigma in local}}


def seeded_noise(job: Job) -> Job:
    """A DP column's noise drawn from the run's seed (`noise_seed`, experiments only: the coordinator's central DP,
    the devices' local DP): one seed, one table."""
    options = dict(job.options)
    central = options.get("coordinator", {}).get("privacy")
    if central is not None:
        options["coordinator"] = {**options["coordinator"], "privacy": {**central, "noise_seed": job.seed}}
    if "privacy" in options:
        options["privacy"] = {**options["privacy"], "noise_seed": job.seed}
    return dataclasses.replace(job, options=options)


def finished_run(run: Path) -> tuple[dict[str, Any], Any, np.ndarray]:
    """A finished fleet run's file (fleet.json), its scenario (built again from it: the same seed, the same data)
    and its last global model."""
    import json

    from coordinator.checkpoint import load_latest
    from edgefil.settings import Where
    from firmware_sim.scenarios import check_scenario

    fleet = json.loads((run / "fleet.json").read_text())
    found = load_latest(run / "checkpoint")
    assert found is not None, f"{run}: no checkpoint"
    return fleet, check_scenario(fleet["scenario"], Where(str(run))).build(), found[0].weights


def membership_attack(run: Path) -> tuple[float, float, float]:
    """The loss-threshold membership inference (Yeom et al. 2018) against a finished run's last global model, as
    anyone who receives it could run it: a sample's loss under the model says whether it was trained on. Members:
    every task's training samples (the devices' data, all of it handed out); non-members: the tasks' test samples,
    never trained on. Returns the attack's ROC AUC over every task's samples, over the last task's (the classes the
    model still holds: the old tasks' are mostly forgotten, and forgetting hides membership as well as any noise),
    and its advantage there (the largest true-positive minus false-positive rate of a threshold: (epsilon,
    delta)-DP bounds it by (e^epsilon - 1 + 2 delta) / (e^epsilon + 1), a bound that says something only at small
    epsilon)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    from edge_client.trainers.pytorch import TorchTrainer
    from models.manifest import load_manifest

    _, scenario, weights = finished_run(run)
    trainer = TorchTrainer(load_manifest(run / "artifacts"))
    trainer.set_weights(weights)

    scored = [(sample_losses(trainer, *task.train()), sample_losses(trainer, *task.test())) for task in scenario.tasks]

    def auc(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
        inside, outside = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
        truth = np.r_[np.ones(len(inside)), np.zeros(len(outside))]
        score = -np.r_[inside, outside]  # a lower loss: more likely a member
        fpr, tpr, _ = roc_curve(truth, score)
        return float(roc_auc_score(truth, score)), float((tpr - fpr).max())

    every, _ = auc(scored)
    last, advantage = auc(scored[-1:])
    return every, last, advantage


UPDATE_ATTACK_DEVICES = 10  # the devices whose update the second attack reads, each on its own


def update_attack(run: Path, epochs: int = 10, lr: float = 3e-3) -> float:
    """The same attack against a device's update, as the coordinator (or whoever reads `dev/<id>/update`) could run
    it: devices 0..UPDATE_ATTACK_DEVICES-1 each train the run's last global model on their last task's samples as
    the fleet's devices do (`epochs` of AdamW at `lr`, batches of 32), and a sample's loss under the update says
    whether it was the device's. Members: the device's samples; non-members: the task's test samples. Central DP
    noises what is released, not what a device sends: only local DP (its columns) changes what this attack reads.
    Returns the mean AUC."""
    from sklearn.metrics import roc_auc_score

    from edge_client.privacy import LocalPrivacy, LocalPrivacySettings
    from edge_client.trainers.pytorch import TorchTrainer
    from models.manifest import load_manifest

    fleet, scenario, weights = finished_run(run)
    local = LocalPrivacySettings(**fleet.get("privacy", {}))
    task = scenario.tasks[-1]
    outside_x, outside_y = task.test()
    aucs = []
    for k in range(min(UPDATE_ATTACK_DEVICES, task.n_clients)):
        x, y = task.client_train(k)
        if not len(y):
            continue
        trainer = TorchTrainer(load_manifest(run / "artifacts"), optimizer="adamw", lr=lr, seed=k)
        trainer.set_weights(weights)
        trainer.fit(x, y, epochs=epochs, batch_size=32)
        if local.local:  # what leaves the device is its release, made as the device makes it
            with tempfile.TemporaryDirectory() as folder:
                release = LocalPrivacy(local, Path(folder), stream=k)  # drawn from the run's noise_seed, if any
                trainer.set_weights(release.release(trainer.get_weights(), weights))
        inside, outside = sample_losses(trainer, x, y), sample_losses(trainer, outside_x, outside_y)
        aucs.append(roc_auc_score(np.r_[np.ones(len(inside)), np.zeros(len(outside))], -np.r_[inside, outside]))
    return float(np.mean(aucs))


def sample_losses(trainer: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each sample's cross-entropy under the trainer's model, in float64."""
    logits, _ = trainer.outputs(x, y)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y]


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
    parser.add_argument("--local-sigmas", default="1", help="local DP's columns ('': none)")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--parallel", type=int, default=1, help="fleet runs at a time (each takes about 2 cores)")
    parser.add_argument("--out", default="runs/privacy")
    args = parser.parse_args()
    # what table1's plan reads besides: every run at the table's regime, behind the per-update guard
    args.backend, args.epochs, args.lr = None, None, None
    args.scenario_option, args.learner_option, args.guard_option = [], [], PER_UPDATE_GUARD
    seeds = [int(s) for s in args.seeds.split(",")]
    columns = methods(floats(args.sigmas), floats(args.adaptive_sigmas), floats(args.median_sigmas),
                      floats(args.local_sigmas), args.clip)
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
            local = [r["local_epsilon"] for r in done if r.get("local_epsilon") is not None]
            text = (f"{np.mean(local):.3g} (local: the largest a device spent)" if local else "no DP"
                    if method in (BASELINE, "median") else (f"{np.mean(spent):.3g}" if spent else "—"))
            if last:
                text += (f"   {last[0]['calibration']}: clip {np.mean([p['clip_norm'] for p in last]):.3g}, noise sd "
                         f"{np.mean([p['noise_sd'] for p in last]):.3g}")
            print(f"    {method:22s} {text}")
        for method in columns:
            if method != BASELINE and finals_of(jobs, results):
                print_paired(method, BASELINE, finals)
        print("  membership inference on the last global model (loss threshold; AUC 0.5: no better than a coin), "
              "mean ± std over the seeds:")
        print(f"    {'column':22s} {'AUC, every task':>16s} {'AUC, last task':>15s} {'advantage, last task':>21s} "
              f"{'AUC, a device update':>21s}")
        for method in columns:
            runs = [Path(j.folder) / j.method for j in jobs if j.method == method and j.result_file in results]
            attacks = np.array([(*membership_attack(run), update_attack(run)) for run in runs])
            if len(attacks):
                print(f"    {method:22s} " + " ".join(f"{m:8.3f} ± {s:5.3f}" for m, s in
                                                     zip(attacks.mean(axis=0), attacks.std(axis=0))))


if __name__ == "__main__":
    main()
