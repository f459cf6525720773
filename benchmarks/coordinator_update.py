"""The coordinator's work an update, alone: a streamed round's inbox (the message's checks and reassembly), the
guard's bounds at their defaults and FedAvg's fold, against the same round with every bound off (`OFF`: plain
aggregation) and with the defaults less Krum selection (`fleet_scale.py`'s and `vs_flower.py`'s guard: FedAvg over
every update, as Flower's side does), timed in the same run.

A fleet's coordinator spends this on each device's update of a round (issue 57: 0.38-0.5 ms of CPU an update in a
1000-device fleet, beside the devices' 0.7 ms of training). The updates here are what a fleet's devices send: a
registered model's weights (MNIST-1D's cnn1d by default, 5210 values) near one global model, each trained on
`--samples` samples drawn from the task's `--task-classes` classes and claiming those (`trained_counts`, as a device
reports them; `fleet_scale.py --per-device 3`: 3 samples of a task of all 10 classes), encoded on the wire once,
then fed chunk by chunk through a fresh `Inbox` and `RoundAggregate` (with the model's head layout) per repeat, in
one thread: the CPU time an update, the median of the repeats, each bound setting in turn.

    .venv/bin/python benchmarks/coordinator_update.py [--model cnn1d] [--updates 3000] [--repeats 5] \
        [--samples 3] [--task-classes 10]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from coordinator.aggregation import RoundAggregate
from coordinator.containment import ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.guard_settings import OFF
from coordinator.inbox import Inbox, Update
from coordinator.influence import HeadLayout
from coordinator.strategies import make_strategy
from edgefil import topics, wire
from models.export import export_registered
from models.manifest import Manifest, load_manifest

FLEET = "bench"
INPUT_SHAPES = {"cnn1d": (1, 40), "lenet": (1, 28, 28), "mlp": (64,)}
CLASSES = 10


def messages(manifest: Manifest, count: int, samples: int, task_classes: int, seed: int = 0
             ) -> tuple[np.ndarray, list[tuple[str, list[bytes]]]]:
    """The global model and `count` devices' update messages on the wire (chunks by topic), each device's
    `samples` drawn from the task's first `task_classes` classes."""
    rng = np.random.default_rng(seed)
    size = manifest.num_parameters
    global_weights = rng.standard_normal(size, dtype=np.float32) * np.float32(0.1)
    encoded = []
    for k in range(count):
        weights = global_weights + rng.standard_normal(size, dtype=np.float32) * np.float32(0.01)
        counts = np.bincount(rng.integers(0, task_classes, samples), minlength=manifest.num_classes).tolist()
        blob = wire.encode_blob(
            "update", wire.weights_bytes(weights), device=f"d{k}", round=1, task=0, model="ab" * 32,
            num_samples=sum(counts), attachments=[], label_counts=counts,
            trained_counts=[[0, c, n] for c, n in enumerate(counts) if n],
            metrics={"loss": 0.5, "device_seconds": 0.01})
        encoded.append((topics.from_device(FLEET, f"d{k}", "update"), blob.chunks))
    return global_weights, encoded


def cpu_us_an_update(manifest: Manifest, global_weights: np.ndarray, encoded: list[tuple[str, list[bytes]]],
                     bounds: UpdateBounds) -> float:
    """One round of every update through a fresh inbox and aggregate: CPU microseconds an update."""
    devices = {f"d{k}" for k in range(len(encoded))}
    inbox = Inbox(FLEET, devices, "m" * 64, manifest.num_parameters)
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters), bounds,
                               global_weights, counters, 1 << 30, heads=HeadLayout.of(manifest.parameters))
    started = time.process_time()
    for topic, chunks in encoded:
        for chunk in chunks:
            event = inbox.accept(topic, chunk)
            if isinstance(event, Update):
                aggregate.add(event.for_strategy())
    aggregate.close()
    return (time.process_time() - started) / len(encoded) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn1d", choices=sorted(INPUT_SHAPES))
    parser.add_argument("--updates", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=3, help="a device's samples (default 3)")
    parser.add_argument("--task-classes", type=int, default=CLASSES, help="the classes they are drawn from")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / args.model
        export_registered(args.model, CLASSES, out, INPUT_SHAPES[args.model], seed=0, backends=("torch",))
        manifest = load_manifest(out)
    global_weights, encoded = messages(manifest, args.updates, args.samples, args.task_classes)
    settings = {"default bounds": UpdateBounds(), "without Krum": UpdateBounds(krum_share=0.0),
                "bounds off": UpdateBounds(**OFF)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, bounds in settings.items():  # alternated: the host's speed weighs on both alike
            times[name].append(cpu_us_an_update(manifest, global_weights, encoded, bounds))
    plain = statistics.median(times["bounds off"])
    print(f"{args.model}: {manifest.num_parameters} values, {args.updates} updates of {args.samples} samples of "
          f"{args.task_classes} classes, {args.repeats} repeats (CPU us an update: the median, each repeat; the "
          "bounds' part: the median less the plain round's)")
    for name in settings:
        median = statistics.median(times[name])
        print(f"  {name:15s} {median:7.1f}  bounds' part {median - plain:6.1f}  ({median / plain:.2f}x)  each: "
              + " ".join(f"{t:.0f}" for t in times[name]))


if __name__ == "__main__":
    main()
