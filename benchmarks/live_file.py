"""The run's files that grow with rounds x devices, as a fleet grows: the dashboard's live.json (its bytes and the
coordinator's CPU to encode it), with each round's every device metrics (what it carried before, and what
results.json keeps) against each round's device means (`coordinator.run_record.live_entry`), encoded whole against
made in parts of the devices' rows and the rounds' entries each encoded once (`RunRecord.live_json`); results.json at a
round's close, the whole record encoded again (as before) against its rounds copied from the checkpoint's history
file (`RunRecord.results_json`, the same text); a checkpoint generation's run state at a round's close, with the
history encoded whole into it or appended to the checkpoint folder's history file
(`coordinator.checkpoint.save_run_state`, `HistoryFile`); and what the coordinator keeps of the history in memory
after the rounds, every round's entry whole (as before) against entries that let their values per device go once
the history file holds them (`HistoryFile.hold`), measured with tracemalloc; and a resume after the rounds: what
the resumed coordinator holds of the history from its start through its first round's checkpoint, the peak of it,
and what that first checkpoint writes (`Checkpoints.start`, `RunRecord`, `Checkpoints.save`).

A run record of `--devices` devices each reporting `--metrics` numbers every round (a device's update carries about
20: its loss, device seconds, store, traffic, the method's own), after each of `--rounds` rounds; printed for
each size: bytes, and milliseconds of CPU for `json.dumps` of the record (best of 3), both ways, and their ratios;
then results.json's text at the last round's close, both ways, a checkpoint generation's run state at that close,
both ways, and the history's memory, both ways.
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
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coordinator.checkpoint import (  # noqa: E402
    HISTORY_FILE,
    CheckpointPolicy,
    Checkpoints,
    DeviceDeliveries,
    HistoryFile,
    RunState,
    save_run_state,
)
from coordinator.roster import Roster  # noqa: E402
from coordinator.run_record import RunRecord  # noqa: E402
from edgefil.durable import STATE_FILE  # noqa: E402


class Traffic:
    bytes_sent = bytes_received = 0
    connects = 1


def new_record(ids: list[str], state: RunState, rounds: int, history_file: HistoryFile | None) -> RunRecord:
    """A run record of the devices `ids` that trains `rounds` rounds from `state`."""
    return RunRecord("lab", {"preset": "digits-class"}, {"name": "fedavg"}, {}, state, Roster(ids), Counter(),
                     Traffic(), total_rounds=rounds, total_steps=rounds, history_file=history_file)


def record_of(devices: int, rounds: int, metrics: int, folder: Path | None = None) -> RunRecord:
    """A record of `rounds` closed rounds; with `folder`, each checkpointed there as the coordinator does (the
    history file's, `HistoryFile`), so that the entries kept let their values per device go."""
    ids = [f"dev-{i:05d}" for i in range(devices)]
    record = new_record(ids, RunState(np.zeros(3, np.float32)), rounds,
                        None if folder is None else HistoryFile(folder / HISTORY_FILE))
    for number in range(1, rounds + 1):
        close_round(record, number, ids, metrics, folder)
    return record


def close_round(record: RunRecord, number: int, ids: list[str], metrics: int, folder: Path | None = None) -> None:
    rng = np.random.default_rng(number)
    names = [sys.intern(f"metric_{k}") for k in range(metrics)]  # one string a name, as msgpack's decoding makes
    entry = record.entry(round=number, task=0, selected=list(ids), received=list(ids), samples=3 * len(ids),
                         accuracy=[0.5], aggregate_s=0.01,
                         metrics={d: dict(zip(names, rng.random(metrics).tolist())) for d in ids})
    record.state.history.append(entry)
    if folder is not None:
        save_run_state(folder / "round", record.state, record.history_file)
    record.round_closed(entry)


def at_close(devices: int, rounds: int, metrics: int, from_file: bool) -> tuple[int, float]:
    """results.json's bytes and CPU ms at round `rounds`'s close, the rounds before it closed: the whole record
    encoded, or (`from_file`) its rounds copied from the history file; best of 3, each on a fresh record."""
    best, size = float("inf"), 0
    for _ in range(3):
        with tempfile.TemporaryDirectory() as folder:
            record = record_of(devices, rounds, metrics, Path(folder) if from_file else None)
            started = time.process_time()
            size = len(b"".join(record.results_json()) if from_file else json.dumps(record.results()).encode())
            best = min(best, time.process_time() - started)
    return size, best * 1000


def kept_mb(devices: int, rounds: int, metrics: int, from_file: bool) -> float:
    """MB that a record of `rounds` closed rounds holds (tracemalloc: what was allocated and not freed while it was
    made), each round's entry whole, or (`from_file`) checkpointed to the history file as the coordinator does."""
    with tempfile.TemporaryDirectory() as folder:
        tracemalloc.start()
        record = record_of(devices, rounds, metrics, Path(folder) if from_file else None)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del record
    return held / 2**20


CHECKPOINT_FORMS = ("whole", "file")


def checkpoint_at_close(devices: int, rounds: int, metrics: int, form: str) -> tuple[int, float, float]:
    """A checkpoint generation's run state at round `rounds`'s close, the rounds before it saved at their own
    closes: the bytes it writes, and the CPU and wall ms to encode and write them (synced, as the coordinator's
    writes are), best of 3. `form`: "whole", the history in state.json, the record encoded whole (as each
    generation was before d2d69b9); "file", the history appended to the checkpoint folder's file, the state naming
    its lines (`HistoryFile`). (d2d69b9's third form, each entry encoded once into state.json, kept every entry's
    text in memory: gone.)"""
    best_cpu = best_wall = float("inf")
    written = 0
    ids = [f"dev-{i:05d}" for i in range(devices)]
    for _ in range(3):
        with tempfile.TemporaryDirectory() as folder:
            generation = Path(folder) / "round"
            record = record_of(devices, rounds - 1, metrics, Path(folder) if form == "file" else None)
            history = record.history_file
            close_round(record, rounds, ids, metrics)
            before = history.path.stat().st_size if history is not None else 0
            started, cpu = time.perf_counter(), time.process_time()
            save_run_state(generation, record.state, history)
            best_cpu = min(best_cpu, time.process_time() - cpu)
            best_wall = min(best_wall, time.perf_counter() - started)
            written = (generation / STATE_FILE).stat().st_size + (
                history.path.stat().st_size - before if history is not None else 0)
    return written, best_cpu * 1000, best_wall * 1000


def resumed(devices: int, rounds: int, metrics: int) -> tuple[float, float, float, float, float]:
    """A coordinator resumed after `rounds` rounds checkpointed as a run makes them, through its first round's
    checkpoint: the history file's MB, the MB of Python's allocations it holds after that checkpoint and their peak
    on the way (tracemalloc, from the start), the CPU s of it all, and the MB that checkpoint wrote."""
    ids = [f"dev-{i:05d}" for i in range(devices)]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "checkpoint"
        run = Checkpoints(root, CheckpointPolicy(keep=2), num_parameters=3)
        state = RunState(np.zeros(3, np.float32), rng=dict(np.random.default_rng(0).bit_generator.state))
        record = new_record(ids, state, rounds + 1, run.history)
        for number in range(1, rounds + 1):
            state.round = number
            close_round(record, number, ids, metrics)
            run.save(state, DeviceDeliveries(), lambda generation: None)
        del record, state, run
        history = root / HISTORY_FILE
        size = history.stat().st_size
        tracemalloc.start()
        started = time.process_time()
        again = Checkpoints(root, CheckpointPolicy(keep=2), num_parameters=3)
        state, _ = again.start(resume=True, fresh=RunState(np.zeros(3, np.float32)))
        record = new_record(ids, state, rounds + 1, again.history)
        state.round = rounds + 1
        close_round(record, rounds + 1, ids, metrics)
        before = history.stat()
        again.save(state, DeviceDeliveries(), lambda generation: None)
        cpu = time.process_time() - started
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        after = history.stat()  # a file written whole is a new one (write_atomically); an appended one grew
        written = after.st_size if after.st_ino != before.st_ino else after.st_size - before.st_size
        return size / 2**20, held / 2**20, peak / 2**20, cpu, written / 2**20


def in_parts(record: RunRecord, changed: float) -> float:
    """Best-of-3 CPU ms of live.json made in parts (`RunRecord.live_json`), after a write that encoded every row,
    with the rows of a `changed` share of the devices changed before each (a round's devices sent its work)."""
    b"".join(record.live_json())
    devices = list(record.roster.records)[:int(changed * len(record.roster.records))]
    best = float("inf")
    for _ in range(3):
        for device in devices:
            record.roster.asked_to_train(device)
        started = time.process_time()
        b"".join(record.live_json())
        best = min(best, time.process_time() - started)
    return best * 1000


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
    print(f"live.json after {args.rounds} rounds, {args.metrics} metrics a device; CPU ms to make and encode it, best "
          "of 3: with every device's metrics (as before d4e45d6), with each round's device means encoded whole (as "
          "before this commit), in parts (`RunRecord.live_json`: each device's row and round's entry encoded once), and "
          "in parts with a tenth of the devices' rows changed since the last write (as in a round)")
    print(f"{'devices':>8} {'every device MB':>15} {'ms':>8} {'device means MB':>15} {'whole ms':>8} {'parts ms':>8} "
          f"{'a tenth new':>11} {'whole/parts':>11}")
    for devices in (int(n) for n in args.devices.split(",")):
        record = record_of(devices, args.rounds, args.metrics)
        whole_bytes, whole_ms = encoded(lambda: {**record.live(), "history": record.history})
        live_bytes, live_ms = encoded(record.live)
        parts_ms = in_parts(record, 0.0)
        changed_ms = in_parts(record, 0.1)
        print(f"{devices:>8} {whole_bytes / 2**20:>15.2f} {whole_ms:>8.1f} {live_bytes / 2**20:>15.2f} "
              f"{live_ms:>8.1f} {parts_ms:>8.1f} {changed_ms:>11.1f} {live_ms / changed_ms:>10.1f}x")
    print(f"\nresults.json at round {args.rounds}'s close; CPU ms, best of 3")
    print(f"{'devices':>8} {'MB':>8} {'all rounds encoded':>18} {'copied from file':>16} {'CPU':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        size, whole_ms = at_close(devices, args.rounds, args.metrics, from_file=False)
        _, copied_ms = at_close(devices, args.rounds, args.metrics, from_file=True)  # the same text: test_run_record
        print(f"{devices:>8} {size / 2**20:>8.2f} {whole_ms:>18.1f} {copied_ms:>16.1f} {whole_ms / copied_ms:>6.1f}x")
    print(f"\na checkpoint generation's run state at round {args.rounds}'s close: MB written, CPU and wall ms to "
          "encode and write it (synced), best of 3")
    print(f"{'devices':>8}" + "".join(f" {form + ' MB':>9} {'CPU':>7} {'wall':>7}" for form in CHECKPOINT_FORMS)
          + f" {'whole/file CPU':>14} {'wall':>7}")
    for devices in (int(n) for n in args.devices.split(",")):
        cells = [checkpoint_at_close(devices, args.rounds, args.metrics, form) for form in CHECKPOINT_FORMS]
        print(f"{devices:>8}" + "".join(f" {size / 2**20:>9.2f} {cpu:>7.1f} {wall:>7.1f}" for size, cpu, wall in cells)
              + f" {cells[0][1] / cells[1][1]:>13.1f}x {cells[0][2] / cells[1][2]:>6.1f}x")
    print(f"\nthe history the coordinator keeps in memory after {args.rounds} rounds (MB, tracemalloc) and what each "
          "round adds to it (MB: its growth from round 1 on, over the rounds)")
    print(f"{'devices':>8} {'every entry whole':>17} {'a round':>8} {'values per device in the file':>29} {'a round':>8} "
          f"{'whole/file a round':>18}")
    for devices in (int(n) for n in args.devices.split(",")):
        whole, filed = (kept_mb(devices, args.rounds, args.metrics, from_file) for from_file in (False, True))
        whole_1, filed_1 = (kept_mb(devices, 1, args.metrics, from_file) for from_file in (False, True))
        grows = [(mb - first) / max(args.rounds - 1, 1) for mb, first in ((whole, whole_1), (filed, filed_1))]
        print(f"{devices:>8} {whole:>17.2f} {grows[0]:>8.3f} {filed:>29.2f} {grows[1]:>8.3f} "
              f"{grows[0] / grows[1]:>17.1f}x")
    print(f"\na coordinator resumed after {args.rounds} rounds, through its first round's checkpoint: the history "
          "file's MB, the MB of Python's allocations it holds after that checkpoint and their peak (tracemalloc), the "
          "CPU s, and the MB the checkpoint wrote")
    print(f"{'devices':>8} {'file MB':>8} {'held MB':>8} {'peak MB':>8} {'CPU s':>7} {'written MB':>10}")
    for devices in (int(n) for n in args.devices.split(",")):
        size, held, peak, cpu, written = resumed(devices, args.rounds, args.metrics)
        print(f"{devices:>8} {size:>8.2f} {held:>8.2f} {peak:>8.2f} {cpu:>7.2f} {written:>10.2f}")

if __name__ == "__main__":
    main()
