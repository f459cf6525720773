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

With `--phases`: what a device does besides training, phase by phase, in rounds that train and in rounds that do
not. The same learners ("memory", so that a round that does not train reads nothing back), each round the global
weights set, one epoch trained (or not), a view made for a policy's hook, the state saved, an update of the trained
weights encoded for the wire and the learner idle, each phase's CPU time (its thread's) summed; rounds that train
and rounds that do not alternate after the warm-up. Printed: each phase's CPU us a learner-round both ways, and
their ratio: the work besides training costs what it does between two trainings (a fleet worker's every device
trains between two of its own phases), which its cost in a round of its own understates.

    .venv/bin/python benchmarks/learner_round.py [--model cnn1d] [--n 200] [--samples 3] [--rounds 5]
        [--repeats 3] [--phases]
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


# `--phases`: ONE's learners (made with the variant "memory"), their rounds timed phase by phase
_LEARNERS, _ROUNDS, _ = ONE.partition("def round_(number):")
assert _ROUNDS, "ONE no longer defines round_(number): PHASES takes its learners from what comes before it"
PHASES = _LEARNERS + """
from edgefil import wire
PHASE_NAMES = ("weights set", "training", "a view", "state saved", "update encoded", "idle")
spent = {trains: dict.fromkeys(PHASE_NAMES, 0.0) for trains in (True, False)}

def timed(trains, name, work):
    start = time.thread_time()
    result = work()
    spent[trains][name] += time.thread_time() - start
    return result

def round_(number, trains):
    for i, learner in enumerate(learners):
        timed(trains, "weights set", lambda: learner.trainer.set_weights(weights))
        if trains:
            timed(trains, "training", learner.train)
        timed(trains, "a view", learner.view)
        learner.state.round = number
        timed(trains, "state saved", lambda: learner.save(folder / str(i) / "state"))
        timed(trains, "update encoded", lambda: wire.encode_blob(
            "update", wire.weights_bytes(learner.trainer.get_weights()), device=f"d{i}", round=number, task=0,
            model="ab" * 32, num_samples=samples, attachments=[], label_counts=learner.state.label_counts,
            trained_counts=[], metrics={"loss": 0.5, "device_seconds": 0.01}))
        timed(trains, "idle", learner.idle)

for number in range(2):
    round_(number, True)
for trains in (True, False):
    spent[trains] = dict.fromkeys(PHASE_NAMES, 0.0)
for number in range(2, 2 + 2 * rounds):
    round_(number, number % 2 == 0)
print(json.dumps({"trains" if trains else "not": {name: cpu / (n * rounds) * 1e6 for name, cpu in phases.items()}
                  for trains, phases in spent.items()}))
"""


def phases(args: argparse.Namespace) -> None:
    """`--phases`: each phase's CPU in rounds that train and in rounds that do not (the module docstring)."""
    done = subprocess.run([sys.executable, "-c", PHASES, "memory", args.model, str(args.n), str(args.samples),
                           str(args.rounds)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"phases: exit {done.returncode}\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    print(f"{args.n} learners of {args.model}, {args.samples} samples each, portable backend, AdamW, state in memory "
          f"between rounds; {args.rounds} rounds that train and {args.rounds} that do not, alternated, after 2")
    print(f"{'phase':>16} {'CPU us, training between':>25} {'not':>8} {'ratio':>7}")
    for name, trained in result["trains"].items():
        alone = result["not"][name]
        ratio = f"{trained / alone:6.2f}x" if alone > 0 else "      -"
        print(f"{name:>16} {trained:>25.1f} {alone:>8.1f} {ratio}")


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
    parser.add_argument("--phases", action="store_true",
                        help="each phase's CPU in rounds that train and in rounds that do not")
    args = parser.parse_args()
    if args.phases:
        phases(args)
        return
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
