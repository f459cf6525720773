"""Which previous generator FedCIL's ACGAN should replay its earlier classes from, measured on one device's data
outside a fleet: the one stored at the round's start (edge_client/policies/fedcil.py: within a task the earlier
classes pass through one more self-replay every round) or the one frozen at the task switch (the authors' code,
daiqing98/FedCIL: `last_generator`, copied in `next_task`, kept for the whole task).

For each client of the scenario (its own train data, task after task), an ACGAN trains by the policy's own loop
(`models/acgan.py` `train_acgan`; `--rounds` rounds of `--steps` steps a task, batch 32, Adam 2e-4 (0.5, 0.999), the
earlier classes replayed as real, as many as the batch's real samples), once per way, from the same seed. After the
last task, `--per-class` samples of each class it learnt are read by the final model of a FedAvg run of the same
seed (`--reference`, a table1 run folder): the share read as the class they were conditioned on, by the class's age
(0: the last task's classes; k: the task k before it). Printed per way: the mean over clients at each age and over
the earlier classes (ages >= 1).

    .venv/bin/python benchmarks/fedcil_freeze.py --reference runs/table1/methods/fashion-class/seed0/fedavg
        [--scenario fashion-class] [--seed 0] [--clients 0,1,2,3,4] [--width 8] [--rounds 3] [--steps 200]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch
from task_confusion import final_model, predicted_classes

from firmware_sim.scenarios import PRESETS, ScenarioData, build
from models.acgan import AcganSpec, build_acgan, train_acgan

WAYS = ("frozen each round", "frozen at the task switch")
BATCH = 32
LATENT = 16


def train_device(data: ScenarioData, client: int, way: str, args: argparse.Namespace) -> dict[int, float]:
    """The client's ACGAN trained `way` over its tasks: {age: the mean share of its samples of the classes of that
    age that the reference reads as their class}."""
    rng = np.random.default_rng(args.seed)
    generator, discriminator = build_acgan(AcganSpec(data.input_shape, data.num_classes, LATENT, args.width), args.seed)
    learnt: dict[int, int] = {}
    for task in range(data.n_tasks):
        x, y = data.tasks[task].client_train(client)
        if not len(y):
            continue
        old = sorted(set(learnt) - set(np.unique(y).tolist()))
        at_switch = copy.deepcopy(generator).eval() if old else None
        for _ in range(args.rounds):
            previous = (copy.deepcopy(generator).eval() if old else None) if way == WAYS[0] else at_switch
            noise = torch.Generator().manual_seed(int(rng.integers(2**31 - 1)))
            classes = np.asarray(sorted({*old, *np.unique(y).tolist()}), dtype=np.int64)
            train_acgan(generator, discriminator, x, y, classes, args.steps, BATCH, 2e-4, rng, noise, previous, old)
        learnt.update({int(c): task for c in np.unique(y)})
    last = max(learnt.values())
    generator.eval()
    noise = torch.Generator().manual_seed(args.seed)
    reader = final_model(args.reference, args.seed)
    by_age: dict[int, list[float]] = {}
    for label, task in learnt.items():
        with torch.no_grad():
            made = generator(torch.randn(args.per_class, LATENT, generator=noise),
                             torch.full((args.per_class,), label, dtype=torch.int64)).numpy().astype(np.float32)
        by_age.setdefault(last - task, []).append(float(np.mean(predicted_classes(reader, made) == label)))
    return {age: float(np.mean(v)) for age, v in by_age.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="a FedAvg run folder of the same seed")
    parser.add_argument("--scenario", default="fashion-class", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", default="0,1,2,3,4")
    parser.add_argument("--width", type=int, default=8, help="the ACGAN's width (8: Table 1's fedcil-bytes)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds a device takes part in per task")
    parser.add_argument("--steps", type=int, default=200, help="ACGAN steps a round (the policy's gan_steps)")
    parser.add_argument("--per-class", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = build(dataclasses.replace(PRESETS[args.scenario], seed=args.seed))
    clients = [int(c) for c in args.clients.split(",")]
    print(f"{args.scenario} seed {args.seed}, clients {clients}, width {args.width}, {args.rounds} rounds x "
          f"{args.steps} steps a task: the share of each class's samples the reference reads as it, by age")
    for way in WAYS:
        ages = [train_device(data, client, way, args) for client in clients]
        by_age = {age: [a[age] for a in ages if age in a] for age in sorted({k for a in ages for k in a})}
        earlier = [v for a in ages for age, v in a.items() if age > 0]
        print(f"  {way:<26} " + "  ".join(f"age {age}: {np.mean(v):.2f}" for age, v in by_age.items())
              + f"  | earlier classes {np.mean(earlier):.2f}")


if __name__ == "__main__":
    main()
