"""Compromised devices in a simulated fleet: what the coordinator's settings withstand, tried before deployment.

A fleet file's `[adversary]` table (`attack`, `devices`) makes its last `devices` virtual devices compromised: each
is the real device daemon, trains honestly on its share, and then sends what its attack makes of that update
instead (`AdversarialDevice`, through the daemon's `_claims`). Everything else about them is honest: they register,
answer every round they are selected for, and speak the protocol, so only the coordinator's bounds and rule stand
between their updates and the global model. `benchmarks/poisoning.py` runs every attack against the default and
the robust settings; docs/security.md holds the table.

The attacks, with g the round's global model, w the device's honestly trained weights, d = w - g its honest update
and n its honest sample count (colluding devices run the same attack, each on its own update):

- `scaled`: g + 20 d, n. Stopped by a bound on how far an update may move the model.
- `sign-flip`: g - 2.5 d, n: reversed, within a 3x bound on its length. Stopped by Krum selection (a direction
  check would too, and refuses honest first-round updates).
- `huge`: every weight 1e30 (finite), n. Stopped by the distance bound.
- `nan`: NaN weights, n. Stopped by the gate (not finite).
- `samples`: g + noise as long as d, claiming 10^9 samples. Stopped by a bound on sample counts.
- `boosted`: model replacement, g + N e with e a noise as long as d and N the fleet's size, n. Stopped by the
  distance bound.
- `drift`: g + d + |d| u, u the unit vector from g back to the first global model the device saw: a slow pull back
  to the start, in the honest direction's company and within a typical length. Only a rule that leaves out what
  the honest majority does not do stops it.
- `lazy`: g itself, n: a free rider. Stopped by a free-rider check.

The noise of `samples` and `boosted` is seeded by the round, so colluding devices send the same garbage (what a
coordinated attack would do to look like a majority).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_client.device import Device

SCALE = 20.0  # `scaled`: times the honest update
FLIP = 2.5  # `sign-flip`: the reversed update's length, in honest updates (under a 3x distance bound)
HUGE = 1e30
INFLATED_SAMPLES = 10**9


@dataclass(frozen=True)
class Honest:
    """What a compromised device has to craft its update from."""

    global_weights: np.ndarray  # g: the round's global model
    weights: np.ndarray  # w: its honestly trained weights
    num_samples: int  # n: its store's samples
    round: int
    fleet_size: int
    start: np.ndarray  # the first global model the device saw

    @property
    def update(self) -> np.ndarray:
        return self.weights.astype(np.float64) - self.global_weights

    def noise(self) -> np.ndarray:
        """A random direction as long as the honest update, the same for every colluding device in a round."""
        direction = np.random.default_rng(self.round).standard_normal(self.weights.size)
        return direction * (float(np.linalg.norm(self.update)) / max(float(np.linalg.norm(direction)), 1e-12))


def _from(honest: Honest, change: np.ndarray, samples: int | None = None) -> tuple[np.ndarray, int]:
    weights = (honest.global_weights.astype(np.float64) + change).astype(np.float32)
    return weights, honest.num_samples if samples is None else samples


def _drift(honest: Honest) -> tuple[np.ndarray, int]:
    back = honest.start.astype(np.float64) - honest.global_weights
    length = np.linalg.norm(back)
    pull = back / length * np.linalg.norm(honest.update) if length > 0 else 0.0
    return _from(honest, honest.update + pull)


ATTACKS: dict[str, Callable[[Honest], tuple[np.ndarray, int]]] = {
    "scaled": lambda h: _from(h, SCALE * h.update),
    "sign-flip": lambda h: _from(h, -FLIP * h.update),
    "huge": lambda h: (np.full(h.weights.size, HUGE, np.float32), h.num_samples),
    "nan": lambda h: (np.full(h.weights.size, np.nan, np.float32), h.num_samples),
    "samples": lambda h: _from(h, h.noise(), INFLATED_SAMPLES),
    "boosted": lambda h: _from(h, h.fleet_size * h.noise()),
    "drift": _drift,
    "lazy": lambda h: (h.global_weights.astype(np.float32), h.num_samples),
}


@dataclass(frozen=True)
class AdversarySettings:
    """`[adversary]` of a fleet file: the last `devices` devices run `attack` (none by default)."""

    attack: str = "none"
    devices: int = 0

    def __post_init__(self) -> None:
        if self.attack not in ("none", *ATTACKS):
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {', '.join(ATTACKS)}")
        if self.devices < 0 or (self.devices > 0) != (self.attack != "none"):
            raise ValueError("devices must be > 0 with an attack, and 0 without one")

    def of(self, index: int, fleet_size: int) -> str | None:
        """The attack device `index` runs, or None (honest)."""
        return self.attack if index >= fleet_size - self.devices else None


class AdversarialDevice(Device):
    """The real device daemon whose updates say what `attack` makes of them (module docstring)."""

    def __init__(self, *args: Any, attack: str, fleet_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attack = ATTACKS[attack]
        self.fleet_size = fleet_size
        self._start: np.ndarray | None = None

    def _claims(self, model: str, weights: np.ndarray) -> tuple[np.ndarray, int]:
        honest_weights, samples = super()._claims(model, weights)
        global_weights = self.models[model]
        if self._start is None:
            self._start = global_weights
        return self.attack(Honest(global_weights, honest_weights, samples, self.learner.state.round,
                                  self.fleet_size, self._start))
