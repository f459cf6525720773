"""Compromised devices of a simulated fleet (firmware_sim/adversary.py): each attack sends what its row of the
module's docstring says, from the device's honest update, and the fleet's [adversary] table picks the devices."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from firmware_sim.adversary import (
    ATTACKS,
    FLIP,
    HEAD_SCALE,
    HUGE,
    INFLATED_SAMPLES,
    SCALE,
    AdversarySettings,
    Honest,
)


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
    assert all(count == 40 for name, (_, count) in sent.items() if name not in ("samples", "tinynoise"))


def test_head_scale_scales_the_current_tasks_head_rows_and_nothing_else(honest):
    rows = np.array([10, 11, 12, 400])
    weights, count = ATTACKS["head-scale"](dataclasses.replace(honest, task_rows=rows))
    np.testing.assert_allclose(weights[rows], HEAD_SCALE * honest.weights[rows])
    rest = np.setdiff1d(np.arange(500), rows)
    np.testing.assert_array_equal(weights[rest], honest.weights[rest])
    assert count == honest.num_samples
    np.testing.assert_array_equal(ATTACKS["head-scale"](honest)[0], honest.weights)  # no task rows: nothing


def test_tinynoise_and_the_reversed_step_follow_the_fleets_last_step(honest):
    """Issue 56's adaptive free rider: noise 0.3 times the last global step, claiming 100 samples; the reversed
    step undoes it. At a device's first round there is no step: both send the global model."""
    from dataclasses import replace

    from firmware_sim.adversary import TINY, TINY_SAMPLES

    previous = honest.global_weights - np.float32(0.05)
    h = replace(honest, previous=previous)
    step = honest.global_weights.astype(np.float64) - previous
    tiny, count = ATTACKS["tinynoise"](h)
    assert count == TINY_SAMPLES
    assert np.linalg.norm(change(tiny, h)) == pytest.approx(TINY * np.linalg.norm(step), rel=1e-3)
    np.testing.assert_allclose(change(ATTACKS["reversed-step"](h)[0], h), -step, rtol=1e-4, atol=1e-5)
    for name in ("tinynoise", "reversed-step"):
        np.testing.assert_array_equal(ATTACKS[name](honest)[0], honest.global_weights)


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
    AdversarySettings("prototype-flood", 1).check_policy("glfc")  # a method's payload attack, on its method
    with pytest.raises(ValueError, match="changes the glfc policy's payloads, and the devices run 'random'"):
        AdversarySettings("prototype-flood", 1).check_policy("random")
    AdversarySettings("drift", 1).check_policy("random")  # an attack on weights: any policy


