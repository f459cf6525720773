"""The bounds on one update (coordinator/guard.py) and the coordinate-wise robust rules (median, trimmed mean)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from coordinator import krum
from coordinator.compute import UpdateChanges
from coordinator.config import CoordinatorConfig
from coordinator.guard import UpdateBounds
from coordinator.guard_settings import GuardSettings
from coordinator.influence import FleetPath, HeadLayout, claimed_classes
from coordinator.krum import ClaimedRows
from coordinator.strategies import make_strategy
from coordinator.strategies.base import ClientUpdate
from coordinator.strategies.robust import DistancesTo, sorted_mean, squared_distances
from edgefil.settings import ConfigError

# the bounds that clip and cap, without free-rider check or Krum selection (the defaults: the tests below)
CLIPPING = UpdateBounds(norm_bound="clip", sample_bound="cap", free_rider_factor=0.0, krum_share=0.0)
devices = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def updates_of(weights: np.ndarray, samples: list[int] | None = None) -> list[ClientUpdate]:
    samples = samples or [10] * len(weights)
    return [ClientUpdate(f"d{i}", np.ascontiguousarray(w, dtype=np.float32), n)
            for i, (w, n) in enumerate(zip(weights, samples))]


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_median_is_numpys_median_per_coordinate_in_column_blocks(n, device):
    w = np.random.default_rng(n).standard_normal((n, 1001)).astype(np.float32)
    got = sorted_mean(list(w), (n - 1) // 2, torch.device(device), columns=100)  # 11 blocks, the last short
    np.testing.assert_allclose(got.cpu().numpy(), np.median(w, axis=0), rtol=1e-6)
    strategy = make_strategy("median", device=device)
    np.testing.assert_allclose(strategy.aggregate(torch.zeros(1001), updates_of(w)).global_weights.cpu().numpy(),
                               np.median(w, axis=0), rtol=1e-6)


@pytest.mark.parametrize("n, beta, trim", [(10, 0.2, 2), (4, 0.2, 1), (2, 0.2, 0), (7, 0.3, 2), (4, 0.0, 0)])
def test_trimmed_mean_drops_the_extremes_of_each_coordinate(n, beta, trim):
    w = np.random.default_rng(0).standard_normal((n, 300)).astype(np.float32)
    expected = np.sort(w, axis=0)[trim : n - trim].mean(axis=0)
    got = make_strategy("trimmed-mean", device="cpu", beta=beta).aggregate(torch.zeros(300), updates_of(w))
    np.testing.assert_allclose(got.global_weights.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_robust_rules_ignore_a_minority_of_hostile_updates_and_sample_claims():
    rng = np.random.default_rng(0)
    honest = rng.normal(1.0, 0.01, (7, 50))
    hostile = np.full((2, 50), 1e30)
    w = np.concatenate([honest, hostile])
    samples = [10] * 7 + [10**9] * 2
    for name, options in (("median", {}), ("trimmed-mean", {"beta": 0.25}), ("centered-clip", {})):
        result = make_strategy(name, device="cpu", **options).aggregate(torch.zeros(50), updates_of(w, samples))
        assert np.abs(result.global_weights.numpy() - 1.0).max() < 0.05, name
    with pytest.raises(ValueError, match="beta"):
        make_strategy("trimmed-mean", device="cpu", beta=0.5)


def test_devices_without_data_do_not_set_the_bounds_to_zero():
    """Most of a round's devices had nothing to train on: they send the global model back with 0 samples. The
    bounds come from the updates that carry something, so the honest ones pass whole (before: a median of 0
    clipped every one of them onto the global model and capped every count at 0)."""
    g = np.zeros(3, np.float32)
    deltas = np.zeros((7, 3))
    deltas[:3] = [[0.3, 0.1, 0.0], [0.2, 0.2, 0.1], [0.25, 0.0, 0.1]]
    counts = [2, 1, 3, 0, 0, 0, 0]
    counters: Counter[str] = Counter()
    out = CLIPPING.apply(g, updates_of(deltas, counts), counters)
    assert not counters
    assert [u.num_samples for u in out] == counts
    np.testing.assert_array_equal(np.stack([u.weights for u in out]), deltas.astype(np.float32))
    nothing = CLIPPING.apply(g, updates_of(np.zeros((3, 3)), [0, 0, 0]), counters)  # no bound to take
    assert [u.num_samples for u in nothing] == [0, 0, 0] and not counters
    deltas[0] *= 100  # a boosted update among them is still clipped, to 3x the typical distance of the others
    out = CLIPPING.apply(g, updates_of(deltas, counts), counters)
    bound = 3.0 * float(np.median(np.linalg.norm(deltas[:3], axis=1)))
    assert counters["clipped"] == 1 and np.isclose(np.linalg.norm(out[0].weights), bound, rtol=1e-5)


def test_norms_are_clipped_exactly_to_the_bound_beyond_the_median():
    g = np.zeros(1, np.float32)
    d = np.array([[1.0], [2.0], [3.0], [30.0], [0.0]])
    out = CLIPPING.apply(g, updates_of(d), Counter())
    # the median of the updates that moved is 2.5 (the unmoved one has no say): bound 7.5
    np.testing.assert_allclose([u.weights[0] for u in out], [1, 2, 3, 7.5, 0])


@pytest.mark.parametrize("max_samples, factor, expected", [
    (0, 10.0, [10, 20, 30, 250]), (25, 0.0, [10, 20, 25, 25]), (0, 0.0, [10, 20, 30, 10**9])])
def test_sample_counts_are_capped_by_the_fleet_maximum_and_the_median(max_samples, factor, expected):
    bounds = UpdateBounds(norm_bound="off", max_samples=max_samples, sample_factor=factor, sample_bound="cap",
                          krum_share=0.0, copy_factor=0.0)  # the same model four times: copies, but for the cap
    out = bounds.apply(np.zeros(1, np.float32), updates_of(np.zeros((4, 1)), [10, 20, 30, 10**9]), Counter())
    assert [u.num_samples for u in out] == expected


@pytest.mark.parametrize("mode", ["clip", "reject", "off"])
def test_guard_clips_rejects_or_passes_a_boosted_update_and_counts_it(mode):
    g = np.zeros(100, dtype=np.float32)
    rng = np.random.default_rng(1)
    deltas = rng.standard_normal((5, 100)).astype(np.float32) * 0.1
    deltas[4] *= 100  # boosted
    counters: Counter[str] = Counter()
    out = UpdateBounds(norm_bound=mode, free_rider_factor=0.0, krum_share=0.0).apply(g, updates_of(deltas), counters)
    norms = np.linalg.norm(deltas, axis=1)
    if mode == "off":
        assert len(out) == 5 and not counters
        return
    if mode == "reject":
        assert [u.device for u in out] == ["d0", "d1", "d2", "d3"] and counters == {"norm-rejected": 1}
        return
    assert counters == {"clipped": 1} and len(out) == 5
    assert np.linalg.norm(out[4].weights - g) == pytest.approx(3 * np.median(norms), rel=1e-5)
    np.testing.assert_allclose(out[4].weights / np.linalg.norm(out[4].weights), deltas[4] / norms[4], rtol=1e-5)
    for before, after in zip(updates_of(deltas)[:4], out[:4]):
        np.testing.assert_array_equal(before.weights, after.weights)


def test_guard_refuses_or_caps_an_inflated_sample_claim_and_the_config_checks_the_table():
    """A device's count is what FedAvg weighs it by: a claim beyond the cap is refused (the default: no honest
    device holds more than its store), or counted as the cap (`sample_bound = "cap"`)."""
    deltas = (1 + np.random.default_rng(0).standard_normal((3, 3)) * 0.1) * 0.1  # updates that agree
    counters: Counter[str] = Counter()
    out = UpdateBounds().apply(np.zeros(3, np.float32), updates_of(deltas, [10, 12, 10**9]), counters)
    assert [u.num_samples for u in out] == [10, 12] and counters == {"samples-rejected": 1}
    out = UpdateBounds(sample_bound="cap").apply(np.zeros(3, np.float32), updates_of(deltas, [10, 12, 10**9]),
                                                 counters)
    assert [u.num_samples for u in out] == [10, 12, 120] and counters["samples-capped"] == 1
    base = {"fleet": "f", "out": "o", "artifacts": "a", "devices": ["d0"], "scenario": {"preset": "digits-class"}}
    assert CoordinatorConfig.from_dict(base).guard == GuardSettings()
    config = CoordinatorConfig.from_dict({**base, "guard": {"norm_bound": "reject", "max_samples": 500}})
    assert config.guard == GuardSettings(norm_bound="reject", max_samples=500)
    with pytest.raises(ConfigError, match="norm_bound"):
        CoordinatorConfig.from_dict({**base, "guard": {"norm_bound": "clamp"}})
    with pytest.raises(ConfigError, match="norm_fator"):
        CoordinatorConfig.from_dict({**base, "guard": {"norm_fator": 2.0}})


def test_a_free_rider_is_refused_and_a_device_without_data_is_not():
    """An update that claims samples but hardly moved the model (the global model sent back) is a free rider; one
    that claims none carries nothing and passes (FedAvg gives it no weight)."""
    rng = np.random.default_rng(2)
    deltas = rng.standard_normal((5, 20)) * 0.1
    deltas[3] = 0.0  # a free rider: the global model back, with samples
    deltas[4] = 0.0  # a device that had nothing to train on
    counters: Counter[str] = Counter()
    out = UpdateBounds(krum_share=0.0).apply(np.zeros(20, np.float32), updates_of(deltas, [10, 10, 10, 10, 0]), counters)
    assert [u.device for u in out] == ["d0", "d1", "d2", "d4"] and counters == {"free-rider": 1}
    out = UpdateBounds(free_rider_factor=0.0, krum_share=0.0).apply(np.zeros(20, np.float32), updates_of(deltas, [10] * 5),
                                                                    Counter())
    assert len(out) == 5  # off


def test_the_rank_cap_counts_a_claim_beyond_every_honest_one_as_the_largest_honest_one():
    """`sample_rank`: no claim counts more than the (f+1)-th largest of the round (f = sample_rank x n, rounded
    down), held or streamed; off (0), nothing is capped."""
    rng = np.random.default_rng(5)
    deltas = rng.standard_normal((8, 20)) * 0.1
    claims = [10, 12, 11, 9, 10, 13, 10**9, 10**9]  # two of eight claim a billion
    bounds = UpdateBounds(sample_rank=0.25, sample_factor=0.0, sample_bound="cap", krum_share=0.0,
                          free_rider_factor=0.0)
    counters: Counter[str] = Counter()
    out = bounds.apply(np.zeros(20, np.float32), updates_of(deltas, claims), counters)
    assert [u.num_samples for u in out] == [10, 12, 11, 9, 10, 13, 13, 13] and counters == {"samples-capped": 2}
    taken: list[ClientUpdate] = []
    stream = dataclasses.replace(bounds, hold=4).stream(np.zeros(20, np.float32), taken.append, Counter())
    for update in updates_of(deltas, claims):
        stream.add(update)
    stream.close()
    # streamed, each by the claims so far: among the first four, f = 1 caps the largest honest one to the second
    assert [u.num_samples for u in taken] == [10, 11, 11, 9, 10, 12, 13, 13]
    off = dataclasses.replace(bounds, sample_rank=0.0).apply(np.zeros(20, np.float32), updates_of(deltas, claims),
                                                             Counter())
    assert [u.num_samples for u in off] == claims


def test_an_update_pointing_against_the_others_is_refused_held_or_streamed():
    """`min_alignment`: the cosine between an update's change and the others' (the rest of a held round; the
    updates taken so far, as they stream) must reach it."""
    rng = np.random.default_rng(3)
    common = rng.standard_normal(200)
    deltas = np.stack([common + rng.standard_normal(200) * 0.5 for _ in range(6)]) * 0.01
    deltas[5] = -deltas[5]  # reversed, as long as an honest one
    bounds = UpdateBounds(min_alignment=-0.3, krum_share=0.0)
    counters: Counter[str] = Counter()
    out = bounds.apply(np.zeros(200, np.float32), updates_of(deltas), counters)
    assert [u.device for u in out] == [f"d{k}" for k in range(5)] and counters == {"misaligned": 1}
    off = UpdateBounds.only()
    assert len(off.apply(np.zeros(200, np.float32), updates_of(deltas), Counter())) == 6
    taken: list[str] = []
    counters = Counter()
    stream = UpdateBounds(min_alignment=-0.3, hold=2, krum_share=0.0).stream(np.zeros(200, np.float32),
                                                              lambda u: taken.append(u.device), counters)
    for update in updates_of(deltas):
        stream.add(update)
    stream.close()
    assert taken == [f"d{k}" for k in range(5)] and counters == {"misaligned": 1}


def test_an_update_that_undoes_the_fleets_last_step_is_refused_held_or_streamed():
    """`min_progress`: an update's change must not point back along the fleet's last global step g - g' (its cosine
    with it at least `min_progress`): g' sent back (`reversed-step`) is refused, an update that learns what the step
    learnt or something new (orthogonal to it) passes; no step known or a claim of no samples: not checked."""
    rng = np.random.default_rng(4)
    previous = rng.standard_normal(200).astype(np.float32)
    step = rng.standard_normal(200) * 0.01
    current = (previous + step).astype(np.float32)
    new = np.zeros(200)
    new[:20] = rng.standard_normal(20) * 0.01  # a class of its own: orthogonal-ish to the step
    changes = [step + rng.standard_normal(200) * 0.005 for _ in range(3)] + [new - np.dot(new, step) / np.dot(
        step, step) * step]
    weights = [current + c for c in changes] + [previous]  # the last one sends g' back
    path = FleetPath(last_step=current.astype(np.float64) - previous)
    bounds = UpdateBounds.only(min_progress=-0.8)
    counters: Counter[str] = Counter()
    out = bounds.apply(current, updates_of(weights), counters, path=path)
    assert [u.device for u in out] == [f"d{k}" for k in range(4)] and counters == {"undoes-last-step": 1}
    assert len(bounds.apply(current, updates_of(weights), Counter())) == 5  # no step known
    assert len(UpdateBounds.only().apply(current, updates_of(weights), Counter(), path=path)) == 5  # off
    nothing = updates_of(weights, [10, 10, 10, 10, 0])
    assert len(bounds.apply(current, nothing, Counter(), path=path)) == 5
    halfway = updates_of([*weights[:4], (current + previous) / 2])  # part of the way back is the same direction
    assert len(bounds.apply(current, halfway, Counter(), path=path)) == 4
    taken: list[str] = []
    counters = Counter()
    stream = dataclasses.replace(bounds, hold=2).stream(current, lambda u: taken.append(u.device), counters,
                                                         path=path)
    for update in updates_of(weights):
        stream.add(update)
    stream.close()
    assert taken == [f"d{k}" for k in range(4)] and counters == {"undoes-last-step": 1}
    with pytest.raises(ValueError, match="min_progress"):
        UpdateBounds(min_progress=1.0)


def test_an_update_pointing_against_the_others_is_turned_not_refused_when_projected():
    """`direction_bound = "project"`: a reversed update keeps its part orthogonal to the others' (where an update on
    classes they do not hold lies) and loses what pointed against them, until its cosine is `min_alignment`; an
    update already at or above it is passed as it is; held or streamed alike."""
    rng = np.random.default_rng(3)
    common = rng.standard_normal(200)
    deltas = np.stack([common + rng.standard_normal(200) * 0.5 for _ in range(6)]) * 0.01
    deltas[5] = -deltas[5] + np.eye(200)[7] * 0.05  # reversed, with a part of its own
    for cosine in (0.0, -0.2):
        bounds = UpdateBounds(min_alignment=cosine, direction_bound="project", krum_share=0.0)
        counters: Counter[str] = Counter()
        out = bounds.apply(np.zeros(200, np.float32), updates_of(deltas), counters)
        assert [u.device for u in out] == [f"d{k}" for k in range(6)] and counters == {"turned": 1}
        for k in range(5):
            np.testing.assert_array_equal(out[k].weights, deltas[k].astype(np.float32))
        others = deltas[:5].sum(0)
        unit = others / np.linalg.norm(others)
        kept = out[5].weights.astype(np.float64)
        assert np.dot(kept, unit) / np.linalg.norm(kept) == pytest.approx(cosine, abs=1e-5)
        orthogonal = deltas[5] - np.dot(deltas[5], unit) * unit
        np.testing.assert_allclose(kept - np.dot(kept, unit) * unit, orthogonal, atol=1e-6)
    # a reversed update 2.5x as long with a long part of its own keeps that part, at most a typical update long
    long = deltas.copy()
    long[5] = 2.5 * deltas[5] + np.eye(200)[7] * 0.5  # deltas[5] is reversed already
    out = UpdateBounds(min_alignment=0.0, direction_bound="project", krum_share=0.0, norm_bound="off").apply(
        np.zeros(200, np.float32), updates_of(long), Counter())
    typical = np.median(np.linalg.norm(long, axis=1))
    assert np.linalg.norm(out[5].weights) == pytest.approx(typical, rel=1e-4)
    assert out[5].weights[7] > 0.9 * np.linalg.norm(out[5].weights)  # what is left is its own part
    taken: list[ClientUpdate] = []
    counters = Counter()
    stream = UpdateBounds(min_alignment=0.0, direction_bound="project", hold=2, krum_share=0.0).stream(
        np.zeros(200, np.float32), taken.append, counters)
    for update in updates_of(deltas):
        stream.add(update)
    stream.close()
    assert [u.device for u in taken] == [f"d{k}" for k in range(6)] and counters == {"turned": 1}
    so_far = deltas[:5].sum(0)  # the changes taken before it
    last = taken[5].weights.astype(np.float64)
    assert np.dot(last, so_far) / (np.linalg.norm(last) * np.linalg.norm(so_far)) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("device", devices)
def test_squared_distances_are_numpys(device):
    w = np.random.default_rng(4).standard_normal((6, 40)).astype(np.float32)
    got = squared_distances(list(w), torch.device(device)).cpu().numpy()
    np.testing.assert_allclose(got, ((w[:, None, :] - w[None, :, :]).astype(np.float64) ** 2).sum(-1), rtol=1e-4,
                               atol=1e-6)


def test_distances_to_the_kept_updates_are_squared_distances_rows():
    rng = np.random.default_rng(7)
    kept = list((rng.standard_normal((5, 300)) * rng.uniform(0.1, 10, (5, 1))).astype(np.float32))
    later = (rng.standard_normal(300) * 3).astype(np.float32)
    full = squared_distances([later, *kept], torch.device("cpu")).numpy()
    np.testing.assert_allclose(DistancesTo(kept)(later), full[0, 1:], rtol=1e-9, atol=1e-9)
    assert DistancesTo.fits(4, 1 << 20, limit=32 << 20) and not DistancesTo.fits(5, 1 << 20, limit=32 << 20)


def test_a_rounds_changes_are_each_weights_own_whichever_came_between():
    """`UpdateChanges`: w - g in float64 and its length, for the weights asked about, after other weights, and for a
    new array that took a dropped one's place; the change from the rows' origin gives `DistancesTo` its distances."""
    rng = np.random.default_rng(11)
    g = rng.standard_normal(300).astype(np.float32)
    a, b = (g + rng.standard_normal((2, 300)).astype(np.float32))
    widened = UpdateChanges(g)
    for weights in (a, b, a, a):
        expected = weights.astype(np.float64) - g
        np.testing.assert_array_equal(widened.of(weights), expected)
        assert widened.length(weights) == pytest.approx(np.linalg.norm(expected), rel=1e-12)
    values = b.copy()
    widened.of(b)
    del b  # its change is in the buffer; the next array may take its place
    later = values + np.float32(1)
    np.testing.assert_array_equal(widened.of(later), later.astype(np.float64) - g)
    np.testing.assert_allclose(DistancesTo([a], g)(later, widened), DistancesTo([a], g)(later), rtol=1e-12)


def test_a_second_reader_of_the_rows_reads_the_last_updates_distances_and_only_its():
    """`DistancesTo.among`: distances to some of the rows' very arrays (Krum's kept ones among the copy check's), read
    from the rows' last measurement of that update, as a DistancesTo of those alone gives them; an array that is not
    among the rows gets none; the last update's distances are its own, not those of another array, equal or not."""
    rng = np.random.default_rng(13)
    g = rng.standard_normal(300).astype(np.float32)
    first = list(g + rng.standard_normal((5, 300)).astype(np.float32))
    later, other = g + rng.standard_normal((2, 300)).astype(np.float32)
    rows = DistancesTo(first, g)
    kept = [first[3], first[0], first[4]]
    among = rows.among(kept)
    assert among is not None and rows.among([first[1], first[1].copy()]) is None
    measured = rows(later)
    assert rows(later) is measured and not measured.flags.writeable  # read again, as it was
    np.testing.assert_array_equal(among(later), measured[[3, 0, 4]])
    np.testing.assert_allclose(among(later), DistancesTo(kept, g)(later), rtol=1e-9)
    same = later.copy()
    assert rows(same) is not measured and rows(other) is not measured
    np.testing.assert_allclose(among(other), DistancesTo(kept, g)(other), rtol=1e-9)


