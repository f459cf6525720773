"""Poisoning: what one hostile device among 4, and two among 8, do to final accuracy, under the default settings
and each robust rule, every run a real fleet.

Each cell is `edgefil fleet run` (mosquitto, the coordinator, virtual devices in worker processes) on class-
incremental digits or Fashion-MNIST (`--scenarios digits-class,fashion-class`): 5 tasks of 2 classes, 3 rounds a
task, every device in every round, E = 10 local epochs of AdamW, random caching at the fleet's binding M. The data
are split into 4 (8, 20) shares; the honest devices hold the first 3 (6, 16). The clean run is the honest devices
alone; an attacked run adds the compromised devices, which hold the last shares, train honestly on them, and send
what their attack makes of it (firmware_sim/adversary.py: scaled, sign-flip, huge, nan, samples, boosted, drift,
lazy, tinynoise, reversed-step, and the literature's alie, ipm, min-max, min-sum, fang, mimic, gaussian, label-flip,
head-scale; and against a method's payloads, in its scenarios, GLFC's prototype-flood, prototype-lie and
prototype-extreme and SDD's statistics-extreme: firmware_sim/payload_attacks/). So the difference between an
attacked run and the clean run of the same seed is what the attack does, and nothing else where the runs are
deterministic: in every fleet that a round holds whole (the guard's `hold`, 8 updates: the fleets of 4 and 8, and
plain FedAvg in any fleet), where an attack the settings remove entirely leaves the clean run's trajectory exactly as
it was. In the fleet of 20 the default bounds the updates after the first 8 by the medians over those so far, in the
order they arrive, which the host's timing decides: one seed's clean run at 4 of 20 ended at 0.499, 0.490 and 0.443
in three runs (plain FedAvg's at 0.5346 each time; issue 56). There a cell's difference is the attack plus that
order's noise, which the mean over seeds averages and the paired test does not remove.

Settings (`--settings`): `default` (a coordinator file without [guard] or [strategy]: with calibration samples, as
in the `-cal` splits, FedAvg after the calibration reference with its trust weight and the size, direction and
influence bounds; without them, Krum selection in their place: coordinator/guard.py), `fedavg` (plain FedAvg: every
bound and check off), `multi-krum` (the default before issue 56: Krum selection and the size bounds), the robust
rules after the default bounds (`median`, `trimmed-mean`, `centered-clip`), and two variants of the default
(`default-krum`: Krum selection beside the reference; `influence`: claims capped and distances clipped instead of
refused), and the default with a part left out (`no-trust`: the trust weight; `no-influence`: the way back and the
head-row bound; `no-way-back`: the way back alone), and the default before two of its changes (`whole-krum`: Krum
comparing whole updates; `trust-net`: the trust weight on an update's net loss change). Printed per setting and
fleet: the clean final accuracy (mean ± std over seeds, %), its difference from plain FedAvg's clean run, and per
attack the mean ± std over seeds of (attacked - clean) in points, paired by seed, and in brackets the share of
honest updates refused (the honest devices' updates received but not aggregated, over the seeds' rounds); a cell 3
points or more away is marked `!`, one where a run failed (every device diverged, so no round could reach its
quorum) `f`, counted with its last completed round's model. The clean column's brackets are the clean runs' own
honest refusals. "All honest" is the fleet with every device honest (the compromised devices' shares held by honest
devices: what the issue's "clean 4-device run" is, and where a rule that reads novelty as attack refuses honest
updates), against plain FedAvg's same run, with its honest refusals; below the table, why they were refused, and the
runs without attack against plain FedAvg's, paired by seed, on the final accuracy and on the average incremental
accuracy (steadier: one round's weights swing the final accuracy by several points in these fleets). With
`--by-attack`, per fleet a row per attack and a column per setting, then the same against the all-honest fleet of
the seed: what the attack does once the compromised devices' own data count on both sides (the methods' payload
attacks send honest weights; in a fleet of 20 the clean fleet of 16 and the all-honest one end up to 15 points apart).

Scenarios (`--scenarios`): `digits-class` and `fashion-class` (the presets: Dirichlet 1 label split), and the
splits where honest devices look least alike: `digits-skewed` (Dirichlet 0.1) and `digits-dynamics` (GLFC's client
dynamics: a device of 8 joins at each task holding only the task's classes, a tenth of those there keep only their
old data, and each device with new data holds one of the task's two classes), `digits-domain` (four domains of every
class, Dirichlet 0.1), and each of these with `-cal`: 10 train samples of each class kept from every device for the
calibration reference.

Every cell runs in a process of its own and writes `cell.json` in its folder; a finished cell is read back, not
run again, so an interrupted matrix resumes.

    .venv/bin/python benchmarks/poisoning.py [--seeds 0,1,2] [--settings default,fedavg,median,...]
        [--attacks scaled,... | clean] [--fleets 4,8,20] [--scenarios digits-class,fashion-class]
        [--out runs/poisoning]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.guard_settings import OFF, SIZE_BOUNDS_ONLY  # noqa: E402
from edgefil.metrics import accuracy_matrix, average_incremental_accuracy  # noqa: E402
from edgefil.settings import dump_toml  # noqa: E402
from firmware_sim.adversary import ATTACKS, attack_names  # noqa: E402
from firmware_sim.payload_attacks import PAYLOAD_ATTACKS  # noqa: E402
from firmware_sim.scenarios import PRESETS, scenario_from_config, shared_build  # noqa: E402

FLEETS = {4: 1, 8: 2, 20: 4}  # devices: of which hostile



@dataclass(frozen=True)
class Split:
    """A scenario of the matrix: a preset, its LeNet input, and what it changes of the preset's split."""

    preset: str
    shape: tuple[int, ...]
    alpha: float | None = None  # the Dirichlet concentration of the label split (None: the preset's, 1)
    dynamics: bool = False  # GLFC's client dynamics: devices joining with new classes only, one class a device
    method: dict[str, Any] | None = None  # a method's fleet tables (policy, strategy, trainer, coordinator keys)
    calibration: int = 0  # train samples a class the coordinator keeps (the `reference` setting's), none on devices


