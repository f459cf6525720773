"""The README's main job: a fleet of virtual devices of mixed profiles (10 by default) on the embedded
class-incremental digits, run once per method at the same replay budget M — Re-Fed caching, random caching, and
the Fixed baseline (trained on the first task only) — over the embedded broker, then the comparison table and
plots (firmware_sim/report.py). Each run is a real `edgefil fleet run`: coordinator, device daemons, MQTT."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from edge_client.config import StoreSettings
from firmware_sim.fleet import Fleet, FleetConfig
from firmware_sim.report import compare_runs

# A mixed fleet, cycled over the devices: slow Wi-Fi boards, a duty-cycled Pi Zero, Jetsons, one x86 box.
PROFILE_CYCLE = (
    "raspberry-pi-4-4gb", "jetson-nano", "raspberry-pi-zero-2w", "jetson-orin-nano", "raspberry-pi-4-4gb",
    "generic", "jetson-nano", "raspberry-pi-zero-2w", "raspberry-pi-4-4gb", "jetson-orin-nano",
)
METHODS: dict[str, dict[str, Any]] = {
    "refed": {"policy": {"name": "refed", "pim_epochs": 2}},
    "random": {"policy": {"name": "random"}},
    "fixed": {"policy": {"name": "random"}, "coordinator": {"train_tasks": 1}},
}


def demo_profiles(devices: int) -> dict[str, int]:
    return dict(Counter(PROFILE_CYCLE[i % len(PROFILE_CYCLE)] for i in range(devices)))


def run_methods(
    out: Path, scenario: dict[str, Any], model: str = "lenet", devices: int = 10, rounds_per_task: int = 3,
    budget: int = 100, seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """One fleet run per method in METHODS, same fleet, data and budget; each run's results by method."""
    runs = {}
    for method, options in METHODS.items():
        print(f"--- {method}: {devices} virtual devices, {scenario}, {rounds_per_task} rounds per task, M = {budget}")
        config = FleetConfig(
            name=f"demo-{method}", out=out / method, devices=devices, workers=2, model=model, seed=seed,
            broker="embedded", scenario={**scenario, "seed": seed}, profiles=demo_profiles(devices),
            policy=options["policy"], store=StoreSettings(max_samples=budget),
            client={"epochs": 2},
            coordinator={
                "rounds_per_task": rounds_per_task, "min_clients": max(1, devices // 2), "deadline_s": 60.0,
                "wait_for_devices_s": 60.0, **options.get("coordinator", {}),
            },
        )
        runs[method] = Fleet(config).run()
        print(f"{method}: final accuracy {runs[method]['final_accuracy']:.2%}; report {runs[method]['report']}")
    return runs


def run_demo(
    out: str | Path = "runs/demo", devices: int = 10, tasks: int = 5, rounds_per_task: int = 3,
    budget: int = 100, seed: int = 0,
) -> list[Path]:
    out = Path(out)
    scenario = {"preset": "digits-class", "n_tasks": tasks}
    run_methods(out, scenario, devices=devices, rounds_per_task=rounds_per_task, budget=budget, seed=seed)
    written = compare_runs([out / m for m in METHODS], out / "comparison", labels=list(METHODS))
    print((out / "comparison" / "comparison.md").read_text())
    print("plots: " + ", ".join(str(p) for p in written if p.suffix == ".png"))
    return written
