"""A round's aggregation (coordinator/aggregation.py): folding rules take each update as it arrives and let it go,
the guard's bounds stream with them, holding rules hold at most `max_held_mib`."""
from __future__ import annotations

import gc
import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from test_robust_aggregation import devices

from coordinator.aggregation import RoundAggregate
from coordinator.containment import ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.strategies import ClientUpdate, RoundContext, Strategy, make_strategy

SIZE = 1000


def contained(strategy: Strategy, counters: Counter[str] | None = None) -> ContainedStrategy:
    return ContainedStrategy(strategy, Counter() if counters is None else counters)


def updates_of(weights: dict[str, np.ndarray], samples: int = 10) -> list[ClientUpdate]:
    return [ClientUpdate(device, w, samples, {"loss": 1.0}) for device, w in weights.items()]


def aggregated(rule: str, updates: list[ClientUpdate], bounds: UpdateBounds, held_bytes: int = 1 << 30,
               counters: Counter[str] | None = None) -> tuple[np.ndarray, RoundAggregate]:
    counters = Counter() if counters is None else counters
    aggregate = RoundAggregate(contained(make_strategy(rule, device="cpu"), counters), bounds,
                               np.zeros(SIZE, np.float32), counters, held_bytes)
    for update in updates:
        aggregate.add(update)
    return aggregate.close().global_weights.numpy(), aggregate


def test_the_aggregate_does_not_depend_on_the_order_updates_arrive_in():
    """Updates are folded in whatever order the network delivers them. A float32 sum depends on its order (shown
    below), so the fold sums in float64: three arrival orders give the same bits, and a rerun of one configuration
    aggregates the same model."""
    rng = np.random.default_rng(0)
    weights = {f"d{i}": rng.standard_normal(SIZE).astype(np.float32) * np.float32(10 ** rng.uniform(-3, 3))
               for i in range(10)}
    devices = list(weights)
    orders = [devices, devices[::-1], sorted(devices, key=lambda d: weights[d][0])]
    models, float32_sums = [], []
    for order in orders:
        updates = updates_of({d: weights[d] for d in order})
        models.append(aggregated("fedavg", updates, UpdateBounds(norm_bound="off", free_rider_factor=0.0, krum_share=0.0))[0])
        total = np.zeros(SIZE, np.float32)
        for d in order:
            total += weights[d]
        float32_sums.append(total)
    assert not all(np.array_equal(float32_sums[0], t) for t in float32_sums[1:])  # order changes float32 bits
    assert all(np.array_equal(models[0], m) for m in models[1:])
    np.testing.assert_allclose(models[0], np.mean(list(weights.values()), axis=0, dtype=np.float64), rtol=1e-6,
                               atol=1e-9)


def test_a_folding_rule_lets_each_update_go_once_the_guard_has_its_first_ones():
    """FedAvg keeps no update: past the guard's `hold` first ones, an update's buffer is free once it is added."""
    # Krum selection keeps the held ones it kept for the round, and the copy bound the held ones (at most `hold`)
    bounds = UpdateBounds(hold=4, krum_share=0.0, copy_factor=0.0)
    aggregate = RoundAggregate(contained(make_strategy("fedavg", device="cpu")), bounds, np.zeros(SIZE, np.float32),
                               Counter(), 1 << 30)
    assert aggregate.folds
    rng = np.random.default_rng(1)
    alive = []
    for k in range(20):
        w = rng.standard_normal(SIZE).astype(np.float32)
        alive.append(weakref.ref(w))
        aggregate.add(ClientUpdate(f"d{k}", w, 10))
        del w
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0
    assert len(aggregate.used) == 20 and aggregate.close().global_weights.shape == (SIZE,)