@pytest.mark.parametrize("compare", ["whole", "classes"])
def test_a_streamed_round_selects_the_same_with_the_kept_updates_distances_cached_or_not(compare, monkeypatch):
    """A later update is compared with the kept ones through their cached rows (`DistancesTo`) where they fit, else
    streamed again: the same updates are taken and named either way, the heads' rows left out as with one Gram."""
    rng = np.random.default_rng(8)
    heads = HeadLayout(tuple(np.arange(30 + 2 * c, 32 + 2 * c) for c in range(5)))
    spread = np.linspace(0.2, 1.0, 30)[:, None]
    deltas = np.concatenate([rng.normal(1.0, 0.1, 40) + rng.normal(0.0, 1.0, (30, 40)) * spread,
                             -rng.normal(1.0, 0.3, (3, 40))])[rng.permutation(33)]
    claims = [{int(c) for c in rng.choice(5, 2, replace=False)} for _ in range(33)]
    rounds = [[ClientUpdate(f"d{k}", d.astype(np.float32), 10, trained_counts=[(0, c, 5) for c in claim])
               for k, (d, claim) in enumerate(zip(deltas, claims))] for _ in range(2)]
    outcomes = []

    def taken_by(taken: list[str]) -> Callable[[ClientUpdate], None]:
        return lambda update: taken.append(update.device)

    for cached, updates in zip((True, False), rounds):
        monkeypatch.setattr(DistancesTo, "fits", staticmethod(lambda count, size, cached=cached: cached))
        taken: list[str] = []
        counters: Counter[str] = Counter()
        bounds = UpdateBounds(hold=8, krum_compare=compare, krum_radius=0.0)  # no update taken back: Krum decides
        stream = bounds.stream(np.zeros(40, np.float32), taken_by(taken), counters, heads=heads)
        for update in updates:
            stream.add(update)
        stream.close()
        outcomes.append((taken, counters))
    assert outcomes[0] == outcomes[1] and outcomes[0][1]["krum-outlier"] > 2  # later updates named too


