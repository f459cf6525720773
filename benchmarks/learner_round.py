"""A learner's round, whole, by where it keeps things between rounds (`[learner] between_rounds`).

`--n` learners in one process, each as a device's is in a round (the global weights set, one epoch on its store,
the policy's finish, its state saved, idle until the next round), `--samples` samples each on `--model` with the
portable backend and AdamW, the round's writes without syncs as in a fleet's worker (edgefil.durable
`power_loss_safe` off). Two warm-up rounds (the first stores the task's samples and creates the state's slots),
then `--rounds` measured. Each variant runs in a fresh process, the variants alternated, best of `--repeats`:

  memory         `between_rounds = "memory"`, a device's default: weights, optimiser state and the store's
                 database connection kept from round to round
  memory, let go the same, with the store's connection let go at every idle (what "memory" did before the
                 connection stayed with it): what keeping the connection saves
  disk           `between_rounds = "disk"`, a fleet's default: weights and optimiser state saved and let go, and
                 the connection with them

Printed: CPU ms a learner-round, the same against "memory", and the PSS (/proc/self/smaps_rollup) each learner
adds, its trainer, store and state included, after the rounds.

    .venv/bin/python benchmarks/learner_round.py [--model cnn1d] [--n 200] [--samples 3] [--rounds 5]
        [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("memory", "memory, let go", "disk")

ONE = """
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
from edge_client.budget import Budget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import make_policy
from edge_client.store import ReplayStore
from edge_client.trainers.portable import PortableTrainer
from edgefil.durable import set_power_loss_safe
from models.export import export_registered
sys.path.insert(0, "benchmarks")
from device_memory import pss_bytes

variant, model, n, samples, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
set_power_loss_safe(False)
folder = Path(tempfile.mkdtemp())
artifacts = folder / "artifacts"
export_registered(model, 10, artifacts, seed=0, backends=("portable",), cache=True)
rng = np.random.default_rng(0)
start = pss_bytes()
learners = []
for i in range(n):
    trainer = PortableTrainer(artifacts, optimizer="adamw", lr=3e-3)
    shape = trainer.manifest.input_shape
    store = ReplayStore(folder / str(i) / "store", Budget(50), sample_shape=shape)
    learner = Learner(trainer, store, make_policy("random"),
                      LearnerConfig(between_rounds="disk" if variant == "disk" else "memory"), seed=0)
    learner.start_task(0, rng.standard_normal((samples, *shape)).astype(np.float32), rng.integers(0, 10, samples))
    learners.append(learner)
weights = learners[0].trainer.get_weights()

def round_(number):
    for i, learner in enumerate(learners):
        learner.trainer.set_weights(weights)
        learner.train()
        learner.finish_round()
        learner.state.round = number
        learner.save(folder / str(i) / "state")
        learner.idle()
        if variant == "memory, let go":
            learner.store.release()

for number in range(2):
    round_(number)
cpu = time.process_time()
for number in range(2, 2 + rounds):
    round_(number)
cpu = time.process_time() - cpu
print(json.dumps({"ms": cpu / (n * rounds) * 1e3, "kib": (pss_bytes() - start) / n / 1024}))
"""


def measure(variant: str, args: argparse.Namespace) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", ONE, variant, args.model, str(args.n), str(args.samples),
                           str(args.rounds)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant}: exit {done.returncode}\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn1d")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            got = measure(variant, args)
            if variant not in best or got["ms"] < best[variant]["ms"]:
                best[variant] = got
    print(f"{args.n} learners of {args.model}, {args.samples} samples each, portable backend, AdamW; "
          f"{args.rounds} rounds after 2; best of {args.repeats}, variants alternated, each in a fresh process")
    print(f"{'between rounds':>16} {'CPU ms a round':>15} {'/ memory':>9} {'KiB a learner':>14}")
    for variant in VARIANTS:
        got = best[variant]
        print(f"{variant:>16} {got['ms']:>15.3f} {got['ms'] / best['memory']['ms']:>8.2f}x {got['kib']:>14.1f}")


if __name__ == "__main__":
    main()