def test_streamed_bounds_are_exact_for_a_round_within_hold_and_a_running_median_beyond():
    rng = np.random.default_rng(2)
    honest = {f"d{k}": (rng.standard_normal(SIZE) * 0.1).astype(np.float32) for k in range(12)}
    boosted = (rng.standard_normal(SIZE) * 100).astype(np.float32)
    bounds = UpdateBounds(hold=8, norm_bound="clip", krum_share=0.0)
    # a round of 6 (within hold): the same model and counters as the whole round bounded at once, then averaged
    small = updates_of({**dict(list(honest.items())[:5]), "bad": boosted})
    counters: Counter[str] = Counter()
    streamed, _ = aggregated("fedavg", small, bounds, counters=counters)
    whole: Counter[str] = Counter()
    expected = make_strategy("fedavg", device="cpu").aggregate(
        torch.zeros(SIZE), bounds.apply(np.zeros(SIZE, np.float32), small, whole)).global_weights.numpy()
    np.testing.assert_array_equal(streamed, expected)
    assert counters == whole == {"clipped": 1}
    # a round of 13, the boosted update last: bounded by the median of all 13 distances, as it arrives
    counters = Counter()
    big = updates_of({**honest, "bad": boosted})
    streamed, aggregate = aggregated("fedavg", big, bounds, counters=counters)
    distances = [float(np.linalg.norm(w.astype(np.float64))) for w in [*honest.values(), boosted]]
    bound = 3.0 * float(np.median(distances))
    clipped = boosted.astype(np.float64) * bound / distances[-1]
    mean = (np.sum([w.astype(np.float64) for w in honest.values()], axis=0) + clipped) / 13
    assert counters == {"clipped": 1} and [u.device for u in aggregate.used][-1] == "bad"
    np.testing.assert_allclose(streamed, mean, rtol=1e-5, atol=1e-7)
    # unbounded, the boosted update would have moved the model 100x further
    assert np.linalg.norm(streamed) < 0.1 * np.linalg.norm(boosted / 13)


def test_sample_claims_are_capped_by_the_running_median_as_they_arrive():
    rng = np.random.default_rng(3)
    updates = [ClientUpdate(f"d{k}", rng.standard_normal(SIZE).astype(np.float32) * 0.1, 10 + k) for k in range(10)]
    updates.append(ClientUpdate("liar", rng.standard_normal(SIZE).astype(np.float32) * 0.1, 10**9))
    counters: Counter[str] = Counter()
    _, aggregate = aggregated("fedavg", updates, UpdateBounds(hold=4, norm_bound="off", sample_bound="cap", krum_share=0.0),
                              counters=counters)
    typical = float(np.median([u.num_samples for u in updates]))
    assert counters == {"samples-capped": 1}
    assert aggregate.used[-1].num_samples == int(10 * typical)


def test_a_holding_rule_holds_at_most_max_held_bytes_and_says_which_it_refused(caplog):
    rng = np.random.default_rng(4)
    updates = updates_of({f"d{k}": rng.standard_normal(SIZE).astype(np.float32) for k in range(10)})
    counters: Counter[str] = Counter()
    got, aggregate = aggregated("median", updates, UpdateBounds(norm_bound="off", krum_share=0.0), held_bytes=4 * 4 * SIZE,
                                counters=counters)
    assert not aggregate.folds
    assert counters == {"held-limit": 6} and [u.device for u in aggregate.used] == ["d0", "d1", "d2", "d3"]
    np.testing.assert_allclose(got, np.median([u.weights for u in updates[:4]], axis=0), rtol=1e-6)
    assert "max_held_mib" in caplog.text
    # the first update is taken whatever its size
    _, aggregate = aggregated("median", updates[:2], UpdateBounds(norm_bound="off"), held_bytes=1)
    assert [u.device for u in aggregate.used] == ["d0"]


def test_a_rule_built_on_fedavg_that_overrides_aggregate_gets_the_whole_round():
    """A method extends FedAvg by overriding `aggregate` (to read attachments, give payloads): were its updates
    folded, its `aggregate` would never run. It holds the round; plain FedAvg and FedProx fold."""
    from coordinator.strategies.fedavg import FedAvg

    class Extended(FedAvg):
        def aggregate(self, global_weights, updates, ctx=RoundContext()):
            self.heard = [u.device for u in updates]
            return super().aggregate(global_weights, updates, ctx)

    zeros = torch.zeros(SIZE)
    assert make_strategy("fedavg", device="cpu").fold(zeros) is not None
    assert make_strategy("fedprox", device="cpu").fold(zeros) is not None
    rule = Extended(device="cpu")
    assert rule.fold(zeros) is None
    aggregate = RoundAggregate(contained(rule), UpdateBounds(), np.zeros(SIZE, np.float32), Counter(), 1 << 30)
    for k in range(3):
        aggregate.add(ClientUpdate(f"d{k}", np.full(SIZE, k + 1, np.float32), 10))
    np.testing.assert_allclose(aggregate.close().global_weights.numpy(), 2.0)
    assert rule.heard == ["d0", "d1", "d2"]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("rule, options", [("fedavg", {}), ("fedavg", {"weighted": False}), ("fedprox", {})])