@pytest.mark.parametrize("kept", [0, 2, krum.CLAIMS_KEPT])
@pytest.mark.parametrize("origin", [False, True])
def test_a_pairs_compared_distance_leaves_out_the_rows_of_the_classes_either_claims_and_nothing_else(
        kept, origin, monkeypatch):
    """`ClaimedRows` (the kept updates' claims and head rows, read once a round): each pair's squared distance is the
    sum over the positions outside the head rows of every class either of the two claims, whatever the claims (one
    class, several, none, one no column claims, one past the head's classes: every class compared, or some), as the
    whole distances less those rows; and so whether what it compares for a set of claims is kept or not
    (`CLAIMS_KEPT` sets at most), and whether the rows are measured from an origin (a round's global model) or not."""
    monkeypatch.setattr(krum, "CLAIMS_KEPT", kept)
    rng = np.random.default_rng(12)
    heads = HeadLayout(tuple(np.arange(30 + 3 * c, 33 + 3 * c) for c in range(5)))
    claims = [{1}, {0, 3}, set(), {4}, {2, 7}, {1, 2, 3}]
    centre = rng.standard_normal(45).astype(np.float32) * 100  # the updates near it: the rows' products cancel
    updates = [ClientUpdate(f"d{k}", centre + rng.standard_normal(45).astype(np.float32), 10,
                            trained_counts=[(0, c, 5) for c in claim]) for k, claim in enumerate(claims)]
    rows, columns = updates[:4], updates[2:]
    claimed = ClaimedRows(columns, heads, centre if origin else None)
    got = claimed.subtract(squared_distances([u.weights for u in updates], torch.device("cpu")).numpy()[:4, 2:], rows)
    assert len(claimed._by_claims) == min(kept, 4)  # four sets of claims among the rows
    for i, mine in enumerate(rows):
        for j, theirs in enumerate(columns):
            outside = np.ones(45, dtype=bool)  # the positions outside the claimed classes' rows
            for c in claimed_classes(mine) | claimed_classes(theirs):
                if c < 5:
                    outside[heads.rows[c]] = False
            apart = mine.weights.astype(np.float64)[outside] - theirs.weights.astype(np.float64)[outside]
            assert got[i, j] == pytest.approx(float(apart @ apart), rel=1e-9, abs=1e-9)


