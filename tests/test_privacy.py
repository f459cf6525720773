"""Central differential privacy (coordinator/privacy.py): the accountant against the Gaussian mechanism's exact
epsilon, clipping and noise where and in the order the docs say (by hand on a toy round), the run that ends at its
budget (its report, and its dashboard in a real browser, saying what it spent), and a rule the noise would not cover refused in
one line."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from browser import CHROMEDRIVER, CHROMIUM, progress_line
from scipy.optimize import brentq
from scipy.stats import norm
from test_robust_aggregation import devices
from thread_fleet import ThreadFederation

from coordinator.aggregation import RoundAggregate
from coordinator.broker import mosquitto_path
from coordinator.containment import ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.guard_settings import GuardSettings
from coordinator.privacy import (
    BALL,
    SUM,
    Accountant,
    BuiltFrom,
    CentralPrivacy,
    PrivacyBudgetSpent,
    PrivacySettings,
    Release,
    RoundCount,
    RoundPrivacy,
)
from coordinator.strategies import AggregateResult, ClientUpdate, RoundContext
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.robust import Median
from edgefil.settings import ConfigError
from firmware_sim.fleet_config import FleetConfig
from firmware_sim.report import write_report


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The Gaussian mechanism of sensitivity 1 and noise sd 1 / mu is exactly (epsilon, delta)-DP for the epsilon
    that solves delta = Phi(mu/2 - epsilon/mu) - e^epsilon Phi(-mu/2 - epsilon/mu) (Balle and Wang 2018, Thm 8);
    T rounds of noise multiplier sigma without sampling compose to mu = sqrt(T) / sigma (Dong, Roth, Su 2019)."""
    def gap(epsilon: float) -> float:
        return norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * norm.cdf(-mu / 2 - epsilon / mu) - delta
    return brentq(gap, 0.0, 100.0)


@pytest.mark.parametrize(("sigma", "rounds"), [(1.0, 10), (4.0, 100)])
def test_the_accountants_epsilon_for_the_gaussian_mechanism_is_its_exact_one_or_just_above(sigma, rounds):
    exact = exact_gaussian_epsilon(math.sqrt(rounds) / sigma, 1e-5)
    by = {}
    for kind in ("pld", "rdp"):
        accountant = Accountant(PrivacySettings(mode="central", noise_multiplier=sigma, accountant=kind))
        accountant.add(1.0, rounds)
        by[kind] = accountant.epsilon()
    print(f"\nsigma {sigma}, {rounds} rounds: exact {exact:.4f}, PLD {by['pld']:.4f}, RDP {by['rdp']:.4f}")
    assert by["pld"] == pytest.approx(exact, rel=0.01)  # PLD is tight
    assert exact <= by["rdp"] <= 1.35 * exact  # RDP is an upper bound, and not a loose one


def test_sampling_spends_less_and_the_rounds_add_up():
    settings = PrivacySettings(mode="central", noise_multiplier=1.0)
    whole, sampled = Accountant(settings), Accountant(settings)
    whole.add(1.0, 20)
    sampled.add(0.1, 20)
    assert sampled.epsilon() < whole.epsilon()
    assert sampled.epsilon([0.1]) > sampled.epsilon()  # one more round costs
    one_by_one = Accountant(settings)
    for _ in range(20):
        one_by_one.add(0.1)
    assert one_by_one.epsilon() == pytest.approx(sampled.epsilon())


def test_a_resumed_run_counts_the_rounds_its_history_released():
    settings = PrivacySettings(mode="central", noise_multiplier=1.5)
    history = [{"round": 1, "privacy": {"sampling_rate": 0.5, "epsilon": 0.1}}, {"round": 2},  # 2: a host round
               {"round": 3, "privacy": {"sampling_rate": 1.0, "epsilon": 0.4}}]
    expected = Accountant(settings)
    expected.add(0.5)
    expected.add(1.0)
    assert CentralPrivacy(settings, history).accountant.epsilon() == pytest.approx(expected.epsilon())


