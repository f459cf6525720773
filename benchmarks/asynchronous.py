"""Asynchronous (FedBuff) rounds against synchronous ones on a fleet of mixed profiles: time to accuracy on the
fleet's clock, final accuracy, and how stale the asynchronous updates were.

The fleet: 12 emulated devices, three each of the Raspberry Pi Zero 2 W (its battery's on/off availability), the
Raspberry Pi 4, the Jetson Nano and the Jetson Orin Nano (firmware_sim/profiles), their compute modelled from the
model's FLOPs at each profile's speed (`compute = "modelled"`: the same run on any host, at any load), on
`digits-class` (5 tasks of 2 classes), LeNet, E epochs, FedAvg, the default guard. Both sides aggregate the same
number of updates a task: synchronous, 3 rounds of every device (36 updates); asynchronous, `--buffer` (K) updates a
model move and 36 / K moves; and a third side with the asynchronous one's moves and updates, synchronous: K devices
drawn each round (`fraction` K / 12) and 36 / K rounds a task (more moves of fewer updates learn differently: this
side tells that apart from not waiting). A synchronous round waits for its slowest device, so its deadline is set per seed to
the longest round a device had in a first synchronous run with a deadline none reaches (x 1.05): a round on the
fleet's clock then lasts what the real one would, at most, and the Pi Zeros' availability is read on the same clock
on both sides (`time_scale` profile seconds a fleet second).

Printed per seed and as mean +- std: the fleet's clock at the run's end (for the synchronous run also on a clock
where each round lasts only as long as its slowest update took, as if it closed at its last answer: the most a
synchronous fleet could gain from a deadline fitted round by round), the final accuracy (the last task's row),
and the time to a target on the fleet's clock: the first round of the last task whose accuracy over the tasks so
far reaches 90 % of the synchronous run's final accuracy (the same target for both sides of a seed); and the
asynchronous updates' mean and largest staleness and the updates refused as too stale; the paired t-test of the
two sides' final accuracies.

    .venv/bin/python benchmarks/asynchronous.py [--seeds 0,1,2] [--buffer 4] [--concurrency 0,4] [--epochs 5]
        [--out runs/async]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefil.settings import dump_toml  # noqa: E402

PROFILES = {"raspberry-pi-zero-2w": 3, "raspberry-pi-4-4gb": 3, "jetson-nano": 3, "jetson-orin-nano": 3}
SYNC_ROUNDS = 3  # a task's synchronous rounds, every device in each
TARGET_SHARE = 0.9  # the target: this share of the synchronous run's final accuracy
TIME_SCALE = 2000.0  # profile seconds a fleet second: a run spans a few of the Pi Zeros' on/off cycles
UNREACHED_DEADLINE_S = 3600.0


def fleet(seed: int, epochs: int, out: Path, deadline_s: float, buffer: int | None, sampled: int | None = None,
          concurrency: int = 0) -> dict[str, Any]:
    """The fleet file of one side: synchronous (every device a round, or `sampled` devices drawn each round with as
    many more rounds), or asynchronous with a buffer of `buffer` and at most `concurrency` devices at work (0: all)."""
    devices = sum(PROFILES.values())
    coordinator: dict[str, Any] = {"rounds_per_task": SYNC_ROUNDS, "deadline_s": deadline_s}
    if sampled is not None:
        # ceil(fraction x available) devices a round: just under `sampled` / devices, or float rounding draws one more
        coordinator = {"rounds_per_task": SYNC_ROUNDS * devices // sampled, "deadline_s": deadline_s,
                       "fraction": (sampled - 0.5) / devices, "min_clients": sampled}
    if buffer is not None:
        coordinator = {"rounds_per_task": SYNC_ROUNDS * devices // buffer, "deadline_s": deadline_s,
                       "asynchronous": {"mode": "buffered", "buffer": buffer, "max_staleness": 12,
                                        "concurrency": concurrency}}
    return {"name": "timing", "out": str(out), "devices": devices, "workers": 2, "seed": seed, "broker": "mosquitto",
            "scenario": {"preset": "digits-class", "seed": seed}, "profiles": PROFILES, "compute": "modelled",
            "time_scale": TIME_SCALE, "client": {"epochs": epochs}, "coordinator": coordinator}


def run(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One fleet file to its end (a finished one is read back); its results.json."""
    results = folder / spec["out"] / "results.json"
    if not results.exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fleet.toml").write_text(dump_toml(spec))
        done = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(folder / "fleet.toml")],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{folder}: {done.stderr[-2000:]}")
    return json.loads(results.read_text())


def slowest_round_s(results: dict[str, Any]) -> float:
    return max(m["device_seconds"] for entry in results["history"] for m in entry["metrics"].values())


def by_profile(results: dict[str, Any]) -> dict[str, int]:
    """Updates a run took, by the profile of their device (device k has the k-th in PROFILES' order)."""
    kinds = [name for name, count in PROFILES.items() for _ in range(count)]
    taken: dict[str, int] = {}
    for entry in results["history"]:
        for device in entry["received"]:
            kind = kinds[int(device.split("-")[1])]
            taken[kind] = taken.get(kind, 0) + 1
    return taken


def slowest_clock(results: dict[str, Any]) -> list[float]:
    """A synchronous run's rounds on a clock where each lasts as long as its slowest update took (had it closed
    at its last answer rather than at its deadline): the end of each round."""
    return list(np.cumsum([max((m["device_seconds"] for m in entry["metrics"].values()), default=0.0)
                           for entry in results["history"]]))