def test_krum_selection_refuses_the_quarter_farthest_from_their_neighbours_and_fedavg_over_the_rest_is_multi_krum():
    """f = a quarter of 8 = 2: the two updates far from the others are refused, and FedAvg of the six kept, weighted
    by samples, is Flower's MultiKrum. A round of 3 loses none."""
    rng = np.random.default_rng(4)
    deltas = np.concatenate([rng.normal(1.0, 0.3, (6, 40)), rng.normal(-1.0, 0.3, (2, 40))])
    samples = [1, 2, 3, 4, 5, 6, 7, 8]
    counters: Counter[str] = Counter()
    kept = UpdateBounds().apply(np.zeros(40, np.float32), updates_of(deltas, samples), counters)
    assert [u.device for u in kept] == [f"d{k}" for k in range(6)] and counters == {"krum-outlier": 2}
    got = make_strategy("fedavg", device="cpu").aggregate(torch.zeros(40), kept).global_weights.numpy()
    np.testing.assert_allclose(got, np.average(deltas[:6], axis=0, weights=samples[:6]), rtol=1e-5, atol=1e-6)
    assert len(UpdateBounds().apply(np.zeros(40, np.float32), updates_of(deltas[:3]), Counter())) == 3
    assert len(UpdateBounds.only().apply(np.zeros(40, np.float32), updates_of(deltas), Counter())) == 8


