"""Where a virtual device's memory goes: the host memory of each part a fleet worker holds per device.

A fleet worker hosts its devices as objects in one process; `fleet_scale.py` and `vs_flower.py` measure what one
more device costs in all (about 1.2 MB). This takes the device apart: each part below is built `--n` times in a
fresh process of its own (so no part reuses memory another freed), and its cost is that process's PSS growth
(/proc/self/smaps_rollup) over `--n`, in KiB:

  trainer-<backend>          the device's trainer on the model's artifacts, with the weights set from a read-only
                             global model shared by all (what a device that has not trained holds)
  trainer-<backend>-trained  the same after one training step (optimizer state allocated: what a device holds once
                             it has trained)
  store                      the replay store holding `--samples` samples, between uses (its SQLite connection
                             let go, as a device's is between rounds)
  link                       the MQTT link (paho client, inbox, callbacks), not connected, on a shared network loop
  thread                     an idle thread (the device's own), blocked on an event
  device                     the whole device as a fleet worker builds it (`firmware_sim.virtual_device`, the
                             fleet's trainer and store settings, its share of the one-task digits scenario), not
                             connected: trainer, store, learner, policy, link and bookkeeping together
  device-trained             the same after it took its share and trained one round on it (one epoch), and saved
                             its state, as a device does in a round (a fleet's `between_rounds = "disk"`: the
                             weights and optimiser state saved and let go)
  device-trained-kept        the same with `between_rounds = "memory"` (a device's default: kept in memory)
  device-trained-own-thread  device-trained, each device built and trained on a thread of its own that stays
                             (as a fleet worker's devices were before its turns had a thread of their own)
  device-trained-turns       the same as a fleet worker hosts them now: each device's thread stays, its building,
                             task start and training run on the worker's one turns thread
                             (`edge_client.environment.Turns`); the difference is what running deep native work
                             on each device's thread kept: its stack's depth and the per-thread buffers

What `device` has beyond the sum of its parts is the learner, the policy and the device's bookkeeping; what a
fleet's marginal cost has beyond `device` is the thread, the connected socket and the broker's side. The model's parameter count is printed
beside them: one float32 copy of the parameters is that times 4 bytes.

    .venv/bin/python benchmarks/device_memory.py [--model lenet] [--backends portable,ort,torch] [--n 200]
        [--samples 50]
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

INPUT_SHAPES = {"lenet": (1, 8, 8), "cnn1d": (1, 40), "mlp": (1, 8, 8), "small_cnn": (3, 32, 32)}
NUM_CLASSES = 10
RESULT = "RESULT "


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def builder(component: str, artifacts: Path, samples: int, folder: Path) -> Callable[[int], Any]:
    """What one device's `component` is, as a function of the device's index."""
    from models.manifest import load_manifest

    manifest = load_manifest(artifacts)
    shape = tuple(manifest.input_shape)
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(manifest.num_parameters) * 0.01).astype(np.float32)
    weights.flags.writeable = False  # as a device's global model is (edge_client.device.shared_model)
    x = rng.random((8, *shape), dtype=np.float32)
    y = np.arange(8, dtype=np.int64) % NUM_CLASSES
    mask = np.ones(NUM_CLASSES, np.float32)
    if component.startswith("trainer-"):
        from edge_client.config import TrainerSettings
        from edge_client.trainers.choice import make_trainer

        backend, _, trained = component.removeprefix("trainer-").partition("-")
        settings = TrainerSettings(backend=backend, optimizer="adamw", lr=1e-3)

        def trainer(i: int) -> Any:
            built = make_trainer(settings, artifacts)
            built.set_weights(weights)
            if trained:
                built.train_step(x, y, mask)
            return built

        return trainer
    if component == "store":
        from edge_client.budget import Budget
        from edge_client.store import ReplayStore

        batch = rng.random((samples, *shape), dtype=np.float32)
        labels = np.arange(samples, dtype=np.int64) % NUM_CLASSES

        def store(i: int) -> Any:
            opened = ReplayStore(folder / f"store-{i}", Budget(max_samples=samples), shape)
            opened.insert(batch, labels, 0)
            opened.release()  # as a device holds it between rounds (Learner.save)
            return opened

        return store
    if component == "link":
        from edgefil.link import BrokerSettings, Link
        from edgefil.netloop import NetworkLoop

        loop = NetworkLoop()
        return lambda i: Link(BrokerSettings(), client_id=f"device-{i}", subscriptions=["a/b", "c/d"], network=loop)
    if component in ("device", "device-trained", "device-trained-kept"):
        return whole_device(artifacts, folder, trained=component != "device",
                            between_rounds="memory" if component.endswith("kept") else "disk")
    if component in ("device-trained-own-thread", "device-trained-turns"):
        return whole_device(artifacts, folder, trained=True, between_rounds="disk",
                            hosting=component.removeprefix("device-trained-"))
    if component == "thread":
        def thread(i: int) -> Any:
            stop = threading.Event()
            started = threading.Thread(target=stop.wait, daemon=True)
            started.start()
            return started, stop

        return thread
    raise ValueError(f"unknown component {component!r}")


def whole_device(artifacts: Path, folder: Path, trained: bool, between_rounds: str,
                 hosting: str | None = None) -> Callable[[int], Any]:
    """A fleet's device, as `firmware_sim.fleet_worker` builds it, from the config a fleet gives it (its
    `between_rounds` as the fleet sets it, "disk", unless told otherwise). `hosting`: None, built and trained in
    this (the main) thread; "own-thread", each device built and trained on a thread of its own that then stays
    (as a fleet worker's devices did before their turns had a thread of their own); "turns", as a fleet worker
    hosts it now: each device on a thread of its own, its building, task start and training on one `Turns` thread
    shared by all."""
    from dataclasses import asdict

    from edge_client.config import DeviceConfig
    from edge_client.environment import Turns
    from edge_client.stream import Chunk
    from edgefil.netloop import NetworkLoop
    from firmware_sim.fleet_config import FleetConfig
    from firmware_sim.virtual_device import virtual_device

    loop = NetworkLoop()
    scenario = {"preset": "digits-class", "n_tasks": 1, "n_clients": 100}  # fleet_scale's, ~3 samples a device
    turns = Turns() if hosting == "turns" else None

    def device(i: int) -> Any:
        config = DeviceConfig.from_dict({
            "device_id": f"dev-{i + 1}", "fleet": "memory", "artifacts": str(artifacts),
            "state_dir": str(folder / f"dev-{i + 1}"), "broker": {"host": "127.0.0.1", "port": 1883},
            "trainer": asdict(FleetConfig.trainer), "store": {"max_samples": 50}, "policy": {"name": "random"},
            "learner": {"epochs": 1, "between_rounds": between_rounds},
            "data": {"scenario": scenario, "client": i % 100},
        })
        built = turns.run(lambda: virtual_device(config, loop, turns)) if turns else virtual_device(config, loop)
        if trained:
            x, y = built.source.task_data(0)
            built.environment.turn(lambda: built.learner.observe(Chunk(x, y, 0)))
            built.environment.turn(built.learner.train)
            built.learner.finish_round()
            built.learner.save(built.config.state_dir)
            built.learner.idle()  # as the device does once it has uploaded
        return built

    if hosting is None:
        return device

    def on_its_thread(i: int) -> Any:
        held: list[Any] = []
        ready, stop = threading.Event(), threading.Event()

        def run() -> None:
            held.append(device(i))
            ready.set()
            stop.wait()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        ready.wait()
        return held[0], thread, stop

    return on_its_thread


def measure(component: str, artifacts: Path, n: int, samples: int) -> float:
    """KiB of PSS one instance of `component` adds (in this process: run it in a fresh one)."""
    with tempfile.TemporaryDirectory() as folder:
        build = builder(component, artifacts, samples, Path(folder))
        kept = [build(-1)]  # the first builds what all of them share (sessions, imports), not counted
        gc.collect()
        before = pss_bytes()
        kept.extend(build(i) for i in range(n))
        gc.collect()
        return (pss_bytes() - before) / n / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lenet", choices=sorted(INPUT_SHAPES))
    parser.add_argument("--backends", default="portable,ort,torch")
    parser.add_argument("--n", type=int, default=200, help="instances of each part")
    parser.add_argument("--samples", type=int, default=50, help="samples in each replay store")
    parser.add_argument("--component", help=argparse.SUPPRESS)  # one part, in a process of its own
    parser.add_argument("--artifacts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.component:
        print(RESULT + json.dumps(measure(args.component, Path(args.artifacts), args.n, args.samples)))
        return
    from models.export import export_registered, exportable_backends
    from models.manifest import load_manifest

    backends = [b for b in args.backends.split(",") if b in exportable_backends()]
    with tempfile.TemporaryDirectory() as folder:
        artifacts = Path(folder) / "artifacts"
        export_registered(args.model, NUM_CLASSES, artifacts, INPUT_SHAPES[args.model], seed=0,
                          backends=tuple(backends), cache=True)
        parameters = load_manifest(artifacts).num_parameters
        print(f"{args.model} {INPUT_SHAPES[args.model]}: {parameters} parameters, one float32 copy "
              f"{parameters * 4 / 1024:.1f} KiB; each part built {args.n} times in a fresh process, KiB of PSS each")
        parts = [f"trainer-{b}{trained}" for b in backends for trained in ("", "-trained")]
        for part in (*parts, "store", "link", "thread", "device", "device-trained", "device-trained-kept",
                     "device-trained-own-thread", "device-trained-turns"):
            done = subprocess.run([sys.executable, __file__, "--component", part, "--artifacts", str(artifacts),
                                   "--n", str(args.n), "--samples", str(args.samples)],
                                  capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
            if done.returncode or not lines:
                print(f"  {part:28s} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            kib = json.loads(lines[-1][len(RESULT):])
            print(f"  {part:28s} {kib:8.1f} KiB  ({kib * 1024 / (parameters * 4):4.1f} parameter copies)", flush=True)


if __name__ == "__main__":
    main()
