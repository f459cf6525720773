"""The influence bounds (coordinator/influence.py): what an update that passed every refusal may still do, bounded."""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from coordinator.guard import UpdateBounds
from coordinator.influence import FleetPath, HeadLayout
from coordinator.strategies.base import ClientUpdate
from models.manifest import ParameterInfo

# every bound off: what a test turns on is what acts
OPEN = UpdateBounds.only()
CLASSES, WIDTH, BODY = 4, 5, 30
PARAMETERS = (ParameterInfo("body.weight", (BODY,)), ParameterInfo("head.weight", (CLASSES, WIDTH)),
              ParameterInfo("head.bias", (CLASSES,)))
HEADS = HeadLayout.of(PARAMETERS)


def updates_of(weights: list[np.ndarray], samples: list[int] | None = None,
               claims: list[set[int]] | None = None) -> list[ClientUpdate]:
    samples = samples or [10] * len(weights)
    claims = claims or [set() for _ in weights]
    return [ClientUpdate(f"d{i}", np.ascontiguousarray(w, dtype=np.float32), n,
                         trained_counts=tuple((0, c, 5) for c in sorted(claimed)))
            for i, (w, n, claimed) in enumerate(zip(weights, samples, claims))]


@pytest.mark.parametrize("slack", [0.0, 0.25])
def test_no_update_steps_back_toward_the_first_model_further_than_the_rounds_median_held_or_streamed(slack):
    """`way_back = "clip"`: an update's component along the way back to the first global model, (g0 - g) / |g0 - g|,
    is cut to the round's median (of the updates that claim samples) plus `way_back_slack` times the round's median
    change length, what it does across that direction stays, an update within is passed as it is; drift (an honest
    update plus |d| along the way back) keeps its honest part. Off: nothing changed; no way back known or a claim of
    no samples: nothing changed."""
    rng = np.random.default_rng(6)
    first = rng.standard_normal(300).astype(np.float32)
    current = (first + rng.standard_normal(300) * 0.1).astype(np.float32)
    back = (first.astype(np.float64) - current) / np.linalg.norm(first.astype(np.float64) - current)
    changes = [rng.standard_normal(300) * 0.01 + k * 0.02 * back for k in range(4)]
    changes.append(changes[0] + np.linalg.norm(changes[0]) * back)  # drift
    weights = [current + c for c in changes]
    steps = [float(np.dot(c, back)) for c in changes]
    lengths = [float(np.linalg.norm(c)) for c in changes]
    most = float(np.median(steps)) + slack * float(np.median(lengths))
    path = FleetPath(way_back=back)
    bounds = dataclasses.replace(OPEN, way_back="clip", way_back_slack=slack)
    counters: Counter[str] = Counter()
    updates = updates_of(weights)
    out = bounds.apply(current, updates, counters, path=path)
    assert counters == {"pulled-back": 2 if slack == 0 else 1}  # the two above the median of five; drift alone
    for update, sent, step, change in zip(out, updates, steps, changes):
        moved = update.weights.astype(np.float64) - current
        if step <= most:
            assert update is sent
            continue
        assert float(np.dot(moved, back)) == pytest.approx(most, abs=1e-5)
        across = change - np.dot(change, back) * back
        np.testing.assert_allclose(moved - np.dot(moved, back) * back, across, atol=1e-5)
    # drift keeps its honest part and steps back no further than the bound
    assert np.linalg.norm(out[4].weights - current - changes[0]) == pytest.approx(most - steps[0], abs=1e-5)
    assert most - steps[0] < (0.3 + slack) * lengths[0] < lengths[0]
    assert all(u is s for u, s in zip(OPEN.apply(
        current, updates, Counter(), path=path), updates))  # off
    assert all(u is s for u, s in zip(bounds.apply(current, updates, Counter()), updates))  # no way back known
    nothing = updates_of(weights, [10, 10, 10, 10, 0])  # the drift claims nothing: not counted, not changed
    counters = Counter()
    assert bounds.apply(current, nothing, counters, path=path)[4] is nothing[4]
    most_of_four = float(np.median(steps[:4])) + slack * float(np.median(lengths[:4]))
    assert counters["pulled-back"] == sum(step > most_of_four for step in steps[:4])
    taken: list[ClientUpdate] = []
    counters = Counter()
    stream = dataclasses.replace(bounds, hold=2).stream(current, taken.append, counters, path=path)
    for update in updates:
        stream.add(update)
    stream.close()
    running = [float(np.median(steps[:max(k + 1, 2)])) + slack * float(np.median(lengths[:max(k + 1, 2)]))
               for k in range(5)]  # the first two held together
    for update, step, bound in zip(taken, steps, running):
        assert float(np.dot(update.weights.astype(np.float64) - current, back)) == pytest.approx(min(step, bound),
                                                                                              abs=1e-5)
    assert counters["pulled-back"] == sum(step > bound for step, bound in zip(steps, running))
    with pytest.raises(ValueError, match="way_back"):
        UpdateBounds(way_back="reject")
    with pytest.raises(ValueError, match="way_back_slack"):
        UpdateBounds(way_back_slack=-0.1)


