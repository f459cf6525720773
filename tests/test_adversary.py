"""Compromised devices of a simulated fleet (firmware_sim/adversary.py): each attack sends what its row of the
module's docstring says, from the device's honest update, and the fleet's [adversary] table picks the devices."""
from __future__ import annotations

import numpy as np
import pytest

from firmware_sim.adversary import ATTACKS, FLIP, HUGE, INFLATED_SAMPLES, SCALE, AdversarySettings, Honest


@pytest.fixture
def honest() -> Honest:
    rng = np.random.default_rng(0)
    g = rng.standard_normal(500).astype(np.float32)
    w = (g + rng.standard_normal(500) * 0.1).astype(np.float32)
    return Honest(global_weights=g, weights=w, num_samples=40, round=3, fleet_size=4, start=np.zeros(500, np.float32))


def change(weights: np.ndarray, honest: Honest) -> np.ndarray:
    return weights.astype(np.float64) - honest.global_weights


def test_each_attack_sends_what_it_says(honest):
    d = honest.update
    length = np.linalg.norm(d)
    sent = {name: attack(honest) for name, attack in ATTACKS.items()}
    np.testing.assert_allclose(change(sent["scaled"][0], honest), SCALE * d, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(change(sent["sign-flip"][0], honest), -FLIP * d, rtol=1e-4, atol=1e-5)
    assert (sent["huge"][0] == np.float32(HUGE)).all() and np.isnan(sent["nan"][0]).all()
    samples, count = sent["samples"]
    assert count == INFLATED_SAMPLES and np.linalg.norm(change(samples, honest)) == pytest.approx(length, rel=1e-3)
    assert abs(change(samples, honest) @ d) < 0.2 * length**2  # garbage: not the honest direction
    assert np.linalg.norm(change(sent["boosted"][0], honest)) == pytest.approx(4 * length, rel=1e-3)
    drift = change(sent["drift"][0], honest) - d
    back = honest.start - honest.global_weights.astype(np.float64)
    assert np.linalg.norm(drift) == pytest.approx(length, rel=1e-3) and drift @ back > 0.999 * length * np.linalg.norm(back)
    np.testing.assert_array_equal(sent["lazy"][0], honest.global_weights)
    assert all(count == 40 for name, (_, count) in sent.items() if name != "samples")


def test_colluding_devices_send_the_same_garbage_in_a_round():
    """`samples` and `boosted` noise is seeded by the round: two compromised devices agree, as a coordinated attack
    would (a majority that looks alike)."""
    g = np.zeros(100, np.float32)
    one = Honest(g, np.full(100, 0.1, np.float32), 10, 5, 8, g)
    other = Honest(g, np.full(100, -0.1, np.float32), 12, 5, 8, g)
    np.testing.assert_array_equal(ATTACKS["samples"](one)[0], ATTACKS["samples"](other)[0])


def test_the_fleets_table_names_the_last_devices_and_refuses_nonsense():
    assert [AdversarySettings("drift", 2).of(k, 8) for k in range(8)] == [None] * 6 + ["drift"] * 2
    assert AdversarySettings().of(3, 4) is None
    with pytest.raises(ValueError, match="unknown attack"):
        AdversarySettings("bribe", 1)
    with pytest.raises(ValueError, match="devices"):
        AdversarySettings("lazy", 0)