def time_to(results: dict[str, Any], clock: list[float], target: float) -> float | None:
    """The clock at the first round of the last task whose accuracy over the tasks so far reaches `target`; None
    if none does."""
    last = results["history"][-1]["task"]
    for entry, at in zip(results["history"], clock):
        if entry["task"] == last and float(np.mean(entry["accuracy"])) >= target:
            return float(at)
    return None


def measure(seed: int, epochs: int, buffer: int, concurrency: list[int], out: Path) -> dict[str, dict[str, Any]]:
    base = out / f"seed-{seed}"
    probe = run(fleet(seed, epochs, Path("run"), UNREACHED_DEADLINE_S, None), base / "probe")
    deadline = round(slowest_round_s(probe) * 1.05, 4)
    sides = {"sync": run(fleet(seed, epochs, Path("run"), deadline, None), base / "sync"),
             "sync-sampled": run(fleet(seed, epochs, Path("run"), deadline, None, sampled=buffer),
                                 base / f"sync-sampled-{buffer}"),
             **{async_side(c): run(fleet(seed, epochs, Path("run"), deadline, buffer, concurrency=c),
                                   base / (f"async-k{buffer}" + (f"-c{c}" if c else "")))
                for c in concurrency}}
    target = TARGET_SHARE * sides["sync"]["final_accuracy"]
    measured: dict[str, dict[str, Any]] = {}
    # each row: the run it reads, and the clock its rounds end on
    clocks = {side: (side, [entry["clock_s"] for entry in results["history"]]) for side, results in sides.items()}
    for side in ("sync", "sync-sampled"):
        clocks[f"{side}, rounds as long as their slowest"] = (side, slowest_clock(sides[side]))
    for side, (run_of, clock) in clocks.items():
        results = sides[run_of]
        history = results["history"]
        staleness = [m.get("staleness", 0.0) for entry in history for m in entry["metrics"].values()]
        measured[side] = {
            "end_s": clock[-1], "final": results["final_accuracy"], "to_target_s": time_to(results, clock, target),
            "updates": sum(len(entry["received"]) for entry in history), "rounds": len(history),
            "mean_staleness": float(np.mean(staleness)), "max_staleness": max(staleness),
            "stale_refused": results["counters"].get("stale", 0), "away": results["counters"].get("away", 0),
            "late": results["counters"].get("late", 0), "deadline_s": deadline, "target": target,
            "by_profile": by_profile(results),
        }
    return measured


def async_side(concurrency: int) -> str:
    return "async" if not concurrency else f"async, {concurrency} at once"


def report(table: dict[int, dict[str, dict[str, Any]]]) -> str:
    lines = ["| seed | side | deadline s | rounds | updates | end (fleet s) | time to target (fleet s) | final acc "
             "| mean / max staleness | stale refused | away | late |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, sides in table.items():
        for side, m in sides.items():
            reached = "not reached" if m["to_target_s"] is None else f"{m['to_target_s']:.3f}"
            lines.append(f"| {seed} | {side} | {m['deadline_s']:.3f} | {m['rounds']} | {m['updates']} | "
                         f"{m['end_s']:.3f} | {reached} (target {m['target']:.3f}) | {m['final']:.4f} | "
                         f"{m['mean_staleness']:.2f} / {m['max_staleness']:.0f} | {m['stale_refused']} | "
                         f"{m['away']} | {m['late']} |")
    lines.append("")

    def summary(side: str, key: str) -> str:
        values = [sides[side][key] for sides in table.values() if sides[side][key] is not None]
        return f"{np.mean(values):.3f} ± {np.std(values):.3f} (n={len(values)})" if values else "-"

    for key, name in (("end_s", "end of the run, fleet s"), ("to_target_s", "time to target, fleet s"),
                      ("final", "final accuracy")):
        lines.append(f"- {name}: " + ", ".join(f"{side} {summary(side, key)}" for side in next(iter(table.values()))))
    asynchronous = [side for side in next(iter(table.values())) if side.startswith("async")]
    for mine in asynchronous:
        for side in [side for side in next(iter(table.values())) if side.startswith("sync")]:
            for key, name in (("end_s", "end"), ("to_target_s", "time to target")):
                ratios = [sides[side][key] / sides[mine][key] for sides in table.values()
                          if sides[side][key] is not None and sides[mine][key]]
                if ratios:
                    lines.append(f"- {side}: its {name} / {mine}'s: {np.mean(ratios):.2f}x ± {np.std(ratios):.2f}")
        for side in ("sync", "sync-sampled"):
            finals = [(sides[side]["final"], sides[mine]["final"]) for sides in table.values()]
            if len(finals) > 1:
                test = stats.ttest_rel([a for a, _ in finals], [b for _, b in finals])
                lines.append(f"- final accuracy, {mine} - {side}: {np.mean([b - a for a, b in finals]):+.4f}, "
                             f"paired t-test p = {test.pvalue:.3f}")
        taken = [sides[mine]["by_profile"] for sides in table.values()]
        lines.append(f"- {mine}: updates taken by profile, summed over seeds: " + ", ".join(
            f"{p} {sum(t.get(p, 0) for t in taken)}" for p in PROFILES))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--buffer", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--concurrency", default="0,4", help="the asynchronous sides' limits on devices at work "
                        "(0: every device)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "async")
    args = parser.parse_args()
    started = time.time()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    table = {seed: measure(seed, args.epochs, args.buffer, concurrency, args.out.resolve())
             for seed in (int(s) for s in args.seeds.split(","))}
    print(report(table))
    print(f"\n({time.time() - started:.0f} s of wall time)")


if __name__ == "__main__":
    main()