def row(weights: np.ndarray, c: int) -> np.ndarray:
    return weights[HEADS.rows[c]]


def test_a_class_head_row_is_at_most_its_claimants_lower_median_held_or_streamed():
    """`row_factor`: each update's head row of a class (its head.weight row and head.bias entry) is scaled back onto
    `row_factor` x the lower median of the lengths of that class's rows from the updates that claim it, whoever sent
    it; a class one device claims is bounded by its row, which it is within (its new class stays free); a class no
    one claims has no bound; the rest of the update stays. A head scaled x2 (`head-scale`) is cut back; honest rows
    at or under the bound pass as they are, and so do rows within the global model's (the bound is never under it:
    an old class's rows shrink as the round forgets it, and clipping them to the shortest would forget it faster)."""
    assert HEADS is not None and [len(r) for r in HEADS.rows] == [WIDTH + 1] * CLASSES
    assert HeadLayout.of((ParameterInfo("body.weight", (BODY,)),)) is None  # no head: no layout
    rng = np.random.default_rng(8)
    current = rng.standard_normal(BODY + CLASSES * (WIDTH + 1)).astype(np.float32)
    weights = [current + rng.standard_normal(current.size).astype(np.float32) * 0.01 for _ in range(4)]
    claims = [{0, 1}, {0, 1}, {0, 1, 2}, {0, 1}]  # class 2: one device alone; class 3: no one
    weights[2][HEADS.rows[2]] *= 3  # its own new class, grown
    weights[3][HEADS.rows[0]] *= 2  # a head scaled on a class the others hold
    weights[3][HEADS.rows[2]] *= 5  # ... and on one it does not claim: the claimant's row is the bound there
    weights[3][HEADS.rows[3]] *= 5  # ... and on one no one claims: no bound
    for w, shrunk in zip(weights, (0.8, 0.85, 0.9, 0.8)):  # an old class the round forgets: no row is cut further
        w[HEADS.rows[1]] = current[HEADS.rows[1]] * shrunk
    lengths = {c: sorted(float(np.linalg.norm(row(w, c))) for w, k in zip(weights, claims) if c in k)
               for c in (0, 1, 2)}
    lower = {c: max(v[(len(v) - 1) // 2], float(np.linalg.norm(row(current, c)))) for c, v in lengths.items()}
    bounds = dataclasses.replace(OPEN, row_factor=1.0)
    counters: Counter[str] = Counter()
    updates = updates_of(weights, claims=claims)
    out = bounds.apply(current, updates, counters, heads=HEADS)
    for update, sent in zip(out, updates):
        for c in (0, 1, 2):
            got, had = float(np.linalg.norm(row(update.weights, c))), float(np.linalg.norm(row(sent.weights, c)))
            assert got == pytest.approx(min(had, lower[c]), rel=1e-5)
        np.testing.assert_array_equal(update.weights[:BODY], sent.weights[:BODY])  # the body stays
    assert out[2].weights[HEADS.rows[2]] == pytest.approx(updates[2].weights[HEADS.rows[2]])  # alone: free
    np.testing.assert_array_equal(row(out[3].weights, 3), row(updates[3].weights, 3))  # no claimant: no bound
    for update, sent in zip(out, updates):  # within the global model's row: a shrinking row is not the attack
        np.testing.assert_array_equal(row(update.weights, 1), row(sent.weights, 1))
    assert counters["row-clipped"] == sum(any(np.linalg.norm(row(u.weights, c)) > lower[c] for c in (0, 1, 2))
                                          for u in updates)
    assert float(np.linalg.norm(row(out[3].weights, 0))) < 0.6 * float(np.linalg.norm(row(updates[3].weights, 0)))
    at_one_and_a_half = dataclasses.replace(OPEN, row_factor=1.5).apply(current, updates, Counter(), heads=HEADS)
    assert float(np.linalg.norm(row(at_one_and_a_half[3].weights, 0))) == pytest.approx(1.5 * lower[0], rel=1e-5)
    assert all(u is s for u, s in zip(OPEN.apply(current, updates, Counter(), heads=HEADS), updates))  # off
    assert all(u is s for u, s in zip(bounds.apply(current, updates, Counter()), updates))  # no head layout
    taken: list[ClientUpdate] = []
    stream = dataclasses.replace(bounds, hold=2).stream(current, taken.append, Counter(), heads=HEADS)
    for update in updates:
        stream.add(update)
    stream.close()
    for k, (update, sent) in enumerate(zip(taken, updates)):
        seen = [float(np.linalg.norm(row(w, 0))) for w in weights[:max(k + 1, 2)]]  # class 0: every claimant
        limit = max(sorted(seen)[(len(seen) - 1) // 2], float(np.linalg.norm(row(current, 0))))
        had = float(np.linalg.norm(row(sent.weights, 0)))
        assert float(np.linalg.norm(row(update.weights, 0))) == pytest.approx(min(had, limit), rel=1e-5)
    with pytest.raises(ValueError, match="row_factor"):
        UpdateBounds(row_factor=0.5)
