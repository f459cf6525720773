"""The run's files that grow with rounds x devices, as a fleet grows: the dashboard's live.json (its bytes and the
coordinator's CPU to encode it), with each round's every device metrics (what it carried before, and what
results.json keeps) against each round's device means (`coordinator.run_record.live_entry`); and results.json at a
round's close, the whole record encoded again (as before) against each round's entry encoded once
(`RunRecord.results_json`, the same text); and a checkpoint generation's run state at a round's close, with the
history encoded whole into it, encoded once into it, or appended to the checkpoint folder's history file
(`coordinator.checkpoint.save_run_state`, `HistoryFile`).

A run record of `--devices` devices each reporting `--metrics` numbers every round (a device's update carries about
20: its loss, device seconds, store, traffic, the method's own), after each of `--rounds` rounds; printed for
each size: bytes, and milliseconds of CPU for `json.dumps` of the record (best of 3), both ways, and their ratios;
then results.json's text at the last round's close (the rounds before it encoded at their own closes), both ways,
and a checkpoint generation's run state at that close, the three ways.
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

from coordinator.checkpoint import HISTORY_FILE, HistoryFile, RunState, save_run_state  # noqa: E402
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


CHECKPOINT_FORMS = ("whole", "once", "file")


def checkpoint_at_close(devices: int, rounds: int, metrics: int, form: str) -> tuple[int, float, float]:
    """A checkpoint generation's run state at round `rounds`'s close, the rounds before it saved at their own
    closes: the bytes it writes, and the CPU and wall ms to encode and write them (synced, as the coordinator's
    writes are), best of 3. `form`: "whole", the history in state.json, the record encoded whole (as each
    generation was before d2d69b9); "once", the history in state.json, each entry encoded once (d2d69b9); "file",
    the history appended to the checkpoint folder's file, the state naming its lines (`HistoryFile`)."""
    best_cpu = best_wall = float("inf")
    written = 0
    ids = [f"dev-{i:05d}" for i in range(devices)]
    for _ in range(3):
        with tempfile.TemporaryDirectory() as folder:
            generation, history = Path(folder) / "round", HistoryFile(Path(folder) / HISTORY_FILE)
            record = record_of(devices, rounds - 1, metrics)
            if form != "whole":
                save_run_state(generation, record.state, history if form == "file" else None)
            close_round(record, rounds, ids, metrics)
            before = history.path.stat().st_size if form == "file" else 0
            started, cpu = time.perf_counter(), time.process_time()
            if form == "whole":
                save_record(generation, record.state)  # json.dumps of the whole record
            else:
                save_run_state(generation, record.state, history if form == "file" else None)
            best_cpu = min(best_cpu, time.process_time() - cpu)
            best_wall = min(best_wall, time.perf_counter() - started)
            written = (generation / STATE_FILE).stat().st_size + (
                history.path.stat().st_size - before if form == "file" else 0)
    return written, best_cpu * 1000, best_wall * 1000


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
    print(f"\na checkpoint generation's run state at round {args.rounds}'s close: MB written, CPU and wall ms to "
          "encode and write it (synced), best of 3")
    print(f"{'devices':>8}" + "".join(f" {form + ' MB':>9} {'CPU':>7} {'wall':>7}" for form in CHECKPOINT_FORMS)
          + f" {'whole/file CPU':>14} {'wall':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        cells = [checkpoint_at_close(devices, args.rounds, args.metrics, form) for form in CHECKPOINT_FORMS]
        print(f"{devices:>8}" + "".join(f" {size / 2**20:>9.2f} {cpu:>7.1f} {wall:>7.1f}" for size, cpu, wall in cells)
              + f" {cells[0][1] / cells[2][1]:>13.1f}x {cells[0][2] / cells[2][2]:>6.1f}x")

if __name__ == "__main__":
    main()
