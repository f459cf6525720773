"""What the export cache saves: an artifact set exported anew against the same set copied from the cache
(models/cache.py), for the models a fleet exports, in one run and one process.

    .venv/bin/python benchmarks/export_cache.py [--models lenet cnn1d] [--repeats 3]

A fleet exports the backend its devices run (portable by default) and torch; `edgefil export` every backend this
host can. Prints seconds per export (median of the repeats) and the cached copy's share of the fresh export."""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {"lenet": (1, 8, 8), "cnn1d": (1, 40), "small_cnn": (1, 8, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lenet", "cnn1d"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("edgefil").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EDGEFIL_CACHE"] = str(Path(tmp) / "cache")  # a cache of this run's own
        from models.export import export_registered

        print("| model | backends | fresh export | cached copy | cached / fresh |")
        print("|---|---|---|---|---|")
        for name in args.models:
            for backends in (("portable", "torch"), ("ort", "portable", "torch")):
                fresh, cached = [], []
                for r in range(args.repeats):
                    start = time.perf_counter()
                    export_registered(name, 10, Path(tmp) / f"{name}-fresh-{r}", SHAPES[name], backends=backends)
                    fresh.append(time.perf_counter() - start)
                export_registered(name, 10, Path(tmp) / f"{name}-seed", SHAPES[name], backends=backends, cache=True)
                for r in range(args.repeats):
                    start = time.perf_counter()
                    export_registered(name, 10, Path(tmp) / f"{name}-cached-{r}-{len(backends)}", SHAPES[name],
                                      backends=backends, cache=True)
                    cached.append(time.perf_counter() - start)
                f, c = statistics.median(fresh), statistics.median(cached)
                print(f"| {name} | {', '.join(backends)} | {f:.2f} s | {c:.3f} s | {c / f:.3f} |")


if __name__ == "__main__":
    main()
