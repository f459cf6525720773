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
- `no-guard` and `secagg`: FedAvg with every check of the guard off (secure aggregation runs with none: each judges
  one update, which the coordinator no longer sees), without and with `[secure_aggregation] mode = "secagg+"`
  (coordinator/secagg.py), paired against each other: what secure aggregation costs in accuracy (its quantisation);
- `<rule>`, `<rule>-clip-only`, `<rule>-dp-sigma-<z>` and `<rule>-adaptive-sigma-<z>` for each rule of `--rules`
  (`glfc`: table1's GLFC, the proxy included): the method without DP, with the clip alone (as `clip-only`), and
  under central DP at each z of `--rule-sigmas`, fixed and adaptive clipping, each paired against the method's own
  column (what central DP costs it: the clip, the mean's noise and, for GLFC, the proxy's noisy choice of each
  task's old model);
- `local-sigma-<z>`: local DP on every device (edge_client/privacy.py: its change clipped to the clip, noise of sd
  z x 2 clip added before it leaves) at each z of `--local-sigmas`, with FedAvg. Its mean carries noise of sd
  2 z clip / sqrt(selected) a weight, far longer than the model: the coordinator's check of exploded models
  (`[checkpoint] explode_factor`) would refuse every round, so these columns alone raise it (`LOCAL_EXPLODE`).
Printed per scenario: each column's final accuracy (mean ± std over the seeds, the last round and the last task's
last rounds), epsilon at delta 1e-5 after the run (RDP, as the runs account it) with the last round's clip and noise
sd, each column paired against `no-dp` (paired t-test over the seeds), and what a membership-inference attack
achieves on its last global model (`membership_attack`) and on a device's update (`update_attack`). Every run is a fleet of its own
(`table1.run_jobs`), a finished one read back; a DP run draws its noise from its seed (`noise_seed`), so one seed
gives one table on any host. Under secure aggregation the attack on a device's update reads what the coordinator
receives, the device's masked vector, decoded as if it were the device's quantised change.

`--parts secure-cost` prints secure aggregation's cost per round against N (`--secure-sizes`, default 10, 100,
1000) next to plain FedAvg's, two ways:
- one session in one process (`session_cost`): every device's and the coordinator's CPU time per step, and the bytes
  each sends and receives, for LeNet's 30,986 weights, with every device staying and with 5 % of them dropping
  after sharing (the coordinator then regenerates their pairwise masks); plain FedAvg's are a device encoding its
  update and the coordinator decoding and folding them;
- a whole fleet (`fleet_scale.run_fleet`: real mosquitto, worker processes hosting the N devices, one MNIST-1D task
  with about `--secure-per-device` samples each so that every device trains, `--secure-rounds` rounds, the guard
  off on both sides): each round's wall time and the CPU the coordinator, the broker and the workers spent, plain
  and secure in one run (ratios only: the host is shared).

