"""Central differential privacy: every update clipped, the released global model noised, and the privacy spent
accounted, with a budget the run stops at.

What a round releases under `[privacy] mode = "central"` (DP-FedAvg, McMahan et al. 2018; Flower's server-side
fixed clipping does the same):

1. clip: each device's change to the global model, w_i - g, is scaled to at most `clip_norm` (L2), and weighs the
   same as every other (its claimed sample count would let one device outweigh the clip);
2. the guard's bounds and the rule run on the clipped updates, as without DP;
3. noise: the rule's mean change is taken over the round's selected devices, m (a device that did not deliver, or
   whose update was refused, adds zero: the sum's denominator does not depend on the data), and Gaussian noise of
   standard deviation `noise_multiplier` x `clip_norm` / m is added to every weight.

Order: clip, then the guard and the rule, then noise (`RoundAggregate` calls `clip` on each update as it comes and
`release` on the rule's result). So the guard sees updates no longer than `clip_norm`, and the noise covers
whatever the guard kept.

What it protects: one device's data, all its rounds together (user-level DP), in the global models the run
releases, at (epsilon, delta) as the accountant says. What it does not: a device's update on its way to the
coordinator (the coordinator and the broker see it whole; secure aggregation is what hides it), and anything a
method sends besides the weights (its attachments, built from the device's data): a rule whose global model
is not the mean of its updates, or that uses their attachments, is refused under central DP
(`Strategy.mean_of_updates`).

Accounting: each round is a sampled Gaussian mechanism, composed over the rounds with Google's `dp-accounting`
(RDP by default; `accountant = "pld"` is tighter and slower). Its sampling rate is the round's selected count over
the devices it was drawn from; the selection draws a fixed number without replacement, which the accountant
approximates as Poisson sampling at that rate, as TensorFlow Federated and Flower account it (with fraction = 1
the rate is 1 and there is nothing to approximate). The rounds are read back from the run's history, so a resumed
run counts what it spent before. A round whose release would take epsilon past `epsilon_budget` is not run: the
run ends with outcome "privacy-budget" (`PrivacyBudgetSpent`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("edgefil.coordinator")

MODES = ("off", "central")
ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class PrivacySettings:
    """The coordinator file's [privacy] table."""

    mode: str = "off"
    clip_norm: float = 1.0  # C: the longest change to the global model one update may make (L2)
    noise_multiplier: float = 1.0  # sigma: the noise's standard deviation over the clipped sum's sensitivity, C
    delta: float = 1e-5  # epsilon is reported at this delta
    epsilon_budget: float = 0.0  # the run stops before a round that would pass it; 0: no budget
    accountant: str = "rdp"  # rdp | pld (dp-accounting's)
    # Experiments only: the noise drawn from this seed, so that one seed gives one table on any host. Whoever knows
    # it can draw the noise again and take it back out: never in a deployment (None: the OS's entropy).
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}; got {self.accountant!r}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm must be a positive number; got {self.clip_norm}")
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a positive number; got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1); got {self.delta}")
        if self.noise_seed is not None and self.noise_seed < 0:
            raise ValueError(f"noise_seed must be >= 0 (or left out); got {self.noise_seed}")
        if not (self.epsilon_budget >= 0 and math.isfinite(self.epsilon_budget)):
            raise ValueError(f"epsilon_budget must be >= 0 (0: none); got {self.epsilon_budget}")

    @property
    def central(self) -> bool:
        return self.mode == "central"


def rule_refused(settings: PrivacySettings, rule: str, mean_of_updates: bool) -> str | None:
    """Why central DP cannot run with this rule (one line), or None: its noise covers a mean of clipped updates."""
    if not settings.central or mean_of_updates:
        return None
    return (f"mode = \"central\" needs a rule whose global model is the mean of the updates and that uses nothing "
            f"else of them (fedavg, fedprox): {rule} is not, so the noise would not cover what it releases")


class PrivacyBudgetSpent(RuntimeError):
    """The next round would take the run past its epsilon budget: it ends here."""


