"""What a cold export costs and what the cache saves: an artifact set exported anew, each in a fresh process as a
host's first run makes it (its imports untimed, the exporter's first-use costs timed), in three ways, against the
same set copied from the cache (models/cache.py).

    .venv/bin/python benchmarks/export_cache.py [--models lenet cnn1d] [--repeats 3]

The fresh exports, the portable and torch backends (what a fleet exports by default), alternated in each repeat:
  one process      every portable graph, exported by one process (`EDGEFIL_EXPORT_HELPERS=0`: the exporter before
                   its helpers)
  helpers          every portable graph, this process and its helper processes (one per other core) taking the
                   next graph as each is free (what `edgefil export` does)
  fleet's set      the graphs a fleet of a method that runs no optional graph exports (random replay, FedAvg:
                   `graphs=()`, no per-sample norms or input gradient), with the helpers
  added graphs     `edgefil export`'s set (every optional graph) asked of a cache that holds the fleet's set: the
                   kept set's part is copied and only the optional graphs are exported and added (models/cache.py)
Prints seconds per export (median of the repeats), each against "one process", and the cached copy."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"lenet": (1, 8, 8), "cnn1d": (1, 40), "small_cnn": (1, 8, 8)}
WAYS = {  # name: (EDGEFIL_EXPORT_HELPERS or None for the default, the optional graphs or None for all, whether
    # the cache first holds the fleet's set)
    "one process": ("0", None, False),
    "helpers": (None, None, False),
    "fleet's set": (None, (), False),
    "added graphs": (None, None, True),
}
CHILD = """
import json, sys, time
from pathlib import Path
from models.export import export_registered
name, shape, out, graphs, cached = json.loads(sys.argv[1])
if cached:  # the fleet's set kept first (untimed)
    export_registered(name, 10, Path(out + "-fleet"), tuple(shape), backends=("portable", "torch"), graphs=(),
                      cache=True)
start = time.perf_counter()
export_registered(name, 10, Path(out), tuple(shape), backends=("portable", "torch"), graphs=graphs, cache=cached)
print(time.perf_counter() - start)
"""


def fresh_export(name: str, out: Path, way: str) -> float:
    """Seconds of one export in a fresh process (after its imports); a way that starts from a kept fleet's set
    has a cache of its own."""
    helpers, graphs, cached = WAYS[way]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGEFIL_CACHE": str(out) + "-cache"}
    env.pop("EDGEFIL_EXPORT_HELPERS", None)
    if helpers is not None:
        env["EDGEFIL_EXPORT_HELPERS"] = helpers
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([name, SHAPES[name], str(out), graphs, cached])],
                          env=env, check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lenet", "cnn1d"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EDGEFIL_CACHE"] = str(Path(tmp) / "cache")  # a cache of this run's own
        from models.export import export_registered

        ways = list(WAYS)
        print(f"| model | {' | '.join(ways)} | {' | '.join(w + ' / one process' for w in ways[1:])} | cached copy |")
        print("|---|" + "---|" * (2 * len(ways) + 0))
        for name in args.models:
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            for r in range(args.repeats):
                for way in ways if r % 2 == 0 else ways[::-1]:
                    seconds[way].append(fresh_export(name, Path(tmp) / f"{name}-{way}-{r}", way))
            export_registered(name, 10, Path(tmp) / f"{name}-seed", SHAPES[name], backends=("portable", "torch"),
                              cache=True)
            cached = []
            for r in range(args.repeats):
                start = time.perf_counter()
                export_registered(name, 10, Path(tmp) / f"{name}-cached-{r}", SHAPES[name],
                                  backends=("portable", "torch"), cache=True)
                cached.append(time.perf_counter() - start)
            median = {way: statistics.median(values) for way, values in seconds.items()}
            base = median["one process"]
            runs = {way: ", ".join(f"{v:.1f}" for v in values) for way, values in seconds.items()}
            print(f"| {name} | " + " | ".join(f"{median[w]:.1f} s ({runs[w]})" for w in ways) + " | "
                  + " | ".join(f"{median[w] / base:.2f}" for w in ways[1:])
                  + f" | {statistics.median(cached):.3f} s |")


if __name__ == "__main__":
    main()
