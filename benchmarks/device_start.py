"""What building a virtual device costs a fleet worker, as the worker's devices add up: the CPU time of
`virtual_device(DeviceConfig.from_dict(...))` (config checks, the model's artifacts, the replay store's database,
the trainer), batch by batch, for one worker's share of a fleet of N (device k of every `--stride`, as a fleet of
`--stride` workers deals them). No broker: the devices are built, not run, so this is the part of a fleet's start
that the worker's one building thread (`Turns`) does alone, one device after another.

`--against DIR` runs the same in another checkout first (the same arguments; its own code), so a change is
compared in one run on one host. That checkout needs `Fleet.prepare` (from commit "review: Fleet.prepare" on; the
table of 2026-12-04 in docs/results.md was made by this file's first version, at deccbee, against d22eea1).

    .venv/bin/python benchmarks/device_start.py [--devices 100000] [--stride 24] [--batch 500] [--against DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(n: int, stride: int, batch: int, folder: Path) -> list[float]:
    """ms of CPU a device, for each batch of `batch` devices built in a row."""
    from fleet_resume import fleet_file

    from coordinator.broker import BrokerAddress
    from coordinator.preparation import Preparation
    from edge_client.config import DeviceConfig
    from edge_client.environment import Turns
    from edgefil.netloop import NetworkLoop
    from edgefil.settings import dump_toml
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig
    from firmware_sim.fleet_worker import limit_torch_threads, set_worker_allocator
    from firmware_sim.virtual_device import virtual_device

    (folder / "fleet.toml").write_text(dump_toml(fleet_file(n, 0, 1, 0.01)))
    fleet = Fleet(FleetConfig.load(folder / "fleet.toml"))
    _, artifacts = fleet.prepare(str(folder / "fleet.toml"), Preparation(fleet.config.out))
    # no broker runs: the devices are built, not connected (`_settings` reads only its address)
    fleet.broker = types.SimpleNamespace(address=BrokerAddress("127.0.0.1", 1))  # type: ignore[assignment]
    configs = [fleet.device_config(k, artifacts) for k in range(0, n, stride)]
    limit_torch_threads()
    set_worker_allocator()
    network, turns, devices, per_batch = NetworkLoop(name="device-start"), Turns(), [], []
    last = time.process_time()
    for k, raw in enumerate(configs, 1):
        devices.append(virtual_device(DeviceConfig.from_dict(dict(raw)), network, turns, None, stop_poll_s=None))
        if k % batch == 0:
            now = time.process_time()
            per_batch.append((now - last) / batch * 1000)
            last = now
    return per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--stride", type=int, default=24)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--against", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # a checkout's numbers (--against)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="device-start-") as folder:
        if args.json is not None:  # that checkout's code first on the path
            sys.path[:0] = [str(args.json), str(args.json / "benchmarks")]
            print(json.dumps(measure(args.devices, args.stride, args.batch, Path(folder))))
            return
        rows = {}
        if args.against is not None:
            done = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--json", str(args.against.resolve()), "--devices",
                 str(args.devices), "--stride", str(args.stride), "--batch", str(args.batch)], cwd=args.against,
                capture_output=True, text=True, check=True)
            rows[f"against ({args.against})"] = json.loads(done.stdout.strip().splitlines()[-1])
        rows["this checkout"] = measure(args.devices, args.stride, args.batch, Path(folder))
    print(f"ms of CPU to build a device, each batch of {args.batch} of one worker's {args.devices // args.stride} "
          f"(N = {args.devices}, every {args.stride}th):")
    for name, values in rows.items():
        print(f"  {name}: " + " ".join(f"{v:.1f}" for v in values)
              + f"  mean {statistics.mean(values):.1f}")
    if len(rows) == 2:
        before, after = (statistics.mean(v) for v in rows.values())
        print(f"  this checkout / against: {after / before:.2f}x")


if __name__ == "__main__":
    main()