def released(global_weights: np.ndarray, mean_of_used: np.ndarray, used: int, selected: int, clip_norm: float,
             noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """The global model a round releases: g plus the used updates' summed clipped changes over the `selected`
    count (the rule gave their mean over `used`), plus Gaussian noise of sd noise_multiplier x clip_norm /
    selected."""
    change = (mean_of_used.astype(np.float64) - global_weights) * (used / selected)
    noise = rng.normal(0.0, noise_multiplier * clip_norm / selected, size=global_weights.shape)
    return (global_weights + change + noise).astype(np.float32)


class Accountant:
    """Epsilon at `delta` after the rounds so far: each a Poisson-sampled Gaussian mechanism (dp-accounting)."""

    def __init__(self, settings: PrivacySettings) -> None:
        self.settings = settings
        self.rounds: Counter[float] = Counter()  # sampling rate -> rounds released at it

    def add(self, rate: float, count: int = 1) -> None:
        self.rounds[round(float(rate), 12)] += count

    def epsilon(self, extra_rate: float | None = None) -> float:
        """Epsilon so far; with `extra_rate`, after one more round at that sampling rate."""
        rounds = Counter(self.rounds)
        if extra_rate is not None:
            rounds[round(float(extra_rate), 12)] += 1
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

    def describe(self) -> dict[str, Any]:
        """What results.json keeps: the settings, the rounds accounted and epsilon at delta."""
        return {**dataclasses.asdict(self.settings), "rounds": sum(self.rounds.values()),
                "epsilon": self.epsilon()}


class CentralPrivacy:
    """One run's central DP: `clip` each update as it comes, `release` the round's model, and account for it."""

    def __init__(self, settings: PrivacySettings, history: Iterable[Mapping[str, Any]] = ()) -> None:
        """`history`: the run's rounds so far (a resumed run): those released under DP count again."""
        self.settings = settings
        self.accountant = Accountant(settings)
        for entry in history:
            rate = entry.get("privacy", {}).get("sampling_rate")
            if rate is not None:
                self.accountant.add(rate)
        # Not the run's seed: whoever knows it could take the noise back out.
        self.rng = np.random.default_rng(secrets.randbits(128))
        if settings.noise_seed is not None:
            log.warning("central DP: the noise comes from noise_seed (experiments only: it can be taken back out)")

    def check_budget(self, rate: float) -> None:
        """PrivacyBudgetSpent where a round at sampling rate `rate` would take epsilon past the budget."""
        budget = self.settings.epsilon_budget
        if not budget:
            return
        after = self.accountant.epsilon(rate)
        if after > budget:
            raise PrivacyBudgetSpent(f"another round would take epsilon to {after:.3f} at delta "
                                     f"{self.settings.delta:g}, past the budget of {budget:g} (spent: "
                                     f"{self.accountant.epsilon():.3f})")

    def clip(self, weights: np.ndarray, global_weights: np.ndarray) -> np.ndarray:
        """An update's weights with its change to the global model clipped to `clip_norm`."""
        # here, not at the top: the config reads this module's settings before torch (which compute imports) loads
        from coordinator.compute import within_length

        return within_length(global_weights, weights, self.settings.clip_norm)

    def release(self, global_weights: np.ndarray, mean_of_used: np.ndarray, used: int, selected: int,
                rate: float, number: int) -> tuple[np.ndarray, dict[str, float]]:
        """Round `number`'s released model, and what its history entry keeps of the privacy spent."""
        settings = self.settings
        # with noise_seed, each round's own stream: a resumed run draws what the whole run would have
        rng = self.rng if settings.noise_seed is None else np.random.default_rng((settings.noise_seed, number))
        weights = released(global_weights, mean_of_used, used, selected, settings.clip_norm,
                           settings.noise_multiplier, rng)
        self.accountant.add(rate)
        epsilon = self.accountant.epsilon()
        log.info("central DP: round released with noise sd %.3g (%d of %d selected used); epsilon %.3f at delta %g",
                 settings.noise_multiplier * settings.clip_norm / selected, used, selected, epsilon, settings.delta)
        return weights, {"sampling_rate": rate, "epsilon": epsilon}
