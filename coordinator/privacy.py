"""Central differential privacy: every update clipped, the released global model noised, and the privacy spent
accounted, with a budget the run stops at.

What a round releases under `[privacy] mode = "central"` (DP-FedAvg, McMahan et al. 2018; Flower's server-side
fixed and adaptive clipping do the same):

1. clip: each device's change to the global model, w_i - g, is scaled to at most the clip norm C (L2), and weighs
   the same as every other (its claimed sample count would let one device outweigh the clip);
2. the guard's bounds and the rule run on the clipped updates, as without DP;
3. noise: Gaussian, on every weight of the rule's result, with a standard deviation of `noise_multiplier` times
   what one device can change of that result (its sensitivity), which depends on how the result is built:
   - "sum": the rule's global model is the mean of the updates (`BuiltFrom.MEAN`: FedAvg, FedProx) and no bound
     of the guard judges an update by the others (`GuardSettings.comparing` is empty): the change released is the
     kept updates' summed changes over the round's selected count m (a device that did not deliver, or whose
     update was refused, adds zero: the denominator does not depend on the data), which one device moves by at
     most C / m;
   - "ball": any other rule that is built from the updates' weights alone (`BuiltFrom.WEIGHTS`: median, trimmed
     mean, centered clipping), or the mean behind a guard that compares updates (one device's update can change
     which of the others are kept): the rule's change is clipped to C too, so that whatever the rule, any two
     results lie within 2C of each other, and the noise is sd `noise_multiplier` x 2C. That is 2m times the sum's
     noise: a robust rule's privacy costs its round's size in noise.
4. what a rule sends besides the global model (`Strategy.reads_more`: GLFC's old model, SDD's synthetic replay
   set) is private only where the rule builds it from what this module released, or from its own Gaussian
   mechanisms, each declared for its round (`Strategy.extra_releases`) and counted as a mechanism of multiplier z
   at the round's sampling rate (`SAMPLED`) or at rate 1 (`WHOLE_FLEET`: it draws on every device that took part
   so far). The rule runs them through the round's `RoundPrivacy` (`RoundContext.privacy`), which may also release
   the model itself inside the rule (`RoundPrivacy.release`), so that what the rule builds next reads the released
   model, not the clipped updates. A rule that says nothing of how it noises what it sends is refused
   (`Strategy.central_dp_refused`): pFedGRP, which sends each device a mixture of the others' models and serves
   one device's generators to the others, releases per device what one aggregate's noise cannot cover (local DP
   on the devices does: edge_client/privacy.py).

Order: clip, then the guard and the rule, then noise (`RoundAggregate` calls `clip` on each update as it comes and
`release` on the rule's result). So the guard sees updates no longer than C, and the noise covers whatever the
guard kept.

Clipping is `"fixed"` (C = `clip_norm`) or `"adaptive"` (Andrew, Thakkar, McMahan and Ramaswamy 2021, as
TensorFlow Federated's and Flower's adaptive clipping): C starts at `clip_norm` and after each round moves
geometrically toward the `target_quantile` of the updates' change lengths: C <- C exp(-`clip_learning_rate` (b -
target)), b the share of the round's selected devices whose change was within C, released with Gaussian noise of sd
`clipped_count_stddev` / m (0: m / 20, the paper's choice, but at least `noise_multiplier`). The count is a second
Gaussian mechanism in the same round; the updates' noise multiplier is raised to (z^-2 - (2 sigma_b)^-2)^-1/2 so that
the two together cost what one mechanism of multiplier z = `noise_multiplier` costs (the paper's Theorem 1), and the
accountant counts z.

What it protects: one device's data, all its rounds together (user-level DP), in the global models the run
releases, at (epsilon, delta) as the accountant says. What it does not: a device's update on its way to the
coordinator (the coordinator and the broker see it whole; secure aggregation is what hides it), and what the run
keeps for its operator (its history's per-device metrics, a rule's metrics, the checkpoint: the coordinator is
trusted under central DP).

Accounting: each round is a sampled Gaussian mechanism, composed over the rounds with Google's `dp-accounting`
(RDP by default; `accountant = "pld"` is tighter and slower), a rule's further mechanisms with it. Its sampling
rate is the round's selected count over the devices it was drawn from; the selection draws a fixed number without
replacement, which the accountant approximates as Poisson sampling at that rate, as TensorFlow Federated and Flower
account it (with fraction = 1 the rate is 1 and there is nothing to approximate). The rounds with their further
mechanisms, and an adaptive clip's last value, are read back from the run's history, so a resumed run counts what
it spent before and clips where it stopped. A round whose release (the rule's declared mechanisms with it) would
take epsilon past `epsilon_budget` is not run: the run ends with outcome "privacy-budget" (`PrivacyBudgetSpent`).
"""
from __future__ import annotations

