"""What the default guard does to honest devices where they look least alike (issue 56): a fleet of four at
Dirichlet 0.1, where a device may hold one class of a task, or none, and trains on its store. No honest update is
counted a free rider: a device that learnt nothing (one class under its mask: a loss of 0) says so by claiming no
samples, and one that trained on its store moved the model."""
from __future__ import annotations

import pytest
from fleet_harness import run_fleet_file

from coordinator.broker import mosquitto_path

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