def sdd_fleet(aggregation: str, row_bound: float | None) -> dict[str, Any]:
    """SDD's fleet tables (docs/methods/sdd.md): `row_bound` None keeps the rule's default."""
    strategy: dict[str, Any] = {"name": "sdd", "input_range": [0.0, 1.0], "aggregation": aggregation}
    if row_bound is not None:
        strategy["row_bound"] = row_bound
    return {"policy": {"name": "sdd"}, "strategy": strategy,
            "trainer": {"backend": "portable", "optimizer": "sgd", "lr": 0.1},
            "coordinator": {"rounds_per_task": 1, "host": {"epochs": 20}}}


# GLFC's fleet (docs/methods/glfc.md): its device policy, and its rule with the proxy (unweighted FedAvg after the
# bounds); Gamma the default, the authors' sigmoid LeNet
GLFC_FLEET: dict[str, Any] = {"policy": {"name": "glfc"}, "strategy": {"name": "glfc", "input_range": [0.0, 1.0]}}
SCENARIOS = {
    "digits-class": Split("digits-class", (1, 8, 8)),
    "fashion-class": Split("fashion-class", (1, 28, 28)),
    # the splits in which honest devices look least alike: few classes a device, and devices that join late
    "digits-skewed": Split("digits-class", (1, 8, 8), alpha=0.1),
    "digits-dynamics": Split("digits-class", (1, 8, 8), dynamics=True),
    "digits-domain": Split("digits-domain", (1, 8, 8)),  # Dirichlet 0.1, every class in every task
    "digits-glfc": Split("digits-class", (1, 8, 8), method=GLFC_FLEET),
    # a method's own aggregation: SDD's few-shot sessions (docs/methods/sdd.md's fleet), its rule after the bounds,
    # as printed (Eq. 17's sum) and normalised, each with its row bound (the default) and without it
    **{f"digits-sdd{form}{bound}": Split("digits-fewshot", (1, 8, 8), method=sdd_fleet(
        "cswa-normalized" if form else "cswa-literal", 0.0 if bound else None))
       for form in ("", "-normalized") for bound in ("", "-unbounded")},
}
CALIBRATION = 10  # a class's calibration samples in the "-cal" splits (digits: about 7 % of a class's train images)
SCENARIOS.update({f"{name}-cal": dataclasses.replace(SCENARIOS[name], calibration=CALIBRATION)
                  for name in ("digits-class", "fashion-class", "digits-skewed", "digits-dynamics", "digits-domain",
                               "digits-glfc")})