class Seeing(FedAvg):
    """FedAvg that holds the round and keeps what it was given (the guard's output, the noise's input)."""

    name = "test-seeing"
    seen: list[ClientUpdate] = []

    def fold(self, global_weights: torch.Tensor) -> None:
        return None

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = RoundContext()) -> AggregateResult:
        type(self).seen = list(updates)
        return super().aggregate(global_weights, updates, ctx)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("rule", [FedAvg, Seeing])
def test_each_update_is_clipped_before_the_guard_and_the_rule_and_the_noise_comes_after(rule, device):
    """Two of four selected devices deliver: one far (change [3, 4, 0, 0], norm 5, 100 samples), one near
    ([0, 0, 0.3, 0.4], 1 sample). Clipped to 1 and weighed alike, their mean change is [0.3, 0.4, 0.15, 0.2]; over
    the 4 selected it is half that; then noise of sd sigma x C / 4, drawn here from the same generator."""
    g = np.full(4, 0.5, np.float32)
    settings = PrivacySettings(mode="central", clip_norm=1.0, noise_multiplier=0.8)
    privacy = CentralPrivacy(settings)
    privacy.rng = np.random.default_rng(7)
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(rule(device=device), counters), UpdateBounds.only(), g, counters,
                               1 << 30, privacy=privacy)
    aggregate.add(ClientUpdate("far", g + np.array([3, 4, 0, 0], np.float32), 100))
    aggregate.add(ClientUpdate("near", g + np.array([0, 0, 0.3, 0.4], np.float32), 1))
    result = aggregate.close(selected=4, eligible=8)
    assert result is not None
    noise = np.random.default_rng(7).normal(0.0, 0.8 * 1.0 / 4, size=4)
    expected = g + np.array([0.3, 0.4, 0.15, 0.2]) / 2 + noise
    np.testing.assert_allclose(result.global_weights.cpu().numpy(), expected, atol=1e-6)
    if rule is Seeing:  # what the rule was given: clipped, weighed alike
        seen = {u.device: u for u in Seeing.seen}
        np.testing.assert_allclose(seen["far"].weights - g, [0.6, 0.8, 0, 0], atol=1e-6)
        np.testing.assert_allclose(seen["near"].weights - g, [0, 0, 0.3, 0.4], atol=1e-6)
        assert {u.num_samples for u in seen.values()} == {1}
    assert aggregate.privacy_spent["sampling_rate"] == 0.5
    assert aggregate.privacy_spent["epsilon"] == pytest.approx(privacy.accountant.epsilon())
    assert aggregate.privacy_spent["epsilon"] > 0


