"""What a fleet worker's torch threads cost: FedCIL's ACGAN steps (the policy's after-training update) by several
hosted devices at once, in a worker process spawned from a parent that had loaded torch (as every benchmark's are).

Three ways, each in a fresh spawned process, one after the other in the same run:
- `pool per core`: torch's default intra-op pool (one thread per core), the devices' updates in their own threads:
  what a benchmark's workers ran before bc852c5 (OMP_NUM_THREADS was set after torch had read it);
- `one thread`: `fleet_worker.limit_torch_threads()` (bc852c5), still in the devices' own threads;
- `one thread, turns`: and each update in the device's turn on the worker's turns thread (`edge_client.environment.
  Turns`, 2b6ed55), as training is.
Printed per way: the worker's CPU seconds and wall seconds for the same steps, and their ratios to the first. The
host's load is part of what is measured (OpenMP's waiting threads spin against whatever else runs), so compare the
ratios of one run, not runs with each other.

    .venv/bin/python benchmarks/worker_threads.py [--devices 4] [--steps 50] [--width 8]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from typing import Any

import torch  # loaded before the workers are spawned, as a benchmark script's parent has it

WAYS = ("pool per core", "one thread", "one thread, turns")


def acgan_update(width: int, steps: int, seed: int) -> None:
    """`steps` ACGAN steps of FedCIL's shape (models/acgan.py; 28x28, 10 classes, batch 32) from `seed`."""
    from models.acgan import AcganSpec, acgan_step, build_acgan

    generator, discriminator = build_acgan(AcganSpec((1, 28, 28), 10, 16, width), seed)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    noise = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 1, 28, 28, generator=noise), torch.randint(0, 10, (32,), generator=noise)
    for _ in range(steps):
        acgan_step(generator, discriminator, opt_g, opt_d, x, y, torch.randn(32, 16, generator=noise), y)


def worker(way: str, devices: int, steps: int, width: int, out: Any) -> None:
    """One worker's devices, each one update, all started at once; sends (CPU s, wall s) of the whole."""
    from edge_client.environment import Turns
    from firmware_sim.fleet_worker import limit_torch_threads

    if way != "pool per core":
        limit_torch_threads()
    turns = Turns() if way == "one thread, turns" else None
    acgan_update(width, 2, 99)  # warm-up: kernels chosen, pages touched
    cpu, wall = time.process_time(), time.perf_counter()

    def device(seed: int) -> None:
        if turns is None:
            acgan_update(width, steps, seed)
        else:
            turns.run(lambda: acgan_update(width, steps, seed))

    threads = [threading.Thread(target=device, args=(seed,)) for seed in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.send((time.process_time() - cpu, time.perf_counter() - wall, torch.get_num_threads()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="devices updating at once in the worker")
    parser.add_argument("--steps", type=int, default=50, help="ACGAN steps per device")
    parser.add_argument("--width", type=int, default=8, help="the ACGAN's width (8: Table 1's fedcil-bytes)")
    args = parser.parse_args()
    spawn = mp.get_context("spawn")
    results: dict[str, tuple[float, float, int]] = {}
    for way in WAYS:
        receive, send = spawn.Pipe(duplex=False)
        process = spawn.Process(target=worker, args=(way, args.devices, args.steps, args.width, send))
        process.start()
        results[way] = receive.recv()
        process.join()
    cpu0, wall0, _ = results[WAYS[0]]
    print(f"{args.devices} devices x {args.steps} ACGAN steps (width {args.width}) in one spawned worker")
    print(f"  {'way':<20} {'torch threads':>13} {'CPU s':>8} {'wall s':>8} {'CPU ratio':>10} {'wall ratio':>10}")
    for way, (cpu, wall, threads) in results.items():
        print(f"  {way:<20} {threads:>13} {cpu:>8.2f} {wall:>8.2f} {cpu / cpu0:>10.2f} {wall / wall0:>10.2f}")


if __name__ == "__main__":
    main()
