"""The guard's `min_progress` in a real fleet (issue 56): a device that sends the fleet's previous global model back
(`reversed-step`: g - (g - g'), which keeps its own data as the fleet had it a round ago, so the calibration
reference passes it) is refused in every round from the one where the coordinator knows g', and no honest update
is."""
from __future__ import annotations

import pytest
from fleet_harness import run_fleet_file

from coordinator.broker import mosquitto_path

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")

# every device is waited for in every round (a deadline far beyond a round on a busy host), so the hostile device's
# g' is the coordinator's: which devices train never depends on the host's speed
FLEET = """
name = "reversed"
out = "run"
devices = 4
model = "lenet"
seed = 0
broker = "mosquitto"
scenario = {preset = "digits-class", n_clients = 4, seed = 0, n_tasks = 2}
[policy]
name = "random"
[client]
epochs = 5
[coordinator]
rounds_per_task = 3
min_clients = 4
deadline_s = 900.0
wait_for_devices_s = 900.0
guard = {krum_share = 0.0, min_progress = -0.95}
[adversary]
attack = "reversed-step"
devices = 1
"""


def test_an_update_that_sends_the_previous_global_model_back_is_refused(tmp_path):
    results = run_fleet_file(tmp_path, FLEET)
    history = results["history"]
    assert len(history) == 6 and all(len(r["received"]) == 4 for r in history)
    hostile = sorted(history[0]["received"])[-1]  # the fleet's last device
    # round 1: no step yet, the device sends g itself (a free rider); from round 2 on, g'
    assert results["counters"].get("undoes-last-step") == 5, results["counters"]
    assert all(hostile not in r["metrics"] for r in history[1:])
    assert all(set(r["received"]) - {hostile} <= set(r["metrics"]) for r in history)  # no honest update refused