def test_past_the_first_hold_updates_one_farther_than_any_kept_one_is_refused_streamed_or_held():
    rng = np.random.default_rng(5)
    honest = rng.normal(1.0, 0.3, (12, 40))
    far = rng.normal(-1.0, 0.3, (1, 40))
    taken: list[str] = []
    counters: Counter[str] = Counter()
    stream = UpdateBounds(hold=8).stream(np.zeros(40, np.float32), lambda u: taken.append(u.device), counters)
    for update in updates_of(np.concatenate([honest, far])):
        stream.add(update)
    stream.close()
    assert "d12" not in taken and counters["krum-outlier"] >= 1  # the far one (honest ones named are taken back)
    assert len(taken) == 13 - counters["krum-outlier"]
    held = UpdateBounds(hold=8).apply(np.zeros(40, np.float32), updates_of(np.concatenate([honest, far])), Counter())
    assert [u.device for u in held] == taken  # a held round (a holding rule's) selects the same way


def test_updates_that_learnt_nothing_are_no_krum_reference_for_the_learners_after_them():
    """A device whose training left the global model as it was claims no samples (edge_client/device.py `_claims`),
    and devices with little data answer first: in a 2000-device fleet the first 8 arrivals were mostly such, the
    kept ones' worst Krum score 0 and their spread 0, and every update that learnt something after them was refused
    (606 of 2000 in round 1, all its learners). Those are no Krum reference, nor scored, nor counted among the
    `hold` a stream waits for: the first `hold` that learnt something are the reference, and a reversed update is
    still refused, held or streamed, however many of the first arrivals learnt nothing."""
    rng = np.random.default_rng(9)
    g = np.zeros(40, np.float32)
    learners = rng.normal(1.0, 0.1, 40) + rng.normal(0.0, 0.5, (12, 40))
    reversed_ = -learners[:1]
    weights = np.concatenate([np.zeros((6, 40)), learners[:2], learners[2:], reversed_])
    samples = [0] * 6 + [10] * 12 + [10]
    for hold in (8, 4):
        taken: list[str] = []
        counters: Counter[str] = Counter()
        stream = UpdateBounds(hold=hold).stream(g, lambda u, taken=taken: taken.append(u.device), counters)
        for update in updates_of(weights, samples):
            stream.add(update)
        stream.close()
        assert sorted(taken) == sorted(f"d{k}" for k in range(18)) and counters == {"krum-outlier": 1}, hold
        held = UpdateBounds(hold=hold).apply(g, updates_of(weights, samples), Counter())
        assert sorted(u.device for u in held) == sorted(taken)  # (a stream's held ones go on in device order)


