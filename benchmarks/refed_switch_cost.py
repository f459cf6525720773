"""Re-Fed's task-switch cost on a device: PIM training + importance scoring, as a multiple of one local epoch.

One client on the embedded digits (class-incremental, M = N_new + 10 % of the old data, as in
replay_policies.py): after task 0 is learned, task 1 arrives; we time one local training epoch on the store's
contents and Re-Fed's ranking of the old samples, for both importance modes, in the same run.

    .venv/bin/python benchmarks/refed_switch_cost.py [--pim-epochs 5] [--repeats 3]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from timing import best_time  # benchmarks/timing.py: scripts run from their folder

from edge_client.policies import RoundView, Samples
from edge_client.policies.refed import ReFed
from edge_client.trainers.ort import OrtTrainer
from firmware_sim.scenarios import preset
from models.export import export_registered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pim-epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = preset("digits-class", n_clients=1, seed=0).build()
    x_old, y_old = data.tasks[0].client_train(0)
    x_new, y_new = data.tasks[1].client_train(0)
    with tempfile.TemporaryDirectory() as tmp:
        export_registered("lenet", data.num_classes, Path(tmp), input_shape=data.input_shape, seed=0)
        trainer = OrtTrainer(tmp, optimizer="adamw", lr=1e-3)
        rng = np.random.default_rng(0)
        trainer.fit(x_old, y_old, epochs=10, batch_size=32, rng=rng)
        weights = trainer.get_weights()
        store_x, store_y = np.concatenate([x_old, x_new]), np.concatenate([y_old, y_new])
        epoch = best_time(lambda _: trainer.fit(store_x, store_y, epochs=1, batch_size=32, rng=rng), args.repeats)
        trainer.set_weights(weights)
        old = Samples(x_old, y_old, np.zeros(len(y_old), dtype=np.int64))
        ctx = RoundView.of_samples(trainer, weights, None, rng, batch_size=32)
        print(f"digits, LeNet, ORT: {len(y_old)} old samples to score, local epoch over {len(store_y)} samples "
              f"= {epoch * 1000:.0f} ms; PIM epochs {args.pim_epochs}")
        print(f"{'importance':12s} {'switch ms':>10s} {'x local epoch':>14s}")
        for mode in ("last-layer", "exact"):
            policy = ReFed(pim_epochs=args.pim_epochs, importance=mode)
            cost = best_time(lambda _: policy.rank(old, 100, ctx), args.repeats)
            print(f"{mode:12s} {cost * 1000:10.0f} {cost / epoch:14.1f}")


if __name__ == "__main__":
    main()
