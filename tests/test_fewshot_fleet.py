"""A few-shot fleet end to end (SDD): the host learns the base session, then five virtual devices learn three
2-way 5-shot sessions through a real broker, each replaying the generator's samples of the sessions before."""
from __future__ import annotations

from edge_client.config import StoreSettings, TrainerSettings
from firmware_sim.fleet import Fleet
from firmware_sim.fleet_config import FleetConfig

GENERATOR = {"generator_epochs": 2, "generator_iterations": 5, "warmup_epochs": 1, "generator_batch_size": 16,
             "replay_per_class": 10}


def test_a_few_shot_fleet_runs_from_the_base_session_to_the_last(tmp_path):
    out = tmp_path / "run"
    config = FleetConfig(
        name="fewshot", out=out, devices=5, workers=1, model="lenet", seed=0, broker="auto",
        scenario={"preset": "digits-fewshot"}, policy={"name": "sdd"},
        store=StoreSettings(max_bytes=256 * 1024),
        trainer=TrainerSettings(backend="portable", optimizer="sgd", lr=0.1),
        client={"epochs": 2}, strategy={"name": "sdd", **GENERATOR},
        coordinator={"rounds_per_task": 1, "min_clients": 5, "deadline_s": 120.0, "wait_for_devices_s": 60.0,
                     "host": {"epochs": 8}},
    )
    results = Fleet(config).run()
    history = results["history"]
    assert results["rounds_completed"] == 4 and len(results["accuracy_matrix"]) == 4
    assert history[0]["received"] == ["host"] and history[0]["selected"] == ["host"]
    assert results["accuracy_matrix"][0][0] > 0.9  # the base session, learnt centrally
    assert all(len(entry["received"]) == 5 for entry in history[1:])  # every device holds a sample
    generator = [entry["rule_metrics"]["generator"] for entry in history]
    assert all(g["generator_steps"] == 10 for g in generator)  # base classes at task 0, the session's after
    held = [g["replay_samples"] for g in generator]  # at most 10 a class of every session so far, growing
    assert all(0 < n <= 10 * classes for n, classes in zip(held, (4, 6, 8, 10))) and held == sorted(held)
    assert all("cswa_mean_accuracy" in g for g in generator[1:])
    for entry, before in zip(history[1:], generator):
        for metrics in entry["metrics"].values():
            assert metrics["stored_bytes"] <= metrics["store_budget_bytes"]
            assert metrics["replay_held"] == before["replay_samples"]  # the last session's broadcast, all of it
            assert 0.0 <= metrics["relabelled_unlike_generated"] <= 1.0  # replayed under the old model's labels
    assert results["counters"].get("statistics", 0) == 0 and results["counters"].get("attachments", 0) == 0