def test_a_rules_further_mechanisms_are_counted_with_its_round_checked_against_the_budget_and_read_back():
    """A rule that declares two further mechanisms for a round (one on its selected devices, one on every device so
    far) spends what dp-accounting gives for the three Gaussian mechanisms composed; the budget check counts them
    before the round; a resumed run reads them back from the history; one it did not declare is refused, and a
    declared one draws noise of sd z x its sensitivity."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    settings = PrivacySettings(mode="central", noise_multiplier=1.3, noise_seed=4)
    privacy = CentralPrivacy(settings)
    g = np.zeros(3, np.float32)
    count = RoundCount(selected=5, eligible=20, delivered=5)
    round_privacy = RoundPrivacy(privacy, g, 5, count, 7, (Release.SAMPLED, Release.WHOLE_FLEET))
    values = round_privacy.gaussian(np.zeros(4), 2.0, Release.SAMPLED)
    np.testing.assert_allclose(values, np.random.default_rng((4, 7, 1)).normal(0.0, 1.3 * 2.0, 4))
    with pytest.raises(RuntimeError, match="did not declare"):
        round_privacy.gaussian(np.zeros(4), 2.0, Release.SAMPLED)  # one was declared, and it ran
    with pytest.raises(RuntimeError, match="did not declare"):
        round_privacy.mean(g)  # a SAMPLED one too
    round_privacy.release(g)  # WHOLE_FLEET's did not run: counted all the same (the budget was checked for it)
    spent = round_privacy.spent
    assert spent is not None and spent["further_rates"] == [0.25, 1.0]

    reference = RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.3)), 2)
    reference.compose(dp_accounting.GaussianDpEvent(1.3))
    assert spent["epsilon"] == pytest.approx(reference.get_epsilon(settings.delta), rel=1e-9)
    resumed = CentralPrivacy(settings, history=[{"privacy": spent}])
    assert resumed.accountant.epsilon() == pytest.approx(spent["epsilon"], rel=1e-9)
    budget = dataclasses.replace(settings, epsilon_budget=resumed.accountant.epsilon([0.25]) + 1e-6)
    CentralPrivacy(budget, history=[{"privacy": spent}]).check_budget(0.25)  # the round alone fits
    with pytest.raises(PrivacyBudgetSpent):  # with the rule's further mechanism it would not
        CentralPrivacy(budget, history=[{"privacy": spent}]).check_budget(0.25, (Release.SAMPLED,))


@pytest.mark.parametrize("device", devices)
def test_a_robust_rule_runs_on_clipped_updates_and_its_change_is_clipped_before_the_noise(device):
    """Median under central DP: clip, the rule, noise. Three devices' changes, each within C = 1 but one sent 10x
    too long: [.55, .55, .55, 0] x 10, [.55, .55, 0, .55], [.55, 0, .55, .55]. Clipped, the first is [.577, .577,
    .577, 0]; the coordinate-wise median is [.55] x 4, 1.1 long, clipped to 1: [.5] x 4; then noise of sd z x 2C
    (any two of the rule's clipped changes lie within 2C), not z x C / selected."""
    g = np.full(4, 0.5, np.float32)
    settings = PrivacySettings(mode="central", clip_norm=1.0, noise_multiplier=0.8)
    privacy = CentralPrivacy(settings, built_from=Median.built_from)
    assert privacy.how == BALL
    privacy.rng = np.random.default_rng(7)
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(Median(device=device), counters), UpdateBounds.only(), g, counters,
                               1 << 30, privacy=privacy)
    for sender, change in (("far", [5.5, 5.5, 5.5, 0]), ("b", [.55, .55, 0, .55]), ("c", [.55, 0, .55, .55])):
        aggregate.add(ClientUpdate(sender, g + np.array(change, np.float32), 10))
    result = aggregate.close(selected=4, eligible=4)
    assert result is not None
    noise = np.random.default_rng(7).normal(0.0, 0.8 * 2 * 1.0, size=4)
    np.testing.assert_allclose(result.global_weights.cpu().numpy(), g + 0.5 + noise, atol=1e-5)
    assert aggregate.privacy_spent["calibration"] == BALL
    assert aggregate.privacy_spent["noise_sd"] == pytest.approx(1.6)


def test_the_mean_behind_a_guard_that_compares_updates_is_noised_as_a_whole():
    """The sum's noise (z x C / selected) holds only where one device's update changes nothing of the others': a
    guard bound that judges an update by the round's (a median distance, Krum, a direction) can refuse others
    because of it. The default guard has such bounds; with them off (the reference's per-update check may stay),
    the mean is noised as a sum."""
    assert GuardSettings().comparing  # the defaults compare
    assert CentralPrivacy(PrivacySettings(mode="central"), comparing=GuardSettings().comparing).how == BALL
    per_update = GuardSettings.only(reference="classes", min_progress=-0.95)
    assert per_update.comparing == ()
    assert CentralPrivacy(PrivacySettings(mode="central"), comparing=per_update.comparing).how == SUM
    for key, on in (("norm_bound", "reject"), ("free_rider_factor", 0.1), ("krum_share", 0.25),
                    ("min_alignment", -0.9), ("way_back", "clip"), ("row_factor", 1.25), ("copy_factor", 0.01)):
        assert GuardSettings.only(**{key: on}).comparing == (key,)
    assert GuardSettings.only(reference="classes", trust_margin=0.05).comparing == ("trust_margin",)
    # a rule built from more than the weights (CSWA's rows): whatever it computes, its clipped change is a ball
    assert CentralPrivacy(PrivacySettings(mode="central"), built_from=BuiltFrom.MORE).how == BALL