# the guard before issue 56's default: Krum selection in every round and the size bounds, nothing compared with the
# calibration samples, no direction or influence bound
MULTI_KRUM = {**{key: value for key, value in SIZE_BOUNDS_ONLY.items() if key != "krum_share"}, "krum_when": "always"}
SETTINGS: dict[str, dict[str, Any]] = {
    # a coordinator file without [guard] or [strategy]: with calibration samples (the "-cal" splits), the reference
    # and its trust weight, the size, direction and influence bounds, FedAvg; without them, Krum selection instead
    "default": {},
    "fedavg": {"strategy": {"name": "fedavg"},  # plain FedAvg: every bound and check off
               "coordinator": {"guard": OFF, "checkpoint": {"explode_factor": 0.0, "collapse_drop": 0.0}}},
    "multi-krum": {"coordinator": {"guard": MULTI_KRUM}},  # the default before issue 56
    "median": {"strategy": {"name": "median"}},  # each robust rule after the default bounds
    "trimmed-mean": {"strategy": {"name": "trimmed-mean"}},
    "centered-clip": {"strategy": {"name": "centered-clip"}},
    # the default with Krum selection in the rounds that have a reference too
    "default-krum": {"coordinator": {"guard": {"krum_when": "always"}}},
    # the default's Krum selection (rounds without calibration samples) comparing whole updates, without the floor:
    # the default before it compared what neither update's classes own (issue 56)
    "whole-krum": {"coordinator": {"guard": {"krum_compare": "whole", "krum_floor": 0.0}}},
    # the default's parts, each left out: what it costs an honest fleet and what it holds
    "no-trust": {"coordinator": {"guard": {"trust_margin": 0.0}}},
    # the trust weight on an update's net loss change over its whole mix: the default before it counted what the
    # update lowered (issue 56)
    "trust-net": {"coordinator": {"guard": {"trust_on": "net"}}},
    "no-influence": {"coordinator": {"guard": {"way_back": "off", "row_factor": 0.0}}},
    "no-way-back": {"coordinator": {"guard": {"way_back": "off"}}},
    # the default refusing nothing for its size (claims capped, distances clipped), which the trust weight was to
    # make safe: two colluders' scaled updates, clipped, took 16 points (issue 56)
    "influence": {"coordinator": {"guard": {"sample_bound": "cap", "norm_bound": "clip"}}},
}
NO_ATTACK = ("clean", "all-honest")
REFUSALS = ("samples-rejected", "norm-rejected", "free-rider", "krum-outlier", "misaligned",  # the guard's counters
            "worse-on-own-classes", "unreached-classes", "misplaced-classes", "undoes-last-step")
CELL_FILE = "cell.json"
MARK = 3.0  # points: a cell this far from its clean run is marked


