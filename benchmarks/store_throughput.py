"""Replay store throughput versus plain files holding the same bytes, measured in one run.

Insert: the store writes batches in durable transactions (rollback journal, synchronous=FULL, byte-budget bound
computed first). The baseline writes each batch's samples and labels to a file of its own and fsyncs the file
and the directory, so each batch is as durable as a committed insert. Read: the store's get() of each batch's
ids versus reading each batch file back, both from a warm page cache. A third line reads random minibatches
from the store, as training on the replay samples does; plain batch files cannot do that without reading whole
files. MB/s counts sample bytes (float32), not labels or overhead.

    .venv/bin/python benchmarks/store_throughput.py [--samples 2048] [--batch 64] [--repeats 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from timing import best_time  # benchmarks/timing.py: scripts run from their folder

from edge_client.budget import Budget
from edge_client.store import ReplayStore
from edgefil.durable import fsync_directory

SHAPES = [((8, 8), "8x8 digits"), ((3, 32, 32), "3x32x32 CIFAR-sized")]


def write_files(directory: Path, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for i, (x, y) in enumerate(batches):
        with open(directory / f"batch-{i:05d}.bin", "wb") as f:
            f.write(x.tobytes())
            f.write(y.astype(np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(directory)


def read_files(directory: Path, batches: list[tuple[np.ndarray, np.ndarray]], shape: tuple[int, ...]) -> None:
    for i, (x, _) in enumerate(batches):
        raw = np.fromfile(directory / f"batch-{i:05d}.bin", dtype=np.uint8)
        samples, labels = raw[: x.nbytes].view(np.float32).reshape(len(x), *shape), raw[x.nbytes :].view(np.int64)
        assert samples.shape == x.shape and len(labels) == len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    root = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    print(f"{args.samples} samples in batches of {args.batch}, best of {args.repeats}, files under {root}")
    print(f"{'shape':21s} {'operation':18s} {'store samples/s':>15s} {'MB/s':>7s} {'files samples/s':>15s} "
          f"{'MB/s':>7s} {'store/files':>11s}")
    try:
        for shape, label in SHAPES:
            x = rng.random((args.samples, *shape), dtype=np.float32)
            y = rng.integers(0, 10, args.samples)
            batches = [(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, args.samples, args.batch)]
            mb = x.nbytes / 1e6
            # budgets as a device would set them: M = all samples, bytes = twice the sample bytes
            budget = Budget(max_samples=args.samples, max_bytes=2 * x.nbytes + 1_000_000)

            def store_insert(k: int) -> None:
                with ReplayStore(root / f"store-{shape}-{k}", budget, shape) as store:
                    for bx, by in batches:
                        store.insert(bx, by, task=0)

            def files_write(k: int) -> None:
                directory = root / f"files-{shape}-{k}"
                directory.mkdir()
                write_files(directory, batches)

            insert_s, write_s = best_time(store_insert, args.repeats), best_time(files_write, args.repeats)
            with ReplayStore(root / f"store-{shape}-0", budget) as store:
                ids = store.ids()
                id_batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]
                get_s = best_time(lambda k: [store.get(b) for b in id_batches], args.repeats)
                shuffled = np.random.default_rng(1).permutation(ids)
                random_s = best_time(
                    lambda k: [store.get(shuffled[i : i + args.batch]) for i in range(0, len(ids), args.batch)],
                    args.repeats,
                )
            read_s = best_time(lambda k: read_files(root / f"files-{shape}-0", batches, shape), args.repeats)
            for name, store_s, files_s in [("insert / write", insert_s, write_s), ("get / read", get_s, read_s),
                                           ("get random batches", random_s, read_s)]:
                print(f"{label:21s} {name:18s} {args.samples / store_s:15,.0f} {mb / store_s:7.1f} "
                      f"{args.samples / files_s:15,.0f} {mb / files_s:7.1f} {files_s / store_s:11.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