The noise added to the mean has an L2 norm of about z x clip / selected x sqrt(parameters), against a mean change no
longer than the clip: DP-FedAvg needs many devices a round to learn at a useful epsilon, and a small fleet shows it.

    .venv/bin/python benchmarks/privacy.py [--scenarios digits-class] [--seeds 0,1,2] [--devices 100]
        [--fraction 1.0] [--rounds-per-task 3] [--sigmas 0.3,1,3] [--adaptive-sigmas 1] [--median-sigmas 1]
        [--local-sigmas 1] [--clip 1.0] [--rules glfc] [--rule-sigmas 1] [--columns no-dp,...] [--parallel 1]
        [--out runs/privacy]
        [--parts accuracy,secure-cost] [--secure-sizes 10,100,1000] [--secure-rounds 3] [--secure-per-device 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from table1 import METHODS as TABLE1_METHODS
from table1 import RANDOM, STRATEGY, Job, finals_of, plan, print_paired, print_table, run_jobs

from coordinator.guard_settings import OFF as GUARD_OFF

BASELINE = "no-dp"
CLIP_ONLY_SIGMA = 1e-4  # noise this small changes nothing measurable: the clip's own cost
MEDIAN = {"name": "median"}
# over table1's guard (its size bounds): the distance bounds off too, so that none compares an update with the others
PER_UPDATE_GUARD = [("norm_bound", "off"), ("free_rider_factor", 0.0)]
LOCAL_EXPLODE = 1e6  # the local DP columns' [checkpoint] explode_factor: their noise is the model's length many times
SECURE = {"secure_aggregation": {"mode": "secagg+"}}
UNGUARDED, SECURED = "no-guard", "secagg"
LENET_DIGITS_PARAMETERS = 30_986  # LeNet on 8x8 digits, the scenario's model
DROPPING = 0.05  # the share of a session's devices that drop after sharing, in its second cost row


def methods(sigmas: list[float], adaptive: list[float], median: list[float], local: list[float], clip: float,
            secure: bool = True) -> dict[str, dict[str, Any]]:
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
               for sigma in local},
            **({UNGUARDED: {"policy": RANDOM, "strategy": STRATEGY, "coordinator": {"guard": dict(GUARD_OFF)}},
                SECURED: {"policy": RANDOM, "strategy": STRATEGY,
                          "coordinator": {"guard": dict(GUARD_OFF), **SECURE}}} if secure else {})}


def rule_columns(rules: list[str], sigmas: list[float], clip: float) -> dict[str, dict[str, Any]]:
    """Each rule's columns (the module's docstring): table1's method as it is, and under central DP."""
    columns: dict[str, dict[str, Any]] = {}
    for rule in rules:
        spec = TABLE1_METHODS[rule]
        columns[rule] = spec
        clip_only = {"mode": "central", "clip_norm": clip, "noise_multiplier": CLIP_ONLY_SIGMA}
        columns[f"{rule}-clip-only"] = {**spec, "coordinator": {**spec.get("coordinator", {}), "privacy": clip_only}}
        for sigma in sigmas:
            for clipping in ("fixed", "adaptive"):
                privacy = {"mode": "central", "clip_norm": clip, "noise_multiplier": sigma, "clipping": clipping}
                name = f"{rule}-{'dp' if clipping == 'fixed' else 'adaptive'}-sigma-{sigma:g}".replace(".", "_")
                columns[name] = {**spec, "coordinator": {**spec.get("coordinator", {}), "privacy": privacy}}
    return columns


def own_baseline(column: str, rules: list[str]) -> str:
    """What a column is paired against: its rule's column without DP, or FedAvg's."""
    return next((rule for rule in rules if column.startswith(f"{rule}-")), BASELINE)


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
    noises what is released, not what a device sends: only local DP (its columns) changes what this attack reads,
    and secure aggregation (`masked_view`). Returns the mean AUC."""
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
                trainer.set_weights(release.release(trainer.get_weights(), weights)[0])
        if fleet.get("coordinator", {}).get("secure_aggregation", {}).get("mode", "off") != "off":
            trainer.set_weights(masked_view(trainer.get_weights(), weights, len(y)))
        inside, outside = sample_losses(trainer, x, y), sample_losses(trainer, outside_x, outside_y)
        aucs.append(roc_auc_score(np.r_[np.ones(len(inside)), np.zeros(len(outside))], -np.r_[inside, outside]))
    return float(np.mean(aucs))


def masked_view(trained: np.ndarray, global_weights: np.ndarray, samples: int) -> np.ndarray:
    """What the coordinator makes of one device's masked vector under secure aggregation (a session of 10 devices at
    the defaults), decoded as if it were the device's quantised change: the device's vector with its self mask on and
    no pairwise mask (one neighbour, whose shares never came: the attacker's best case; more masks change nothing
    of a vector the self mask alone makes uniform)."""
    from coordinator.secagg import SecureAggregationSettings
    from edge_client.secagg import SecureRoundSettings, SecureUpload
    from edgefil import wire
    from edgefil.secagg import KeyPair, Quantiser

    settings, count = SecureAggregationSettings(mode="secagg+"), 10
    upload = SecureUpload("dev-0", 1, SecureRoundSettings("attack", settings.clip_range, settings.max_weight),
                          trained.astype(np.float64) - global_weights, samples, 0, "model", {})
    other = KeyPair.generate().public
    upload.on_neighbours({"count": count, "threshold": 1, "index": 1, "neighbours": {"dev-1": [2, other, other]}})
    blob = upload.on_relayed({"shares": {}})
    words = np.frombuffer(b"".join(bytes(frame.data) for frame in blob.frames), dtype=wire.BLOB_DTYPES["masked"])
    change, weight = Quantiser(settings.clip_range, count).decode(words, 1)
    return (global_weights + change / max(weight, 1e-12)).astype(np.float32)


def sample_losses(trainer: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each sample's cross-entropy under the trainer's model, in float64."""
    logits, _ = trainer.outputs(x, y)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y]