@dataclass(frozen=True)
class Cell:
    scenario: str
    setting: str
    devices: int  # the fleet's, hostile ones included (the scenario's shares)
    attack: str  # "clean": the honest devices alone; "all-honest": every device of the fleet honest
    seed: int

    @property
    def hostile(self) -> int:
        return 0 if self.attack in NO_ATTACK else FLEETS[self.devices]

    @property
    def honest(self) -> int:
        return self.devices if self.attack == "all-honest" else self.devices - FLEETS[self.devices]

    @property
    def joining(self) -> int:
        """Devices joining at each task (client dynamics): one of 8, none of 4, 2 of 20."""
        return self.devices // 8 if SCENARIOS[self.scenario].dynamics else 0

    def quorum(self, scenario: dict[str, Any]) -> int:
        """The round quorum: every honest device that holds data of the first task (one that joins later holds none
        before; at 20 shares of digits one may hold no sample of the first task's classes). Such a device says it
        has no data and is not waited for; counted in the quorum, it would keep round 1 from ever closing. Devices
        that diverge still fail the quorum (the `f` cells)."""
        data = shared_build(scenario_from_config(scenario))
        holding = sum(data.client_first_task(k) == 0 for k in range(self.honest))
        return max(1, holding)

    def folder(self, out: Path) -> Path:
        return out / self.scenario / self.setting / f"{self.honest}of{self.devices}" / self.attack / f"seed-{self.seed}"

    def fleet(self, out: Path) -> dict[str, Any]:
        setting = SETTINGS[self.setting]
        split = SCENARIOS[self.scenario]
        method = split.method or {}
        scenario: dict[str, Any] = {"preset": split.preset, "n_clients": self.devices, "seed": self.seed}
        if split.alpha is not None:
            scenario["alpha"] = split.alpha
        if split.calibration:
            scenario["calibration"] = split.calibration
        if split.dynamics:  # a device of 8 joins at each task (none of 4, 2 of 20); one class of two a device
            scenario.update(dynamics="glfc", joining=self.joining)
        preset = PRESETS[split.preset]
        if preset.kind == "few-shot" and (preset.classes_per_task or 0) * (preset.shots or 0) < self.devices:
            # a session's N K samples are one a device at least (the kind refuses fewer): at 20 devices digits'
            # 2-way 5-shot sessions become 2-way 10-shot
            scenario["shots"] = -(-self.devices // (preset.classes_per_task or 1))
        coordinator = {"rounds_per_task": 3, "min_clients": self.quorum(scenario), "deadline_s": 120.0,
                       "wait_for_devices_s": 120.0, **method.get("coordinator", {}), **setting.get("coordinator", {})}
        table: dict[str, Any] = {
            "name": "poisoning", "out": str(self.folder(out)), "devices": self.honest + self.hostile,
            "model": "lenet", "seed": self.seed, "broker": "mosquitto", "scenario": scenario,
            "policy": method.get("policy", {"name": "random"}), "client": {"epochs": 10}, "coordinator": coordinator,
        }
        if "trainer" in method:
            table["trainer"] = method["trainer"]
        # a method's scenario keeps its rule: its `fedavg` setting is that rule with every bound and check off
        strategy = method.get("strategy", setting.get("strategy"))
        if strategy is not None:
            table["strategy"] = strategy
        if self.hostile:
            table["adversary"] = {"attack": self.attack, "devices": self.hostile}
        return table


def applying(attacks: list[str], scenario: str) -> list[str]:
    """Those of `attacks` that apply to `scenario`: every attack on weights, and an attack on a method's payloads
    where the scenario's devices run that method."""
    policy = (SCENARIOS[scenario].method or {}).get("policy", {"name": "random"})["name"]
    return [a for a in attacks if a in ATTACKS or a in NO_ATTACK or PAYLOAD_ATTACKS.get(a).method == policy]


def run_cell(cell: Cell, out: Path, artifacts: Path) -> dict[str, Any]:
    """The cell's final accuracy and counters: read back when done before, else run in a process of its own."""
    folder = cell.folder(out)
    done = folder / CELL_FILE
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(artifacts, folder / "artifacts", copy_function=os.link)  # exported once per scenario
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
              **honest_refusals(results, cell.honest), "seconds": time.monotonic() - started}
    done.write_text(json.dumps(record, indent=1))
    return record