def omniscient(seed: int = 0, honest_devices: int = 6, colluders: int = 2, size: int = 300) -> Honest:
    """A compromised device of a fleet of honest_devices + colluders that read B, the honest updates of the round."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(size).astype(np.float32)
    benign = rng.standard_normal((honest_devices, size)) * 0.1 + 0.05  # B: a shared direction and spread
    return Honest(g, (g + benign[0]).astype(np.float32), 30, 4, honest_devices + colluders, np.zeros(size, np.float32),
                  benign=benign, colluders=colluders)


def test_alie_is_the_mean_plus_z_sigma_with_the_papers_z():
    """Baruch et al.'s Algorithm 3: z = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f: 0 at 1 of 4 (the mean),
    0.32 at 2 of 8, 0.39 at 4 of 20."""
    from statistics import NormalDist

    for honest_devices, f, z in ((3, 1, 0.0), (6, 2, NormalDist().inv_cdf(5 / 8)), (16, 4, NormalDist().inv_cdf(13 / 20))):
        h = omniscient(honest_devices=honest_devices, colluders=f)
        sent = change(ATTACKS["alie"](h)[0], h)
        np.testing.assert_allclose(sent, h.benign.mean(0) + z * h.benign.std(0), rtol=1e-4, atol=1e-5)
    assert NormalDist().inv_cdf(5 / 8) == pytest.approx(0.3186, abs=1e-4)


def test_ipm_mimic_and_gaussian_send_what_they_say():
    from firmware_sim.adversary import GAUSSIAN_STD, IPM_EPSILON

    h = omniscient()
    np.testing.assert_allclose(change(ATTACKS["ipm"](h)[0], h), -IPM_EPSILON * h.benign.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(change(ATTACKS["mimic"](h)[0], h), h.benign[0], rtol=1e-4, atol=1e-5)
    noise = change(ATTACKS["gaussian"](h)[0], h)
    assert abs(noise.mean()) < 0.3 and noise.std() == pytest.approx(GAUSSIAN_STD, rel=0.15)
    assert noise @ h.benign.mean(0) < 0.3 * np.linalg.norm(noise) * np.linalg.norm(h.benign.mean(0))


def test_min_max_and_min_sum_go_as_far_as_their_bound_allows():
    """Shejwalkar and Houmansadr's AGR-agnostic attacks: mu - gamma u within B's own spread, gamma as large as
    that allows (a 1 % longer step breaks the bound)."""
    h = omniscient()
    benign = h.benign
    pairwise = np.linalg.norm(benign[:, None] - benign[None], axis=2)
    mean = benign.mean(0)
    unit = mean / np.linalg.norm(mean)
    for name, measure, bound in (
            ("min-max", lambda v: np.linalg.norm(benign - v, axis=1).max(), pairwise.max()),
            ("min-sum", lambda v: (np.linalg.norm(benign - v, axis=1) ** 2).sum(), (pairwise**2).sum(1).max())):
        sent = change(ATTACKS[name](h)[0], h)
        gamma = float((mean - sent) @ unit)
        np.testing.assert_allclose(sent, mean - gamma * unit, rtol=1e-4, atol=1e-5)  # along -u only
        assert gamma > 0 and measure(sent) <= bound * (1 + 1e-4), name
        assert measure(mean - 1.01 * gamma * unit) > bound, name  # the largest such step


def test_fangs_update_points_against_the_honest_signs_and_is_what_krum_picks():
    from firmware_sim.adversary import krum_pick

    h = omniscient(honest_devices=6, colluders=2)
    sent = change(ATTACKS["fang"](h)[0], h)
    signs = np.sign(h.benign.mean(0))
    lam = float(np.abs(sent).max())
    np.testing.assert_allclose(sent, -lam * signs, rtol=1e-4, atol=1e-6)
    assert lam > 0 and krum_pick(np.vstack([h.benign, sent, sent]), 2) >= 6


def test_an_omniscient_attack_without_b_uses_the_devices_own_update(honest):
    """A device that read no honest update (never selected with them) crafts from its own: ALIE then sends it."""
    np.testing.assert_allclose(change(ATTACKS["alie"](honest)[0], honest), honest.update, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(change(ATTACKS["mimic"](honest)[0], honest), honest.update, rtol=1e-4, atol=1e-5)


def test_label_flip_trains_on_labels_flipped_all_to_all():
    from firmware_sim.adversary import FlippedLabels

    class Share:
        def task_data(self, task):
            return np.zeros((4, 1)), np.array([0, 1, 2, 9])

    x, y = FlippedLabels(Share(), 10).task_data(0)
    assert y.tolist() == [9, 8, 7, 0] and y.dtype == np.int64 and x.shape == (4, 1)


def _mimic_fleet(out, scenario: dict, rounds_per_task: int, min_clients: int) -> dict:
    """A real fleet of 4 (mosquitto, workers) whose last device runs `mimic` under plain FedAvg: its results."""
    from coordinator.broker import mosquitto_path
    from edge_client.config import TrainerSettings
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (scripts/test installs it)")
    config = FleetConfig(
        name="mimic", out=out, devices=4, workers=1, model="lenet", seed=0, broker="mosquitto",
        scenario=scenario, policy={"name": "random"},
        trainer=TrainerSettings(backend="torch", optimizer="adamw", lr=3e-3), client={"epochs": 1},
        strategy={"name": "fedavg"}, adversary=AdversarySettings("mimic", 1),
        coordinator={"rounds_per_task": rounds_per_task, "min_clients": min_clients, "deadline_s": 120.0,
                     "wait_for_devices_s": 120.0,
                     "guard": {"norm_bound": "off", "sample_factor": 0.0, "free_rider_factor": 0.0,
                               "krum_share": 0.0}},
    )
    return Fleet(config).run()


def test_an_omniscient_attacker_in_a_fleet_reads_every_honest_update_of_each_round(tmp_path):
    """`mimic` in a real fleet (mosquitto, workers): the compromised device, in a worker of its own, reads the 3
    honest devices' updates of every round before it sends (its update's `known_updates`)."""
    results = _mimic_fleet(tmp_path / "run", {"preset": "digits-class", "n_tasks": 2}, 2, 4)
    assert results["rounds_completed"] == 4
    for entry in results["history"]:
        assert sorted(entry["received"]) == ["dev-000", "dev-001", "dev-002", "dev-003"]
        assert entry["metrics"]["dev-003"]["known_updates"] == 3, entry["metrics"]["dev-003"]


def test_an_omniscient_attacker_waits_only_for_the_honest_devices_holding_data(tmp_path):
    """At 20 shares of digits (seed 5) share 0 holds no sample of the first task: its device says "no-data", is not
    selected and saves no update. The compromised device reads the two honest updates of the first task's round
    and sends (it waited forever for the third before, and the round never closed), then all three once the
    device holds data."""
    from firmware_sim.scenarios import scenario_from_config, shared_build

    scenario = {"preset": "digits-class", "n_clients": 20, "seed": 5, "calibration": 10}
    first_tasks = [shared_build(scenario_from_config(scenario)).client_first_task(k) for k in range(4)]
    assert first_tasks == [1, 0, 0, 0]  # the case this test is about
    results = _mimic_fleet(tmp_path / "run", scenario, 1, 3)
    assert results["rounds_completed"] == 5
    first, *later = results["history"]
    assert sorted(first["received"]) == ["dev-001", "dev-002", "dev-003"]
    assert first["metrics"]["dev-003"]["known_updates"] == 2, first["metrics"]["dev-003"]
    for entry in later:
        assert sorted(entry["received"]) == ["dev-000", "dev-001", "dev-002", "dev-003"]
        assert entry["metrics"]["dev-003"]["known_updates"] == 3, entry["metrics"]["dev-003"]
