"""Flowing-data scenarios (pFedGRP): client task sequences, parts and test parts, per-client seen test sets,
and the per-client evaluation behind IAA."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.evaluation import Evaluator
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.client_shares import ClientSource
from firmware_sim.scenario_kinds import flowing as flowing_kind
from firmware_sim.scenarios import PRESETS, Scenario, preset, scenario_from_config
from models.manifest import load_manifest

FLOWING_PRESETS = [name for name, s in PRESETS.items() if s.kind == "flowing"]
# Many rounds, parts of 40 of ~135 digits per class: 3 parts per pass, so every class runs through several passes.
LONG = dict(dataset="digits", kind="flowing", n_tasks=60, classes_per_task=2, n_clients=3, samples_per_class=40)


@pytest.fixture(autouse=True)
def _cache_in_tmp(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path_factory.getbasetemp() / "edgefil-cache"))


@pytest.fixture(scope="module")
def circulating():
    return Scenario(**LONG, sequence="circulating").build()


@pytest.fixture(scope="module")
def gradual():
    return Scenario(**LONG, sequence="gradual", replace_every=7).build()


@pytest.fixture(scope="module")
def digits_class():
    return preset("digits-class", n_clients=4).build()


def _client_sequence(data, k: int) -> list[tuple[int, ...]]:
    return [task.client_classes[k] for task in data.tasks]


# --- Scenario ------------------------------------------------------------------------------------

FLOWING = dict(dataset="digits", kind="flowing", classes_per_task=2, samples_per_class=10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(FLOWING, classes_per_task=None, sequence="gradual"), "classes_per_task"),
        (dict(FLOWING), "sequence"),
        (dict(FLOWING, sequence="random"), "sequence"),
        (dict(FLOWING, sequence="gradual", samples_per_class=None), "samples_per_class"),
        (dict(FLOWING, sequence="gradual", samples_per_class=0), "samples_per_class"),
        (dict(FLOWING, sequence="circulating", n_client_tasks=6), "12 classes"),
        (dict(FLOWING, sequence="circulating", n_client_tasks=0), "n_client_tasks"),
        (dict(FLOWING, sequence="gradual", n_client_tasks=2), "n_client_tasks must be an integer >= 3"),
        (dict(FLOWING, sequence="gradual", replace_every=0), "replace_every"),
        (dict(FLOWING, sequence="circulating", replace_every=5), "replace_every applies to sequence='gradual'"),
        (dict(FLOWING, sequence="gradual", domains=("digits-original",)), "domains"),
        (dict(FLOWING, dataset="digits_domains", sequence="gradual"), "domain streams"),
        (dict(dataset="digits", classes_per_task=2, sequence="gradual"), "apply to kind='flowing' only"),
        (dict(dataset="digits_domains", kind="domain", samples_per_class=5), "samples_per_class apply"),
    ],
)
def test_invalid_flowing_scenarios_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scenario(**kwargs)


def test_parts_larger_than_a_class_are_rejected_when_built():
    with pytest.raises(ValueError, match="samples_per_class=200.*only 131"):
        Scenario(**FLOWING | {"samples_per_class": 200}, sequence="circulating").build()


def test_flowing_defaults_follow_the_paper():
    gradual = Scenario(**FLOWING, sequence="gradual")
    assert (gradual.n_client_tasks, gradual.replace_every) == (5, 30)
    circulating = Scenario(**FLOWING, sequence="circulating")
    assert (circulating.n_client_tasks, circulating.replace_every) == (5, None)


@pytest.mark.parametrize("scenario", [*(PRESETS[n] for n in FLOWING_PRESETS), Scenario(**LONG, sequence="gradual")])
def test_flowing_scenarios_round_trip_through_json(scenario):
    data = scenario.to_dict()
    assert None not in data.values()  # TOML has no null
    assert Scenario.from_dict(json.loads(json.dumps(data))) == scenario


def test_config_with_a_flowing_preset_and_overrides():
    s = scenario_from_config({"preset": "digits-flowing-gradual", "n_clients": 3, "n_tasks": 8, "seed": 4,
                              "samples_per_class": 20, "replace_every": 4})
    assert (s.kind, s.sequence, s.n_clients, s.n_tasks, s.seed, s.samples_per_class, s.replace_every) == \
           ("flowing", "gradual", 3, 8, 4, 20, 4)
    built = s.build()
    assert len(built.tasks) == 8 and built.tasks[0].n_clients == 3


@pytest.mark.parametrize("name", FLOWING_PRESETS)
def test_flowing_presets_build(name):
    s = PRESETS[name]
    assert (s.n_clients, s.classes_per_task, s.n_client_tasks, s.n_tasks) == (10, 2, 5, 20)
    if s.dataset == "mnist1d":  # generating the full 20,000 takes ~10 s; 3,000 still hold > 100 per class
        s = preset(name, dataset_options={"num_samples": 3000})
    built = s.build()
    assert len(built.tasks) == 20 and built.num_classes == 10
    for task in built.tasks:
        assert task.n_clients == 10 and len(task.client_classes) == 10
        assert all(len(idx) == 2 * s.samples_per_class for idx in task.client_train_indices)


# --- sequences -----------------------------------------------------------------------------------

def test_client_tasks_split_the_classes_disjointly(circulating):
    firsts = []
    for k in range(3):
        groups = _client_sequence(circulating, k)[:5]
        assert all(len(g) == 2 for g in groups)
        assert sorted(c for g in groups for c in g) == list(range(10))  # disjoint, and covering every class
        firsts.append(groups)
    assert firsts[0] != firsts[1]  # seeded per client


def test_circulating_sequences_repeat_every_n_client_tasks(circulating):
    for k in range(3):
        sequence = _client_sequence(circulating, k)
        assert len(set(sequence[:5])) == 5
        assert all(sequence[t] == sequence[t % 5] for t in range(len(sequence)))


def test_gradual_sequences_loop_two_tasks_and_replace_one_every_replace_every(gradual):
    for k in range(3):
        sequence = _client_sequence(gradual, k)
        windows = [sequence[i:i + 7] for i in range(0, len(sequence), 7)]
        loops = []
        for window in windows:
            assert len(set(window)) == 2 and all(a != b for a, b in zip(window, window[1:]))  # T1, T2, T1, ...
            loops.append(set(window))
        for before, after in zip(loops, loops[1:]):
            assert len(before & after) == 1  # one loop task replaced by another task of the client
        assert {c for g in sequence for c in g} <= set(range(10))


def test_sequences_are_seeded():
    def sequences(seed: int):
        built = Scenario(**LONG | {"n_tasks": 20}, sequence="gradual", replace_every=3, seed=seed).build()
        return [_client_sequence(built, k) for k in range(3)]

    assert sequences(0) == sequences(0)
    assert sequences(0) != sequences(1)


# --- parts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["circulating", "gradual"])
def test_each_round_brings_a_part_of_every_class_of_the_client_task(fixture, request):
    built = request.getfixturevalue(fixture)
    for task in built.tasks:
        assert task.classes == tuple(sorted(set().union(*task.client_classes)))
        for k in range(task.n_clients):
            _, y = task.client_train(k)
            labels, counts = np.unique(y, return_counts=True)
            assert tuple(labels) == task.client_classes[k] and set(counts) == {40}
            _, y_test = task.client_test(k)
            assert set(np.unique(y_test)) == set(task.client_classes[k])
        np.testing.assert_array_equal(task.train_indices, np.unique(np.concatenate(task.client_train_indices)))
        assert len(task.train()[1]) == len(task.train_indices)


def test_parts_are_used_in_passes_with_matching_test_parts(circulating):
    data = circulating.tasks[0].data
    for k in range(3):
        for c in range(10):
            rounds = [task for task in circulating.tasks if c in task.client_classes[k]]
            train = [task.client_train_indices[k][data.y_train[task.client_train_indices[k]] == c] for task in rounds]
            test = [task.client_test_indices[k][data.y_test[task.client_test_indices[k]] == c] for task in rounds]
            n_parts = int(np.sum(data.y_train == c)) // 40
            assert len(rounds) >= 3 * n_parts
            passes = [np.concatenate(train[i:i + n_parts]) for i in range(0, 3 * n_parts, n_parts)]
            for one in passes:
                assert len(np.unique(one)) == len(one) == n_parts * 40  # each sample at most once per pass
            assert not all(np.array_equal(np.sort(passes[0]), np.sort(p)) for p in passes[1:])  # fresh permutation
            # test parts: a partition of the class's test samples, the same part for the same part index
            class_test = np.flatnonzero(data.y_test == c)
            np.testing.assert_array_equal(np.sort(np.concatenate(test[:n_parts])), class_test)
            for i in range(n_parts, len(test)):
                np.testing.assert_array_equal(test[i], test[i % n_parts])


def test_test_parts_hold_at_least_one_sample():
    many = flowing_kind._test_parts(np.arange(10), 4)
    assert [len(p) for p in many] == [2, 3, 2, 3]
    np.testing.assert_array_equal(np.concatenate(many), np.arange(10))
    few = flowing_kind._test_parts(np.arange(3), 5)
    assert all(len(p) == 1 for p in few) and set(np.concatenate(few)) == {0, 1, 2}


# --- a client's history --------------------------------------------------------------------------

def test_client_seen_test_is_the_growing_union_of_test_parts(gradual):
    data = gradual.tasks[0].data
    for k in range(3):
        previous: set[int] = set()
        for t in (0, 1, 5, 20, 59):
            idx = np.unique(np.concatenate([task.client_test_indices[k] for task in gradual.tasks[: t + 1]]))
            x, y = gradual.client_seen_test(k, t)
            np.testing.assert_array_equal(x, data.x_test[idx])
            np.testing.assert_array_equal(y, data.y_test[idx])
            assert previous <= set(idx.tolist())
            previous = set(idx.tolist())
            seen = gradual.client_seen_classes(k, t)
            assert set(np.unique(y)) == set(seen)
            assert seen == tuple(sorted({c for task in gradual.tasks[: t + 1] for c in task.client_classes[k]}))


def test_client_samples_seen_sums_the_parts(gradual):
    for k in range(3):
        for t in (0, 3, 59):
            assert gradual.client_samples_seen(k, t) == (t + 1) * 2 * 40


def test_client_history_of_the_class_and_domain_kinds(digits_class):
    for t in range(len(digits_class.tasks)):
        tasks = digits_class.tasks[: t + 1]
        x, y = digits_class.client_seen_test(2, t)
        expected = np.concatenate([task.client_test(2)[1] for task in tasks])
        np.testing.assert_array_equal(np.sort(y), np.sort(expected))
        assert len(x) == len(y)
        assert digits_class.client_seen_classes(2, t) == tuple(sorted(c for task in tasks for c in task.classes))
        assert digits_class.client_samples_seen(2, t) == sum(len(task.client_train_indices[2]) for task in tasks)
    domains = Scenario("digits_domains", kind="domain", n_tasks=2, n_clients=3).build()
    _, y = domains.client_seen_test(1, 1)
    assert len(y) == sum(len(task.client_test_indices[1]) for task in domains.tasks)  # two datasets, concatenated
    assert domains.client_seen_classes(1, 1) == tuple(range(10))


def test_client_source_gives_the_client_train_part(gradual):
    source = ClientSource(gradual.scenario.to_dict(), 2)
    for t in (0, 13):
        for got, expected in zip(source.task_data(t), gradual.tasks[t].client_train(2)):
            np.testing.assert_array_equal(got, expected)


# --- evaluation ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluator(circulating, export_artifacts):
    return Evaluator(circulating, load_manifest(export_artifacts("lenet", 10, (1, 8, 8))))


def test_client_accuracy_masks_to_the_client_seen_classes(evaluator, circulating):
    zeros = np.zeros(evaluator.manifest.num_parameters, np.float32)
    for k, t in ((0, 0), (1, 2), (2, 7)):
        # all logits equal: the lowest unmasked class wins, so accuracy = that class's share of the test set
        _, y = circulating.client_seen_test(k, t)
        lowest = circulating.client_seen_classes(k, t)[0]
        assert evaluator.client_accuracy(zeros, k, t) == pytest.approx(np.mean(y == lowest))


def test_client_accuracy_matches_a_direct_evaluation(evaluator, circulating):
    weights = np.random.default_rng(0).normal(0, 0.1, evaluator.manifest.num_parameters).astype(np.float32)
    direct = TorchTrainer(evaluator.manifest)
    direct.set_weights(weights)
    mask = np.isin(np.arange(10), circulating.client_seen_classes(1, 3)).astype(np.float32)
    expected = direct.evaluate(*circulating.client_seen_test(1, 3), class_mask=mask).accuracy
    assert evaluator.client_accuracy(weights, 1, 3) == pytest.approx(expected)


def test_iaa_weights_clients_by_the_samples_they_have_seen(digits_class, export_artifacts):
    evaluator = Evaluator(digits_class, load_manifest(export_artifacts("lenet", 10, (1, 8, 8))))
    n = [digits_class.client_samples_seen(k, 1) for k in range(4)]
    accuracies = {3: 0.2, 0: 1.0, 1: 0.0}  # any order, any subset of the clients
    expected = (1.0 * n[0] + 0.0 * n[1] + 0.2 * n[3]) / (n[0] + n[1] + n[3])
    assert evaluator.iaa(accuracies, 1) == pytest.approx(expected)
    assert len(set(n)) > 1  # Dirichlet shares differ, so the weighting matters
