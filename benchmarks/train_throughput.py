"""Local training throughput: ORT training artifacts versus the same model in torch eager mode.

Both backends train the same model from the same weights on the same batches (SGD, same batch size) in one
run; the script prints samples/s for each and the ratio ORT / torch, for several thread counts.

    .venv/bin/python benchmarks/train_throughput.py [--batch 32] [--samples 4096] [--repeats 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from edge_client.trainers.base import Trainer
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.export import export_registered

CASES = [  # model, input shape, where its inputs come from in practice
    ("lenet", (1, 8, 8), "embedded digits"),
    ("cnn1d", (1, 40), "embedded MNIST-1D"),
    ("small_cnn", (3, 32, 32), "CIFAR-10 sized"),
]


def samples_per_second(trainer: Trainer, x: np.ndarray, y: np.ndarray, batch: int, repeats: int) -> float:
    """Best of `repeats` timed epochs after one warm-up epoch (throughput does not depend on the values)."""
    rng = np.random.default_rng(0)
    trainer.fit(x[: batch * 4], y[: batch * 4], epochs=1, batch_size=batch, rng=rng)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.fit(x, y, epochs=1, batch_size=batch, rng=rng)
        best = min(best, time.perf_counter() - start)
    return len(y) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    print(f"batch {args.batch}, {args.samples} samples per epoch, best of {args.repeats} epochs, SGD lr 0.01")
    print(f"{'model':10s} {'params':>9s} {'threads':>7s} {'ORT samples/s':>14s} {'torch samples/s':>16s} {'ORT/torch':>9s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape, _ in CASES:
            directory = Path(tmp) / name
            manifest = export_registered(name, 10, directory, input_shape=shape, seed=0)
            x = rng.random((args.samples, *shape), dtype=np.float32)
            y = rng.integers(0, 10, args.samples)
            best = {"ort": 0.0, "torch": 0.0}
            for threads in args.threads:
                ort_trainer = OrtTrainer(directory, optimizer="sgd", lr=0.01, threads=threads)
                torch.set_num_threads(threads)
                torch_trainer = TorchTrainer(manifest, optimizer="sgd", lr=0.01)
                torch_trainer.set_weights(ort_trainer.get_weights())
                ort_rate = samples_per_second(ort_trainer, x, y, args.batch, args.repeats)
                torch_rate = samples_per_second(torch_trainer, x, y, args.batch, args.repeats)
                best = {"ort": max(best["ort"], ort_rate), "torch": max(best["torch"], torch_rate)}
                print(
                    f"{name:10s} {manifest.num_parameters:9,d} {threads:7d} {ort_rate:14,.0f} "
                    f"{torch_rate:16,.0f} {ort_rate / torch_rate:9.2f}"
                )
            print(
                f"{name:10s} {'':9s} {'best':>7s} {best['ort']:14,.0f} {best['torch']:16,.0f} "
                f"{best['ort'] / best['torch']:9.2f}"
            )


if __name__ == "__main__":
    main()
