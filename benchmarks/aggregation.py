"""Aggregation throughput: FedAvg's fold of device updates versus a plain memory copy of the same bytes.

For each number of clients and model size, FedAvg (weighted) aggregates read-only float32 updates made as the
network delivers them (np.frombuffer over bytes). The baseline, timed in the same run, is np.copyto of each update
into one update-sized destination: the same number of update-sized reads. The fold reads each update once and
reads and writes a float64 total (so its result does not depend on the order updates arrive in): 20 bytes of
memory traffic per 4-byte value against the copy's 8, so a memory-bound fold runs at about 0.4x copy speed
(a float32 total, before the coordinator streamed, ran near copy speed, but summed in device order).
Updates come from a pool of distinct buffers bounded in bytes (1000 clients x 11M parameters is 44 GB); every
timed call takes the pool's next buffers, so each update is a buffer not touched since many calls ago whenever the
pool is larger than the last-level cache. GB/s counts update bytes (4 per parameter). On cuda the FedAvg time
includes each update's host-to-device copy (through the fold's two pinned buffers and copy stream) and a final
synchronize; the copy baseline stays on the host, and an `h2d GB/s` column gives the host-to-device bandwidth of
the same bytes from pinned memory (the transfer alone, the bound a fold that copies every update can reach). The
optional last column is the naive torch.stack(updates).mul(c).sum(0), run only where the stack is small.

FedAvg is timed at torch's default thread count and at one thread: a parallel region waits for its slowest thread,
so on a machine whose cores are shared with other work a descheduled thread can stall every fold for a scheduler
tick, while one thread per fold is barely slower when the machine is quiet.

    .venv/bin/python benchmarks/aggregation.py [--device cpu|cuda|auto] [--quick] [--pool-gb 1.5] [--threads 2,1]
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import numpy as np
import torch
from timing import best_time  # benchmarks/timing.py: scripts run from their folder

from coordinator.compute import as_tensor, resolve_device
from coordinator.strategies import ClientUpdate
from coordinator.strategies.fedavg import FedAvg

CLIENTS = [10, 100, 1000]
SIZES = [(100_000, "100K"), (1_000_000, "1M"), (11_000_000, "11M")]
STACK_LIMIT = 1_000_000_000  # bytes a naive stack may hold (it allocates twice that)
CELL_BYTES = 4_000_000_000  # update bytes per cell and method, spread over the repeats


class Pool:
    """Distinct read-only update buffers, handed out in turn."""

    def __init__(self, size: int, count: int, rng: np.random.Generator) -> None:
        self.buffers = [np.frombuffer(rng.random(size, dtype=np.float32).tobytes(), dtype="<f4") for _ in range(count)]
        self.next = 0

    def take(self, count: int) -> list[np.ndarray]:
        taken = [self.buffers[(self.next + k) % len(self.buffers)] for k in range(count)]
        self.next = (self.next + count) % len(self.buffers)
        return taken


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return models[0] if models else platform.machine()


def stack_mean(weights: list[np.ndarray], coefficients: list[float], device: torch.device) -> torch.Tensor:
    c = torch.tensor(coefficients, dtype=torch.float32, device=device)
    return torch.stack([as_tensor(w, device) for w in weights]).mul(c[:, None]).sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--quick", action="store_true", help="10 and 100 clients, 100K and 1M parameters")
    parser.add_argument("--pool-gb", type=float, default=1.5, help="bound on the pool of distinct update buffers")
    parser.add_argument("--threads", default=None,
                        help="comma-separated torch thread counts to time FedAvg with (default: torch's, then 1)")
    args = parser.parse_args()

    device = resolve_device(args.device)
    default_threads = torch.get_num_threads()
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({default_threads, 1}, reverse=True))
    clients_list, sizes = (CLIENTS[:2], SIZES[:2]) if args.quick else (CLIENTS, SIZES)
    pool_bytes = int((0.1 if args.quick else args.pool_gb) * 1e9)
    cell_bytes = CELL_BYTES // 20 if args.quick else CELL_BYTES
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    strategy = FedAvg(weighted=True, device=device)

    print(f"FedAvg (weighted) on {device} ({device_name(device)}); baseline np.copyto on the host, one thread")
    print(f"updates cycle through a pool of distinct read-only buffers of at most {pool_bytes / 1e9:.2f} GB "
          f"(each update a buffer not used for the longest time); best of the repeats shown")
    print(f"GB/s = update bytes / s; xcopy = FedAvg GB/s / copy GB/s; Tn = n torch threads; "
          f"stack = naive torch.stack baseline at {default_threads} threads")
    fold_heads = "".join(f" {f'FedAvg ms T{t}':>12s} {f'GB/s T{t}':>9s} {f'xcopy T{t}':>9s}" for t in threads)
    h2d_head = f" {'h2d GB/s':>9s}" if device.type == "cuda" else ""
    print(f"{'clients':>7s} {'params':>6s} {'pool':>5s} {'reps':>4s}{fold_heads} {'copy GB/s':>9s}{h2d_head} "
          f"{'stack GB/s':>10s}")
    for size, label in sizes:
        update_bytes = 4 * size
        pool = Pool(size, max(1, min(max(clients_list), pool_bytes // update_bytes)), rng)
        global_weights = torch.zeros(size, dtype=torch.float32, device=device)
        destination = np.empty(size, dtype=np.float32)
        for clients in clients_list:
            total = clients * update_bytes
            repeats = max(2, min(10, cell_bytes // total))
            samples = rng.integers(1, 500, clients).tolist()
            fold_s = {}
            for t in threads:
                rounds = [[ClientUpdate(f"d{k}", w, n) for k, (w, n) in enumerate(zip(pool.take(clients), samples))]
                          for _ in range(repeats)]

                def fold(k: int) -> None:
                    strategy.aggregate(global_weights, rounds[k])
                    sync()

                torch.set_num_threads(t)
                fold_s[t] = best_time(fold, repeats)
            torch.set_num_threads(default_threads)
            copies = [pool.take(clients) for _ in range(repeats)]

            def copy(k: int) -> None:
                for w in copies[k]:
                    np.copyto(destination, w)

            copy_s = best_time(copy, repeats)
            stack = "-"
            if total <= STACK_LIMIT:
                coefficients = [n / sum(samples) for n in samples]
                stacks = [pool.take(clients) for _ in range(repeats)]

                def naive(k: int) -> None:
                    stack_mean(stacks[k], coefficients, device)
                    sync()

                stack = f"{total / best_time(naive, repeats) / 1e9:.2f}"
            h2d = ""
            if device.type == "cuda":
                pinned = torch.empty(size, dtype=torch.float32, pin_memory=True)
                pinned.numpy()[:] = pool.buffers[0]
                target = torch.empty(size, dtype=torch.float32, device=device)

                def transfer(k: int) -> None:
                    for _ in range(clients):
                        target.copy_(pinned, non_blocking=True)
                    sync()

                h2d = f" {total / best_time(transfer, repeats) / 1e9:9.2f}"
            folds = "".join(f" {fold_s[t] * 1e3:12.1f} {total / fold_s[t] / 1e9:9.2f} {copy_s / fold_s[t]:9.2f}"
                            for t in threads)
            print(f"{clients:7d} {label:>6s} {len(pool.buffers):5d} {repeats:4d}{folds} {total / copy_s / 1e9:9.2f}"
                  f"{h2d} {stack:>10s}")


if __name__ == "__main__":
    main()
