"""Scenarios: validation, serialisation, class/domain tasks, Dirichlet client splits, client test sets."""
from __future__ import annotations

import argparse
import json
import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefil.durable import read_npz
from firmware_sim import scenarios
from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.client_shares import ClientSource, write_shares
from firmware_sim.data_split import add_data_parser
from firmware_sim.scenarios import PRESETS, Scenario, client_test_split, dirichlet_split, preset


@pytest.fixture(autouse=True)
def _cache_in_tmp(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path_factory.getbasetemp() / "edgefil-cache"))


@pytest.fixture(scope="module")
def digits_class():
    return preset("digits-class").build()


@pytest.fixture(scope="module")
def digits_domain():
    return preset("digits-domain").build()


def _label_entropy(labels: np.ndarray) -> float:
    p = np.bincount(labels) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# --- Scenario: validation and serialisation ------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dataset="digits", n_tasks=6, classes_per_task=2), "12 classes"),
        (dict(dataset="digits", classes_per_task=2, alpha=0), "alpha"),
        (dict(dataset="digits", classes_per_task=2, alpha=-1.0), "alpha"),
        (dict(dataset="digits", classes_per_task=2, alpha=float("inf")), "alpha"),
        (dict(dataset="digits", classes_per_task=2, n_clients=0), "n_clients"),
        (dict(dataset="digits", classes_per_task=2, n_tasks=0), "n_tasks"),
        (dict(dataset="digits", classes_per_task=2, seed=-1), "seed"),
        (dict(dataset="digits", classes_per_task=2, client_test_fraction=0), "client_test_fraction"),
        (dict(dataset="digits", classes_per_task=2, kind="task"), "kind"),
        (dict(dataset="digits"), "classes_per_task"),
        (dict(dataset="digits", classes_per_task=2, domains=("a",)), "domains"),
        (dict(dataset="digits_domains", classes_per_task=2), "domain stream"),
        (dict(dataset="digits", kind="domain", n_tasks=1), "domain stream"),
        (dict(dataset="digits_domains", kind="domain", n_tasks=4, classes_per_task=2), "classes_per_task"),
        (dict(dataset="digits_domains", kind="domain", n_tasks=3, domains=("digits-original",)), "n_tasks=3"),
    ],
)
def test_invalid_scenarios_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scenario(**kwargs)


def test_largest_valid_class_scenario_is_accepted():
    assert Scenario("digits", n_tasks=10, classes_per_task=1).n_tasks == 10


@pytest.mark.parametrize(
    "scenario",
    [
        *PRESETS.values(),
        Scenario("digits_domains", kind="domain", n_tasks=2, domains=["digits-noisy", "digits-original"],
                 alpha=3, data_root="/tmp/x", dataset_options={"disjoint": False, "test_fraction": 0.2}),
        Scenario("digit10", kind="domain", n_tasks=4, data_root="/data", dataset_options={"shape": (1, 32, 32)}),
    ],
)
def test_to_dict_round_trips_through_json(scenario):
    data = scenario.to_dict()
    again = Scenario.from_dict(json.loads(json.dumps(data)))
    assert again == scenario
    assert again.to_dict() == data