def honest_refusals(results: dict[str, Any], honest: int) -> dict[str, int]:
    """How many of the honest devices' (the first `honest` of the fleet) updates arrived, and how many of those the
    round refused (received, not aggregated: a round's `metrics` name the aggregated ones)."""
    names = sorted({d for entry in results["history"] for d in entry["received"]})[:honest]
    received = sum(d in entry["received"] for entry in results["history"] for d in names)
    refused = sum(d in entry["received"] and d not in entry["metrics"] for entry in results["history"] for d in names)
    return {"honest_received": received, "honest_refused": refused}


def export_once(out: Path, scenario: str) -> Path:
    from models.export import export_registered

    shape = SCENARIOS[scenario].shape
    artifacts = out / f"artifacts-lenet-{'x'.join(map(str, shape))}"
    if not (artifacts / "manifest.json").is_file():
        shutil.rmtree(artifacts, ignore_errors=True)
        export_registered("lenet", 10, artifacts, shape, seed=0, backends=("portable", "torch"))
    return artifacts


def last_rounds(record: dict[str, Any]) -> str:
    """", last rounds 0.812 ± 0.010 (3)": the mean over the last task's rounds, where the record has it."""
    last = record.get("last_rounds_accuracy")
    return "" if not last else f", last rounds {last['mean']:.3f} ± {last['std']:.3f} ({last['rounds']})"


def points(values: list[float]) -> str:
    mean, std = 100 * float(np.mean(values)), 100 * float(np.std(values))
    return f"{mean:+5.1f} ± {std:3.1f}"


def refused(cells: list[dict[str, Any]]) -> str:
    """"(1.2 %)": the share of honest updates refused over `cells` (cells run before it was recorded: "(?)")."""
    if not all("honest_received" in cell for cell in cells):
        return "(?)"
    received = sum(cell["honest_received"] for cell in cells)
    return f"({100 * sum(cell['honest_refused'] for cell in cells) / max(received, 1):.1f} %)"


def table(results: dict[Cell, dict[str, Any]], scenario: str, settings: list[str], attacks: list[str],
          seeds: list[int], fleets: list[int]) -> str:
    lines = []
    header = (f"{'setting':<18}{'fleet':<8}{'clean %':>22}{'vs fedavg':>14}{'all honest vs fedavg':>26}"
              + "".join(f"{a:>24}" for a in attacks))
    lines.append(header)
    for setting in settings:
        for devices in fleets:
            clean_cells = [results[Cell(scenario, setting, devices, "clean", s)] for s in seeds]
            clean = [cell["final_accuracy"] for cell in clean_cells]
            row = f"{setting:<18}{f'{FLEETS[devices]} of {devices}':<8}"
            row += f"{f'{100 * np.mean(clean):.1f} ± {100 * np.std(clean):3.1f} {refused(clean_cells)}':>22}"
            row += f"{points(against_fedavg(results, Cell(scenario, setting, devices, 'clean', 0), seeds)):>14}"
            everyone = [results[Cell(scenario, setting, devices, "all-honest", s)] for s in seeds]
            all_honest = against_fedavg(results, Cell(scenario, setting, devices, "all-honest", 0), seeds)
            row += f"{points(all_honest) + ' ' + refused(everyone) + marked(all_honest, everyone):>26}"
            for attack in attacks:
                cells = [results[Cell(scenario, setting, devices, attack, s)] for s in seeds]
                diff = [cell["final_accuracy"] - c for cell, c in zip(cells, clean)]
                row += f"{points(diff) + ' ' + refused(cells) + marked(diff, cells):>24}"
            lines.append(row)
    return "\n".join(lines)


