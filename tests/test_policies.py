"""Replay policies: each ranks earlier samples the way its definition says."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.policies import RoundView, Samples, make_policy, policy_names
from edge_client.policies.base import balanced_quotas, interleave_by_class
from edge_client.policies.herding import herding_order
from edge_client.policies.reservoir import reservoir_update
from edge_client.trainers.ort import OrtTrainer


@given(st.lists(st.integers(0, 6), min_size=1, max_size=200), st.integers(0, 250))
@settings(max_examples=200, deadline=None)
def test_balanced_quotas_are_as_even_as_the_counts_allow(labels, keep):
    labels = np.asarray(labels)
    quotas = balanced_quotas(labels, keep)
    classes, counts = np.unique(labels, return_counts=True)
    count = dict(zip(classes.tolist(), counts.tolist()))
    assert sum(quotas.values()) == min(keep, len(labels))
    assert all(0 <= quotas[c] <= count[c] for c in quotas)
    uncapped = [q for c, q in quotas.items() if q < count[c]]
    if uncapped:  # a class below its count never has fewer than any other class minus one
        assert max(quotas.values()) - min(uncapped) <= 1


def test_interleaving_keeps_every_prefix_balanced():
    merged = interleave_by_class({0: np.array([10, 11, 12]), 1: np.array([20, 21, 22]), 2: np.array([30])})
    assert merged.tolist() == [10, 20, 30, 11, 21, 12, 22]


def test_herding_picks_a_subset_whose_mean_is_closer_than_random_subsets():
    rng = np.random.default_rng(0)
    features = rng.standard_normal((200, 16))
    target = features.mean(0)
    chosen = herding_order(features, 10)
    assert len(set(chosen.tolist())) == 10
    herding_error = np.linalg.norm(features[chosen].mean(0) - target)
    random_errors = [np.linalg.norm(features[rng.choice(200, 10, replace=False)].mean(0) - target) for _ in range(200)]
    assert herding_error < np.min(random_errors)


def test_reservoir_keeps_every_sample_with_equal_probability():
    capacity, total, trials = 20, 100, 3000
    kept = np.zeros(total)
    rng = np.random.default_rng(1)
    for _ in range(trials):
        # 40 samples first, then 60 more: the reservoir must not favour either batch
        _, first = reservoir_update(0, 0, 40, capacity, rng)
        stays, second = reservoir_update(40, len(first), 60, capacity, rng)
        kept[first[stays]] += 1
        kept[40 + second] += 1
    frequency = kept / trials
    assert frequency.sum() == pytest.approx(capacity)
    assert np.abs(frequency - capacity / total).max() < 0.05  # ~4 standard errors at 3000 trials


@pytest.mark.parametrize("name", ["none", "generator"])
def test_policies_that_cache_no_raw_samples_keep_none(export_artifacts, name):
    trainer = OrtTrainer(export_artifacts("lenet"), lr=0.01)
    ctx = RoundView.of_samples(trainer, trainer.get_weights(), None, np.random.default_rng(0))
    assert make_policy(name).rank(_old_samples(trainer), 30, ctx).tolist() == []


def test_make_policy_by_name():
    assert set(policy_names()) >= {"none", "random", "reservoir", "class-balanced", "herding", "refed", "generator"}
    assert make_policy("refed", lam=0.8, pim_epochs=2).lam == 0.8
    with pytest.raises(ValueError, match="unknown replay policy"):
        make_policy("lru")


def _old_samples(trainer, n=120, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.random((4, *trainer.manifest.input_shape), dtype=np.float32)
    y = rng.integers(0, 4, n)
    x = (centers[y] + 0.1 * rng.standard_normal((n, *trainer.manifest.input_shape))).astype(np.float32)
    return Samples(x, y, np.zeros(n, dtype=np.int64))


@pytest.mark.parametrize("name", ["random", "reservoir", "class-balanced", "herding", "refed"])
def test_every_caching_policy_returns_keep_distinct_positions(export_artifacts, name):
    trainer = OrtTrainer(export_artifacts("lenet"), lr=0.01)
    old = _old_samples(trainer)
    options = {"pim_epochs": 2} if name == "refed" else {}
    ctx = RoundView.of_samples(trainer, trainer.get_weights(), None, np.random.default_rng(0))
    ranking = make_policy(name, **options).rank(old, 30, ctx)
    assert len(ranking) == 30 == len(set(ranking.tolist()))
    assert ranking.min() >= 0 and ranking.max() < len(old)
    if name in ("class-balanced", "herding"):
        assert np.bincount(old.y[ranking], minlength=4).min() >= 7  # 30 slots over 4 classes