def test_an_honest_update_krum_names_is_taken_back_within_the_radius_and_a_reversed_one_is_not():
    """Honest updates on different data differ unevenly: Krum names the one farthest from its neighbours in a clean
    round too (as with krum_radius 0). Within 2x the farthest kept update's distance from the kept ones' mean it is
    taken back; a reversed update lies beyond and stays refused, held or streamed."""
    rng = np.random.default_rng(6)
    spread = np.linspace(1.0, 2.0, 6)[:, None]  # the last devices' updates differ most from the rest
    honest = rng.normal(1.0, 0.1, 40) + rng.normal(0.0, 0.3, (6, 40)) * spread
    g = np.zeros(40, np.float32)
    named: Counter[str] = Counter()
    assert len(UpdateBounds(krum_radius=0.0).apply(g, updates_of(honest), named)) == 5
    assert named == {"krum-outlier": 1}
    counters: Counter[str] = Counter()
    assert len(UpdateBounds().apply(g, updates_of(honest), counters)) == 6 and not counters
    attacked = np.concatenate([honest, -honest[:1]])
    kept = UpdateBounds().apply(g, updates_of(attacked), counters)
    assert [u.device for u in kept] == [f"d{k}" for k in range(6)] and counters == {"krum-outlier": 1}
    taken: list[str] = []
    streamed: Counter[str] = Counter()
    stream = UpdateBounds(hold=4).stream(g, lambda u: taken.append(u.device), streamed)
    for update in updates_of(attacked):
        stream.add(update)
    stream.close()
    assert taken == [f"d{k}" for k in range(6)] and streamed == {"krum-outlier": 1}
    with pytest.raises(ValueError, match="krum_radius"):
        UpdateBounds(krum_radius=-1.0)


def test_a_head_s_row_lengths_in_one_pass_are_the_floats_of_one_row_at_a_time():
    """`HeadLayout.lengths` measures every class's head row at once (a round bounds each update's rows), with the
    same float64 lengths as each row alone, on LeNet's real layout and at any scale of the weights."""
    from coordinator.influence import _length
    from models.manifest import ParameterInfo

    parameters = [ParameterInfo("trunk.weight", (120, 84)), ParameterInfo("head.weight", (10, 84)),
                  ParameterInfo("head.bias", (10,))]
    heads = HeadLayout.of(parameters)
    assert heads is not None and heads.table.shape == (10, 85)
    rng = np.random.default_rng(3)
    for scale in (1e-6, 1.0, 1e6):
        weights = (rng.standard_normal(120 * 84 + 850) * scale).astype(np.float32)
        assert heads.lengths(weights) == [_length(weights[row]) for row in heads.rows]