# --- secure aggregation's cost -------------------------------------------------------------------------

def session_cost(n: int, parameters: int, dropping: float = 0.0, seed: int = 0) -> dict[str, float]:
    """One secure session of `n` devices in this process, every message through the codec: CPU seconds per device
    (each device's steps) and for the coordinator (its stages, the unmasking, the fold of the sum into FedAvg), and
    bytes per device each way; `dropping`: the share of devices that drop after sharing. Plain FedAvg's beside it:
    each device encodes its update, the coordinator decodes, reassembles and folds them."""
    import torch

    from coordinator.secagg import Advertised, SecureAggregationSettings, SecureMessage, SecureRound
    from coordinator.strategies import ClientUpdate, make_strategy
    from edge_client.secagg import SecureRoundSettings, SecureUpload
    from edgefil import wire

    rng = np.random.default_rng(seed)
    settings = SecureAggregationSettings(mode="secagg+")
    start = rng.normal(0, 0.1, parameters).astype(np.float32)
    trained = {f"dev-{i:04d}": (start + rng.normal(0, 0.01, parameters)).astype(np.float32) for i in range(n)}
    dropped = set(sorted(trained)[: max(1, round(dropping * n)) if dropping else 0])
    cost = {"device_cpu": 0.0, "coordinator_cpu": 0.0, "device_sent": 0.0, "device_received": 0.0,
            "plain_device_cpu": 0.0, "plain_coordinator_cpu": 0.0, "plain_device_sent": 0.0}

    def timed(side: str, work: Callable[[], Any]) -> Any:
        began = time.process_time()
        result = work()
        cost[side] += time.process_time() - began
        return result

    fedavg = make_strategy("fedavg", device="cpu")
    fold = timed("plain_coordinator_cpu", lambda: fedavg.fold(torch.from_numpy(start)))
    reassembler = wire.Reassembler(1 << 30)
    for device, weights in trained.items():
        blob = timed("plain_device_cpu", lambda: wire.encode_blob(
            "update", wire.weights_bytes(weights), device=device, round=1, task=0, model="m", num_samples=20,
            metrics={}))
        cost["plain_device_sent"] += sum(len(frame) for frame in blob.frames)

        def take(blob: wire.EncodedBlob = blob) -> None:
            for chunk in blob.chunks:
                done = reassembler.add(device, wire.decode(chunk))
            fold.add(ClientUpdate(device, done.weights(parameters), 20))
        timed("plain_coordinator_cpu", take)
    timed("plain_coordinator_cpu", fold.result)

    secure = SecureRound(settings, 1, "cost", parameters + 1)
    config = SecureRoundSettings("cost", settings.clip_range, settings.max_weight)
    uploads = {}
    for device, weights in trained.items():
        uploads[device] = upload = timed("device_cpu", lambda: SecureUpload(
            device, 1, config, weights.astype(np.float64) - start, 20, 0, "m", {}))
        cost["device_sent"] += len(upload.advertisement)
        m = timed("coordinator_cpu", lambda: wire.decode(upload.advertisement))
        secure.advertise(Advertised(device, 1, 0, "m", "cost", m["cipher_key"], m["mask_key"], m["commitment"], {}))
    masked = wire.Reassembler(1 << 30)
    stages = (("shares", lambda: secure.begin_sharing(rng)), ("masked", secure.begin_masking),
              ("reveal", secure.begin_unmasking))
    for stage, begin in stages:
        for device, payload in timed("coordinator_cpu", begin).items():
            cost["device_received"] += len(payload)
            if stage != "shares" and device in dropped:
                continue
            message = wire.decode(payload)
            upload = uploads[device]
            if stage == "masked":
                blob = timed("device_cpu", lambda: upload.on_relayed(message))
                cost["device_sent"] += sum(len(frame) for frame in blob.frames)

                def take_masked(blob: wire.EncodedBlob = blob, device: str = device) -> None:
                    for chunk in blob.chunks:
                        done = masked.add(device, wire.decode(chunk))
                    secure.take(SecureMessage(device, "masked", 1, "cost", done.header, done.words(parameters + 1)))
                timed("coordinator_cpu", take_masked)
                continue
            answer = upload.on_neighbours if stage == "shares" else upload.on_unmask
            reply = timed("device_cpu", lambda: answer(message))
            cost["device_sent"] += len(reply)
            timed("coordinator_cpu", lambda: secure.take(SecureMessage(device, stage, 1, "cost", wire.decode(reply))))
    summed = timed("coordinator_cpu", secure.result)
    fold = timed("coordinator_cpu", lambda: fedavg.fold(torch.from_numpy(start)))
    timed("coordinator_cpu", lambda: (fold.add(ClientUpdate("secure-sum", start + summed.mean_change.astype(
        np.float32), round(summed.samples))), fold.result()))
    exact = np.mean([w.astype(np.float64) - start for d, w in trained.items() if d not in dropped], axis=0)
    return {**{k: v / n if "device" in k else v for k, v in cost.items()},
            "error": float(np.abs(summed.mean_change - exact).max()), "survivors": len(summed.survivors)}


