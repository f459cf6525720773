"""Re-Fed's per-sample importance G(x_i) = ||grad l(x_i)||^2: the last-layer closed form versus the exact norm.

LeNet is trained with ORT on all ten classes of the embedded digits' training split (1,347 samples), the setting of
a PIM at a task switch, which scores samples of classes it has trained on. AdamW (lr 3e-3) is used because plain
SGD leaves this LeNet on its initial loss plateau for several epochs, where every score is alike. After each epoch
(epoch 0 = the untrained model: Re-Fed's early emphasis weights the first PIM iterations most) both modes score
every training sample on both backends. Printed per backend: Spearman rank correlation between the two modes, the
overlap of their top 10 % (the samples a cache would keep), and each mode's time (best of --repeats, measured in
this run) with the ratio exact / last-layer.

A second table answers how the portable backend (plain onnxruntime) should compute "exact": its exported
per-sample gradient graph (vmap of the gradient over fixed chunks) against batch-of-one runs of its gradient graph,
on every zoo model from its seeded initial weights, with ORT Training's batch-of-one steps and torch.func's vmap as
references. Printed: samples/s of each, the ratio vmap / batch-of-one, and the largest relative difference between
the two portable ways.

    .venv/bin/python benchmarks/importance_modes.py [--epochs 2] [--repeats 3] [--threads 1] [--models lenet ...]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from math import ceil

import numpy as np
import torch
from scipy.stats import spearmanr

from edge_client.trainers.base import Trainer
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from models.export import export_registered
from models.zoo import REGISTRY

TOP_FRACTION = 0.1
EXACT_SAMPLES = {"resnet18_cifar": 32}  # samples scored per model in the second table; others DEFAULT_EXACT_SAMPLES
DEFAULT_EXACT_SAMPLES = 512


def timed_scores(trainer: Trainer, x: np.ndarray, y: np.ndarray, mode: str, repeats: int) -> tuple[np.ndarray, float]:
    """Scores and the best wall time of `repeats` runs after one warm-up run (the scores never change)."""
    scores = trainer.per_sample_grad_norms(x, y, mode)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.per_sample_grad_norms(x, y, mode)
        best = min(best, time.perf_counter() - start)
    return scores, best


def batch_of_one_norms(trainer: PortableTrainer, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """||grad||^2 of each sample from one run of the portable gradient graph per sample."""
    return np.array([float(np.sum(np.square(trainer.gradient(x[i : i + 1], y[i : i + 1])[1], dtype=np.float64)))
                     for i in range(len(y))])


def best_time(run: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls of `run` after one warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def compare_exact(models: list[str], repeats: int, threads: int) -> None:
    """The second table: the portable backend's two ways to the exact norms, per zoo model."""
    print(f"\nexact norms, {threads} thread(s), best of {repeats}: samples/s")
    print(f"{'model':>15s} {'n':>4s} {'portable vmap':>13s} {'portable b1':>11s} {'vmap/b1':>7s} "
          f"{'ort b1':>8s} {'torch vmap':>10s} {'vmap~b1 max rel':>15s}")
    for name in models:
        spec = REGISTRY[name]
        n = EXACT_SAMPLES.get(name, DEFAULT_EXACT_SAMPLES)
        rng = np.random.default_rng(0)
        x = rng.random((n, *spec.default_input_shape), dtype=np.float32)
        y = rng.integers(0, 10, n)
        with tempfile.TemporaryDirectory() as tmp:
            manifest = export_registered(name, 10, tmp, seed=0, backends=("portable", "ort", "torch"))
            portable = PortableTrainer(tmp, threads=threads)
            ort = OrtTrainer(tmp, threads=threads)
            torch_trainer = TorchTrainer(manifest)
            vmap = portable.per_sample_grad_norms(x, y, "exact")
            one = batch_of_one_norms(portable, x, y)
            times = [
                best_time(lambda: portable.per_sample_grad_norms(x, y, "exact"), repeats),
                best_time(lambda: batch_of_one_norms(portable, x, y), repeats),
                best_time(lambda: ort.per_sample_grad_norms(x, y, "exact"), repeats),
                best_time(lambda: torch_trainer.per_sample_grad_norms(x, y, "exact"), repeats),
            ]
            rates = [n / t for t in times]
            print(f"{name:>15s} {n:4d} {rates[0]:13,.0f} {rates[1]:11,.0f} {rates[0] / rates[1]:7.2f} "
                  f"{rates[2]:8,.0f} {rates[3]:10,.0f} {np.max(np.abs(vmap - one) / one):15.1e}")


def top_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Share of the k highest scores of `a` that are also among the k highest of `b`."""
    return len(np.intersect1d(np.argsort(-a)[:k], np.argsort(-b)[:k])) / k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op and torch threads")
    parser.add_argument("--models", nargs="+", default=list(REGISTRY), choices=list(REGISTRY),
                        help="zoo models of the second table")
    args = parser.parse_args()

    data = load_dataset("digits")
    x, y = data.x_train, data.y_train
    k = ceil(TOP_FRACTION * len(y))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = export_registered("lenet", data.num_classes, tmp, input_shape=data.input_shape, seed=0,
                                     backends=("portable", "ort", "torch"))
        trainer = OrtTrainer(tmp, optimizer="adamw", lr=3e-3, threads=args.threads)
        backends: dict[str, Trainer] = {
            "ort": trainer, "portable": PortableTrainer(tmp, threads=args.threads), "torch": TorchTrainer(manifest)
        }
        print(
            f"lenet ({manifest.num_parameters:,} parameters), digits train split: {len(y)} samples scored, "
            f"top-k k = {k}, best of {args.repeats}, {args.threads} thread(s)"
        )
        print(
            f"{'epoch':>5s} {'train acc':>9s} {'backend':>7s} {'spearman':>8s} {'top-k':>6s} "
            f"{'last-layer s':>12s} {'exact s':>8s} {'exact/last':>10s} {'vs ort max rel':>17s}"
        )
        rng = np.random.default_rng(0)
        for epoch in range(args.epochs + 1):
            if epoch:
                trainer.fit(x, y, epochs=1, batch_size=32, rng=rng)
            for follower in ("portable", "torch"):
                backends[follower].set_weights(trainer.get_weights())
            accuracy = trainer.evaluate(x, y).accuracy
            exact_scores = {}
            for name, backend in backends.items():
                last, last_time = timed_scores(backend, x, y, "last-layer", args.repeats)
                exact, exact_time = timed_scores(backend, x, y, "exact", args.repeats)
                exact_scores[name] = exact
                rho = spearmanr(exact, last).statistic
                agreement = (
                    f"{np.max(np.abs(exact - exact_scores['ort']) / exact_scores['ort']):17.1e}"
                    if name != "ort"
                    else ""
                )
                print(
                    f"{epoch:5d} {accuracy:9.3f} {name:>7s} {rho:8.3f} {top_overlap(exact, last, k):6.2f} "
                    f"{last_time:12.4f} {exact_time:8.3f} {exact_time / last_time:10.1f} {agreement}"
                )
    compare_exact(args.models, args.repeats, args.threads)


if __name__ == "__main__":
    main()
