"""The coordinator's CPU per update and its round's close, with its per-update work in 1, 2 or 4 inbox workers
(coordinator/inbox_workers.py), against N updates through a real mosquitto.

Each cell starts a mosquitto (the coordinator's account and one per worker), the workers, and a producer process
that publishes N updates of one model (LeNet's 30,986 values by default: one chunk each), 8 devices' chunks
interleaved as overlapping uploads arrive, as the coordinator's account (the broker's ACL would let each device
publish its own; one connection keeps the producer's cost out of the way). The workers take them through their
shared subscription, gate, bound (the default guard) and fold them; the coordinator's process counts each
update's word (`Heard`) and, once all N are heard, closes the round: it asks every worker for its share and merges
them. Printed per cell: the coordinator process's CPU per update (what is left of its per-update work: one word a
worker sends), the workers' CPU per update (the gate, the guard, the fold, summed over the workers: the work that
was the coordinator's), the round's opening (handing every worker the round and waiting for each one's answer; 0
without workers), the round's close (asking for the shares, merging them, the result) and the wall time from
the first publish to the last word. 0 workers is the baseline, measured in the same run: the coordinator's own
process subscribed to the updates and doing all of it, as it does without workers (`benchmarks/coordinator_memory.py`
gives the same work fed through a pipe, without the MQTT client's share).

On a host with fewer cores than workers plus the producer and the broker, the workers share cores and the wall
time does not fall with them: read the CPU columns, which say what each process spent, not how fast it went.

    .venv/bin/python benchmarks/inbox_workers.py [--parameters 30986] [--counts 1000,10000] [--workers 0,1,2,4]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.aggregation import RoundAggregate
from coordinator.broker import Credentials, MosquittoBroker, inbox_worker_account
from coordinator.containment import ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.inbox import Inbox, Update, UpdateRefused
from coordinator.inbox_workers import InboxWorkers, WorkerPlan, merged_into
from coordinator.round_share import RoundOpening, SharePlan
from coordinator.rounds import OpenRound
from coordinator.strategies import make_strategy
from edgefil import topics, wire
from edgefil.link import CONNECTED, BrokerSettings, Link

FLEET = "bench"
MODEL = "ab" * 32
MANIFEST = "m" * 64
COORDINATOR = Credentials("coordinator", "bench-password")
HEARD_S = 120.0  # a ceiling for the next word while updates flow


class Broker(MosquittoBroker):
    """A broker whose queue for a slow subscriber holds a whole round of `updates`: the coordinator's account
    publishes for devices it has no accounts for here, so the roster that sizes a fleet's queue is not known to it."""

    def __init__(self, folder: str, updates: int, workers: int) -> None:
        super().__init__(folder, FLEET, {}, COORDINATOR, max_packet_bytes=2 * 1024 * 1024, inbox_workers=workers)
        self.updates = updates

    @property
    def max_queued_messages(self) -> int:
        return max(super().max_queued_messages, 2 * self.updates)


AHEAD = 2000  # the updates the producer may publish beyond those the coordinator has heard of


def produce(settings: BrokerSettings, count: int, parameters: int, concurrent: int, go: Connection,
            heard: Any) -> None:
    """Publish every device's update as chunks, `concurrent` devices' interleaved, once told to start, at most
    `AHEAD` updates beyond `heard` (what the coordinator has heard of so far): devices upload as they finish, and a
    round's 12 GB published at once would only measure the memory of the queues that hold them."""
    link = Link(settings, "producer")
    link.start()
    rng = np.random.default_rng(0)
    step = rng.normal(0.0, 0.01, parameters).astype(np.float32)
    go.recv()
    for first in range(0, count, concurrent):
        while first - heard.value > AHEAD:
            time.sleep(0.005)
        group = []
        for k in range(first, min(first + concurrent, count)):
            weights = step + rng.standard_normal(parameters, dtype=np.float32) * np.float32(0.002)
            group.append((f"d{k}", wire.encode_blob(
                "update", wire.weights_bytes(weights), device=f"d{k}", round=1, task=0, model=MODEL,
                num_samples=int(rng.integers(10, 100)), attachments=[], label_counts=[], metrics={}).chunks))
        for index in range(max(len(chunks) for _, chunks in group)):
            for device, chunks in group:
                if index < len(chunks):
                    while True:
                        try:
                            link.publish(topics.from_device(FLEET, device, "update"), chunks[index])
                            break
                        except BufferError:
                            time.sleep(0.01)
    link.wait_idle(600)
    link.stop()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_this_process(settings: BrokerSettings, devices: frozenset[str], parameters: int, go: Connection,
                    counted: Any) -> tuple[float, float, float, int, RoundAggregate]:
    """0 workers: the coordinator's own process subscribes to the updates and runs the gate, the round's checks, the
    guard and the fold on each, as `Coordinator` does without workers: (its CPU s, the wall s of the flow, the
    close's wall s, the updates refused, the round's aggregate)."""
    count = len(devices)
    reader = inbox_worker_account(COORDINATOR, 0)  # an account of its own: the producer publishes as the coordinator
    link = Link(dataclasses.replace(settings, username=reader.username, password=reader.password), reader.username,
                [f"{topics.prefix(FLEET)}/{topics.FROM_DEVICE}/+/update"])
    link.start()
    link.wait_subscribed(60)
    counters: Counter[str] = Counter()
    weights = np.zeros(parameters, np.float32)
    inbox = Inbox(FLEET, set(devices), MANIFEST, parameters)
    opened = OpenRound(1, 0, MODEL, sorted(devices), math.inf)
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters), GuardSettings(),
                               weights, counters, 1 << 30)
    cpu_before, started = time.process_time(), time.perf_counter()
    go.send("go")
    heard = refused = 0
    try:
        while heard < count:
            item = link.get(timeout=HEARD_S)
            if item is None:
                raise TimeoutError(f"{count - heard} updates unheard after {HEARD_S} s")
            if item.topic == CONNECTED:
                continue
            event = inbox.accept(item.topic, item.payload)
            if isinstance(event, UpdateRefused):
                heard, refused = heard + 1, refused + 1
                counted.value = heard
            elif isinstance(event, Update):
                heard += 1
                counted.value = heard
                if opened.offer(event, counters) is None:
                    aggregate.add(event.for_strategy())
                else:
                    refused += 1
        flowed = time.perf_counter()
        aggregate.close()
        closed = time.perf_counter()
    finally:
        link.stop()
    return time.process_time() - cpu_before, flowed - started, closed - flowed, refused, aggregate