import enum
import logging
import math
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefil.dp import check_gaussian, clipped_change

log = logging.getLogger("edgefil.coordinator")

MODES = ("off", "central")
ACCOUNTANTS = ("rdp", "pld")
CLIPPINGS = ("fixed", "adaptive")
SUM, BALL = "sum", "ball"  # how the noise is calibrated (the module's docstring)


class BuiltFrom(enum.Enum):
    """What a rule's global model is built from (`Strategy.built_from`): what central DP's noise must cover."""

    MEAN = "the mean of the updates' weights"
    WEIGHTS = "the updates' weights alone"
    MORE = "more than the updates' weights"


@dataclass(frozen=True)
class PrivacySettings:
    """The coordinator file's [privacy] table."""

    mode: str = "off"
    clip_norm: float = 1.0  # C: the longest change to the global model one update may make (L2); adaptive: its start
    noise_multiplier: float = 1.0  # z: the noise's standard deviation over the released change's sensitivity
    delta: float = 1e-5  # epsilon is reported at this delta
    epsilon_budget: float = 0.0  # the run stops before a round that would pass it; 0: no budget
    accountant: str = "rdp"  # rdp | pld (dp-accounting's)
    clipping: str = "fixed"  # fixed | adaptive (C follows a quantile of the updates' lengths)
    target_quantile: float = 0.5  # adaptive: the share of updates C should leave whole
    clip_learning_rate: float = 0.2  # adaptive: the geometric step of C a round
    clipped_count_stddev: float = 0.0  # adaptive: the noise on the count within C (0: selected / 20, >= z)
    # Experiments only: the noise drawn from this seed, so that one seed gives one table on any host. Whoever knows
    # it can draw the noise again and take it back out: never in a deployment (None: the OS's entropy).
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}; got {self.accountant!r}")
        if self.clipping not in CLIPPINGS:
            raise ValueError(f"clipping must be one of {', '.join(CLIPPINGS)}; got {self.clipping!r}")
        check_gaussian(self.clip_norm, self.noise_multiplier, self.delta, self.epsilon_budget)
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1); got {self.target_quantile}")
        if not (self.clip_learning_rate > 0 and math.isfinite(self.clip_learning_rate)):
            raise ValueError(f"clip_learning_rate must be a positive number; got {self.clip_learning_rate}")
        if self.clipped_count_stddev and not 2 * self.clipped_count_stddev > self.noise_multiplier:
            raise ValueError(f"clipped_count_stddev must be 0 (selected / 20) or more than noise_multiplier / 2 "
                             f"({self.noise_multiplier / 2:g}), or the count alone spends the round's privacy; got "
                             f"{self.clipped_count_stddev}")
        if self.noise_seed is not None and self.noise_seed < 0:
            raise ValueError(f"noise_seed must be >= 0 (or left out); got {self.noise_seed}")

    @property
    def central(self) -> bool:
        return self.mode == "central"

    @property
    def adaptive(self) -> bool:
        return self.clipping == "adaptive"

    def count_stddev(self, selected: int) -> float:
        """sigma_b: the noise on an adaptive round's count of updates within C."""
        return self.clipped_count_stddev or max(selected / 20, self.noise_multiplier)

    def update_multiplier(self, selected: int) -> float:
        """The updates' noise multiplier in a round of `selected` devices: z; adaptive, z raised so that the updates
        and the count together cost z (Andrew et al. 2021, Theorem 1)."""
        z = self.noise_multiplier
        return z if not self.adaptive else (z ** -2 - (2 * self.count_stddev(selected)) ** -2) ** -0.5


