"""Generator replay end to end: device daemons with per-class generators and pFedGRP's personalized aggregation,
over a real broker, on the flowing-data (circulating) digits scenario."""
from __future__ import annotations

import msgpack
import numpy as np

from coordinator.checkpoint import PERSONALIZED_FILE, generation_dir
from coordinator.server import CHECKPOINT_DIR
from coordinator.strategies.pfedgrp import STATE_FILE
from edge_client.config import StoreSettings, TrainerSettings
from edgefil.metrics import average_of_iaa, iaa_forgetting
from firmware_sim.fleet import Fleet
from firmware_sim.fleet_config import FleetConfig

BUDGET = 512 * 1024
ROUNDS = 6


def test_a_fleet_learns_flowing_data_from_generators_with_personalized_models(tmp_path):
    out = tmp_path / "run"
    config = FleetConfig(
        name="gen", out=out, devices=3, workers=1, model="lenet", seed=0, broker="auto",
        scenario={"preset": "digits-flowing-circulating", "n_tasks": ROUNDS, "samples_per_class": 20},
        policy={"name": "generator", "init_steps": 30, "transfer_steps": 10, "precision": "int8",
                "keep_auxiliary": False},
        store=StoreSettings(max_bytes=BUDGET),
        trainer=TrainerSettings(backend="torch", optimizer="adamw", lr=3e-3),
        client={"epochs": 2}, strategy={"name": "pfedgrp", "weight_steps": 5},
        coordinator={"rounds_per_task": 1, "min_clients": 3, "deadline_s": 60.0, "wait_for_devices_s": 60.0},
    )
    results = Fleet(config).run()
    history = results["history"]
    assert results["rounds_completed"] == ROUNDS and len(results["iaa"]) == ROUNDS
    assert results["aa"] == average_of_iaa(results["iaa"]) and results["afm"] == iaa_forgetting(results["iaa"])
    assert all(0.0 <= a <= 1.0 for a in results["iaa"]) and results["aa"] > 0.2  # ten classes: chance is 0.1
    metrics = [m for entry in history for m in entry["metrics"].values()]
    assert len(metrics) == 3 * ROUNDS
    assert all(m["stored_bytes"] <= m["store_budget_bytes"] == BUDGET for m in metrics)  # generators count too
    assert all(m["replayed_samples"] == 0 for m in history[0]["metrics"].values())  # nothing to replay at t = 1
    assert all(m["replayed_samples"] > 0 for e in history[1:] for m in e["metrics"].values())
    # a class new to a device but known to the coordinator: asked for over MQTT and warm-started from it
    assert sum(m["generators_from_coordinator"] for m in metrics) > 0
    # circulating: round 6 brings each device's first task back, its own generators are warm-started
    assert all(m["generators_from_own"] == 2 for m in history[-1]["metrics"].values())
    # the quality check's share of each device's replay set, in the round's history from round 2 on
    assert all(sorted(e["rule_metrics"]) == sorted(e["received"]) for e in history[1:])
    assert all(0.0 <= r["recognised"] <= 1.0 for e in history[1:] for r in e["rule_metrics"].values())
    # every device got its personalized model; its mixing weights lie on the simplex
    generation = generation_dir(out / CHECKPOINT_DIR, ROUNDS)
    saved = msgpack.unpackb((generation / PERSONALIZED_FILE).read_bytes(), raw=False)
    assert saved["round"] == ROUNDS and sorted(saved["models"]) == ["dev-000", "dev-001", "dev-002"]
    state = msgpack.unpackb((generation / STATE_FILE).read_bytes(), raw=False)
    for weights in state["weights_used"].values():
        assert min(weights) >= 0 and abs(sum(weights) - 1) < 1e-5
    assert len(state["generators"]) == 3  # the coordinator caches every device's generators
    personal = [np.frombuffer(b, dtype="<f4") for b in saved["models"].values()]
    assert not np.array_equal(personal[0], personal[1])