@contextlib.contextmanager
def round_of(count: int, workers: int, parameters: int, concurrent: int
             ) -> Iterator[tuple[BrokerSettings, frozenset[str], Connection, Any]]:
    """A broker with accounts for `workers` workers (at least one: the in-process reader takes the first) and a
    producer of `count` updates waiting to be told to go: (the coordinator's settings, the devices, the pipe that
    says go, the count of updates heard that paces the producer)."""
    devices = frozenset(f"d{k}" for k in range(count))
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        broker = Broker(folder, count, max(workers, 1))
        broker.start()
        try:
            settings = BrokerSettings(broker.host, broker.port, COORDINATOR.username, COORDINATOR.password,
                                      keepalive=60)
            go, told = context.Pipe()
            counted = context.Value("q", 0, lock=False)
            producer = context.Process(target=produce, args=(settings, count, parameters, concurrent, told, counted))
            producer.start()
            try:
                yield settings, devices, go, counted
            finally:
                producer.join(60)
        finally:
            broker.stop()


def cell(count: int, workers: int, parameters: int, concurrent: int) -> dict[str, float]:
    if workers == 0:
        with round_of(count, workers, parameters, concurrent) as (settings, devices, go, counted):
            cpu, wall, close, refused, aggregate = in_this_process(settings, devices, parameters, go, counted)
        return {"taken": count - refused, "refused": refused, "used": len(aggregate.used),
                "coordinator_ms": 1000 * cpu / count, "workers_ms": 0.0, "open_s": 0.0, "close_s": close,
                "wall_s": wall}
    with round_of(count, workers, parameters, concurrent) as (settings, devices, go, counted):
        plan = WorkerPlan(settings, SharePlan(FLEET, devices, MANIFEST, parameters, "fedavg", guard=GuardSettings()))
        pool = InboxWorkers(plan, workers)
        pool.start()
        try:
            weights = np.zeros(parameters, np.float32)
            opening = time.perf_counter()
            pool.open(RoundOpening(1, 0, MODEL, tuple(sorted(devices)), weights))  # until every worker has it
            opened = time.perf_counter() - opening
            workers_before = sum(cpu_seconds(pid) for pid in pool.pids)
            cpu_before, started = time.process_time(), time.perf_counter()
            go.send("go")
            heard: Counter[str] = Counter()
            while sum(heard.values()) < count:
                word = pool.heard(timeout=HEARD_S)
                if word is None:
                    raise TimeoutError(f"{count - sum(heard.values())} updates unheard after {HEARD_S} s")
                heard[word.reason or "taken"] += 1
                counted.value += 1
            flowed = time.perf_counter()
            counters: Counter[str] = Counter()
            aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters),
                                       GuardSettings(), weights, counters, 1 << 30)
            merged = merged_into(aggregate, pool.close())
            merged.close()
            closed = time.perf_counter()
            coordinator_cpu = time.process_time() - cpu_before
            workers_cpu = sum(cpu_seconds(pid) for pid in pool.pids) - workers_before
        finally:
            pool.stop()
    return {"taken": heard["taken"], "refused": count - heard["taken"], "used": len(merged.used),
            "coordinator_ms": 1000 * coordinator_cpu / count, "workers_ms": 1000 * workers_cpu / count,
            "open_s": opened, "close_s": closed - flowed, "wall_s": flowed - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=30_986)
    parser.add_argument("--counts", default="1000,10000")
    parser.add_argument("--workers", default="0,1,2,4", help="0: the coordinator's own process, as without workers")
    parser.add_argument("--concurrent", type=int, default=8, help="devices whose uploads overlap")
    args = parser.parse_args()
    print(f"inbox workers: {args.parameters} parameters an update, FedAvg behind the default guard, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at the start")
    print(f"{'N':>7} {'workers':>7} {'used':>7} {'refused':>7} {'coord ms/upd':>12} {'workers ms/upd':>14} "
          f"{'open s':>8} {'close s':>8} {'wall s':>8}")
    for count in [int(c) for c in args.counts.split(",")]:
        for workers in [int(w) for w in args.workers.split(",")]:
            got = cell(count, workers, args.parameters, args.concurrent)
            print(f"{count:>7} {workers:>7} {got['used']:>7} {got['refused']:>7} {got['coordinator_ms']:>12.3f} "
                  f"{got['workers_ms']:>14.3f} {got['open_s']:>8.3f} {got['close_s']:>8.3f} {got['wall_s']:>8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