@pytest.mark.parametrize("parts", [2, 4])
def test_a_folding_rules_partial_folds_merge_into_what_one_fold_gives(rule, options, parts, device):
    """A folding rule's fold splits (`Fold.partial`, `Fold.merge`; a `Fold` that has not both cannot be made, they
    are abstract, so every rule that folds has them): disjoint shares of a round folded apart and
    merged give the one fold's model, sample-less updates among them (a plain mean that gives way) and a share of
    only sample-less ones; a part with a device already folded, or of another size, is refused. The shares are
    folded on the CPU, as inbox workers and sites fold them, and merged into the coordinator's fold on `device`."""
    rng = np.random.default_rng(3)
    updates = [ClientUpdate(f"d{k}", rng.standard_normal(SIZE).astype(np.float32), int(n))
               for k, n in enumerate([0, 0, 5, 0, 12, 1, 30, 0, 7, 0, 0, 9])]
    zeros = torch.zeros(SIZE)
    whole = make_strategy(rule, device=device, **options).fold(zeros)
    for update in updates:
        whole.add(update)
    shares = [[0, 1, 3], [2, 4, 5, 6, 7, 8, 9, 10, 11]] if parts == 2 else [[k for k in range(12) if k % 4 == j]
                                                                          for j in range(4)]
    folds = []
    for share in shares:
        fold = make_strategy(rule, device="cpu", **options).fold(zeros)
        for k in share:
            fold.add(updates[k])
        folds.append(fold)
    merged = make_strategy(rule, device=device, **options).fold(zeros)
    for fold in folds:
        merged.merge(fold.partial())
    np.testing.assert_allclose(merged.result().global_weights.cpu().numpy(),
                               whole.result().global_weights.cpu().numpy(), rtol=1e-6, atol=1e-7)
    again = make_strategy(rule, device="cpu", **options).fold(zeros)
    again.add(updates[0])
    with pytest.raises(ValueError, match="twice"):
        again.merge(folds[0].partial())
    other = make_strategy(rule, device="cpu", **options).fold(torch.zeros(SIZE + 1))
    with pytest.raises(ValueError, match="cannot be merged"):
        other.merge(folds[1].partial())


@pytest.mark.parametrize("device", devices)
def test_a_round_split_over_aggregates_in_two_processes_gives_the_model_and_counts_of_one(device):
    """What an inbox worker hands on (`RoundAggregate.partial`, folded on the CPU) crosses a process (pickled) and
    merges into the round's own aggregate on the coordinator's `device`: the same model as one aggregate of every
    update, each update used once, and what the workers' guards counted added to the round's (a free rider refused
    in one share)."""
    import pickle

    rng = np.random.default_rng(5)
    step = rng.normal(0.0, 0.1, SIZE)
    updates = [ClientUpdate(f"d{k}", (step + rng.normal(0.0, 0.02, SIZE)).astype(np.float32), 10 + k)
               for k in range(16)]
    updates.append(ClientUpdate("rider", (step * 1e-4).astype(np.float32), 10))
    bounds = UpdateBounds(krum_share=0.0)
    one, _ = aggregated("fedavg", updates[:-1], bounds)
    counters: Counter[str] = Counter()
    rule = contained(make_strategy("fedavg", device=device), counters)
    round_ = RoundAggregate(rule, bounds, np.zeros(SIZE, np.float32), counters, 1 << 30)
    for share in (updates[0::2], updates[1::2]):
        worker_counters: Counter[str] = Counter()
        worker = RoundAggregate(contained(make_strategy("fedavg", device="cpu"), worker_counters), bounds,
                                np.zeros(SIZE, np.float32), worker_counters, 1 << 30)
        for update in share:
            worker.add(update)
        round_.merge(pickle.loads(pickle.dumps(worker.partial())))
    merged = round_.close().global_weights.cpu().numpy()
    np.testing.assert_allclose(merged, one, rtol=1e-6, atol=1e-8)
    assert sorted(u.device for u in round_.used) == sorted(u.device for u in updates[:-1])
    assert counters["free-rider"] == 1 and round_.samples == sum(u.num_samples for u in updates[:-1])
