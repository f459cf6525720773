"""Poisoning: what one hostile device among 4, and two among 8, do to final accuracy, under the default settings
and each robust rule, every run a real fleet.

Each cell is `edgefil fleet run` (mosquitto, the coordinator, virtual devices in worker processes) on class-
incremental digits: 5 tasks of 2 classes, 3 rounds a task, every device in every round, E = 10 local epochs of
AdamW, random caching at the fleet's binding M. The data are split into 4 (8) shares; the honest devices hold the
first 3 (6). The clean run is the honest devices alone; an attacked run adds the compromised devices, which hold
the last shares, train honestly on them, and send what their attack makes of it (firmware_sim/adversary.py: scaled,
sign-flip, huge, nan, samples, boosted, drift, lazy). So the difference between an attacked run and the clean run
of the same seed is what the attack does, and nothing else: the runs are deterministic, and an attack the settings
remove entirely leaves the clean run's trajectory exactly as it was.

Settings (`--settings`): `default` (a coordinator file without [guard] or [strategy]: FedAvg after the guard's
bounds and Krum selection, which together are Multi-Krum), `fedavg` (plain FedAvg: every bound and check off),
`no-krum` (the default bounds without Krum selection), and the robust rules after the default bounds (`median`,
`trimmed-mean`, `centered-clip`). Printed per setting and fleet: the clean final accuracy (mean ±
std over seeds, %), its difference from plain FedAvg's clean run, and per attack the mean ± std over seeds of
(attacked - clean) in points, paired by seed; a cell 3 points or more away is marked `!`, one where a run failed
(every device diverged, so no round could reach its quorum) `f`, counted with its last completed round's model.

Every cell runs in a process of its own and writes `cell.json` in its folder; a finished cell is read back, not
run again, so an interrupted matrix resumes.

    .venv/bin/python benchmarks/poisoning.py [--seeds 0,1,2] [--settings default,fedavg,median,...]
        [--attacks scaled,... | clean] [--fleets 4,8] [--out runs/poisoning]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefil.settings import dump_toml  # noqa: E402
from firmware_sim.adversary import ATTACKS  # noqa: E402

FLEETS = {4: 1, 8: 2}  # devices: of which hostile
PLAIN_GUARD = {"norm_bound": "off", "sample_factor": 0.0, "free_rider_factor": 0.0, "krum_share": 0.0}
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},  # a coordinator file without [guard] or [strategy]
    "fedavg": {"strategy": {"name": "fedavg"},  # plain FedAvg: every bound and check off
               "coordinator": {"guard": PLAIN_GUARD, "checkpoint": {"explode_factor": 0.0, "collapse_drop": 0.0}}},
    "no-krum": {"coordinator": {"guard": {"krum_share": 0.0}}},  # the default bounds without Krum selection
    "median": {"strategy": {"name": "median"}},  # each robust rule after the default bounds
    "trimmed-mean": {"strategy": {"name": "trimmed-mean"}},
    "centered-clip": {"strategy": {"name": "centered-clip"}},
}
CELL_FILE = "cell.json"
MARK = 3.0  # points: a cell this far from its clean run is marked


@dataclass(frozen=True)
class Cell:
    setting: str
    devices: int  # the fleet's, hostile ones included (the scenario's shares)
    attack: str  # "clean": the honest devices alone
    seed: int

    @property
    def hostile(self) -> int:
        return 0 if self.attack == "clean" else FLEETS[self.devices]

    @property
    def honest(self) -> int:
        return self.devices - FLEETS[self.devices]

    def folder(self, out: Path) -> Path:
        return out / self.setting / f"{self.honest}of{self.devices}" / self.attack / f"seed-{self.seed}"

    def fleet(self, out: Path) -> dict[str, Any]:
        setting = SETTINGS[self.setting]
        coordinator = {"rounds_per_task": 3, "min_clients": self.honest, "deadline_s": 120.0,
                       "wait_for_devices_s": 120.0, **setting.get("coordinator", {})}
        table: dict[str, Any] = {
            "name": "poisoning", "out": str(self.folder(out)), "devices": self.honest + self.hostile,
            "model": "lenet", "seed": self.seed, "broker": "mosquitto",
            "scenario": {"preset": "digits-class", "n_clients": self.devices, "seed": self.seed},
            "policy": {"name": "random"}, "client": {"epochs": 10}, "coordinator": coordinator,
        }
        if "strategy" in setting:
            table["strategy"] = setting["strategy"]
        if self.hostile:
            table["adversary"] = {"attack": self.attack, "devices": self.hostile}
        return table


def run_cell(cell: Cell, out: Path, artifacts: Path) -> dict[str, Any]:
    """The cell's final accuracy and counters: read back when done before, else run in a process of its own."""
    folder = cell.folder(out)
    done = folder / CELL_FILE
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(artifacts, folder / "artifacts", copy_function=os.link)  # exported once for every cell
    file = folder / "fleet.toml"
    file.write_text(dump_toml(cell.fleet(out)))
    started = time.monotonic()
    finished = subprocess.run([sys.executable, "-m", "edgefil.cli", "--log-level", "warning", "fleet", "run",
                               str(file)], cwd=ROOT, capture_output=True, text=True)
    if not (folder / "results.json").is_file():
        raise RuntimeError(f"{cell}: exit {finished.returncode}, no results.json\n{finished.stderr[-3000:]}")
    results = json.loads((folder / "results.json").read_text())
    # a run that failed (plain FedAvg under some attacks: every device diverges, no round reaches its quorum) counts
    # with the model of its last completed round, and is marked in the table
    record = {"final_accuracy": results["final_accuracy"], "last_rounds_accuracy": results["last_rounds_accuracy"],
              "outcome": results["outcome"],
              "counters": results["counters"], "accuracy_matrix": results["accuracy_matrix"],
              "seconds": time.monotonic() - started}
    done.write_text(json.dumps(record, indent=1))
    return record


