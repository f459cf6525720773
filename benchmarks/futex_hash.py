"""A futex wake-up in a process of many threads: the kernel's own futex hash against the one a fleet worker sizes for
its threads (`firmware_sim.fleet_worker.size_futex_hash`).

Linux 6.16 on gives a process with threads a futex hash of its own, sized by the online CPUs (16 slots on a 2-core
host) however many threads the process has; each wait and wake looks up its slot, and a wake walks the slot's
queue. Here, in a fresh process for each measure, `--idle` threads wait (each on a lock of its own, as a fleet's
idle devices wait for their next message) while two threads hand a lock back and forth `--handovers` times (each
hand-over a futex wake and wait, as a GIL hand-over or a message given to a device is); printed: CPU microseconds a
hand-over with the kernel's table and with the sized one, and their ratio. Both sides in the same run, alternated,
best of `--repeats`.

    .venv/bin/python benchmarks/futex_hash.py [--idle 0,500,1500,4000] [--handovers 20000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import ctypes, sys, threading, time
from firmware_sim.fleet_worker import THREADS_BESIDE_DEVICES, size_futex_hash
sized, idle, handovers = sys.argv[1] == "sized", int(sys.argv[2]), int(sys.argv[3])
slots = size_futex_hash(idle + THREADS_BESIDE_DEVICES) if sized else None
release = threading.Event()
waiting = [threading.Thread(target=release.wait) for _ in range(idle)]
for thread in waiting:
    thread.start()
ping, pong = threading.Lock(), threading.Lock()
ping.acquire()
pong.acquire()

def answer():
    for _ in range(handovers):
        ping.acquire()
        pong.release()

other = threading.Thread(target=answer)
other.start()
started = time.process_time()
for _ in range(handovers):
    ping.release()
    pong.acquire()
cpu = time.process_time() - started
other.join()
release.set()
print(cpu / handovers * 1e6, ctypes.CDLL(None).prctl(78, 2, 0, 0, 0))
"""


def measure(sized: bool, idle: int, handovers: int) -> tuple[float, int]:
    done = subprocess.run([sys.executable, "-c", ONE, "sized" if sized else "kernel", str(idle), str(handovers)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    us, slots = done.stdout.split()
    return float(us), int(slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", default="0,500,1500,4000")
    parser.add_argument("--handovers", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(78, 2, 0, 0, 0) < 0:
        print("this kernel keeps no futex hash per process (Linux before 6.16): nothing to compare")
        return
    print(f"a lock handed between two threads, {args.handovers} times, beside idle threads; CPU us a hand-over, "
          f"best of {args.repeats}")
    print(f"{'idle threads':>12} {'kernel slots':>12} {'us':>7} {'sized slots':>11} {'us':>7} {'ratio':>6}")
    for idle in (int(n) for n in args.idle.split(",")):
        best: dict[bool, tuple[float, int]] = {}
        for _ in range(args.repeats):
            for sized in (False, True):
                us, slots = measure(sized, idle, args.handovers)
                if sized not in best or us < best[sized][0]:
                    best[sized] = (us, slots)
        (kernel_us, kernel_slots), (sized_us, sized_slots) = best[False], best[True]
        print(f"{idle:>12} {kernel_slots:>12} {kernel_us:>7.1f} {sized_slots:>11} {sized_us:>7.1f} "
              f"{kernel_us / sized_us:>5.2f}x")


if __name__ == "__main__":
    main()
