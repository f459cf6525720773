"""What central DP (coordinator/privacy.py) and local DP (edge_client/privacy.py) share: the check of a Gaussian
mechanism's settings, the clip of a change before it is noised, and the exact epsilon of Gaussian mechanisms
composed without sampling."""
from __future__ import annotations

import math

import numpy as np


def clipped_change(weights: np.ndarray, global_weights: np.ndarray, clip_norm: float) -> np.ndarray:
    """weights - global_weights in float64, scaled onto `clip_norm` (L2) where longer: what a release noises (a
    device's under local DP, the rule's under central DP's "ball" calibration)."""
    change = weights.astype(np.float64) - global_weights
    length = float(np.linalg.norm(change))
    if length > clip_norm:
        change *= clip_norm / length
    return change


def check_gaussian(clip_norm: float, noise_multiplier: float, delta: float, epsilon_budget: float) -> None:
    """ValueError (one line) for a clip, noise multiplier, delta or budget that no Gaussian mechanism has."""
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be a positive number; got {clip_norm}")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a positive number; got {noise_multiplier}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1); got {delta}")
    if not (epsilon_budget >= 0 and math.isfinite(epsilon_budget)):
        raise ValueError(f"epsilon_budget must be >= 0 (0: none); got {epsilon_budget}")


def gaussian_epsilon(rounds: int, noise_multiplier: float, delta: float) -> float:
    """Epsilon at `delta` of `rounds` Gaussian mechanisms of multiplier `noise_multiplier`, exactly: they compose to
    one of mu = sqrt(rounds) / z (Dong, Roth and Su 2019), and epsilon solves delta = Phi(mu/2 - epsilon/mu) -
    e^epsilon Phi(-mu/2 - epsilon/mu) (Balle and Wang 2018, Theorem 8), here by bisection to 1e-9, with the normal
    CDF alone (no accounting library: a device computes it)."""
    if rounds <= 0:
        return 0.0
    mu = math.sqrt(rounds) / noise_multiplier

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def delta_at(epsilon: float) -> float:  # decreasing in epsilon
        return phi(mu / 2 - epsilon / mu) - math.exp(epsilon) * phi(-mu / 2 - epsilon / mu)

    low, high = 0.0, 1.0
    while delta_at(high) > delta:
        low, high = high, 2 * high
    while high - low > 1e-9 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_at(middle) > delta else (low, middle)
    return high
