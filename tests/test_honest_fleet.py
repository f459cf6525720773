"""What the default guard does to honest devices where they look least alike (issue 56): a fleet of four at
Dirichlet 0.1, where a device may hold one class of a task, or none, and trains on its store. No honest update is
counted a free rider: a device that learnt nothing (one class under its mask: a loss of 0) says so by claiming no
samples, and one that trained on its store moved the model."""
from __future__ import annotations

import pytest
from fleet_harness import run_fleet_file

from coordinator.broker import mosquitto_path
from edgefil.settings import load_toml
from firmware_sim.scenarios import scenario_from_config, shared_build

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")

# benchmarks/poisoning.py's digits-skewed-cal all-honest fleet of 4, seed 0: before devices that learnt nothing claimed
# none, 9 of its 60 honest updates were refused as free riders. Every device is waited for (a deadline far beyond a
# round on a busy host): which devices train never depends on the host's speed
FLEET = """
name = "skewed"
out = "run"
devices = 4
model = "lenet"
seed = 0
broker = "mosquitto"
scenario = {preset = "digits-class", n_clients = 4, seed = 0, alpha = 0.1, calibration = 10}
[policy]
name = "random"
[client]
epochs = 10
[coordinator]
rounds_per_task = 3
min_clients = 4
deadline_s = 900.0
wait_for_devices_s = 900.0
"""


def test_no_honest_device_of_a_skewed_fleet_is_counted_a_free_rider(tmp_path):
    results = run_fleet_file(tmp_path, FLEET)
    assert sum(len(r["received"]) for r in results["history"]) == 60  # 4 devices, 5 tasks of 3 rounds
    assert "free-rider" not in results["counters"], results["counters"]
    used = [m for r in results["history"] for m in r["metrics"].values()]
    assert any(m["loss"] == 0.0 and m["stored_samples"] > 0 for m in used)  # a device that learnt nothing, kept


# GLFC's client dynamics on class-incremental digits: two devices hold data from the first task, one joins at each
# later task holding only that task's classes (one class of its two: `class_share`), a tenth of those there keep only
# their old data. Under the defaults, with the calibration samples a first federation keeps (`edgefil init`). Every
# device is waited for: which devices train never depends on the host's speed
JOINING = """
name = "joining"
out = "run"
devices = 6
model = "lenet"
seed = 1
broker = "mosquitto"
scenario = {preset = "digits-class", n_clients = 6, seed = 1, dynamics = "glfc", joining = 1, calibration = 10}
[policy]
name = "random"
[client]
epochs = 10
[coordinator]
rounds_per_task = 2
min_clients = 2
deadline_s = 900.0
wait_for_devices_s = 900.0
"""
REFUSALS = ("samples-rejected", "norm-rejected", "free-rider", "krum-outlier", "misaligned", "undoes-last-step",
            "worse-on-own-classes", "unreached-classes", "misplaced-classes")


def test_a_device_that_joins_at_task_2_holding_only_new_classes_is_never_refused_under_the_defaults(tmp_path):
    """Issue 56: the default guard read novelty as attack (Krum refused the same honest device in 10 of 10 rounds).
    The device that joins at task 2 brings a class no other device holds; it trains from the task's first round and
    every one of its updates is aggregated, and no honest update of the run is refused for anything."""
    (tmp_path / "fleet.toml").write_text(JOINING)
    data = shared_build(scenario_from_config(load_toml(tmp_path / "fleet.toml")["scenario"]))
    joiner = next(f"dev-{k:03d}" for k in range(6) if data.client_first_task(k) == 2)
    results = run_fleet_file(tmp_path, JOINING)
    assert results["outcome"] == "complete"
    later = [r for r in results["history"] if r["task"] >= 2]
    assert later and all(joiner in r["received"] for r in later if r["task"] == 2)  # from the task's first round
    assert all(joiner in r["metrics"] for r in later if joiner in r["received"])  # aggregated, every round
    assert not {k: v for k, v in results["counters"].items() if k in REFUSALS}, results["counters"]
    assert all(set(r["received"]) <= set(r["metrics"]) for r in results["history"])  # nothing received was left out