def print_session_cost(sizes: list[int], parameters: int) -> None:
    print(f"\nsecure aggregation, one session in one process ({parameters:,} weights, every device staying, then "
          f"{DROPPING:.0%} dropping after sharing), against plain FedAvg's encode, decode and fold:")
    print(f"  {'N':>5s} {'dropping':>8s} {'device CPU ms':>13s} {'plain':>6s} {'ratio':>6s} {'coord. CPU s':>12s} "
          f"{'plain':>6s} {'ratio':>6s} {'device KB sent':>14s} {'plain':>6s} {'received':>8s} {'max error':>9s}")
    for n in sizes:
        for dropping in (0.0, DROPPING):
            c = session_cost(n, parameters, dropping)
            print(f"  {n:5d} {dropping:8.0%} {c['device_cpu'] * 1e3:13.2f} {c['plain_device_cpu'] * 1e3:6.2f} "
                  f"{c['device_cpu'] / c['plain_device_cpu']:6.1f} {c['coordinator_cpu']:12.3f} "
                  f"{c['plain_coordinator_cpu']:6.3f} {c['coordinator_cpu'] / c['plain_coordinator_cpu']:6.1f} "
                  f"{c['device_sent'] / 1e3:14.1f} {c['plain_device_sent'] / 1e3:6.1f} "
                  f"{c['device_received'] / 1e3:8.1f} {c['error']:9.1e}")


