"""The README's main job: a fleet of virtual devices of mixed profiles (10 by default) on the embedded
class-incremental digits, run once per method at the same replay budget M — Re-Fed caching, random caching, and
the Fixed baseline (trained on the first task only) — over the embedded broker, then the comparison table and
plots (firmware_sim/report.py). Each run is a real `edgefil fleet run`: coordinator, device daemons, MQTT.

The regime is the papers' (shared/specs/refed.md), scaled to minutes on two cores:
- every task is learned in its own rounds: E = 10 local epochs of AdamW (lr 3e-3) a round, 4 rounds a task (with 3,
  seed 1's first task stopped at 0.86: its two duty-cycled Pi Zeros are offline in round 1; with 4 it reaches 0.98);
- the budget binds: M defaults to N_task (1 + 0.25 (T - 1)) with N_task the mean size of one device's task, so at
  the last task a device caches about a quarter of its old data (`budget_for`; the README says how to pick M);
- every run aggregates with Re-Fed's server rule, the unweighted mean (Algorithm 2), so only the cache differs;
- Re-Fed's PIM takes 40 epochs at most and stops once an epoch gains less than 5 % (`pim_tolerance`), scoring with
  exact per-sample gradient norms (a device caches a few dozen samples here, so the exact score is affordable).
Each demo writes a new numbered folder under `out` (run-1, run-2, ...), so running it again never meets an old run.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.guard_settings import SIZE_BOUNDS_ONLY, GuardSettings
from edge_client.config import StoreSettings, TrainerSettings
from edge_client.privacy import LocalPrivacySettings
from edgefil.settings import Where
from firmware_sim.fleet import Fleet
from firmware_sim.fleet_config import FleetConfig
from firmware_sim.report import compare_runs
from firmware_sim.scenarios import OLD_DATA_CACHED, check_scenario

# A mixed fleet, cycled over the devices: slow Wi-Fi boards, a duty-cycled Pi Zero, Jetsons, one x86 box.
PROFILE_CYCLE = (
    "raspberry-pi-4-4gb", "jetson-nano", "raspberry-pi-zero-2w", "jetson-orin-nano", "raspberry-pi-4-4gb",
    "generic", "jetson-nano", "raspberry-pi-zero-2w", "raspberry-pi-4-4gb", "jetson-orin-nano",
)
REFED = {"name": "refed", "pim_epochs": 40, "pim_tolerance": 0.05, "importance": "exact"}
METHODS: dict[str, dict[str, Any]] = {
    "refed": {"policy": REFED},
    "random": {"policy": {"name": "random"}},
    "fixed": {"policy": {"name": "random"}, "coordinator": {"train_tasks": 1}},
}
STRATEGY = {"name": "fedavg", "weighted": False}  # Re-Fed's server rule, the same for every run
# Re-Fed's rule takes every honest device's update: the guard's Krum selection, which can refuse an honest update now
# and then in an honest fleet (docs/security.md), is not part of the rule being compared, nor are its comparisons with
# calibration samples and its bounds on direction, influence and copies (issue 56's defaults, which these fleets have
# no calibration samples for). Its distance bounds stay on, the same for every method, and they too refuse honest
# updates under label skew: 0.5-8 % of them in table1's fleets at Dirichlet 0.1, worth 3.7 points on a first domain's
# diagonal (docs/results.md, issue 35). So the learning tables are measured as before issue 56.
GUARD = SIZE_BOUNDS_ONLY


@dataclass(frozen=True)
class DemoSettings:
    devices: int = 10
    tasks: int = 5
    rounds_per_task: int = 4
    epochs: int = 10
    budget: int | None = None  # M in samples; None: budget_for(the scenario)
    seed: int = 0
    model: str = "lenet"
    lr: float = 3e-3
    preset: str = "digits-class"  # a class-incremental preset (firmware_sim/scenarios.py) the model takes
    fraction: float = 1.0  # the share of devices selected each round (Re-Fed's active ratio k)
    emulated: bool = True  # devices of mixed profiles (PROFILE_CYCLE); False: at the host's speed, no deadline drops
    dataset_options: Mapping[str, Any] = field(default_factory=dict)  # the preset's loader options replaced
    scenario_options: Mapping[str, Any] = field(default_factory=dict)  # more Scenario fields (e.g. dynamics)

    @property
    def scenario(self) -> dict[str, Any]:
        options = {"dataset_options": dict(self.dataset_options)} if self.dataset_options else {}
        return {"preset": self.preset, "n_tasks": self.tasks, "n_clients": self.devices, "seed": self.seed, **options,
                **self.scenario_options}


def demo_profiles(devices: int) -> dict[str, int]:
    return dict(Counter(PROFILE_CYCLE[i % len(PROFILE_CYCLE)] for i in range(devices)))


def budget_for(scenario: dict[str, Any], cached: float = OLD_DATA_CACHED) -> int:
    """The scenario's binding M (`ScenarioData.binding_budget`): a device caches `cached` of its old data at the
    last task."""
    return check_scenario(scenario, Where("demo")).build().binding_budget(cached)


def planned_rounds(tasks: int, rounds_per_task: int, train_tasks: int | None) -> int:
    """Rounds a run reports: rounds_per_task per trained task, one evaluation per task past `train_tasks`."""
    trained = tasks if train_tasks is None else min(train_tasks, tasks)
    return trained * rounds_per_task + (tasks - trained)


class Progress:
    """One line per round: the run, round k/N, the task, mean accuracy on the tasks seen, elapsed, ETA (the
    demo's remaining rounds at its mean pace so far)."""

    def __init__(self, total_rounds: int) -> None:
        self.total, self.done, self.started = total_rounds, 0, time.monotonic()

    def for_run(self, label: str, rounds: int, tasks: int) -> Callable[[dict[str, Any]], None]:
        count = 0

        def report(entry: dict[str, Any]) -> None:
            nonlocal count
            count += 1
            self.done += 1
            elapsed = time.monotonic() - self.started
            eta = elapsed / self.done * (self.total - self.done)
            accuracy = sum(entry["accuracy"]) / max(len(entry["accuracy"]), 1)
            print(f"[{label}] round {count}/{rounds} (task {entry['task'] + 1}/{tasks}) accuracy {accuracy:.1%} "
                  f"| elapsed {_clock(elapsed)}, ETA {_clock(eta)}", flush=True)

        return report


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


def next_run_folder(out: Path) -> Path:
    """out/run-<n>, n one past the highest there (a fresh folder for every demo)."""
    taken = [int(p.name[4:]) for p in out.glob("run-*") if p.name[4:].isdigit()] if out.is_dir() else []
    return out / f"run-{max(taken, default=0) + 1}"


def fleet_config(method: str, settings: DemoSettings, out: Path, budget: int,
                 options: Mapping[str, Any] | None = None) -> FleetConfig:
    """The fleet of one run: `options` (METHODS[method] by default) give its policy, and may give its strategy,
    its coordinator options, its trainer backend (a method that trains with torch only), its devices' [learner]
    (`learner`: {"mask_seen_classes": ...}), a byte limit beside M (`store`: {"max_bytes": ...}) and its devices'
    local DP (`privacy`: edge_client/privacy.py)."""
    options = METHODS[method] if options is None else options
    return FleetConfig(
        name=f"demo-{method}", out=out / method, devices=settings.devices, workers=2, model=settings.model,
        seed=settings.seed, broker="embedded", scenario=settings.scenario,
        profiles=demo_profiles(settings.devices) if settings.emulated else {},
        policy=options["policy"], store=StoreSettings(max_samples=budget, **options.get("store", {})),
        trainer=TrainerSettings(backend=options.get("backend", "ort"), optimizer="adamw", lr=settings.lr),
        privacy=LocalPrivacySettings(**options.get("privacy", {})),
        client={"epochs": settings.epochs}, learner=options.get("learner", {}),
        strategy=options.get("strategy", STRATEGY),
        coordinator={
            "rounds_per_task": settings.rounds_per_task, "fraction": settings.fraction,
            "min_clients": max(1, round(settings.devices * settings.fraction) // 2),
            "deadline_s": 60.0, "wait_for_devices_s": 60.0, "guard": {**GUARD, "hold": held(settings)},
            **options.get("coordinator", {}),
        },
    )


def held(settings: DemoSettings) -> int:
    """The guard's `hold` for these fleets: every update of a round (at least the guard's default). Held updates
    are bounded together in device order, so which updates a round takes does not depend on the order the network
    brought them in: the same seed makes the same run on a quiet and on a busy host (with virtual time)."""
    return max(GuardSettings().hold, math.ceil(settings.devices * settings.fraction))


def run_methods(out: Path, settings: DemoSettings,
                methods: Mapping[str, Mapping[str, Any]] = METHODS) -> dict[str, dict[str, Any]]:
    """One fleet run per method (the demo's three by default), same fleet, data, budget and, unless a method names
    its own, rule; each run's results by method. The runtime's own INFO lines are held back meanwhile, out of the
    way of the progress lines."""
    budget = settings.budget or budget_for(settings.scenario)
    configs = {method: fleet_config(method, settings, out, budget, options) for method, options in methods.items()}
    rounds = {m: planned_rounds(settings.tasks, settings.rounds_per_task, c.coordinator.get("train_tasks"))
              for m, c in configs.items()}
    progress = Progress(sum(rounds.values()))
    print(f"{settings.devices} virtual devices, {settings.preset} in {settings.tasks} tasks, "
          f"{settings.rounds_per_task} rounds per task, E = {settings.epochs}, M = {budget}, seed {settings.seed}; "
          f"runs in {out}", flush=True)
    edgefil_level = logging.getLogger("edgefil").level
    logging.getLogger("edgefil").setLevel(logging.WARNING)
    try:
        return {method: Fleet(config).run(progress=progress.for_run(method, rounds[method], settings.tasks))
                for method, config in configs.items()}
    finally:
        logging.getLogger("edgefil").setLevel(edgefil_level)


def run_demo(out: str | Path = "runs/demo", settings: DemoSettings = DemoSettings()) -> list[Path]:
    folder = next_run_folder(Path(out))
    run_methods(folder, settings)
    written = compare_runs([folder / m for m in METHODS], folder / "comparison", labels=list(METHODS))
    print((folder / "comparison" / "comparison.md").read_text())
    print("plots: " + ", ".join(str(p) for p in written if p.suffix == ".png"))
    return written

