"""Crash-test writer: runs replay-store operations until it is killed, reporting each one on stdout.

    python tests/store_writer.py DIRECTORY SEED MAX_BYTES MAX_SAMPLES [crash-only]

`crash-only`: its writes need survive only its own crash (edgefil.durable `power_loss_safe` off: no syncs).

It waits for a line on stdin before opening the store (so the parent can start it ahead, while numpy loads),
prints `ready` once the store is open, then for every operation `begin <op> <args>` before the call and `done
<result>` once it returned (flushed at once, so the parent knows what committed):

    begin insert <seed> <n> <task>    done <first id>   x, y = batch(seed, n); ids first id .. first id + n - 1
    begin delete <id,id,...>          done -
    begin keep <id,id,...>            done -            (keep_only)

Like a Re-Fed client at a task switch, it evicts before inserting when the budget has no room.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_client.budget import Budget  # noqa: E402
from edge_client.store import ReplayStore  # noqa: E402
from edgefil.durable import set_power_loss_safe  # noqa: E402

SHAPE = (3, 32, 32)


def batch(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples an insert wrote, reproducible by the parent."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *SHAPE), dtype=np.float32), rng.integers(0, 10, n)


def report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    directory, seed, max_bytes, max_samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    set_power_loss_safe(sys.argv[5:] != ["crash-only"])
    rng = np.random.default_rng(seed)
    sys.stdin.readline()
    store = ReplayStore(directory, Budget(max_samples=max_samples, max_bytes=max_bytes), SHAPE)
    report("ready")
    task = 0
    while True:
        ids = store.ids()
        if rng.random() < 0.6:
            n = int(rng.integers(1, 40))
            if store.room_for(n) < n and len(ids):  # task switch: keep a random part of the cache
                keep = rng.choice(ids, size=int(rng.integers(0, len(ids))), replace=False)
                report("begin keep " + ",".join(map(str, np.sort(keep))))
                store.keep_only(keep)
                report("done -")
                task += 1
            n = min(n, store.room_for(n))
            batch_seed = int(rng.integers(2**31))
            report(f"begin insert {batch_seed} {n} {task}")
            first = store.insert(*batch(batch_seed, n), task)
            report(f"done {first[0] if n else -1}")
        elif len(ids):
            doomed = rng.choice(ids, size=int(rng.integers(1, len(ids) + 1)), replace=False)
            report("begin delete " + ",".join(map(str, np.sort(doomed))))
            store.delete(doomed)
            report("done -")


if __name__ == "__main__":
    main()