class Release(enum.Enum):
    """A further Gaussian mechanism a rule runs in a round under central DP (`Strategy.extra_releases`), by the
    devices whose data it draws on: what rate the accountant counts it at."""

    SAMPLED = "the round's selected devices"  # the round's sampling rate
    WHOLE_FLEET = "every device that took part so far"  # rate 1

    def rate(self, round_rate: float) -> float:
        return round_rate if self is Release.SAMPLED else 1.0


def calibration(built_from: BuiltFrom, comparing: Iterable[str]) -> str:
    """SUM where one device moves the released change by its own clipped change over the round's count, else BALL
    (the module's docstring)."""
    return SUM if built_from is BuiltFrom.MEAN and not tuple(comparing) else BALL


class PrivacyBudgetSpent(RuntimeError):
    """The next round would take the run past its epsilon budget: it ends here."""


def released(global_weights: np.ndarray, result: np.ndarray, kept: int, selected: int, clip_norm: float,
             sd: float, how: str, rng: np.random.Generator) -> np.ndarray:
    """The global model a round releases: g plus the rule's change, plus Gaussian noise of sd `sd` on every weight.
    SUM: the rule gave the mean of `kept` clipped updates, released as their sum over the `selected` count; BALL:
    the rule's change clipped to `clip_norm`."""
    if how == SUM:
        change = (result.astype(np.float64) - global_weights) * (kept / selected)
    else:
        change = clipped_change(result, global_weights, clip_norm)
    noise = rng.normal(0.0, sd, size=global_weights.shape)
    return (global_weights + change + noise).astype(np.float32)


class Accountant:
    """Epsilon at `delta` after the rounds so far: each a Poisson-sampled Gaussian mechanism (dp-accounting)."""

    def __init__(self, settings: PrivacySettings) -> None:
        self.settings = settings
        self.rounds: Counter[float] = Counter()  # sampling rate -> rounds released at it

    def add(self, rate: float, count: int = 1) -> None:
        self.rounds[round(float(rate), 12)] += count

    def epsilon(self, more: Iterable[float] = ()) -> float:
        """Epsilon so far; with `more`, after further mechanisms at those sampling rates."""
        rounds = Counter(self.rounds)
        for rate in more:
            rounds[round(float(rate), 12)] += 1
        if not rounds:
            return 0.0
        import dp_accounting
        from dp_accounting.pld import PLDAccountant
        from dp_accounting.rdp import RdpAccountant

        # Its RDP warns of each order it leaves out (a fractional order whose series does not converge, as at
        # q = 0.5, sigma = 0.8): the bound holds without it, and a line per order and round would bury the run's.
        logging.getLogger("absl").setLevel(logging.ERROR)

        accountant = RdpAccountant() if self.settings.accountant == "rdp" else PLDAccountant()
        for rate, count in sorted(rounds.items()):
            gaussian = dp_accounting.GaussianDpEvent(self.settings.noise_multiplier)
            event = gaussian if rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(rate, gaussian)
            accountant.compose(event, count)
        return float(accountant.get_epsilon(self.settings.delta))


