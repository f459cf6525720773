"""The run's files that grow with rounds x devices, as a fleet grows: the dashboard's live.json (its bytes and the
coordinator's CPU to encode it), with each round's every device metrics (what it carried before, and what
results.json keeps) against each round's device means (`coordinator.run_record.live_entry`); and results.json at a
round's close, the whole record encoded again (as before) against each round's entry encoded once
(`RunRecord.results_json`, the same text); and the checkpoint's state.json at a round's close, the same two ways
(`coordinator.checkpoint.save_run_state`).

A run record of `--devices` devices each reporting `--metrics` numbers every round (a device's update carries about
20: its loss, device seconds, store, traffic, the method's own), after each of `--rounds` rounds; printed for
each size: bytes, and milliseconds of CPU for `json.dumps` of the record (best of 3), both ways, and their ratios;
then results.json's text at the last round's close (the rounds before it encoded at their own closes), both ways,
and the checkpoint's state.json (the run state with the whole history) at that close, both ways.
The coordinator rewrites live.json at most every second and keeps that within 5 % of its time (run_logs.py), so a
file that took longer to encode was written less often, and the dashboard reads it every second.

    .venv/bin/python benchmarks/live_file.py [--devices 100,1000,10000] [--rounds 4] [--metrics 20]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coordinator.checkpoint import RunState, save_run_state  # noqa: E402
from coordinator.roster import Roster  # noqa: E402
from coordinator.run_record import RunRecord  # noqa: E402
from edgefil.durable import STATE_FILE, save_record  # noqa: E402


class Traffic:
    bytes_sent = bytes_received = 0
    connects = 1


def record_of(devices: int, rounds: int, metrics: int) -> RunRecord:
    ids = [f"dev-{i:05d}" for i in range(devices)]
    record = RunRecord("lab", {"preset": "digits-class"}, {"name": "fedavg"}, {}, RunState(np.zeros(3, np.float32)),
                       Roster(ids), Counter(), Traffic(), total_rounds=rounds, total_steps=rounds)
    for number in range(1, rounds + 1):
        close_round(record, number, ids, metrics)
    return record


def close_round(record: RunRecord, number: int, ids: list[str], metrics: int) -> None:
    rng = np.random.default_rng(number)
    entry = record.entry(round=number, task=0, selected=ids, received=ids, samples=3 * len(ids), accuracy=[0.5],
                         aggregate_s=0.01, metrics={d: {f"metric_{k}": float(v) for k, v in
                                                        enumerate(rng.random(metrics))} for d in ids})
    record.state.history.append(entry)
    record.round_closed(entry)


def at_close(devices: int, rounds: int, metrics: int, spliced: bool) -> tuple[int, float]:
    """results.json's bytes and CPU ms at round `rounds`'s close, the rounds before it closed (and, spliced, each
    encoded at its close); best of 3, each on a fresh record."""
    best, size = float("inf"), 0
    ids = [f"dev-{i:05d}" for i in range(devices)]
    for _ in range(3):
        record = record_of(devices, rounds - 1, metrics)
        if spliced:
            record.results_json()
        close_round(record, rounds, ids, metrics)
        started = time.process_time()
        size = len((record.results_json() if spliced else json.dumps(record.results())).encode())
        best = min(best, time.process_time() - started)
    return size, best * 1000


def checkpoint_at_close(devices: int, rounds: int, metrics: int, once: bool) -> tuple[int, float]:
    """The checkpoint's state.json (the run state, the whole history in it) at round `rounds`'s close: its bytes
    and CPU ms to encode and write it, the rounds before it saved at their own closes (each entry encoded once,
    `save_run_state`) or not (the record encoded whole, as each generation was); best of 3."""
    best, size = float("inf"), 0
    ids = [f"dev-{i:05d}" for i in range(devices)]
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(3):
            record = record_of(devices, rounds - 1, metrics)
            if once:
                save_run_state(folder, record.state)
            close_round(record, rounds, ids, metrics)
            started = time.process_time()
            if once:
                save_run_state(folder, record.state)
            else:
                save_record(folder, record.state)  # json.dumps of the whole record
            best = min(best, time.process_time() - started)
            size = (Path(folder) / STATE_FILE).stat().st_size
    return size, best * 1000


def encoded(make: object) -> tuple[int, float]:
    """Bytes and best-of-3 CPU ms of json.dumps(make())."""
    best, size = float("inf"), 0
    for _ in range(3):
        started = time.process_time()
        size = len(json.dumps(make()).encode())  # type: ignore[operator]
        best = min(best, time.process_time() - started)
    return size, best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="100,1000,10000")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--metrics", type=int, default=20)
    args = parser.parse_args()
    print(f"live.json after {args.rounds} rounds, {args.metrics} metrics a device; CPU ms to encode, best of 3")
    print(f"{'devices':>8} {'every device MB':>15} {'ms':>8} {'device means MB':>15} {'ms':>8} {'bytes':>7} "
          f"{'CPU':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        record = record_of(devices, args.rounds, args.metrics)
        whole_bytes, whole_ms = encoded(lambda: {**record.live(), "history": record.history})
        live_bytes, live_ms = encoded(record.live)
        print(f"{devices:>8} {whole_bytes / 2**20:>15.2f} {whole_ms:>8.1f} {live_bytes / 2**20:>15.2f} "
              f"{live_ms:>8.1f} {whole_bytes / live_bytes:>6.1f}x {whole_ms / live_ms:>6.1f}x")
    print(f"\nresults.json at round {args.rounds}'s close; CPU ms, best of 3")
    print(f"{'devices':>8} {'MB':>8} {'all rounds encoded':>18} {'each round once':>15} {'CPU':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        size, whole_ms = at_close(devices, args.rounds, args.metrics, spliced=False)
        _, spliced_ms = at_close(devices, args.rounds, args.metrics, spliced=True)  # the same text: test_run_record
        print(f"{devices:>8} {size / 2**20:>8.2f} {whole_ms:>18.1f} {spliced_ms:>15.1f} {whole_ms / spliced_ms:>6.1f}x")
    print(f"\nthe checkpoint's state.json at round {args.rounds}'s close; CPU ms to encode and write it, best of 3")
    print(f"{'devices':>8} {'MB':>8} {'all rounds encoded':>18} {'each round once':>15} {'CPU':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        size, whole_ms = checkpoint_at_close(devices, args.rounds, args.metrics, once=False)
        _, once_ms = checkpoint_at_close(devices, args.rounds, args.metrics, once=True)  # test_checkpoints
        print(f"{devices:>8} {size / 2**20:>8.2f} {whole_ms:>18.1f} {once_ms:>15.1f} {whole_ms / once_ms:>6.1f}x")


if __name__ == "__main__":
    main()