def print_fleet_cost(sizes: list[int], rounds: int, per_device: int, out: Path) -> None:
    """Plain and secure FedAvg fleets at each size, alternated, through `fleet_scale.run_fleet` (its module says
    what it measures): the median round's wall time and CPU by process."""
    import fleet_scale

    from firmware_sim.fleet_config import FleetConfig

    args = argparse.Namespace(per_device=per_device, idle_s=0.0, profile=0, rounds=rounds, workers=None,
                              backend=FleetConfig.trainer.backend, replay_m=50, deadline_s=600.0, wait_s=600.0)
    print(f"\nsecure aggregation in a whole fleet (mosquitto, MNIST-1D cnn1d, ~{per_device} samples a device, "
          f"{rounds} rounds, every device selected, the guard off on both sides; median round):")
    print(f"  {'N':>5s} {'mode':>7s} {'wall s':>7s} {'ratio':>6s} {'coordinator CPU s':>17s} {'broker':>7s} "
          f"{'workers':>8s} {'ms a device (all)':>17s} {'received':>8s}")
    for n in sizes:
        walls = {}
        for mode, extra in (("plain", {}), ("secure", SECURE)):
            run = fleet_scale.run_fleet(n, args, out / f"{mode}-{n}", None, "mosquitto", guard=dict(GUARD_OFF),
                                        coordinator=extra)
            r = fleet_scale.summarize(run)["rounds"]
            walls[mode] = r["wall"]
            total = r["cpu_coordinator"] + r["cpu_broker"] + r["cpu_workers"]
            print(f"  {n:5d} {mode:>7s} {r['wall']:7.2f} {r['wall'] / walls['plain']:6.2f} "
                  f"{r['cpu_coordinator']:17.2f} {r['cpu_broker']:7.2f} {r['cpu_workers']:8.2f} "
                  f"{total / n * 1e3:17.1f} {r['received']:8.0f}")


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
    parser.add_argument("--rules", default="", help="methods of table1 run without DP and under central DP ('glfc')")
    parser.add_argument("--rule-sigmas", default="1", help="the rules' DP columns' noise multipliers")
    parser.add_argument("--columns", default="", help="only these columns ('': every one)")
    parser.add_argument("--parallel", type=int, default=1, help="fleet runs at a time (each takes about 2 cores)")
    parser.add_argument("--out", default="runs/privacy")
    parser.add_argument("--parts", default="accuracy,secure-cost", help="accuracy, secure-cost, or both")
    parser.add_argument("--secure-sizes", default="10,100,1000")
    parser.add_argument("--secure-rounds", type=int, default=3)
    parser.add_argument("--secure-per-device", type=int, default=10)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "secure-cost" in parts:
        sizes = [int(n) for n in args.secure_sizes.split(",")]
        print_session_cost(sizes, LENET_DIGITS_PARAMETERS)
        print_fleet_cost(sizes, args.secure_rounds, args.secure_per_device, Path(args.out) / "secure-cost")
    if "accuracy" not in parts:
        return
    # what table1's plan reads besides: every run at the table's regime, behind the per-update guard
    args.backend, args.epochs, args.lr = None, None, None
    args.scenario_option, args.learner_option, args.guard_option = [], [], PER_UPDATE_GUARD
    seeds = [int(s) for s in args.seeds.split(",")]
    rules = [rule for rule in args.rules.split(",") if rule]
    columns = {**methods(floats(args.sigmas), floats(args.adaptive_sigmas), floats(args.median_sigmas),
                         floats(args.local_sigmas), args.clip),
               **rule_columns(rules, floats(args.rule_sigmas), args.clip)}
    if args.columns:
        columns = {name: columns[name] for name in args.columns.split(",")}
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
                    if method in (BASELINE, "median", *rules) else (f"{np.mean(spent):.3g}" if spent else "—"))
            if last:
                text += (f"   {last[0]['calibration']}: clip {np.mean([p['clip_norm'] for p in last]):.3g}, noise sd "
                         f"{np.mean([p['noise_sd'] for p in last]):.3g}")
            print(f"    {method:22s} {text}")
        for method in columns:
            if method not in (BASELINE, *rules) and finals_of(jobs, results):
                print_paired(method, own_baseline(method, rules), finals)
        if SECURED in columns and finals_of(jobs, results):
            print_paired(SECURED, UNGUARDED, finals)  # the same guard (none): what secure aggregation itself costs
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