class CentralPrivacy:
    """One run's central DP: `clip` each update as it comes, `release` the round's model, and account for it."""

    def __init__(self, settings: PrivacySettings, history: Iterable[Mapping[str, Any]] = (),
                 built_from: BuiltFrom = BuiltFrom.MEAN, comparing: Iterable[str] = ()) -> None:
        """`history`: the run's rounds so far (a resumed run): those released under DP count again, and an adaptive
        clip goes on from where they left it; `built_from`: the rule's (`Strategy.built_from`); `comparing`: the
        guard's bounds that judge an update by the round's others (`GuardSettings.comparing`). Whether the rule may
        run under central DP at all is its own to say (`Strategy.central_dp_refused`), asked before this."""
        self.settings = settings
        self.how = calibration(built_from, comparing)
        self.mean_how = calibration(BuiltFrom.MEAN, comparing)  # a rule's own release of the updates' mean
        self.clip_norm = settings.clip_norm  # C of the next round
        self.accountant = Accountant(settings)
        for entry in history:
            spent = entry.get("privacy", {})
            if "sampling_rate" in spent:
                self.accountant.add(spent["sampling_rate"])
            for rate in spent.get("further_rates", ()):
                self.accountant.add(rate)
            if settings.adaptive and "next_clip_norm" in spent:
                self.clip_norm = float(spent["next_clip_norm"])
        comparing = tuple(comparing)
        if comparing:
            log.warning("central DP: the guard's %s judge an update by the round's others, so one device can change "
                        "what is kept of theirs: the noise covers the whole released change (sd %g x 2C, not %g x "
                        "C / selected); set them off for the mean's noise", ", ".join(comparing),
                        settings.noise_multiplier, settings.noise_multiplier)
        # Not the run's seed: whoever knows it could take the noise back out.
        self.rng = np.random.default_rng(secrets.randbits(128))
        if settings.noise_seed is not None:
            log.warning("central DP: the noise comes from noise_seed (experiments only: it can be taken back out)")

    def check_budget(self, rate: float, further: Sequence[Release] = ()) -> None:
        """PrivacyBudgetSpent where a round at sampling rate `rate`, with the rule's `further` mechanisms, would take
        epsilon past the budget."""
        budget = self.settings.epsilon_budget
        if not budget:
            return
        after = self.accountant.epsilon([rate, *(release.rate(rate) for release in further)])
        if after > budget:
            raise PrivacyBudgetSpent(f"another round would take epsilon to {after:.3f} at delta "
                                     f"{self.settings.delta:g}, past the budget of {budget:g} (spent: "
                                     f"{self.accountant.epsilon():.3f})")

    def clip(self, weights: np.ndarray, global_weights: np.ndarray) -> tuple[np.ndarray, bool]:
        """An update's weights with its change to the global model clipped to this round's C, and whether it was
        within C already (what adaptive clipping counts)."""
        # here, not at the top: the config reads this module's settings before torch (which compute imports) loads
        from coordinator.compute import distance, within_length

        moved = distance(global_weights, weights)
        return within_length(global_weights, weights, self.clip_norm, moved), moved <= self.clip_norm

    def release(self, global_weights: np.ndarray, result: np.ndarray, kept: int, round_: RoundCount, number: int,
                further: Sequence[Release] = ()) -> tuple[np.ndarray, dict[str, Any]]:
        """Round `number`'s released model from the rule's `result` (of `kept` updates), and what its history entry
        keeps of the privacy spent, the rule's `further` mechanisms of the round counted with it."""
        settings, selected = self.settings, round_.selected
        # with noise_seed, each round's own stream: a resumed run draws what the whole run would have
        rng = self.rng if settings.noise_seed is None else np.random.default_rng((settings.noise_seed, number))
        sensitivity = self.clip_norm / selected if self.how == SUM else 2 * self.clip_norm
        sd = settings.update_multiplier(selected) * sensitivity
        weights = released(global_weights, result, kept, selected, self.clip_norm, sd, self.how, rng)
        spent: dict[str, Any] = {"sampling_rate": round_.rate, "calibration": self.how, "clip_norm": self.clip_norm,
                                 "noise_sd": sd}
        if settings.adaptive:
            self.clip_norm = spent["next_clip_norm"] = self._adapted(round_, rng)
        self.accountant.add(round_.rate)
        if further:
            spent["further_rates"] = [release.rate(round_.rate) for release in further]
            for rate in spent["further_rates"]:
                self.accountant.add(rate)
        spent["epsilon"] = epsilon = self.accountant.epsilon()
        log.info("central DP: round released with noise sd %.3g (%s; %d of %d selected kept, C %.3g)%s; epsilon %.3f "
                 "at delta %g", sd, self.how, kept, selected, spent["clip_norm"],
                 f" and {len(further)} further mechanism(s) of the rule" if further else "", epsilon, settings.delta)
        return weights, spent

    def rule_rng(self, number: int) -> np.random.Generator:
        """Where a rule's further mechanisms of round `number` draw their noise: the run's own entropy, or (with
        noise_seed) a stream of their own for the round, apart from the model's."""
        seed = self.settings.noise_seed
        return self.rng if seed is None else np.random.default_rng((seed, number, 1))

    def _adapted(self, round_: RoundCount, rng: np.random.Generator) -> float:
        """Next round's C: the share of the selected devices whose change was within C, with noise (each counts
        +-1/2 about the middle, so one device moves the sum by 1/2), stepped geometrically toward the target."""
        settings, selected = self.settings, round_.selected
        noisy = round_.within - round_.delivered / 2 + rng.normal(0.0, settings.count_stddev(selected))
        share = noisy / selected + 0.5
        return self.clip_norm * math.exp(-settings.clip_learning_rate * (share - settings.target_quantile))


