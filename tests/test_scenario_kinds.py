"""Scenario kinds register like methods: one class per kind, found by the name a scenario's `kind` gives, checked
by the one Scenario schema; and the few-shot kind's sessions (base session, then N-way K-shot sessions split by
Dirichlet over the clients)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgefil.settings import ConfigError, Where
from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.scenario_kinds import KINDS, ScenarioKind, Task
from firmware_sim.scenario_kinds.base import dirichlet_task, one_dataset
from firmware_sim.scenarios import PRESETS, Scenario, check_scenario, preset


class _EveryClassAtOnce(ScenarioKind):
    """A kind defined outside the package: one task of every class, registered by its name alone."""

    name = "test-every-class-at-once"
    takes = ("classes_per_task",)

    def validate(self, scenario: Scenario) -> None:
        if scenario.classes_per_task is not None:
            raise ValueError("this kind takes every class at once")

    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        data = one_dataset(scenario, loaded)
        return (dirichlet_task(scenario, 0, data, tuple(range(data.num_classes))),)


def test_every_kind_is_a_registered_class_and_every_preset_builds_through_it(monkeypatch):
    assert {"class", "domain", "flowing", "few-shot"} <= set(KINDS.names())
    asked: list[str] = []
    for name in KINDS.names():
        original = KINDS.get(name).tasks

        def spy(self: ScenarioKind, scenario: Scenario, loaded: Any, original: Any = original) -> tuple[Task, ...]:
            asked.append(self.name)
            return original(self, scenario, loaded)

        monkeypatch.setattr(KINDS.get(name), "tasks", spy)
    for name, scenario in PRESETS.items():
        before = len(asked)
        data = scenario.build()
        assert asked[before:] == [scenario.kind], name
        assert data.n_tasks == scenario.n_tasks


def test_a_kind_defined_anywhere_is_built_and_checked_by_the_one_schema():
    raw = {"dataset": "digits", "kind": "test-every-class-at-once", "n_tasks": 1, "n_clients": 3}
    data = check_scenario(raw, Where("test.toml", "scenario")).build()
    assert data.tasks[0].classes == tuple(range(10))
    assert sum(len(i) for i in data.tasks[0].client_train_indices) == len(data.tasks[0].train_indices)
    with pytest.raises(ConfigError, match="every class at once"):
        check_scenario({**raw, "classes_per_task": 2}, Where("test.toml", "scenario"))
    with pytest.raises(ConfigError, match="shots apply to kind='few-shot' only"):
        check_scenario({**raw, "shots": 2}, Where("test.toml", "scenario"))
    with pytest.raises(ConfigError, match="unknown scenario kind 'nope'; choose one of .*few-shot"):
        check_scenario({**raw, "kind": "nope"}, Where("test.toml", "scenario"))
    with pytest.raises(ConfigError, match=r"\[scenario\] shots: expected an integer"):
        check_scenario({**raw, "shots": "five"}, Where("test.toml", "scenario"))


@pytest.mark.parametrize("alpha", [1.0, 0.1])
@pytest.mark.parametrize("base_training", ["central", "federated"])
def test_few_shot_sessions_hold_k_shots_per_class_over_every_client(alpha, base_training):
    scenario = preset("digits-fewshot", alpha=alpha, base_training=base_training, seed=3)
    data = scenario.build()
    base, sessions = data.tasks[0], data.tasks[1:]
    assert len(base.classes) == 4 and all(len(s.classes) == 2 for s in sessions)
    seen = [c for task in data.tasks for c in task.classes]
    assert len(set(seen)) == len(seen) == 10  # disjoint sessions, every digit once
    y_train = base.data.y_train
    assert len(base.train_indices) == np.isin(y_train, base.classes).sum()  # the base has every sample
    assert base.host_trained == (base_training == "central")
    if base_training == "central":
        assert all(len(i) == 0 for i in base.client_train_indices)
    else:
        assert sum(len(i) for i in base.client_train_indices) == len(base.train_indices)
    for session in sessions:
        assert not session.host_trained
        held = np.concatenate(session.client_train_indices)
        assert np.array_equal(np.sort(held), session.train_indices)  # disjoint shares of the session's shots
        assert np.bincount(y_train[held], minlength=10)[list(session.classes)].tolist() == [5, 5]
        assert all(len(i) >= 1 for i in session.client_train_indices)  # every device holds a sample
        assert len(session.test_indices) == np.isin(base.data.y_test, session.classes).sum()
    x, y = data.seen_test(2)
    assert set(np.unique(y)) == set(base.classes) | set(sessions[0].classes) | set(sessions[1].classes)


def test_a_smaller_alpha_skews_the_few_shot_split():
    """Over seeds, each client's share of a session is more concentrated on one class at alpha 0.1 than at 1."""
    def purity(alpha: float) -> float:
        values = []
        for seed in range(8):
            data = preset("mnist1d-fewshot", alpha=alpha, shots=20, seed=seed).build()
            for session in data.tasks[1:]:
                for idx in session.client_train_indices:
                    counts = np.bincount(session.data.y_train[idx])
                    values.append(counts.max() / counts.sum())
        return float(np.mean(values))

    assert purity(0.1) > purity(1.0)


@pytest.mark.parametrize("change,message", [
    (dict(shots=1, n_clients=5), "hold 2 samples: fewer than the 5 clients"),
    (dict(shots=10_000), "shots=10000, but a class"),
    (dict(base_classes=6, n_tasks=4), "6 base classes \\+ 3 sessions x 2 = 12 classes, but 'digits' has 10"),
    (dict(n_tasks=1), "n_tasks must be an integer >= 2"),
    (dict(base_training="host"), "base_training must be one of"),
    (dict(sequence="gradual"), "sequence apply to kind='flowing' only"),
])
def test_bad_few_shot_scenarios_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        preset("digits-fewshot", **change).build()


def test_a_few_shot_scenario_round_trips_through_its_dict():
    scenario = preset("digits-fewshot", alpha=0.5)
    assert Scenario.from_dict(scenario.to_dict()) == scenario
    assert scenario.to_dict()["base_training"] == "central"  # the default, stated


def test_the_reports_name_a_kinds_tasks_as_the_kind_does():
    from firmware_sim.report import _described

    setting, names = _described(preset("digits-fewshot").to_dict())
    assert setting.startswith("few-shot: 4 base classes learnt by the host, then 3 sessions of 2-way 5-shot")
    assert [names(t) for t in range(3)] == ["base", "session 1", "session 2"]
    setting, names = _described(preset("digits-class").to_dict())
    assert setting.startswith("class-incremental, 5 tasks") and names(2) == "task 2"
    assert _described({"kind": "from-another-version", "n_tasks": 3})[1](1) == "task 1"