def lengths_round(privacy: CentralPrivacy, lengths: np.ndarray, number: int, rng: np.random.Generator) -> None:
    """One round of updates whose changes are `lengths` long (random directions, 10 weights), released."""
    g = np.zeros(10, np.float32)
    within = 0
    for length in lengths:
        direction = rng.normal(size=10)
        _, whole = privacy.clip((direction / np.linalg.norm(direction) * length).astype(np.float32), g)
        within += whole
    privacy.release(g, g, len(lengths), RoundCount(len(lengths), len(lengths), len(lengths), within), number)


@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_an_adaptive_clip_follows_the_quantile_of_the_update_lengths_it_is_set_to(quantile):
    """Andrew et al.'s geometric update from C = 0.1: after 60 rounds of 100 updates whose lengths are lognormal
    about 2, C is within 15 % of their `quantile` (the count it follows is noised: sd 100 / 20 = 5 updates)."""
    settings = PrivacySettings(mode="central", clipping="adaptive", clip_norm=0.1, target_quantile=quantile,
                               noise_seed=1)
    privacy, rng = CentralPrivacy(settings), np.random.default_rng(0)
    for number in range(1, 61):
        lengths_round(privacy, rng.lognormal(np.log(2.0), 0.5, size=100), number, rng)
    target = float(np.exp(np.log(2.0) + 0.5 * norm.ppf(quantile)))
    print(f"\nquantile {quantile}: C {privacy.clip_norm:.3f}, the lengths' quantile {target:.3f}")
    assert privacy.clip_norm == pytest.approx(target, rel=0.15)