@dataclass(frozen=True)
class RoundCount:
    """What a release needs to know of its round's devices: `selected` were asked (by all its attempts), drawn from
    `eligible`; `delivered` updates were clipped, `within` of them already within C."""

    selected: int
    eligible: int
    delivered: int = 0
    within: int = 0

    @property
    def rate(self) -> float:
        return min(self.selected / self.eligible, 1.0)


class RoundPrivacy:
    """Central DP as a rule sees its round (`RoundContext.privacy`): the round's model release, which a rule may
    run itself (`release`) to build what it sends on from the released model, and the further Gaussian mechanisms
    it declared for the round (`Strategy.extra_releases`): `gaussian`, or `mean` (the mean of the round's clipped
    updates, released as the model's sum is). The declared ones are counted whether the rule runs them or not (the
    budget was checked for them); one it did not declare is refused."""

    def __init__(self, central: CentralPrivacy, global_weights: np.ndarray, kept: int, count: RoundCount,
                 number: int, declared: Sequence[Release] = ()) -> None:
        self.central, self.global_weights, self.kept, self.count = central, global_weights, kept, count
        self.number = number
        self.declared = tuple(declared)
        self._left = list(declared)
        self.spent: dict[str, Any] | None = None  # the history's record of the release, once it ran
        self.rng = central.rule_rng(number)
        # C of the round, the longest change one device's update makes (an adaptive release moves the central one on
        # to the next round's)
        self.clip_norm = central.clip_norm

    @property
    def multiplier(self) -> float:
        """z: every further mechanism's noise over its sensitivity."""
        return self.central.settings.noise_multiplier

    @property
    def selected(self) -> int:
        return self.count.selected

    def release(self, result: np.ndarray) -> np.ndarray:
        """The round's released global model from the rule's `result` (as `CentralPrivacy.release`); once a round."""
        if self.spent is not None:
            raise RuntimeError(f"round {self.number}: the model is released once")
        weights, self.spent = self.central.release(self.global_weights, result, self.kept, self.count, self.number,
                                                   self.declared)
        return weights

    def gaussian(self, values: np.ndarray, sensitivity: float, release: Release) -> np.ndarray:
        """`values` plus Gaussian noise of sd z x `sensitivity` (how far one device can move them, L2)."""
        self._take(release)
        return values + self.rng.normal(0.0, self.multiplier * sensitivity, size=np.shape(values))

    def mean(self, result: np.ndarray) -> np.ndarray:
        """The mean of the round's kept clipped updates (`result`), released as a mean rule's model is (sd z C /
        selected; behind a guard that compares updates, its change clipped to C and sd 2 z C): a SAMPLED mechanism
        of its own."""
        self._take(Release.SAMPLED)
        how = self.central.mean_how
        sd = self.multiplier * (self.clip_norm / self.selected if how == SUM else 2 * self.clip_norm)
        return released(self.global_weights, result, self.kept, self.selected, self.clip_norm, sd, how, self.rng)

    def _take(self, release: Release) -> None:
        if release not in self._left:
            raise RuntimeError(f"round {self.number}: the rule ran a further mechanism ({release.name}) it did not "
                               f"declare (Strategy.extra_releases)")
        self._left.remove(release)
