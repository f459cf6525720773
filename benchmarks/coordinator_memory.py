"""The coordinator's peak memory for one round of 100 vs 1000 updates of one model: folding rules stream, holding
rules are bounded.

Each cell is a fresh process holding the coordinator's side of a round: an Inbox (chunk reassembly, its checks,
the blob hash) and the round's RoundAggregate (the guard's bounds, then the rule), fed the updates' chunks as a
device would send them. A producer process makes the updates (a random model per device, encoded with
wire.encode_blob as a device does) and writes their chunks into a pipe, `--concurrent` devices' chunks
interleaved, as uploads that overlap on the broker arrive; the coordinator process reads them, so its memory is
its own. Peak is the process's peak RSS above its RSS just before the round, in MiB.

Beside the memory, each cell gives the coordinator process's CPU per update (its user and system time from the
round's first chunk to its close, over the updates used: the gate's checks and reassembly, the guard's bounds, the
fold) and the round's close time (the bounds and the rule on what the round held, then the result): what one
coordinator process costs as N grows, the baseline that issue 60's inbox workers are to divide. The producer's
encoding runs in its own process and is not counted.

Rules: `fedavg` (folds: the round's memory should not grow with N), `fedavg-held` (the baseline: the same rule
made to hold the whole round without a bound, as the coordinator did before it streamed), `median` (needs every update: holds them up
to `--max-held-mib`, refusing the rest as `held-limit`).

    .venv/bin/python benchmarks/coordinator_memory.py [--parameters 1000000] [--counts 100,1000] [--concurrent 8]
        [--rules fedavg,fedavg-held,median]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from coordinator.aggregation import RoundAggregate
from coordinator.containment import ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.inbox import Inbox, Update
from coordinator.strategies import AggregateResult, ClientUpdate, Strategy, make_strategy
from coordinator.strategies.fedavg import FedAvg
from edgefil import topics, wire

FLEET = "bench"
MANIFEST = "m" * 64
RULES = ("fedavg", "fedavg-held", "median")


class HeldFedAvg(Strategy):
    """FedAvg made to hold its round, as the coordinator did before it streamed (the baseline): no fold."""

    name = "fedavg-held"

    def __init__(self, device: str = "cpu", manifest: None = None) -> None:
        super().__init__(device)
        self.rule = FedAvg(device=device)

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> AggregateResult:
        return self.rule.aggregate(global_weights, updates)


def produce(out: Connection, count: int, parameters: int, concurrent: int) -> None:
    """Every device's update, as chunks, `concurrent` devices' chunks interleaved."""
    rng = np.random.default_rng(0)
    for first in range(0, count, concurrent):
        group = []
        for k in range(first, min(first + concurrent, count)):
            weights = rng.standard_normal(parameters, dtype=np.float32) * np.float32(0.01)
            group.append(wire.encode_blob(
                "update", wire.weights_bytes(weights), device=f"d{k}", round=1, task=0, model="ab" * 32,
                num_samples=int(rng.integers(10, 100)), attachments=[], label_counts=[], metrics={},
            ).chunks)
        for index in range(max(len(chunks) for chunks in group)):
            for k, chunks in enumerate(group):
                if index < len(chunks):
                    out.send_bytes(f"d{first + k}".encode() + b"\0" + chunks[index])
    out.send_bytes(b"")
    out.close()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cell(rule: str, count: int, parameters: int, concurrent: int, max_held_mib: int) -> dict[str, float]:
    strategy = make_strategy(rule, device="cpu")
    devices = {f"d{k}" for k in range(count)}
    inbox = Inbox(FLEET, devices, MANIFEST, parameters)
    counters: Counter[str] = Counter()
    global_weights = np.zeros(parameters, np.float32)
    receive, send = multiprocessing.Pipe(duplex=False)
    producer = multiprocessing.get_context("fork").Process(target=produce, args=(send, count, parameters, concurrent))
    producer.start()
    send.close()
    before = rss_mib()
    started, cpu_started = time.perf_counter(), time.process_time()
    held = max_held_mib << 20 if rule != "fedavg-held" else 1 << 62  # the baseline: as before, no bound
    aggregate = RoundAggregate(ContainedStrategy(strategy, counters), UpdateBounds(), global_weights, counters, held)
    while message := receive.recv_bytes():
        device, chunk = message.split(b"\0", 1)
        event = inbox.accept(topics.from_device(FLEET, device.decode(), "update"), chunk)
        if isinstance(event, Update):
            aggregate.add(ClientUpdate(event.device, event.weights, event.num_samples, event.metrics))
    closing = time.perf_counter()
    aggregate.close()
    closed = time.perf_counter()
    cpu = time.process_time() - cpu_started
    producer.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak - before, "used": len(aggregate.used), "held_limit": counters["held-limit"],
            "seconds": closed - started, "rejections": sum(inbox.rejections.values()),
            "cpu_ms_per_update": 1000 * cpu / max(len(aggregate.used), 1), "close_s": closed - closing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=1_000_000)
    parser.add_argument("--counts", default="100,1000")
    parser.add_argument("--concurrent", type=int, default=8, help="devices whose uploads overlap")
    parser.add_argument("--max-held-mib", type=int, default=1024)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # rule:count, run in this process
    args = parser.parse_args()
    if args.cell:
        rule, count = args.cell.split(":")
        print(json.dumps(cell(rule, int(count), args.parameters, args.concurrent, args.max_held_mib)))
        return
    counts = [int(c) for c in args.counts.split(",")]
    model_mib = args.parameters * 4 / 2**20
    print(f"model {args.parameters} parameters ({model_mib:.1f} MiB), {args.concurrent} uploads overlapping, "
          f"max_held_mib {args.max_held_mib}; peak RSS above the start of the round, MiB")
    print(f"{'rule':12s}" + "".join(f" {'N=' + str(c):>10s} {'models':>7s} {'used':>6s} {'s':>6s}" for c in counts)
          + f" {'ratio':>7s}")
    cpu_rows = []
    for rule in args.rules.split(","):
        row, peaks, cpu_row = f"{rule:12s}", [], f"{rule:12s}"
        for count in counts:
            done = subprocess.run([sys.executable, __file__, "--cell", f"{rule}:{count}",
                                   "--parameters", str(args.parameters), "--concurrent", str(args.concurrent),
                                   "--max-held-mib", str(args.max_held_mib)],
                                  capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.splitlines()[-1])
            peaks.append(result["peak_mib"])
            row += (f" {result['peak_mib']:10.1f} {result['peak_mib'] / model_mib:7.1f} {result['used']:6d} "
                    f"{result['seconds']:6.1f}")
            cpu_row += f" {result['cpu_ms_per_update']:13.3f} {result['close_s']:9.3f}"
        print(row + f" {peaks[-1] / peaks[0]:7.2f}", flush=True)
        cpu_rows.append(cpu_row)
    print("\nthe coordinator's CPU per update used (ms: the gate, the guard, the fold) and the round's close (s)")
    print(f"{'rule':12s}" + "".join(f" {'N=' + str(c) + ' ms':>13s} {'close s':>9s}" for c in counts))
    print("\n".join(cpu_rows))


if __name__ == "__main__":
    main()
