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
- `tinynoise`: g + noise 0.3 times as long as the fleet's last global step (g - g', g' the global model of the
  device's previous round), claiming 100 samples: moves enough to pass as no free rider, lies nearest the honest
  centre (issue 56's adaptive free rider).
- `reversed-step`: g - (g - g'): the fleet's last step undone, as long as a global step (shorter than an honest
  update, so within every distance bound).

The noise of `samples` and `boosted` is seeded by the round, so colluding devices send the same garbage (what a
coordinated attack would do to look like a majority).

The literature's adaptive attacks, as FLPoison (vio1etus/FLPoison) and ByzFL run them: omniscient, each crafted
from B, the round's honest updates (every compromised device reads them and sends the same vector; how, below),
with mu and sigma B's coordinate-wise mean and standard deviation, n the fleet's devices and f the compromised ones:

- `alie` (Baruch et al. 2019, "A little is enough"): mu + z sigma, z = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f,
  the paper's Algorithm 3 (FLPoison divides by n - f instead). At 1 of 4, z = 0: the attack is B's mean, harmless
  by construction; at 2 of 8, z = 0.32; at 4 of 20, 0.39.
- `ipm` (Xie et al. 2020, inner product manipulation): -epsilon mu, epsilon = `IPM_EPSILON` (0.1, FLPoison's; small
  enough to pass Krum, which a large one would not).
- `min-max`, `min-sum` (Shejwalkar and Houmansadr 2021, AGR-agnostic): mu - gamma u, u = mu / |mu|, gamma the
  largest (binary search from 10 to 1e-5) whose distance to every update of B is at most B's largest pairwise
  distance (min-max), or whose summed squared distances to B are at most the largest of a B update's (min-sum).
- `fang` (Fang et al. 2020, full knowledge, against Krum): -lambda sign(mu), lambda halved from the paper's upper
  bound until Krum over B and the f crafted updates picks a crafted one (or lambda < 1e-5).
- `mimic` (Karimireddy et al. 2022): the update of B's first device, so its data count f + 1 times.
- `gaussian` (Blanchard et al. 2017): an update of N(0, `GAUSSIAN_STD`^2) noise per weight (1, FLPoison's).
- `label-flip` (data poisoning, FLPoison's all-to-all "inverse"): the device trains honestly on labels y -> C - 1 - y
  of its share and sends what it learnt.

Against a method's own aggregation:

- `head-scale`: w with the head's rows (and biases) of the classes of the device's current task times
  `HEAD_SCALE` (2), n: a sliver of the model, so within every distance bound, that class-wise aggregation (SDD's
  CSWA sums a device's new-class rows) takes as it comes (issue 56: 0.693 to 0.406 under SDD as printed).

Against a method's own payloads (firmware_sim/payload_attacks/, a file per method): the device sends its honest
weights and claim, and what the attack makes of its policy's attachments instead of them: GLFC's `prototype-flood`,
`prototype-lie` and `prototype-extreme`, SDD's `statistics-extreme`. A fleet whose devices run another policy is
refused (`AdversarySettings.check_policy`).

How a compromised device knows B: in a simulated fleet every device saves the update it sends in its state folder
before sending it (edge_client/state.py), and the fleet names the honest devices' folders to the compromised ones,
which run in a worker process of their own (`Fleet`), so that waiting costs no honest device a turn. Each waits until
every honest device that holds data by the round's task has saved its update of the round's global model (one that
holds none says "no-data" and saves none; the fleet names each peer's first task with data): for as long as that
takes where the fleet selects every device every round (`wait_all`: fraction 1, no availability profiles, as in
`benchmarks/poisoning.py`; so what it knows never depends on the host's speed), else at most `KNOWLEDGE_WAIT_S`,
using those that have; with none, its own honest update is B. A stop request ends the wait. A deployed fleet's broker
ACL gives no device another's update: these attacks are what an attacker who also holds the coordinator's inbox could
do, the standard worst case of the robustness literature.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from edge_client.device import Device
from edge_client.sources import TaskSource
from edge_client.state import StateError, load_state
from firmware_sim.payload_attacks import PAYLOAD_ATTACKS, PayloadAttack, PayloadContext
from models.manifest import class_head_positions

SCALE = 20.0  # `scaled`: times the honest update
FLIP = 2.5  # `sign-flip`: the reversed update's length, in honest updates (under a 3x distance bound)
HUGE = 1e30
INFLATED_SAMPLES = 10**9
TINY = 0.3  # `tinynoise`: times the last global step
TINY_SAMPLES = 100
IPM_EPSILON = 0.1
GAUSSIAN_STD = 1.0
HEAD_SCALE = 2.0  # `head-scale`: times the current task's classes' head rows
SEARCH_START, SEARCH_STOP = 10.0, 1e-5  # min-max and min-sum's binary search on gamma; fang's smallest lambda
KNOWLEDGE_WAIT_S = 60.0  # the most a compromised device waits for the honest updates where not all train each round
log = logging.getLogger("edgefil.fleet")


@dataclass(frozen=True)
class Honest:
    """What a compromised device has to craft its update from."""

    global_weights: np.ndarray  # g: the round's global model
    weights: np.ndarray  # w: its honestly trained weights
    num_samples: int  # n: its store's samples
    round: int
    fleet_size: int
    start: np.ndarray  # the first global model the device saw
    benign: np.ndarray | None = None  # B: the round's honest updates, one a row (omniscient attacks only)
    previous: np.ndarray | None = None  # g': the global model of the device's previous round (None at its first)
    colluders: int = 1  # f: the fleet's compromised devices
    task_rows: np.ndarray | None = None  # positions of the head's rows and biases of the current task's classes

    @property
    def update(self) -> np.ndarray:
        return self.weights.astype(np.float64) - self.global_weights

    def noise(self) -> np.ndarray:
        """A random direction as long as the honest update, the same for every colluding device in a round."""
        direction = np.random.default_rng(self.round).standard_normal(self.weights.size)
        return direction * (float(np.linalg.norm(self.update)) / max(float(np.linalg.norm(direction)), 1e-12))

    @property
    def last_step(self) -> np.ndarray:
        """g - g': the fleet's last step as this device saw it (zero at its first round)."""
        if self.previous is None:
            return np.zeros(self.weights.size)
        return self.global_weights.astype(np.float64) - self.previous

    @property
    def known(self) -> np.ndarray:
        """B, or the device's own honest update where it read none."""
        return self.benign if self.benign is not None and len(self.benign) else self.update[None, :]


def _from(honest: Honest, change: np.ndarray, samples: int | None = None) -> tuple[np.ndarray, int]:
    weights = (honest.global_weights.astype(np.float64) + change).astype(np.float32)
    return weights, honest.num_samples if samples is None else samples


def _head_scaled(honest: Honest) -> tuple[np.ndarray, int]:
    weights = honest.weights.astype(np.float32, copy=True)
    if honest.task_rows is not None:
        weights[honest.task_rows] *= HEAD_SCALE
    return weights, honest.num_samples


def _drift(honest: Honest) -> tuple[np.ndarray, int]:
    back = honest.start.astype(np.float64) - honest.global_weights
    length = np.linalg.norm(back)
    pull = back / length * np.linalg.norm(honest.update) if length > 0 else 0.0
    return _from(honest, honest.update + pull)


def _tiny(honest: Honest) -> tuple[np.ndarray, int]:
    direction = np.random.default_rng([honest.round, 2]).standard_normal(honest.weights.size)
    length = TINY * float(np.linalg.norm(honest.last_step))
    return _from(honest, direction * length / max(float(np.linalg.norm(direction)), 1e-12), TINY_SAMPLES)


def _alie(honest: Honest) -> tuple[np.ndarray, int]:
    known, n, f = honest.known, honest.fleet_size, honest.colluders
    s = math.floor(n / 2 + 1) - f
    z = NormalDist().inv_cdf(min(max((n - s) / n, 1e-6), 1 - 1e-6))
    return _from(honest, known.mean(0) + z * known.std(0))


def _largest(known: np.ndarray, fits: Callable[[np.ndarray], bool], direction: np.ndarray) -> np.ndarray:
    """mu - gamma direction for the largest gamma (a binary search, FLPoison's) with which `fits` holds."""
    mean = known.mean(0)
    gamma, step, found = SEARCH_START, SEARCH_START / 2, 0.0
    while abs(found - gamma) > SEARCH_STOP:
        if fits(mean - gamma * direction):
            found, gamma = gamma, gamma + step
        else:
            gamma -= step
        step /= 2
    return mean - found * direction


def _pairwise(known: np.ndarray) -> np.ndarray:
    squared = (known**2).sum(1)
    return np.sqrt(np.maximum(squared[:, None] + squared[None, :] - 2 * known @ known.T, 0.0))


def _min_max(honest: Honest) -> tuple[np.ndarray, int]:
    known = honest.known
    bound = _pairwise(known).max()
    mean = known.mean(0)
    unit = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return _from(honest, _largest(known, lambda v: float(np.linalg.norm(known - v, axis=1).max()) <= bound, unit))


def _min_sum(honest: Honest) -> tuple[np.ndarray, int]:
    known = honest.known
    bound = (_pairwise(known) ** 2).sum(1).max()
    mean = known.mean(0)
    unit = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return _from(honest, _largest(known, lambda v: float((np.linalg.norm(known - v, axis=1) ** 2).sum()) <= bound,
                                  unit))


def krum_pick(vectors: np.ndarray, byzantine: int) -> int:
    """Krum's choice (Blanchard et al. 2017): the row with the least sum of squared distances to its n - f - 2
    nearest others (at least one), scored as the coordinator's guard scores them."""
    from coordinator.krum import krum_scores  # torch: only where an attack needs it, not at a worker's start

    rows = [np.ascontiguousarray(v, dtype=np.float32) for v in vectors]
    return int(np.argmin(krum_scores(rows, max(len(vectors) - byzantine - 2, 1))))


def _fang(honest: Honest) -> tuple[np.ndarray, int]:
    """Fang et al.'s full-knowledge attack on Krum, in update space (g is the origin): -lambda s, s = sign(mu),
    lambda from the paper's upper bound, halved until Krum picks a crafted update."""
    known, f = honest.known, honest.colluders
    m, d = len(known) + f, known.shape[1]
    direction = np.sign(known.mean(0))
    distances = _pairwise(known)
    spread = 0.0
    if m - 2 * f - 1 > 0 and len(known) > 1:
        near = np.sort(distances, axis=1)[:, 1:max(m - f - 2, 1) + 1]
        spread = float(near.sum(1).min()) / ((m - 2 * f - 1) * math.sqrt(d))
    lam = spread + float(np.linalg.norm(known, axis=1).max()) / math.sqrt(d)
    while lam > SEARCH_STOP:
        crafted = -lam * direction
        if krum_pick(np.vstack([known, np.tile(crafted, (f, 1))]), f) >= len(known):
            return _from(honest, crafted)
        lam /= 2
    return _from(honest, np.zeros_like(direction))


ATTACKS: dict[str, Callable[[Honest], tuple[np.ndarray, int]]] = {
    "scaled": lambda h: _from(h, SCALE * h.update),
    "sign-flip": lambda h: _from(h, -FLIP * h.update),
    "huge": lambda h: (np.full(h.weights.size, HUGE, np.float32), h.num_samples),
    "nan": lambda h: (np.full(h.weights.size, np.nan, np.float32), h.num_samples),
    "samples": lambda h: _from(h, h.noise(), INFLATED_SAMPLES),
    "boosted": lambda h: _from(h, h.fleet_size * h.noise()),
    "drift": _drift,
    "lazy": lambda h: (h.global_weights.astype(np.float32), h.num_samples),
    "tinynoise": _tiny,
    "reversed-step": lambda h: _from(h, -h.last_step),
    "alie": _alie,
    "ipm": lambda h: _from(h, -IPM_EPSILON * h.known.mean(0)),
    "min-max": _min_max,
    "min-sum": _min_sum,
    "fang": _fang,
    "mimic": lambda h: _from(h, h.known[0]),
    "gaussian": lambda h: _from(h, np.random.default_rng([h.round, 1]).standard_normal(h.weights.size) * GAUSSIAN_STD),
    "label-flip": lambda h: (h.weights, h.num_samples),  # what it learnt from flipped labels (FlippedLabels)
    "head-scale": _head_scaled,
}
OMNISCIENT = frozenset({"alie", "ipm", "min-max", "min-sum", "fang", "mimic"})  # they read the honest updates


def attack_names() -> list[str]:
    """Every attack a compromised device may run: on weights (ATTACKS), then on a method's payloads."""
    return [*ATTACKS, *PAYLOAD_ATTACKS.names()]


def _honest(honest: Honest) -> tuple[np.ndarray, int]:
    return honest.weights, honest.num_samples


@dataclass(frozen=True)
class AdversarySettings:
    """`[adversary]` of a fleet file: the last `devices` devices run `attack` (none by default)."""

    attack: str = "none"
    devices: int = 0

    def __post_init__(self) -> None:
        if self.attack not in ("none", *attack_names()):
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {', '.join(attack_names())}")
        if self.devices < 0 or (self.devices > 0) != (self.attack != "none"):
            raise ValueError("devices must be > 0 with an attack, and 0 without one")

    def check_policy(self, policy: str) -> None:
        """ValueError where the attack changes a method's payloads and the devices run another policy (their
        updates carry nothing it could change)."""
        method = PAYLOAD_ATTACKS.get(self.attack).method if self.attack in PAYLOAD_ATTACKS.names() else policy
        if method != policy:
            raise ValueError(f"{self.attack} changes the {method} policy's payloads, and the devices run "
                             f"{policy!r}")

    def honest(self, fleet_size: int) -> int:
        """How many devices of the fleet are honest: the first ones."""
        return fleet_size - self.devices

    def of(self, index: int, fleet_size: int) -> str | None:
        """The attack device `index` runs, or None (honest)."""
        return self.attack if index >= self.honest(fleet_size) else None


class FlippedLabels:
    """A data source whose labels are flipped all-to-all (y -> C - 1 - y): `label-flip`'s device trains on them."""

    def __init__(self, source: TaskSource, num_classes: int) -> None:
        self.source = source
        self.num_classes = num_classes

    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.source.task_data(task)
        return x, (self.num_classes - 1 - np.asarray(y)).astype(np.int64)


class AdversarialDevice(Device):
    """The real device daemon whose updates say what `attack` makes of them (module docstring). `peers`: the
    honest devices' state folders, which the omniscient attacks read B from, each with the first task it holds data
    of (before it a device says "no-data", is not selected and saves no update: it is not waited for)."""

    def __init__(self, *args: Any, attack: str, fleet_size: int, colluders: int = 1,
                 peers: Sequence[tuple[str, int]] = (), wait_all: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attack_name = attack
        self.attack = ATTACKS.get(attack, _honest)  # a payload attack sends honest weights
        self.payload_attack: PayloadAttack | None = (PAYLOAD_ATTACKS.get(attack)() if attack not in ATTACKS
                                                     else None)
        self.fleet_size = fleet_size
        self.colluders = colluders
        self.peers = [(Path(folder), int(first)) for folder, first in peers]
        self.wait_all = wait_all
        self._start: np.ndarray | None = None
        self._previous: np.ndarray | None = None  # g': the global model of the round before the current one
        self._current: tuple[str, np.ndarray] | None = None  # the current round's global model and its id
        if attack == "label-flip":
            self.source = FlippedLabels(self.source, self.trainer.manifest.num_classes)

    def _claims(self, model: str, weights: np.ndarray) -> tuple[np.ndarray, int]:
        honest_weights, samples = super()._claims(model, weights)
        global_weights = self.models[model]
        if self._start is None:
            self._start = global_weights
        benign = self._benign(model, global_weights) if self.attack_name in OMNISCIENT else None
        if benign is not None:  # in the update's metrics (the round's dict, sent after this): what it knew
            self.learner.state.metrics["known_updates"] = float(len(benign))
        if self._current is None or self._current[0] != model:  # a new round's model (not a resend of the same)
            self._previous, self._current = (self._current[1] if self._current else None), (model, global_weights)
        previous = self._previous
        return self.attack(Honest(global_weights, honest_weights, samples, self.learner.state.round,
                                  self.fleet_size, self._start, benign, previous, self.colluders, self._task_rows()))

    def _attachments(self) -> dict[str, bytes]:
        honest = super()._attachments()
        if self.payload_attack is None:
            return honest
        return self.payload_attack.craft(honest, PayloadContext(self.learner.policy, self.trainer.manifest,
                                                                Path(self.config.artifacts), self._task_classes()))

    def _task_classes(self) -> np.ndarray:
        """The classes of the device's current task that it holds samples of."""
        return np.flatnonzero(np.asarray(self.learner.state.task_counts, dtype=np.int64))

    def _task_rows(self) -> np.ndarray:
        """The head's positions of the classes of the device's current task (what `head-scale` scales)."""
        return class_head_positions(self.trainer.manifest.parameters, self._task_classes())

    def _benign(self, model: str, global_weights: np.ndarray) -> np.ndarray | None:
        """B: the updates the honest devices saved for global model `model`, waiting for them (module docstring)."""
        found: dict[Path, np.ndarray] = {}
        peers = [folder for folder, first in self.peers if first <= self.learner.state.data_task]
        deadline = math.inf if self.wait_all else time.monotonic() + KNOWLEDGE_WAIT_S
        while not self.stop_requested.is_set():
            for peer in peers:
                if peer not in found:
                    try:
                        saved = load_state(peer, weights=True, optimizer=False)
                    except (StateError, OSError, ValueError):  # being written: read it next time
                        continue
                    if saved is not None and saved.model == model and saved.weights is not None:
                        found[peer] = saved.weights.astype(np.float64) - global_weights
            if len(found) == len(peers) or time.monotonic() >= deadline:
                break
            self.stop_requested.wait(0.05)
        if len(found) < len(peers):
            log.warning("%s (%s): %d of %d honest updates of the round read", self.id, self.attack_name, len(found),
                        len(peers))
        return np.stack([found[p] for p in peers if p in found]) if found else None
