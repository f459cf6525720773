"""Local differential privacy: a device clips and noises its own update before it leaves, and counts what that
has spent, trusting nobody else (not the coordinator, not the broker, not whoever reads the traffic).

Under `[privacy] mode = "local"` in the device file (a fleet file's `[device_privacy]`), the device's change to the
global model it trained from, w - g, is scaled to at most `clip_norm` C (L2) and Gaussian noise of standard
deviation `noise_multiplier` x 2C is added to every weight, before the update is saved and sent (a resend sends
the same release, never a second one). Whatever the device's data, its clipped change lies within C of g, so two
releases' means lie within 2C of each other: each round the device takes part in is a Gaussian mechanism of noise
multiplier z = `noise_multiplier` over everything it holds (device-level DP, as central DP's, but without trusting
the aggregator). k rounds compose to one Gaussian mechanism of mu = sqrt(k) / z (Dong, Roth and Su 2019), whose
epsilon at `delta` is exact and closed-form (Balle and Wang 2018, Theorem 8): the device computes it with the normal
CDF alone, so the device install carries no accounting library. No sampling amplification is counted: the device
knows it was selected, and so does whoever watches it.

The rounds released are counted in the state folder (`privacy.json`), written before the update leaves, so a
restart never counts less than was sent. With `epsilon_budget`, a round that would take epsilon past it is not
trained: the device answers it with an error status saying so, and sends nothing.

What a policy attaches to its updates goes into the same release (`ReplayPolicy.attached_values`: GLFC's prototype
gradients, SDD's feature statistics, pFedGRP's generators' weights): the change and those numbers are one vector,
clipped to C together and noised alike, so the round is still one Gaussian mechanism of multiplier z and its epsilon
is the weights' alone. A resend carries the weights' release and no attachments (their release is not kept). A
policy whose attachments are no such numbers is refused in one line (`device.local_privacy`). What it does not
cover: the metadata every update carries (its sample count, the classes it holds and has trained on, its metrics,
the statistics' sample counts, a generator's header: its class, spec, samples and steps).
What it costs: the mean of m devices' updates carries noise of sd 2 z C / sqrt(m) a weight, 2 sqrt(m) times what
central DP adds to it at the same z (z C / m): 20 times at 100 devices (docs/results.md measures it).
"""
from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.policies.base import AttachedValues
from edgefil.dp import check_gaussian, clipped_change, gaussian_epsilon
from edgefil.durable import write_atomically

log = logging.getLogger("edgefil.device")

MODES = ("off", "local")
COUNT_FILE = "privacy.json"


@dataclass(frozen=True)
class LocalPrivacySettings:
    """The device file's [privacy] table."""

    mode: str = "off"
    clip_norm: float = 1.0  # C: the longest change to the global model the device sends (L2)
    noise_multiplier: float = 1.0  # z: the noise's sd over 2C, what the device's data can change of its update
    delta: float = 1e-5  # epsilon is reported at this delta
    epsilon_budget: float = 0.0  # the device trains no round that would pass it; 0: no budget
    # Experiments only (central DP's `noise_seed`): each release's noise drawn from this seed, the device's stream
    # and the round's count, so that one seed gives one table. Whoever knows it can take the noise back out: never
    # on a device of one's own (None: the OS's entropy).
    noise_seed: int | None = None
    # true: the device sends its update only masked, in a secure aggregation session (edge_client/secagg.py), and
    # answers a plain round with an error status, untrained: its operator's say over who sees its update
    require_secure_aggregation: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        check_gaussian(self.clip_norm, self.noise_multiplier, self.delta, self.epsilon_budget)
        if self.noise_seed is not None and self.noise_seed < 0:
            raise ValueError(f"noise_seed must be >= 0 (or left out); got {self.noise_seed}")

    @property
    def local(self) -> bool:
        return self.mode == "local"


class LocalPrivacy:
    """One device's local DP: `release` each round's update, count it, and say what is spent."""

    def __init__(self, settings: LocalPrivacySettings, state_dir: Path, stream: int = 0) -> None:
        """`stream`: this device's among a fleet's (its id's hash), which `noise_seed` draws from."""
        self.settings, self.stream = settings, stream
        self.path = Path(state_dir) / COUNT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rounds = int(json.loads(self.path.read_text())["rounds"]) if self.path.is_file() else 0
        self.rng = np.random.default_rng(secrets.randbits(128))  # nobody's seed: the noise cannot be drawn again
        if settings.noise_seed is not None:
            log.warning("local DP: the noise comes from noise_seed (experiments only: it can be taken back out)")

    def epsilon(self, rounds: int | None = None) -> float:
        """Epsilon at delta after `rounds` releases (default: those made)."""
        settings = self.settings
        return gaussian_epsilon(self.rounds if rounds is None else rounds, settings.noise_multiplier, settings.delta)

    def refusal(self) -> str | None:
        """Why the next round must not be trained (one line), or None."""
        budget = self.settings.epsilon_budget
        if budget and self.epsilon(self.rounds + 1) > budget:
            return (f"local DP: another round would take epsilon to {self.epsilon(self.rounds + 1):.3f} at delta "
                    f"{self.settings.delta:g}, past the device's budget of {budget:g} (spent: {self.epsilon():.3f})")
        return None

    def release(self, weights: np.ndarray, global_weights: np.ndarray, attached: AttachedValues | None = None
                ) -> tuple[np.ndarray, dict[str, bytes] | None]:
        """The update to send for `weights` trained from `global_weights`, and the attachments to send for the
        policy's `attached` values (None: none): the change and the values, one vector, clipped to C together, plus
        noise of sd z 2C on each number; counted (on disk) first."""
        self.rounds += 1
        write_atomically(self.path, json.dumps({"rounds": self.rounds}).encode())
        seed = self.settings.noise_seed
        rng = self.rng if seed is None else np.random.default_rng((seed, self.stream, self.rounds))
        clip, size = self.settings.clip_norm, global_weights.size
        values = np.zeros(0) if attached is None else attached.values
        # the change and the values are one vector: clipped around (g, 0), so two releases lie within 2C
        released = clipped_change(np.r_[weights, values], np.r_[global_weights, np.zeros_like(values)], clip)
        released += rng.normal(0.0, self.settings.noise_multiplier * 2 * clip, size=released.shape)
        update = (global_weights + released[:size]).astype(np.float32)
        return update, None if attached is None else attached.encode(released[size:])