def by_attack(results: dict[Cell, dict[str, Any]], scenario: str, settings: list[str], attacks: list[str],
              seeds: list[int], devices: int, baseline: str = "clean") -> str:
    """`table` turned for one fleet: a row per attack (the all-honest fleet against plain FedAvg first, where the
    baseline is the clean run), a column per setting, each cell the mean ± std change from the setting's `baseline`
    run of the same seed, the honest refusals and the mark.

    Against the clean run (the honest devices alone) an attack's change includes what the compromised devices' own
    data add where their update keeps an honest part; against the all-honest run (every device honest) it is what
    the attack itself does. The second is the comparison for the methods' payload attacks, whose weights are honest
    (GLFC's prototype gradients, SDD's statistics): in a fleet of 20 the fleets of 16 and 20 end up to 15 points
    apart at one seed (docs/results.md, issue 56)."""
    lines = [f"{'attack':<15}" + "".join(f"{setting:>24}" for setting in settings)]
    for attack in ["all-honest", *attacks] if baseline == "clean" else attacks:
        row = f"{attack:<15}"
        for setting in settings:
            cells = [results[Cell(scenario, setting, devices, attack, s)] for s in seeds]
            if attack == "all-honest":
                diff = against_fedavg(results, Cell(scenario, setting, devices, attack, 0), seeds)
            else:
                base = [results[Cell(scenario, setting, devices, baseline, s)]["final_accuracy"] for s in seeds]
                diff = [cell["final_accuracy"] - b for cell, b in zip(cells, base)]
            row += f"{points(diff) + ' ' + refused(cells) + marked(diff, cells):>24}"
        lines.append(row)
    return "\n".join(lines)


def against_fedavg(results: dict[Cell, dict[str, Any]], cell: Cell, seeds: list[int],
                   measure: Callable[[dict[str, Any]], float] | None = None) -> list[float]:
    """A run without attack (`cell`'s, any seed) against plain FedAvg's same run, per seed, on `measure` (a cell's
    record to a number; its final accuracy by default)."""
    read = measure or final_accuracy
    return [read(results[dataclasses.replace(cell, seed=s)])
            - read(results[dataclasses.replace(cell, setting="fedavg", seed=s)]) for s in seeds]


def final_accuracy(record: dict[str, Any]) -> float:
    return float(record["final_accuracy"])


def average_incremental(record: dict[str, Any]) -> float:
    """A cell's average incremental accuracy (edgefil.metrics), from its accuracy matrix: steadier than the final
    accuracy, which one round's weights swing by several points in these fleets (docs/results.md, issue 56)."""
    return average_incremental_accuracy(accuracy_matrix(record["accuracy_matrix"]))


def marked(diff: list[float], cells: list[dict[str, Any]]) -> str:
    """`!` for a mean change of MARK points or more, `f` where a run failed."""
    mark = "!" if abs(100 * np.mean(diff)) >= MARK else " "
    return mark + ("f" if any(cell.get("outcome", "complete") != "complete" for cell in cells) else " ")


def refusal_causes(results: dict[Cell, dict[str, Any]], scenario: str, setting: str, seeds: list[int],
                   fleets: list[int]) -> str:
    """Why the guard refused honest updates in the runs without attack (every device honest), per fleet."""
    parts = []
    for devices in fleets:
        counters: Counter[str] = Counter()
        for s in seeds:
            counters.update({k: v for k, v in results[Cell(scenario, setting, devices, "all-honest", s)]["counters"]
                             .items() if k in REFUSALS})
        causes = ", ".join(f"{k} {v}" for k, v in counters.most_common()) or "none"
        parts.append(f"{devices} devices: {causes}")
    return f"{setting}: honest updates refused, by cause: " + "; ".join(parts)


