"""Re-Fed's PIM, measured: what lambda, the PIM's learning rate and its epochs do to the PIM and to the cache it picks.

The setting is a device of the class-incremental digits (or `--scenario mnist1d-class`) fleet
(`benchmarks/table1.py`: 20 devices, Dirichlet 1.0, M caching 25 % of the old data at the last task) at its switch
to task `--task` (default 2): its old samples are its previous task's data and a uniform cache of the tasks before
(what the random cache would hold), M - N_new of them are kept. The global model the PIM starts from is the model
(LeNet, the 1-D CNN) trained on every client's data of the tasks before (AdamW, 3e-3, `--global-epochs` epochs): a
global model that knows the old tasks, as it does in the fleets (diagonal 0.9+).

For each configuration (lambda x pim_lr x stopping rule, and the supplement's two heads at lambda 0.5: the PIM an
auxiliary head on the shared layers) and each device: the PIM's epochs run, its drift ||v - w||
/ ||w|| (the median: a diverged run stops wherever it got) and whether it diverged; the share of the kept set it has
in common with the set ranked by the samples' gradient norms under the global model itself (the PIM's start: what
the ranking would be without the PIM), and with the kept set at the shipped configuration (lambda 0.5, pim_lr 0.01,
tolerance 0.05); the share of the kept set from the previous task (the rest comes from the older cache), the share
of it the global model classifies right, and the classes it holds; the same of all old samples (what a random cache
keeps in expectation). Mean over devices and seeds. Every configuration sees the same samples, global model and rng seed.

    .venv/bin/python benchmarks/pim_study.py [--seeds 0 1 2] [--devices 5] [--task 2] [--scenario digits-class]
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import numpy as np

from edge_client.policies import RoundView, Samples
from edge_client.policies.refed import ReFed, check_pim_step
from edge_client.trainers.ort import OrtTrainer
from firmware_sim.scenarios import OLD_DATA_CACHED, preset
from models.export import export_registered

LAMBDAS = (0.05, 0.5, 0.95)
RATES = (0.01, 0.1, 1.0)
STOPS = {"tolerance 0.05": 0.05, "40 epochs": 0.0}  # the fleets' rule, and the paper's 40 epochs
SHIPPED = (0.5, 0.01, "tolerance 0.05", "one")
TWO_HEADS_LAMBDA = 0.5  # the supplement's two heads (`heads = "two"`), at the shipped lambda
DEVICES = 20
MODELS = {"digits-class": "lenet", "mnist1d-class": "cnn1d"}


def device_state(data, k: int, task: int, budget: int, rng: np.random.Generator) -> tuple[Samples, int]:
    """Device k's old samples at its switch to `task` (its previous task whole, the tasks before as a uniform cache
    filling M - N_previous) and how many of them M keeps (M - N_new)."""
    parts = [(*data.tasks[t].client_train(k), t) for t in range(task)]
    x_prev, y_prev, _ = parts[-1]
    older = [(x, y, np.full(len(y), t)) for x, y, t in parts[:-1]]
    x_old = np.concatenate([x for x, _, _ in older]) if older else x_prev[:0]
    y_old = np.concatenate([y for _, y, _ in older]) if older else y_prev[:0]
    t_old = np.concatenate([t for _, _, t in older]) if older else np.zeros(0, np.int64)
    room = max(budget - len(y_prev), 0)
    pick = rng.permutation(len(y_old))[:room]
    samples = Samples(np.concatenate([x_old[pick], x_prev]), np.concatenate([y_old[pick], y_prev]),
                      np.concatenate([t_old[pick], np.full(len(y_prev), task - 1)]).astype(np.int64))
    n_new = len(data.tasks[task].client_train(k)[1])
    return samples, max(budget - n_new, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--devices", type=int, default=5, help="devices studied per seed (of the fleet's 20, the "
                        "first whose cache is a choice: M - N_new between 1 and the old samples less one)")
    parser.add_argument("--task", type=int, default=2, help="the task the devices switch to")
    parser.add_argument("--global-epochs", type=int, default=10)
    parser.add_argument("--scenario", choices=sorted(MODELS), default="digits-class")
    args = parser.parse_args()
    configs, refused = [], []
    grid = [(*c, "one") for c in itertools.product(LAMBDAS, RATES, STOPS)]
    grid += [(TWO_HEADS_LAMBDA, lr, stop, "two") for lr, stop in itertools.product(RATES, STOPS)]
    for lam, lr, stop, heads in grid:
        try:
            check_pim_step(lam, lr)
            configs.append((lam, lr, stop, heads))
        except ValueError as err:
            refused.append(f"lambda {lam}, pim_lr {lr}: {err}")
    rows: dict[tuple, list[dict[str, float]]] = {c: [] for c in configs}
    everything: list[dict[str, float]] = []  # per device: the old samples as a whole (what a random cache keeps)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            data = preset(args.scenario, n_clients=DEVICES, seed=seed).build()
            budget = data.binding_budget(OLD_DATA_CACHED)
            artifacts = Path(tmp) / f"model-{seed}"
            export_registered(MODELS[args.scenario], data.num_classes, artifacts, data.input_shape, seed=seed,
                              backends=("ort",), cache=True)
            trainer = OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)
            seen = [data.tasks[t].train() for t in range(args.task)]
            x_seen, y_seen = np.concatenate([x for x, _ in seen]), np.concatenate([y for _, y in seen])
            mask = np.zeros(data.num_classes, np.float32)
            mask[np.unique(y_seen)] = 1.0
            trainer.fit(x_seen, y_seen, epochs=args.global_epochs, class_mask=mask, rng=np.random.default_rng(seed))
            global_weights = trainer.get_weights()
            studied = 0
            for k in range(DEVICES):
                old, keep = device_state(data, k, args.task, budget, np.random.default_rng([seed, k]))
                if studied == args.devices or keep == 0 or keep >= len(old):
                    continue  # a device whose new task fills M (or leaves it all old data) has no choice to make
                studied += 1

                def view() -> RoundView:
                    return RoundView.of_samples(trainer, global_weights, mask, np.random.default_rng([seed, k, 1]),
                                                batch_size=32, stored=old)

                trainer.set_weights(global_weights)
                start = trainer.per_sample_grad_norms(old.x, old.y, mode="exact", class_mask=mask)
                by_global = set(np.argsort(-start, kind="stable")[:keep].tolist())
                logits = trainer.teacher_logits(global_weights, old.x) + np.where(mask > 0, 0.0, -1e9)
                right = logits.argmax(1) == old.y  # what the global model gets right of the old samples
                everything.append({"right": 100 * float(right.mean()),
                                   "previous_task": 100 * float(np.mean(old.task == args.task - 1)),
                                   "classes": len(np.unique(old.y))})
                kept: dict[tuple, set[int]] = {}
                runs = {}
                for lam, lr, stop, heads in configs:
                    policy = ReFed(lam=lam, pim_lr=lr, pim_epochs=40, pim_tolerance=STOPS[stop], heads=heads)
                    kept[(lam, lr, stop, heads)] = set(policy.rank(old, keep, view()).tolist())
                    runs[(lam, lr, stop, heads)] = policy.last_pim
                for config in configs:
                    chosen, run = kept[config], runs[config]
                    assert run is not None
                    rows[config].append({
                        "epochs": run.epochs, "drift": 100 * run.drift, "diverged": float(run.diverged),
                        "with_global": 100 * len(chosen & by_global) / keep,
                        "with_shipped": 100 * len(chosen & kept[SHIPPED]) / keep,
                        "previous_task": 100 * float(np.mean(old.task[sorted(chosen)] == args.task - 1)),
                        "right": 100 * float(right[sorted(chosen)].mean()),
                        "classes": len(np.unique(old.y[sorted(chosen)])),
                    })
                print(f"seed {seed} device {k}: {len(old)} old samples, keeps {keep}", flush=True)
    print(f"\nRe-Fed's PIM at the switch to task {args.task} on {args.scenario} ({DEVICES} devices, M caching "
          f"{OLD_DATA_CACHED:.0%} of the old data at the last task), seeds {args.seeds}, {args.devices} devices each; "
          "mean over devices and seeds")
    print(f"{'lambda':>6s} {'pim_lr':>6s} {'stopping':>15s} {'heads':>5s} {'epochs':>6s} {'drift % (median)':>16s} {'diverged':>8s} "
          f"{'kept set shared with: global ranking %':>38s} {'shipped %':>9s} {'from the previous task %':>24s} "
          f"{'global model right %':>20s} {'classes':>7s}")
    for (lam, lr, stop, heads), values in rows.items():
        mean = {key: float(np.mean([v[key] for v in values])) for key in values[0]} if values else {}
        if mean:  # a diverged run's drift is where it stopped, however far: the median says what a run does
            mean["drift"] = float(np.median([v["drift"] for v in values]))
        if not mean:
            continue
        print(f"{lam:6.2f} {lr:6.3f} {stop:>15s} {heads:>5s} {mean['epochs']:6.1f} {mean['drift']:16.2f} {mean['diverged']:8.2f} "
              f"{mean['with_global']:38.1f} {mean['with_shipped']:9.1f} {mean['previous_task']:24.1f} "
              f"{mean['right']:20.1f} {mean['classes']:7.2f}")
    whole = {key: float(np.mean([v[key] for v in everything])) for key in everything[0]} if everything else {}
    if whole:
        print(f"every old sample (what a random cache keeps in expectation): from the previous task "
              f"{whole['previous_task']:.1f} %, global model right on {whole['right']:.1f} %, {whole['classes']:.2f} "
              "classes")
    for line in sorted(set(refused)):
        print(f"refused when configured: {line}")


if __name__ == "__main__":
    main()
