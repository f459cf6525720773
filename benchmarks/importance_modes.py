"""Re-Fed's per-sample importance G(x_i) = ||grad l(x_i)||^2: the last-layer closed form versus the exact norm.

LeNet is trained with ORT on all ten classes of the embedded digits' training split (1,347 samples), the setting of
a PIM at a task switch, which scores samples of classes it has trained on. AdamW (lr 3e-3) is used because plain
SGD leaves this LeNet on its initial loss plateau for several epochs, where every score is alike. After each epoch
(epoch 0 = the untrained model: Re-Fed's early emphasis weights the first PIM iterations most) both modes score
every training sample on both backends. Printed per backend: Spearman rank correlation between the two modes, the
overlap of their top 10 % (the samples a cache would keep), and each mode's time (best of --repeats, measured in
this run) with the ratio exact / last-layer.

    .venv/bin/python benchmarks/importance_modes.py [--epochs 2] [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from math import ceil

import numpy as np
import torch
from scipy.stats import spearmanr

from edge_client.trainers.base import Trainer
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from models.export import export_registered

TOP_FRACTION = 0.1


def timed_scores(trainer: Trainer, x: np.ndarray, y: np.ndarray, mode: str, repeats: int) -> tuple[np.ndarray, float]:
    """Scores and the best wall time of `repeats` runs after one warm-up run (the scores never change)."""
    scores = trainer.per_sample_grad_norms(x, y, mode)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.per_sample_grad_norms(x, y, mode)
        best = min(best, time.perf_counter() - start)
    return scores, best


def top_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Share of the k highest scores of `a` that are also among the k highest of `b`."""
    return len(np.intersect1d(np.argsort(-a)[:k], np.argsort(-b)[:k])) / k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op and torch threads")
    args = parser.parse_args()

    data = load_dataset("digits")
    x, y = data.x_train, data.y_train
    k = ceil(TOP_FRACTION * len(y))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = export_registered("lenet", data.num_classes, tmp, input_shape=data.input_shape, seed=0)
        trainer = OrtTrainer(tmp, optimizer="adamw", lr=3e-3, threads=args.threads)
        backends: dict[str, Trainer] = {"ort": trainer, "torch": TorchTrainer(manifest)}
        print(
            f"lenet ({manifest.num_parameters:,} parameters), digits train split: {len(y)} samples scored, "
            f"top-k k = {k}, best of {args.repeats}, {args.threads} thread(s)"
        )
        print(
            f"{'epoch':>5s} {'train acc':>9s} {'backend':>7s} {'spearman':>8s} {'top-k':>6s} "
            f"{'last-layer s':>12s} {'exact s':>8s} {'exact/last':>10s} {'ort~torch max rel':>17s}"
        )
        rng = np.random.default_rng(0)
        for epoch in range(args.epochs + 1):
            if epoch:
                trainer.fit(x, y, epochs=1, batch_size=32, rng=rng)
            backends["torch"].set_weights(trainer.get_weights())
            accuracy = trainer.evaluate(x, y).accuracy
            exact_scores = {}
            for name, backend in backends.items():
                last, last_time = timed_scores(backend, x, y, "last-layer", args.repeats)
                exact, exact_time = timed_scores(backend, x, y, "exact", args.repeats)
                exact_scores[name] = exact
                rho = spearmanr(exact, last).statistic
                agreement = (
                    f"{np.max(np.abs(exact - exact_scores['ort']) / exact_scores['ort']):17.1e}"
                    if name == "torch"
                    else ""
                )
                print(
                    f"{epoch:5d} {accuracy:9.3f} {name:>7s} {rho:8.3f} {top_overlap(exact, last, k):6.2f} "
                    f"{last_time:12.4f} {exact_time:8.3f} {exact_time / last_time:10.1f} {agreement}"
                )


if __name__ == "__main__":
    main()