def export_once(out: Path) -> Path:
    from models.export import export_registered

    artifacts = out / "artifacts-lenet"
    if not (artifacts / "manifest.json").is_file():
        shutil.rmtree(artifacts, ignore_errors=True)
        export_registered("lenet", 10, artifacts, (1, 8, 8), seed=0, backends=("portable", "torch"))
    return artifacts


def last_rounds(record: dict[str, Any]) -> str:
    """", last rounds 0.812 ± 0.010 (3)": the mean over the last task's rounds, where the record has it."""
    last = record.get("last_rounds_accuracy")
    return "" if not last else f", last rounds {last['mean']:.3f} ± {last['std']:.3f} ({last['rounds']})"


def points(values: list[float]) -> str:
    mean, std = 100 * float(np.mean(values)), 100 * float(np.std(values))
    return f"{mean:+5.1f} ± {std:3.1f}"


def table(results: dict[Cell, dict[str, Any]], settings: list[str], attacks: list[str], seeds: list[int],
          fleets: list[int]) -> str:
    lines = []
    header = f"{'setting':<14}{'fleet':<7}{'clean %':>13}{'vs fedavg':>14}" + "".join(f"{a:>15}" for a in attacks)
    lines.append(header)
    for setting in settings:
        for devices in fleets:
            clean = [results[Cell(setting, devices, "clean", s)]["final_accuracy"] for s in seeds]
            plain = [results[Cell("fedavg", devices, "clean", s)]["final_accuracy"] for s in seeds]
            vs = np.subtract(clean, plain).tolist()
            row = f"{setting:<14}{f'{FLEETS[devices]} of {devices}':<7}"
            row += f"{100 * np.mean(clean):>7.1f} ± {100 * np.std(clean):3.1f}{points(vs):>14}"
            for attack in attacks:
                cells = [results[Cell(setting, devices, attack, s)] for s in seeds]
                diff = [cell["final_accuracy"] - c for cell, c in zip(cells, clean)]
                mark = "!" if abs(100 * np.mean(diff)) >= MARK else " "
                mark += "f" if any(cell.get("outcome", "complete") != "complete" for cell in cells) else " "
                row += f"{points(diff) + mark:>15}"
            lines.append(row)
    return "\n".join(lines)


def paired(results: dict[Cell, dict[str, Any]], setting: str, seeds: list[int], fleets: list[int]) -> str:
    """The clean runs of `setting` against plain FedAvg's, paired by seed (every fleet)."""
    diffs = [results[Cell(setting, d, "clean", s)]["final_accuracy"] - results[Cell("fedavg", d, "clean", s)]
             ["final_accuracy"] for d in fleets for s in seeds]
    if np.allclose(diffs, 0):
        return f"{setting}: clean runs identical to plain FedAvg's in every pair ({len(diffs)})"
    test = stats.ttest_1samp(diffs, 0.0)
    return f"{setting}: clean - plain FedAvg {points(diffs)} points over {len(diffs)} pairs, paired t-test p {test.pvalue:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--fleets", default=",".join(map(str, FLEETS)))
    parser.add_argument("--out", default="runs/poisoning")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    attacks = [a for a in args.attacks.split(",") if a and a != "clean"]  # the clean run is always run
    fleets = [int(d) for d in args.fleets.split(",")]
    out = Path(args.out).resolve()
    artifacts = export_once(out)
    cells = [Cell(setting, devices, attack, seed) for setting in dict.fromkeys(["fedavg", *settings])
             for devices in fleets for attack in ["clean", *(attacks if setting in settings else [])]
             for seed in seeds]
    results = {}
    started = time.monotonic()
    for k, cell in enumerate(cells, 1):
        results[cell] = run_cell(cell, out, artifacts)
        print(f"[{k}/{len(cells)} {time.monotonic() - started:6.0f} s] {cell.setting} {cell.honest}+{cell.hostile} "
              f"{cell.attack} seed {cell.seed}: final {results[cell]['final_accuracy']:.3f}{last_rounds(results[cell])}",
              flush=True)
    print(f"\npoisoning: class-incremental digits, 5 tasks x 3 rounds, E = 10, seeds {args.seeds}; final accuracy "
          f"of the clean run (%) and each attack's change from it (points, mean ± std over seeds, paired)\n")
    print(table(results, settings, attacks, seeds, fleets))
    print()
    for setting in settings:
        if setting != "fedavg":
            print(paired(results, setting, seeds, fleets))


if __name__ == "__main__":
    main()
