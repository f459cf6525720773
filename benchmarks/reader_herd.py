"""A message to every device of a crowded host: its readers woken all at once (a plain queue each) against at most
`edgefil.wakeups.READERS_AWAKE` of them a process (`edgefil.wakeups.Inbox` behind a `ReaderGate`, as a fleet
worker's links are).

`--processes` processes, as a fleet's workers, each with `--threads` reader threads waiting for a message (a device
waiting in its link's `get`), the switch interval a fleet worker sets; then one message to each reader, which does
`--work` iterations of Python (about 1 ms at 30,000 here) and waits again. Both sides run in this one run, the same
processes' count and work, one side after the other; printed: the wall time until every reader of every process has
read its message, the processes' user and system CPU, and the ratio of the sides. What is ideal is the work's CPU over
the host's cores.

    .venv/bin/python benchmarks/reader_herd.py [--processes 4] [--threads 2000] [--work 30000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefil.wakeups import READERS_AWAKE, Inbox, ReaderGate  # noqa: E402
from firmware_sim.fleet_worker import WORKER_SWITCH_INTERVAL_S  # noqa: E402


def asleep(inbox: Inbox | queue.Queue) -> bool:
    """Whether `inbox`'s reader waits in its get (the plain queue's waiter list, as its condition keeps it)."""
    return inbox._asleep if isinstance(inbox, Inbox) else len(inbox.not_empty._waiters) > 0  # type: ignore[attr-defined]


def one_process(gated: bool, threads: int, work: int, ready: multiprocessing.Barrier, out: multiprocessing.Queue) -> None:
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
    gate = ReaderGate(READERS_AWAKE)
    inboxes: list = [Inbox(gate) if gated else queue.Queue() for _ in range(threads)]
    done = threading.Semaphore(0)

    def reader(inbox) -> None:
        while True:
            if inbox.get() is None:
                return
            total = 0
            for i in range(work):
                total += i
            done.release()

    for inbox in inboxes:
        threading.Thread(target=reader, args=(inbox,), daemon=True).start()
    while not all(asleep(inbox) for inbox in inboxes):  # a message to a reader not yet in its get passes no gate
        time.sleep(0.01)
    ready.wait()  # every process's readers waiting: the message goes to all at once
    before = resource.getrusage(resource.RUSAGE_SELF)
    for inbox in inboxes:
        inbox.put(1)
    for _ in inboxes:
        done.acquire()
    after = resource.getrusage(resource.RUSAGE_SELF)
    out.put((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))


def side(gated: bool, processes: int, threads: int, work: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(processes + 1)
    out = context.Queue()
    workers = [context.Process(target=one_process, args=(gated, threads, work, ready, out)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.perf_counter()
    times = [out.get() for _ in workers]
    wall = time.perf_counter() - started
    for worker in workers:
        worker.join()
    return {"wall_s": wall, "user_s": sum(t[0] for t in times), "system_s": sum(t[1] for t in times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2000)
    parser.add_argument("--work", type=int, default=30000)
    args = parser.parse_args()
    results = {name: side(gated, args.processes, args.threads, args.work)
               for name, gated in (("all at once", False), (f"at most {READERS_AWAKE} a process", True))}
    plain, gated = results.values()
    print(f"{args.processes} processes x {args.threads} readers, one message each, {args.work} iterations of work")
    print(f"{'readers woken':>26} {'wall s':>8} {'user s':>8} {'system s':>9}")
    for name, r in results.items():
        print(f"{name:>26} {r['wall_s']:8.2f} {r['user_s']:8.2f} {r['system_s']:9.2f}")
    print(f"all at once / gated: wall {plain['wall_s'] / gated['wall_s']:.1f}x, "
          f"CPU {(plain['user_s'] + plain['system_s']) / (gated['user_s'] + gated['system_s']):.1f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
