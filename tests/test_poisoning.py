"""A poisoning device in a real run (mosquitto, the coordinator and four honest device processes): one device's
valid credentials send huge weights, a garbage model claiming 10^9 samples, and a boosted model-replacement
update, in turn, every round. Under the default settings (no [guard] or [strategy] in the coordinator file) the
run completes with accuracy within a few points of the same run without the attacker: every attack is refused;
with every bound off, FedAvg does not survive the same attacker (so the attack is real). `benchmarks/poisoning.py` measures every attack of firmware_sim/adversary.py."""
from __future__ import annotations

import pytest
from fleet_harness import CEILING_S, Fleet
from hostile_device import ATTACKS, PoisoningDevice

from coordinator.broker import mosquitto_path
from models.manifest import load_manifest, manifest_digest

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
HONEST = 4
DEFAULTS: dict = {}
UNGUARDED = {"strategy": {"name": "fedavg"}, "guard": {"norm_bound": "off", "sample_factor": 0.0,
                                                        "free_rider_factor": 0.0, "krum_share": 0.0},
             "checkpoint": {"explode_factor": 0.0, "collapse_drop": 0.0},
             "deadline_s": 10.0, "max_attempts": 1}  # honest devices stop answering once the model is NaN


def run(tmp_path, artifacts, options: dict, attacker: bool) -> tuple[int, dict, dict[int, str]]:
    """(coordinator exit code, results, the attacks sent by round) of a run with 4 honest devices, and the
    attacker as a 5th when asked. Every selected device is waited for (min_clients = all)."""
    n = HONEST + attacker
    fleet = Fleet(tmp_path, artifacts, n_devices=n,
                  coordinator_options={"min_clients": n, "rounds_per_task": 3, "client": {"epochs": 5}, **options})
    fleet.scenario["n_clients"] = HONEST + 1  # the same data split with and without the attacker
    hostile = None
    try:
        fleet.broker.start()
        for i in range(HONEST):
            fleet.start_device(i)
        if attacker:
            hostile = PoisoningDevice(fleet.broker.address, fleet.fleet, fleet.devices[HONEST],
                                      fleet.passwords[fleet.devices[HONEST]], manifest_digest(artifacts),
                                      load_manifest(artifacts).num_parameters)
            hostile.start()
        fleet.start_coordinator()
        code = fleet.wait_coordinator(timeout=CEILING_S)
        results = fleet.results() if (fleet.root / "run" / "results.json").exists() else {}
        assert hostile is None or not hostile.errors, hostile.errors
        return code, results, dict(hostile.sent) if hostile else {}
    finally:
        if hostile is not None:
            hostile.stop()
        fleet.stop()


def test_a_poisoning_device_is_contained_by_the_default_settings(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    code, clean, _ = run(tmp_path / "clean", artifacts, DEFAULTS, attacker=False)
    assert code == 0
    code, poisoned, sent = run(tmp_path / "poisoned", artifacts, DEFAULTS, attacker=True)
    assert code == 0
    assert set(sent.values()) == set(ATTACKS) and len(sent) == poisoned["rounds_completed"] == 15
    assert not any("dev-4" in entry["metrics"] for entry in poisoned["history"])  # never aggregated
    counters = poisoned["counters"]
    # each attack refused by a bound (an honest update beyond 3x the median distance is refused too, rarely)
    assert counters.get("samples-rejected", 0) == len([a for a in sent.values() if a == "samples"]), counters
    assert counters.get("norm-rejected", 0) >= len([a for a in sent.values() if a != "samples"]), counters
    assert poisoned["final_accuracy"] >= clean["final_accuracy"] - 0.05, (clean["final_accuracy"],
                                                                          poisoned["final_accuracy"])

    code, unguarded, _ = run(tmp_path / "unguarded", artifacts, UNGUARDED, attacker=True)
    assert code != 0 or unguarded["final_accuracy"] < clean["final_accuracy"] - 0.2, unguarded.get("final_accuracy")