def test_krum_compares_two_updates_without_the_rows_of_the_classes_they_trained_on():
    """`krum_compare = "classes"` (the default): a device that alone brings class 2 differs from the others by its
    row of class 2, and one that holds class 0 alone by how it learnt class 0's row (against the old classes only,
    not against class 1); whole updates compared, Krum refuses both, compared on what neither's classes own,
    neither. An update that undoes the round's step is refused either way, also when it claims a class no other
    device brings: its body still points back."""
    rng = np.random.default_rng(11)
    heads = HeadLayout(tuple(np.arange(30 + 2 * c, 32 + 2 * c) for c in range(5)))  # 30 body values, 5 rows of 2
    step = np.zeros(40)
    step[:30], step[30:34] = 0.1, 0.5  # the body, and the rows of classes 0 and 1
    deltas = [step + rng.normal(0.0, 0.03, 40) for _ in range(6)]
    novel = step.copy()
    novel[30:34], novel[34:36] = 0.0, 1.5  # classes 0 and 1 untouched, class 2 learnt
    deltas.append(novel + rng.normal(0.0, 0.03, 40))
    alone = step.copy()
    alone[30:32], alone[32:34] = 1.2, -0.3  # class 0's row learnt against the old classes, class 1 pushed down
    deltas.append(alone + rng.normal(0.0, 0.03, 40))

    def round_of(changes: list[np.ndarray], claims: list[set[int]]) -> list[ClientUpdate]:
        return [ClientUpdate(f"d{k}", change.astype(np.float32), 10, trained_counts=[(0, c, 5) for c in claim])
                for k, (change, claim) in enumerate(zip(changes, claims))]

    g = np.zeros(40, np.float32)
    honest = [{0, 1}] * 6 + [{2}, {0}]
    for compare, refused in (("whole", 2), ("classes", 0)):
        counters: Counter[str] = Counter()
        kept = UpdateBounds(krum_compare=compare).apply(g, round_of(deltas, honest), counters, heads=heads)
        assert counters["krum-outlier"] == refused and len(kept) == 8 - refused
    for claim in ({0, 1}, {3}):
        counters = Counter()
        attacked = round_of([*deltas, -step], [*honest, claim])
        kept = UpdateBounds(min_alignment=-1.0).apply(g, attacked, counters, heads=heads)
        assert [u.device for u in kept] == [f"d{k}" for k in range(8)] and counters["krum-outlier"] == 1
    with pytest.raises(ValueError, match="krum_compare"):
        UpdateBounds(krum_compare="rows")


def test_a_named_update_within_the_floor_of_the_kept_ones_centre_stays():
    """`krum_floor` (0.05 of the round's median distance from the global model): in SDD's few-shot sessions what
    Krum compares (the body, trained at a thousandth of the head's rate) differs between honest devices by about a
    hundredth of their length, so a device whose one sample points its body elsewhere was named and lay just beyond
    the radius (1 honest update of 36 refused). Within the floor it stays; an update whose body moves a tenth of a
    typical update's length against the others' is refused."""
    rng = np.random.default_rng(12)
    heads = HeadLayout(tuple(np.arange(30 + 2 * c, 32 + 2 * c) for c in range(5)))
    changes = []
    for k in range(4):
        change = np.zeros(40)
        change[:30] = rng.normal(0.0, 1e-3 * (4.0 if k == 3 else 1.0), 30)  # the last device: one sample's direction
        change[30 + 2 * k:32 + 2 * k] = 1.0  # its own class's row, the update's length
        changes.append(change)
    updates = [ClientUpdate(f"d{k}", c.astype(np.float32), 3, trained_counts=[(1, k, 3)])
               for k, c in enumerate(changes)]
    g = np.zeros(40, np.float32)
    for floor, refused in ((0.0, 1), (0.05, 0)):
        counters: Counter[str] = Counter()
        UpdateBounds(krum_floor=floor).apply(g, updates, counters, heads=heads)
        assert counters["krum-outlier"] == refused
    pulling = changes[0].copy()
    pulling[:30] = -0.1 * np.sqrt(2.0) / np.sqrt(30.0)  # the body moved a tenth of the update's length
    counters = Counter()
    attacked = [*updates, ClientUpdate("d4", pulling.astype(np.float32), 3, trained_counts=[(1, 0, 3)])]
    kept = UpdateBounds(min_alignment=-1.0).apply(g, attacked, counters, heads=heads)
    assert [u.device for u in kept] == [f"d{k}" for k in range(4)] and counters["krum-outlier"] == 1
    with pytest.raises(ValueError, match="krum_floor"):
        UpdateBounds(krum_floor=-0.1)


@pytest.mark.parametrize("device", devices)
def test_centered_clipping_moves_at_most_tau_over_n_a_step_for_any_one_update(device):
    rng = np.random.default_rng(5)
    honest = rng.normal(1.0, 0.1, (5, 30))
    w = np.concatenate([honest, np.full((1, 30), 1e6)])
    start = np.median(w, axis=0)
    tau = float(np.median(np.linalg.norm(w - start, axis=1)))
    got = make_strategy("centered-clip", device=device, iterations=1).aggregate(torch.zeros(30), updates_of(w))
    step = got.global_weights.cpu().numpy() - start
    honest_part = sum((u - start) * min(1.0, tau / np.linalg.norm(u - start)) for u in honest) / 6
    assert np.linalg.norm(step - honest_part) <= tau / 6 * (1 + 1e-4)  # the far update's share: tau / n at most