def test_adaptive_clipping_raises_the_updates_noise_so_that_both_mechanisms_cost_z_and_resumes_its_clip():
    """sigma_b = selected / 20 (at least z): z_updates = (z^-2 - (2 sigma_b)^-2)^-1/2, so that the updates' and the
    count's Gaussian mechanisms compose to one of multiplier z (Andrew et al. 2021, Theorem 1); a resumed run's C
    is the one its history left."""
    settings = PrivacySettings(mode="central", clipping="adaptive", noise_multiplier=1.2)
    for selected, sigma_b in ((10, 1.2), (100, 5.0)):
        assert settings.count_stddev(selected) == sigma_b
        z_updates = settings.update_multiplier(selected)
        assert z_updates > 1.2
        assert (z_updates ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(1.2)
    privacy = CentralPrivacy(settings)
    g = np.zeros(5, np.float32)
    _, spent = privacy.release(g, g, 3, RoundCount(10, 20, 3, 2), 1)
    assert spent["noise_sd"] == pytest.approx(settings.update_multiplier(10) * 1.0 / 10)
    assert spent["clip_norm"] == 1.0 and spent["next_clip_norm"] == privacy.clip_norm != 1.0
    history = [{"round": 1, "privacy": spent}, {"round": 2}]
    resumed = CentralPrivacy(settings, history)
    assert resumed.clip_norm == spent["next_clip_norm"]
    assert resumed.accountant.epsilon() == pytest.approx(privacy.accountant.epsilon())
    assert CentralPrivacy(PrivacySettings(mode="central"), history).clip_norm == 1.0  # fixed: the setting's


def test_a_noise_seed_gives_each_round_its_own_noise_again_in_any_process():
    """`noise_seed` (experiments): the same round's release is the same from a fresh accountant (a resumed run, a
    rerun of the table), another round's is not; without it two releases of one round differ."""
    g, mean = np.zeros(50, np.float32), np.full(50, 0.01, np.float32)

    def release(settings: PrivacySettings, number: int) -> np.ndarray:
        return CentralPrivacy(settings).release(g, mean, 3, RoundCount(4, 8), number)[0]

    seeded = PrivacySettings(mode="central", noise_seed=3)
    np.testing.assert_array_equal(release(seeded, 5), release(seeded, 5))
    assert not np.array_equal(release(seeded, 5), release(seeded, 6))
    unseeded = PrivacySettings(mode="central")
    assert not np.array_equal(release(unseeded, 5), release(unseeded, 5))


def test_a_typo_and_a_rule_the_noise_would_not_cover_are_refused_in_one_line_and_robust_rules_are_not(tmp_path, export_artifacts):
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator

    base = {"fleet": "lab", "out": str(tmp_path / "run"), "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
            "devices": ["dev-0"], "scenario": {"preset": "digits-class"}}
    with pytest.raises(ConfigError, match="privacy.*mode must be one of off, central"):
        CoordinatorConfig.from_dict({**base, "privacy": {"mode": "centrl"}})
    with pytest.raises(ConfigError, match="privacy.*clipped_count_stddev must be 0 .* or more than noise_multiplier"):
        CoordinatorConfig.from_dict({**base, "privacy": {"mode": "central", "clipping": "adaptive",
                                                         "noise_multiplier": 2.0, "clipped_count_stddev": 0.5}})
    refused_as = "pfedgrp sends more than it .*which that noise would not cover; use local DP"
    with pytest.raises(ConfigError, match=f"strategy.*name.*privacy.*{refused_as}") as refused:
        CoordinatorConfig.from_dict({**base, "privacy": {"mode": "central"}, "strategy": {"name": "pfedgrp"}})
    assert "\n" not in str(refused.value)
    # built from the weights alone, or noising what they send besides (GLFC's choice, SDD's generator's inputs)
    for rule in ("median", "trimmed-mean", "centered-clip", "glfc", "sdd"):
        CoordinatorConfig.from_dict({**base, "privacy": {"mode": "central"}, "strategy": {"name": rule}})
    fleet = FleetConfig(name="lab", out=tmp_path / "fleet", devices=2, scenario={"preset": "digits-class"},
                        strategy={"name": "glfc", "monitor": "seen"}, coordinator={"privacy": {"mode": "central"}})
    with pytest.raises(ConfigError, match="fleet config: \\[strategy\\] name: .*monitor = \"seen\""):  # a fleet's
        fleet.check()
    built = CoordinatorConfig.from_dict(base)  # and where a program builds the settings itself
    with pytest.raises(ValueError, match=refused_as):
        Coordinator(dataclasses.replace(built, strategy={"name": "pfedgrp"},
                                        privacy=PrivacySettings(mode="central")))


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_run_ends_at_its_privacy_budget_and_says_what_it_spent(tmp_path, export_artifacts):
    """Every device in every round (rate 1), sigma 2: the budget lies between the epsilon of 2 rounds and of 3, so
    the run releases 2 rounds, then ends with outcome privacy-budget, epsilon in each round and in results.json."""
    settings = PrivacySettings(mode="central", clip_norm=1.0, noise_multiplier=2.0)
    spent = []
    for rounds in (2, 3):
        accountant = Accountant(settings)
        accountant.add(1.0, rounds)
        spent.append(accountant.epsilon())
    budget = sum(spent) / 2
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2) as federation:
        results = federation.coordinator({"name": "fedavg"}, rounds_per_task=2, privacy=PrivacySettings(
            mode="central", clip_norm=1.0, noise_multiplier=2.0, epsilon_budget=budget)).run()
    assert results["outcome"].startswith("privacy-budget: another round would take epsilon to"), results["outcome"]
    assert results["rounds_completed"] == 2
    assert [entry["privacy"]["sampling_rate"] for entry in results["history"]] == [1.0, 1.0]
    assert results["history"][0]["privacy"]["epsilon"] < results["history"][1]["privacy"]["epsilon"]
    assert results["epsilon"] == pytest.approx(spent[0]) and results["epsilon"] <= budget
    assert results["settings"]["privacy"]["epsilon_budget"] == budget
    summary = write_report(federation.root / "run")[0].read_text()  # the report says it too
    assert f"| privacy (central DP) | epsilon {results['epsilon']:.3f} at delta 1e-05; budget {budget}" in summary
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/test installs them)")
    shown = progress_line(federation.root / "run", tmp_path, "ε")  # the page says what the run spent
    assert f"ε {results['epsilon']:.2f} at δ 0.00001 of a budget of {budget:.2f}" in shown, shown