def _toml_compatible(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _toml_compatible(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_toml_compatible(v) for v in value)
    return isinstance(value, (str, int, float, bool))  # no None, no tuples


def test_to_dict_is_toml_compatible():
    s = Scenario("digit10", kind="domain", n_tasks=4, dataset_options={"shape": (1, 28, 28)})
    data = s.to_dict()
    assert _toml_compatible(data)
    assert "data_root" not in data and "classes_per_task" not in data and data["dataset_options"]["shape"] == [1, 28, 28]


def test_from_dict_rejects_unknown_fields():
    data = {**preset("digits-class").to_dict(), "clients": 3}
    with pytest.raises(ValueError, match="clients"):
        Scenario.from_dict(data)


def test_preset_overrides_are_validated():
    s = preset("mnist1d-class", n_clients=5, alpha=0.5)
    assert (s.dataset, s.n_clients, s.alpha, s.n_tasks, s.classes_per_task) == ("mnist1d", 5, 0.5, 5, 2)
    with pytest.raises(ValueError, match="alpha"):
        preset("digits-class", alpha=0.0)
    with pytest.raises(ValueError, match="digits-class"):
        preset("cifar-class")


def test_scenario_is_immutable():
    s = preset("digits-class")
    with pytest.raises(AttributeError):
        s.alpha = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.dataset_options["x"] = 1  # type: ignore[index]


# --- class-incremental ---------------------------------------------------------------------------

def test_class_tasks_are_disjoint_and_hold_all_their_samples(digits_class):
    data = digits_class.tasks[0].data
    assert digits_class.num_classes == 10 and digits_class.input_shape == (1, 8, 8)
    assert len(digits_class.tasks) == 5
    seen: set[int] = set()
    for t, task in enumerate(digits_class.tasks):
        assert task.index == t and task.domain is None and len(task.classes) == 2
        assert not seen & set(task.classes)
        seen |= set(task.classes)
        np.testing.assert_array_equal(task.train_indices, np.flatnonzero(np.isin(data.y_train, task.classes)))
        np.testing.assert_array_equal(task.test_indices, np.flatnonzero(np.isin(data.y_test, task.classes)))
        x, y = task.test()
        assert set(np.unique(y)) == set(task.classes) and len(x) == len(y) == len(task.test_indices)
    assert seen == set(range(10))


def test_class_order_is_seeded():
    def classes(seed: int, n_tasks: int = 4):
        return [t.classes for t in preset("digits-class", seed=seed, n_tasks=n_tasks).build().tasks]

    assert classes(0) == classes(0)
    assert classes(0) != classes(1)
    assert classes(0, n_tasks=2) == classes(0)[:2]  # fewer tasks: same first tasks
    assert len({c for task in classes(0) for c in task}) == 8


def test_build_checks_class_count_of_datasets_known_only_after_loading(monkeypatch):
    x = np.zeros((8, 1, 2, 2), np.float32)
    y = np.arange(8) % 4
    monkeypatch.setattr(scenarios, "load_dataset", lambda name, root, **o: ArrayDataset(name, x, y, x, y, 4))
    scenario = Scenario("cifar10", n_tasks=3, classes_per_task=2, data_root="/d")  # count unknown: accepted
    with pytest.raises(ValueError, match="6 classes"):
        scenario.build()


# --- domain-incremental --------------------------------------------------------------------------

def test_domain_tasks_follow_the_stream_with_all_labels(digits_domain):
    names = ["digits-original", "digits-rot90", "digits-inverted", "digits-noisy"]
    assert [t.domain for t in digits_domain.tasks] == names
    for task in digits_domain.tasks:
        assert task.classes == tuple(range(10))
        assert task.data.name == task.domain
        assert len(task.train_indices) == len(task.data.y_train)
        assert set(np.unique(task.test()[1])) == set(range(10))


def test_domains_pick_and_order_domains():
    scenario = Scenario("digits_domains", kind="domain", n_tasks=2, domains=("digits-noisy", "digits-rot90"))
    assert [t.domain for t in scenario.build().tasks] == ["digits-noisy", "digits-rot90"]
    with pytest.raises(ValueError, match="unknown"):
        Scenario("digits_domains", kind="domain", n_tasks=1, domains=("svhn",)).build()
    with pytest.raises(ValueError, match="cannot make 5 tasks"):
        Scenario("digits_domains", kind="domain", n_tasks=5).build()


def test_seen_test_is_the_union_of_task_test_sets(digits_domain):
    x, y = digits_domain.seen_test(1)
    parts = [t.test() for t in digits_domain.tasks[:2]]
    np.testing.assert_array_equal(x, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(y, np.concatenate([p[1] for p in parts]))


# --- clients -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["digits_class", "digits_domain"])
def test_client_shares_partition_each_task(fixture, request):
    built = request.getfixturevalue(fixture)
    for task in built.tasks:
        assert task.n_clients == built.scenario.n_clients
        joined = np.concatenate(task.client_train_indices)
        np.testing.assert_array_equal(np.sort(joined), task.train_indices)  # nothing lost or duplicated
        assert all(len(idx) > 0 for idx in task.client_train_indices)
        x, y = task.client_train(0)
        np.testing.assert_array_equal(y, task.data.y_train[task.client_train_indices[0]])
        assert x.shape == (len(y), *built.input_shape)


@pytest.mark.parametrize("name", ["digits-class", "digits-domain"])
def test_calibration_samples_are_kept_from_every_client_and_test_set(name):
    plain, held = preset(name).build(), preset(name, calibration=5).build()
    for before, task in zip(plain.tasks, held.tasks):
        x, y = held.calibration(task.index)
        assert x.shape == (len(y), *held.input_shape)
        classes, counts = np.unique(y, return_counts=True)
        assert set(classes) == set(np.unique(task.data.y_train[before.train_indices])) and set(counts) == {5}
        kept = task.calibration_indices
        assert not np.isin(kept, np.concatenate(task.client_train_indices)).any()
        assert not np.isin(kept, task.train_indices).any()
        # the clients' shares are what they were less the kept samples, in their order; the test sets are untouched
        for was, now in zip(before.client_train_indices, task.client_train_indices):
            np.testing.assert_array_equal(now, was[~np.isin(was, kept)])
        np.testing.assert_array_equal(task.test_indices, before.test_indices)
    assert len(plain.calibration(0)[1]) == 0  # none unless asked for
    with pytest.raises(ValueError, match="calibration"):
        preset(name, calibration=-1)


def test_a_deployments_split_writes_its_calibration_samples_beside_the_test_sets(tmp_path):
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers())
    args = parser.parse_args(["data", "split", "--devices", "a,b", "--out", str(tmp_path), "--calibration", "4"])
    assert args.run(args) == 0
    built = preset("digits-class", n_clients=2, calibration=4).build()
    for t in range(built.n_tasks):
        kept = read_npz(tmp_path / "test" / f"calibration-{t}.npz")
        np.testing.assert_array_equal(kept["y"], built.calibration(t)[1])
        assert kept["x"].shape == (len(kept["y"]), 1, 8, 8)
        share = read_npz(tmp_path / "devices" / "a" / f"task-{t}.npz")
        np.testing.assert_array_equal(share["y"], built.tasks[t].client_train(0)[1])  # less what was kept


@pytest.mark.parametrize("fixture", ["digits_class", "digits_domain"])
def test_client_test_sets_are_subsets_with_the_client_label_mix(fixture, request):
    built = request.getfixturevalue(fixture)
    fraction = built.scenario.client_test_fraction
    for task in built.tasks:
        task_test = set(task.test_indices.tolist())
        for k in range(task.n_clients):
            test_idx = task.client_test_indices[k]
            assert set(test_idx.tolist()) <= task_test and len(np.unique(test_idx)) == len(test_idx)
            train_labels = task.client_train(k)[1]
            _, test_labels = task.client_test(k)
            for c in range(built.num_classes):
                expected = min(math.ceil(fraction * np.sum(train_labels == c)), np.sum(task.test()[1] == c))
                assert np.sum(test_labels == c) == expected


def test_smaller_alpha_gives_more_skewed_clients():
    def mean_entropy(alpha: float) -> float:
        built = Scenario("digits_domains", kind="domain", n_tasks=1, n_clients=10, alpha=alpha).build()
        task = built.tasks[0]
        return float(np.mean([_label_entropy(task.client_train(k)[1]) for k in range(task.n_clients)]))

    skewed, even = mean_entropy(0.1), mean_entropy(100.0)
    assert even > 0.9 * math.log(10)  # close to uniform over 10 labels
    assert skewed < 0.5 * even


def test_splits_are_seeded():
    a, b, c = (preset("digits-class", seed=s).build().tasks[0] for s in (4, 4, 5))
    for k in range(a.n_clients):
        np.testing.assert_array_equal(a.client_train_indices[k], b.client_train_indices[k])
        np.testing.assert_array_equal(a.client_test_indices[k], b.client_test_indices[k])
    assert any(not np.array_equal(x, y) for x, y in zip(a.client_train_indices, c.client_train_indices))


SPLIT_LABELS = st.lists(st.integers(0, 5), min_size=1, max_size=200)  # a task's labels, as the splits take them


@settings(max_examples=60, deadline=None)
@given(
    labels=SPLIT_LABELS,
    n_clients=st.integers(1, 30),
    alpha=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_split_is_a_partition(labels, n_clients, alpha, seed):
    labels = np.asarray(labels)
    parts = dirichlet_split(labels, n_clients, alpha, np.random.default_rng(seed))
    assert len(parts) == n_clients
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    if len(labels) >= n_clients:
        assert all(len(p) > 0 for p in parts)


@settings(max_examples=60, deadline=None)
@given(
    labels=SPLIT_LABELS,
    n_clients=st.integers(1, 60),
    alpha=st.floats(0.01, 2.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_splits_repair_takes_from_the_largest_client_lowest_id_first(labels, n_clients, alpha, seed):
    """The repair (each empty client in turn takes a random sample of the currently largest, ties to the lowest id)
    found through a heap gives the clients the search of every client gave."""
    labels = np.asarray(labels)

    def searched(rng: np.random.Generator) -> list[list[int]]:  # the rule as written, a search for each empty client
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            cuts = np.round(np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(members)).astype(int)
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.extend(chunk.tolist())
        if len(labels) >= n_clients:
            for part in parts:
                if not part:
                    donor = max(parts, key=len)
                    part.append(donor.pop(int(rng.integers(len(donor)))))
        return [sorted(p) for p in parts]

    split = dirichlet_split(labels, n_clients, alpha, np.random.default_rng(seed))
    assert [p.tolist() for p in split] == searched(np.random.default_rng(seed))


def test_client_test_split_caps_at_available_samples():
    test_labels = np.array([0, 0, 1])
    client_labels = [np.array([0] * 10), np.array([1, 1]), np.array([2, 2]), np.array([], dtype=np.int64)]
    split = client_test_split(client_labels, test_labels, 0.5, np.random.default_rng(0))
    assert sorted(split[0].tolist()) == [0, 1]  # wants 5 of class 0, only 2 exist
    assert split[1].tolist() == [2]  # ceil(0.5 * 2) = 1
    assert len(split[2]) == 0 and len(split[3]) == 0  # no test samples of class 2; no train data


def test_client_sources_of_one_scenario_share_one_build(monkeypatch):
    """A fleet worker's devices build their scenario once between them (before, each device built all N clients'
    shares: start-up grew as N^2); a different scenario is built apart."""
    calls = []
    real = scenarios.build
    monkeypatch.setattr(scenarios, "build", lambda s: calls.append(s) or real(s))
    monkeypatch.setattr(scenarios, "_shared", {})
    config = preset("digits-class", n_clients=6, seed=11).to_dict()
    sources = [ClientSource(config, k) for k in range(6)]
    assert len(calls) == 1 and all(s.data is sources[0].data for s in sources)
    x0, _ = sources[0].task_data(0)
    x0[:] = -1.0  # a device's share is its own copy: writing it leaves the shared build untouched
    assert (sources[0].task_data(0)[0] >= 0).all()
    other = ClientSource(preset("digits-class", n_clients=6, seed=12).to_dict(), 0)
    assert len(calls) == 2 and other.data is not sources[0].data


def test_glfc_dynamics_join_clients_keep_some_on_old_data_and_share_out_each_class():
    """GLFC's client dynamics: 2 clients join at each task, a tenth of those already there get no new data, each
    learning client sees one of a task's two classes (60 % of 2, at least one), a class's samples are disjoint
    shards, and every class of the task is held by someone."""
    from firmware_sim.scenarios import preset

    scenario = preset("digits-class", dynamics="glfc", joining=2, n_clients=18, old_only=0.25)
    data = scenario.build()
    first = 18 - 2 * 4
    for task in data.tasks:
        present = first + 2 * task.index
        sizes = [len(idx) for idx in task.client_train_indices]
        assert all(n == 0 for n in sizes[present:])  # not joined yet
        if task.index:
            earlier = present - 2
            assert sum(n == 0 for n in sizes[:earlier]) == round(0.25 * earlier)  # S_o: old data only
            assert all(n > 0 for n in sizes[earlier:present])  # S_n: the newcomers learn
        held = [set(task.data.y_train[idx].tolist()) for idx in task.client_train_indices if len(idx)]
        assert all(len(classes) == 1 for classes in held)
        assert set().union(*held) == set(task.classes)
        everything = np.concatenate(task.client_train_indices)
        assert len(everything) == len(set(everything.tolist())) == len(task.train_indices)
    assert scenario == type(scenario).from_dict(scenario.to_dict())
    with pytest.raises(ValueError, match="apply with dynamics"):
        preset("digits-class", joining=2)
    with pytest.raises(ValueError, match="leave none"):
        preset("digits-class", dynamics="glfc", joining=5, n_clients=20)


@pytest.mark.parametrize("name", ["digits-class", "digits-domain", "digits-flowing-gradual", "digits-fewshot"])
def test_a_client_reads_from_its_fleets_shares_what_the_built_scenario_gives_it(tmp_path, monkeypatch, name):
    """The shares folder a fleet writes (every client's rows of every task, mapped by its workers) gives each client
    what the built scenario gives it, task by task, for every kind (a domain stream's tasks index different
    datasets; a few-shot base session has no client rows), with no build in the reading process."""

    scenario = preset(name, n_clients=5)
    data = scenario.build()
    write_shares(data, tmp_path / "shares")
    monkeypatch.setattr(scenarios, "_shared", {})
    monkeypatch.setattr(scenarios, "build", lambda s: pytest.fail("built although the shares serve it"))
    for k in range(5):
        source = ClientSource(scenario.to_dict(), k, tmp_path / "shares")
        for t in range(len(data.tasks)):
            x, y = source.task_data(t)
            want_x, want_y = data.client_train(t, k)
            assert x.dtype == np.float32 and y.dtype == np.int64
            np.testing.assert_array_equal(x, want_x)
            np.testing.assert_array_equal(y, want_y)
    x, _ = ClientSource(scenario, 0, tmp_path / "shares").task_data(0)
    if len(x):
        x[:] = -7.0  # a device's share is its own copy: the mapped rows stay as written
        assert not (ClientSource(scenario, 0, tmp_path / "shares").task_data(0)[0] == -7.0).any()


def test_shares_of_another_scenario_or_none_at_all_are_passed_over_and_the_scenario_is_built(tmp_path, caplog):
    """A shares folder written for another scenario (or missing: a config moved to another machine) serves
    nothing: said once in the log, and the client's data come from the scenario built here, the same as ever."""

    write_shares(preset("digits-class", n_clients=4, seed=1).build(), tmp_path / "other")
    scenario = preset("digits-class", n_clients=4, seed=2)
    built = scenario.build()
    for folder, why in ((tmp_path / "other", "another scenario's"), (tmp_path / "missing", "FileNotFoundError")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edgefil.fleet"):
            sources = [ClientSource(scenario, k, folder) for k in range(4)]
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and why in said[0] and "building the scenario here" in said[0], said
        for k, source in enumerate(sources):
            np.testing.assert_array_equal(source.task_data(1)[1], built.client_train(1, k)[1])