def paired(results: dict[Cell, dict[str, Any]], scenario: str, setting: str, seeds: list[int],
           fleets: list[int]) -> str:
    """The runs without attack of `setting` (clean and all honest) against plain FedAvg's, paired by seed: on the
    final accuracy and on the average incremental accuracy."""
    final, average = ([d for devices in fleets for kind in NO_ATTACK
                       for d in against_fedavg(results, Cell(scenario, setting, devices, kind, 0), seeds, measure)]
                      for measure in (final_accuracy, average_incremental))
    if np.allclose(final, 0) and np.allclose(average, 0):
        return f"{setting}: runs without attack identical to plain FedAvg's in every pair ({len(final)})"
    return (f"{setting}: without attack - plain FedAvg {points(final)} points over {len(final)} pairs, paired t-test "
            f"p {p_value(final)}; average incremental accuracy {points(average)}, p {p_value(average)}")


def p_value(diffs: list[float]) -> str:
    """The paired t-test's p of `diffs` against 0 ("-" where every pair is equal)."""
    return "-" if np.allclose(diffs, 0) else f"{stats.ttest_1samp(diffs, 0.0).pvalue:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--attacks", default=",".join(attack_names()),
                        help="each scenario runs those of them that apply to it (`applying`)")
    parser.add_argument("--fleets", default=",".join(map(str, FLEETS)))
    parser.add_argument("--scenarios", default="digits-class,fashion-class", help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", default="runs/poisoning")
    parser.add_argument("--by-attack", action="store_true", help="also a table per fleet with a row per attack")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    attacks = [a for a in args.attacks.split(",") if a and a not in NO_ATTACK]  # the runs without attack always run
    fleets = [int(d) for d in args.fleets.split(",")]
    scenarios = args.scenarios.split(",")
    for scenario in scenarios:
        ruled = [s for s in settings if SCENARIOS[scenario].method and "strategy" in SETTINGS[s] and s != "fedavg"]
        if ruled:
            parser.error(f"{scenario} runs its method's own rule: {', '.join(ruled)} would replace it")
    unknown = [a for a in attacks if a not in attack_names()]
    if unknown:
        parser.error(f"unknown attacks {', '.join(unknown)}; choose of {', '.join(attack_names())}")
    out = Path(args.out).resolve()
    cells = [Cell(scenario, setting, devices, attack, seed) for scenario in scenarios
             for setting in dict.fromkeys(["fedavg", *settings])
             for devices in fleets
             for attack in [*NO_ATTACK, *(applying(attacks, scenario) if setting in settings else [])]
             for seed in seeds]
    results = {}
    started = time.monotonic()
    for k, cell in enumerate(cells, 1):
        results[cell] = run_cell(cell, out, export_once(out, cell.scenario))
        print(f"[{k}/{len(cells)} {time.monotonic() - started:6.0f} s] {cell.scenario} {cell.setting} "
              f"{cell.honest}+{cell.hostile} {cell.attack} seed {cell.seed}: final "
              f"{results[cell]['final_accuracy']:.3f}{last_rounds(results[cell])}", flush=True)
    for scenario in scenarios:
        print(f"\npoisoning: {scenario}, E = 10, seeds {args.seeds}; final accuracy of the clean "
              f"run (%) and each attack's change from it (points, mean ± std over seeds, paired), honest updates "
              f"refused in brackets\n")
        print(table(results, scenario, settings, applying(attacks, scenario), seeds, fleets))
        print()
        for devices in fleets if args.by_attack else []:
            print(f"{FLEETS[devices]} of {devices}, by attack:\n"
                  f"{by_attack(results, scenario, settings, applying(attacks, scenario), seeds, devices)}\n")
        for devices in fleets if args.by_attack and applying(attacks, scenario) else []:
            turned = by_attack(results, scenario, settings, applying(attacks, scenario), seeds, devices, "all-honest")
            print(f"{FLEETS[devices]} of {devices}, by attack, against the all-honest fleet of {devices}:\n{turned}\n")
        for setting in settings:
            if setting != "fedavg":
                print(paired(results, scenario, setting, seeds, fleets))
                print(refusal_causes(results, scenario, setting, seeds, fleets))


if __name__ == "__main__":
    main()
