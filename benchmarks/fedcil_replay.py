"""What FedCIL's devices replay: the samples each device's stored ACGAN makes of the classes it has learnt, read by
a classifier that knows every class, from the runs' own files (no run repeated).

For each run (`<runs>/<scenario>/seed<k>/<method>/`), each device's last ACGAN (`devices/<id>/fedcil/acgan.npz`, the
file the policy keeps) generates `--per-class` samples of every class it has learnt; the reference (the final global
model of the `--reference` run of the same seed, FedAvg by default) classifies them. Printed per method: the devices
holding an ACGAN, the classes one holds, and the share of generated samples the reference reads as the class they
were conditioned on, by the class's age: 0 for the classes of the device's last task (the ones its ACGAN last
trained on real data), k for those of the task k before it (held only by the ACGAN's replay of its own earlier
self), with how many device-classes each share averages; beside it the reference's accuracy on the real test
images. A share near the real images' says the ACGAN draws its classes; near 1/10 (chance) that it does not.

    .venv/bin/python benchmarks/fedcil_replay.py --scenario fashion-class --seeds 0,1,2,3,4
        --runs runs/table1/methods --methods fedcil,fedcil-bytes [--reference fedavg] [--per-class 100]
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch
from task_confusion import final_model, predicted_classes

from edge_client.trainers.pytorch import TorchTrainer
from edgefil.durable import read_npz
from firmware_sim.scenarios import PRESETS, build
from models.acgan import AcganSpec, build_acgan
from models.generators import load_module


def device_replay(path: Path, reader: TorchTrainer, per_class: int, seed: int) -> dict[int, float]:
    """Class -> the share of `per_class` samples the stored ACGAN at `path` makes of it that `reader` reads as it."""
    data = read_npz(path.read_bytes())
    classes_total, latent, width, *shape = data["spec"].tolist()
    generator, _ = build_acgan(AcganSpec(tuple(shape), classes_total, latent, width), 0)
    load_module(generator, np.ascontiguousarray(data["generator"], dtype=np.float32))
    generator.eval()
    noise = torch.Generator().manual_seed(seed)
    shares = {}
    for label in data["classes"].tolist():
        labels = torch.full((per_class,), int(label), dtype=torch.int64)
        with torch.no_grad():
            made = generator(torch.randn(per_class, latent, generator=noise), labels).numpy().astype(np.float32)
        shares[int(label)] = float(np.mean(predicted_classes(reader, made) == label))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="fashion-class", choices=sorted(PRESETS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--methods", required=True, help="FedCIL runs, e.g. fedcil,fedcil-bytes")
    parser.add_argument("--reference", default="fedavg", help="the run whose final model reads the samples")
    parser.add_argument("--per-class", type=int, default=100)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.scenario}, seeds {seeds}: what each device's last ACGAN draws, read by {args.reference}'s final model")
    for method in args.methods.split(","):
        held, classes, real = [], [], []
        by_age: dict[int, list[float]] = {}
        for seed in seeds:
            folder = args.runs / args.scenario / f"seed{seed}"
            reader = final_model(folder / args.reference, seed)
            data = build(dataclasses.replace(PRESETS[args.scenario], seed=seed))
            task_of_class = {c: t for t in range(len(data.tasks)) for c in data.task_classes(t)}
            last_task = max(task_of_class.values())
            files = sorted((folder / method / "devices").glob("*/fedcil/acgan.npz"))
            held.append(len(files))
            for path in files:
                shares = device_replay(path, reader, args.per_class, seed)
                classes.append(len(shares))
                own = max(task_of_class[c] for c in shares)  # the device's last task: its ACGAN's latest
                for c, v in shares.items():
                    by_age.setdefault(own - task_of_class[c], []).append(v)
            for t in range(last_task + 1):
                x, y = data.task_test(t)
                real.append(float(np.mean(predicted_classes(reader, x) == y)))
        ages = "  ".join(f"age {age}: {np.mean(v):.2f} (n {len(v)})" for age, v in sorted(by_age.items()))
        print(f"  {method:<14} ACGANs a run {np.mean(held):.1f}, classes each {np.mean(classes):.1f}; read as their "
              f"class: {ages}; real test images {np.mean(real):.2f}")


if __name__ == "__main__":
    main()