def test_copies_of_one_update_share_its_weight_held_or_streamed():
    """`copy_factor`: updates within 0.01 times the shorter of their changes of each other are one update sent k
    times, and each counts 1/k of its samples (the `mimic` attack: two devices sending an honest device's update as
    theirs made its data count three times); distinct updates, updates that both barely moved, and updates that claim
    nothing are left as they are. Streamed, a later copy of a held update counts none of its samples. The first `hold`
    compared pairwise are the first that claim samples: after updates that learnt nothing, copies are still found."""
    rng = np.random.default_rng(8)
    deltas = rng.standard_normal((6, 50)) * 0.01
    copied = np.concatenate([deltas, deltas[[2, 2]] + 1e-9])  # d6, d7: d2's update (float32 rounds the 1e-9 away)
    counters: Counter[str] = Counter()
    bounds = UpdateBounds.only(copy_factor=0.01)
    out = bounds.apply(np.zeros(50, np.float32), updates_of(copied, [30, 30, 30, 30, 30, 30, 60, 90]), counters)
    assert [u.num_samples for u in out] == [30, 30, 10, 30, 30, 30, 20, 30] and counters == {"copies": 3}
    untouched = updates_of(deltas)
    assert bounds.apply(np.zeros(50, np.float32), untouched, Counter()) == untouched  # distinct: as they came
    small = updates_of(np.concatenate([deltas, deltas[:2] * 1e-4]))  # two that barely moved, each its own way
    assert bounds.apply(np.zeros(50, np.float32), small, Counter()) == small
    nothing = updates_of(np.zeros((3, 50)), [0, 0, 0])  # the global model sent back, claiming nothing
    counters = Counter()
    assert [u.num_samples for u in bounds.apply(np.zeros(50, np.float32), nothing, counters)] == [0, 0, 0]
    assert not counters
    assert [u.num_samples for u in UpdateBounds.only().apply(  # off
        np.zeros(50, np.float32), updates_of(copied, [30] * 8), Counter())] == [30] * 8
    taken: list[ClientUpdate] = []
    counters = Counter()
    stream = dataclasses.replace(bounds, hold=4).stream(np.zeros(50, np.float32), taken.append, counters)
    for update in updates_of(copied, [30] * 8):
        stream.add(update)
    stream.close()
    assert [u.num_samples for u in taken] == [30, 30, 30, 30, 30, 30, 0, 0] and counters == {"copies": 2}
    counters = Counter()  # a holding rule's whole round: past `hold`, each update is compared with the first ones
    held = dataclasses.replace(bounds, hold=4).apply(np.zeros(50, np.float32), updates_of(copied, [30] * 8), counters)
    assert [u.num_samples for u in held] == [30, 30, 30, 30, 30, 30, 0, 0] and counters == {"copies": 2}
    # the first `hold` that claim samples are compared pairwise, however many that learnt nothing came first
    after_nothing = updates_of(np.concatenate([np.zeros((4, 50)), deltas[:2], deltas[[1, 1]] + 1e-9]),
                               [0, 0, 0, 0, 30, 30, 30, 30])
    expected = [("d0", 0), ("d1", 0), ("d2", 0), ("d3", 0), ("d4", 30), ("d5", 10), ("d6", 10), ("d7", 10)]
    taken, counters = [], Counter()
    stream = dataclasses.replace(bounds, hold=4).stream(np.zeros(50, np.float32), taken.append, counters)
    for update in after_nothing:
        stream.add(update)
    stream.close()
    assert sorted((u.device, u.num_samples) for u in taken) == expected and counters == {"copies": 3}
    counters = Counter()
    held = dataclasses.replace(bounds, hold=4).apply(np.zeros(50, np.float32), after_nothing, counters)
    assert [(u.device, u.num_samples) for u in held] == expected and counters == {"copies": 3}
    with pytest.raises(ValueError, match="copy_factor"):
        UpdateBounds(copy_factor=1.0)


def test_a_copy_check_measures_only_the_pairs_whose_lengths_allow_a_copy_and_decides_as_measuring_every_pair(
        monkeypatch):
    """Two changes' lengths differ by at most the distance between the updates: `copies` measures a pair only where
    its lengths differ by less than its bound, and decides every pair as measuring it would, copies near the bound
    on either side, updates that did not move and changes of the same length in other directions included."""
    from coordinator import guard
    from coordinator.compute import distance

    rng = np.random.default_rng(7)
    g = rng.standard_normal(300).astype(np.float32)
    base = rng.standard_normal((12, 300))
    changes = [base[k] / np.linalg.norm(base[k]) * length for k, length in enumerate(rng.uniform(0.5, 2.0, 12))]
    changes += [changes[0] * (1 + f) + 0.004 * np.linalg.norm(changes[0]) * base[1] / np.linalg.norm(base[1])
                for f in (0.0, 0.004, 0.006, 0.02)]  # near copies of the first, inside and outside the bound
    changes += [base[5] / np.linalg.norm(base[5]) * np.linalg.norm(changes[0]), np.zeros(300), np.zeros(300)]
    updates = updates_of(np.array([g + c for c in changes], np.float32))
    moved = [distance(g, u.weights) for u in updates]
    bounds = UpdateBounds.only(copy_factor=0.01)
    measured = []
    monkeypatch.setattr(guard, "distance", lambda a, b: measured.append(1) or distance(a, b))
    pairs = [(i, j) for i in range(len(updates)) for j in range(i + 1, len(updates))]
    decided = [bounds.copies(updates[i], updates[j], moved[i], moved[j]) for i, j in pairs]
    expected = [distance(updates[i].weights, updates[j].weights) <= 0.01 * min(moved[i], moved[j]) for i, j in pairs]
    assert decided == expected and 3 <= sum(decided) < len(pairs)
    assert len(measured) < len(pairs) / 4
    taken = list(zip(updates[:12], moved[:12]))
    rows = bounds.taken_rows_of(g, taken)
    assert rows is not None  # a later update measured against every taken one at once decides the same
    for update, length in zip(updates[12:], moved[12:]):
        once, alone = Counter[str](), Counter[str]()
        assert (bounds.copied(update, length, taken, once, rows).num_samples
                == bounds.copied(update, length, taken, alone).num_samples)
        assert once == alone
    later = [bounds.copied(u, m, taken, Counter(), rows).num_samples for u, m in zip(updates[12:], moved[12:])]
    assert 0 < later.count(0) < len(later)  # copies near the bound on both sides among them
