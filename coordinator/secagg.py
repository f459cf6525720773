"""The coordinator's side of secure aggregation (SecAgg+; edgefil/secagg.py has the arithmetic, edge_client/secagg.py
the device's side, docs/security.md, "Secure aggregation", what it protects and what it costs).

Under `[secure_aggregation] mode = "secagg+"` a round's selected devices train as always, then, instead of their
updates, advertise fresh keys (`keys`: the round's delivery, which the round's deadline and quorum judge). When the
round's collection closes, a `SecureRound` runs three more stages, each until every device it awaits has answered or
gone offline, at most `stage_s` (in virtual time `wall_limit_s`: a busy host drops no device; the stages take no
time on the fleet's clock, their work being a few milliseconds a device: docs/results.md, "Secure aggregation"):

1. sharing: each advertised device learns its neighbours (a random k-regular graph, Harary's on a random order of the
   devices, as the paper builds it) and sends its shares, sealed for each; the coordinator cannot open them.
2. masking: each device that shared gets the shares sealed for it and sends its masked vector, which the coordinator
   adds into one running sum mod 2^32 as it arrives and lets go: it holds one vector, whatever the number of devices.
3. unmasking: each device whose masked vector came (a survivor) is told which of its neighbours survived and which
   dropped, and answers with what unmasks the sum: b's shares of the survivors, the masking keys' shares of the
   dropped. The coordinator takes each survivor's self mask off, and the pairwise masks a dropped device left in its
   neighbours' vectors, and decodes the sum: sum_i f_i (w_i - g) and sum_i f_i.

The round's rule (a mean: FedAvg, FedProx) then gets one update, the survivors' weighted mean g + sum f_i (w_i - g) /
sum f_i, weighing sum f_i x max_weight samples: FedAvg's mean over the survivors, with each device's weight capped at
`max_weight` samples. Where the rule weighs every update alike (`Strategy.weighs_by_samples`: FedAvg's
`weighted = false`), every f_i is 1 and the sum weighs as one update: a round whose two attempts each delivered a
sum averages the two sums as equals, not their devices.

A session that cannot finish (fewer survivors than the threshold, shares that do not reconstruct, a sum outside what
honest devices can send) gives nothing: the round's attempt has no deliveries and is run again, as one that missed
its quorum, with a new session.

What it refuses, in one line when the file is read: a rule that needs individual updates (median, Krum-like rules,
GLFC, SDD, pFedGRP: `BuiltFrom` other than MEAN), any guard check (each judges one update, which the coordinator no
longer sees), and central DP (its clip is per update; local DP on the devices composes: a device masks its release).
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.guard_settings import OFF as GUARD_OFF
from coordinator.privacy import BuiltFrom
from edgefil import wire
from edgefil.secagg import (
    MASK,
    KeyPair,
    Quantiser,
    SecAggError,
    add_mask,
    agree,
    combine,
    commitment,
    pairwise_sign,
    share_value,
)

log = logging.getLogger("edgefil.coordinator")

MODES = ("off", "secagg+")
# A session's failures that say a device lied (shares that give back no secret its device committed to, neighbours
# that answered holding no share of a device, a sum no honest survivors can give): the round keeps its previous model
# and goes on, rather than run again, since a device that lies once lies again. The rest (too few devices, survivors
# or answers) are dropouts: the round runs again.
LIES = frozenset({"shares-inconsistent", "shares-withheld", "sum-out-of-range"})
# Where a secret's shares number more than the threshold, the subsets of them tried until one gives back what the
# device committed to: a neighbour that reveals a wrong share cannot spoil the sum (with one liar among k = 9 and t =
# 5, a random subset leaves it out 44 % of the time: all 32 fail with a chance of 1e-8)
RECONSTRUCTION_TRIES = 32


@dataclass(frozen=True)
class SecureAggregationSettings:
    """`[secure_aggregation]`."""

    mode: str = "off"
    # k, each device's neighbours; 0: 2 ceil(log2 n) + 2 (at most n - 1: every other device), the paper's O(log n)
    degree: int = 0
    # t = floor(threshold x k) + 1 of a device's k neighbours reconstruct its secrets: by default a majority
    threshold: float = 0.5
    clip_range: float = 4.0  # each value of a device's weighted change is clipped to +-clip_range, then quantised
    max_weight: float = 10_000.0  # the samples that count as weight 1: a device that claims more weighs as many
    stage_s: float = 60.0  # the longest each stage after training waits for its devices (real time)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.degree < 0 or self.degree == 1:
            raise ValueError(f"degree must be 0 (automatic) or >= 2, got {self.degree}")
        if not 0 <= self.threshold < 1:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold}")
        for name in ("clip_range", "max_weight", "stage_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def degree_for(self, n: int) -> int:
        """k for a session of n devices: even (Harary's graph), at most n - 1."""
        k = self.degree or 2 * math.ceil(math.log2(max(n, 2))) + 2
        k += k % 2
        return min(k, n - 1)

    def threshold_for(self, k: int) -> int:
        return min(k + 1, math.floor(self.threshold * k) + 1)

    def round_config(self, session: str, weighted: bool) -> dict[str, object]:
        """What a secure round's message tells its devices (`secure` in its config); `weighted`: whether the rule
        weighs each update by its samples (`Strategy.weighs_by_samples`), else alike."""
        return {"session": session, "clip_range": self.clip_range, "max_weight": self.max_weight,
                "weighted": weighted}


def secure_refused(settings: SecureAggregationSettings, rule: str, built_from: BuiltFrom, reads_more: bool = False
                   ) -> str | None:
    """Why secure aggregation cannot run with this rule (one line), or None: one built from more than the mean of
    the updates' weights, or reading more of them (`Strategy.reads_more`: attachments)."""
    if not settings.on or (built_from is BuiltFrom.MEAN and not reads_more):
        return None
    return (f"mode = \"{settings.mode}\" gives the coordinator the sum of the updates alone: {rule} needs each update "
            f"(choose fedavg or fedprox)")


def config_refused(settings: SecureAggregationSettings, guard_checks: tuple[str, ...], central_dp: bool) -> str | None:
    """Why secure aggregation cannot run beside the guard's checks or central DP (one line), or None."""
    if not settings.on or not (guard_checks or central_dp):
        return None
    why = (f"the guard's checks {', '.join(guard_checks)} judge each update" if guard_checks else
           "central DP clips each update")
    return (f"gives the coordinator the sum of the updates alone, and {why}: leave [guard] out (or turn its checks "
            f"off) and use local DP on the devices instead of central")


def without_guard(table: Mapping[str, Any]) -> dict[str, Any]:
    """A coordinator table whose [guard] is off where it turns secure aggregation on and gives no [guard]: every
    check of the guard judges one update, which secure aggregation hides from the coordinator."""
    table = dict(table)
    secure = table.get("secure_aggregation", {})
    if isinstance(secure, Mapping) and secure.get("mode", "off") != "off" and "guard" not in table:
        table["guard"] = dict(GUARD_OFF)
    return table


def neighbourhoods(devices: list[str], degree: int, rng: np.random.Generator) -> dict[str, list[str]]:
    """Each device's neighbours: a Harary graph of even `degree` (each device linked to the degree / 2 before and
    after it) on a random order of the devices; every other device where degree = n - 1."""
    n = len(devices)
    if degree >= n - 1:
        return {d: [e for e in devices if e != d] for d in devices}
    order = [devices[i] for i in rng.permutation(n)]
    half = degree // 2
    return {order[p]: sorted({order[(p + s) % n] for s in range(-half, half + 1) if s}) for p in range(n)}


@dataclass(frozen=True)
class Advertised:
    """A device's keys for the session, and its update's metadata (the round's delivery)."""

    device: str
    round: int
    task: int
    model: str
    session: str
    cipher_key: bytes
    mask_key: bytes
    commitment: bytes
    metrics: Mapping[str, float]
    label_counts: tuple[int, ...] = ()  # not sent: what a device holds stays with it, as its update does


@dataclass(frozen=True)
class SecureMessage:
    """A device's later message in a session: its shares, masked vector (`words`) or reveal."""

    device: str
    kind: str
    round: int
    session: str
    message: wire.Message
    words: np.ndarray | None = None


@dataclass(frozen=True)
class SecureSum:
    """What a session gives: the survivors' weighted mean change and its weight in samples."""

    survivors: frozenset[str]
    mean_change: np.ndarray
    samples: float  # the sum's weight: its samples where the rule weighs by them, else its devices
    quantisation_step: float  # the rounding grid of one value of one device's weighted change


@dataclass
class SecureRound:
    """One session: the devices' keys as they advertise, then `begin_*` each stage (the messages to send, by
    device and kind) and `take` their answers; `awaiting` is who the stage still waits for."""

    settings: SecureAggregationSettings
    round: int
    session: str
    length: int  # words of a masked vector: the model's parameters and the weight
    weighted: bool = True  # the devices weigh their changes by their samples (else each by 1)
    keys: dict[str, Advertised] = field(default_factory=dict)
    stage: str = "keys"
    awaiting: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)  # went offline or left the session: no stage waits for them
    counts: dict[str, int] = field(default_factory=dict)  # devices at each stage, for the round's history

    def __post_init__(self) -> None:
        self.neighbours: dict[str, list[str]] = {}
        self.points: dict[str, int] = {}
        self.threshold = 0
        self.sealed: dict[str, Mapping[str, bytes]] = {}  # sender -> its sealed shares by receiver
        self.total = np.zeros(self.length, dtype=np.uint32)
        self.survivors: set[str] = set()
        self.reveals: dict[str, wire.Message] = {}

    def advertise(self, event: Advertised) -> None:
        if self.stage == "keys":
            self.keys[event.device] = event

    def went_offline(self, device: str) -> None:
        """No stage waits for `device` any more (its process, and with it its part in the session, may be gone)."""
        self.gone.add(device)
        self.awaiting.discard(device)

    # --- stages -----------------------------------------------------------------------------------

    def begin_sharing(self, rng: np.random.Generator) -> dict[str, bytes]:
        """The neighbours message of every device that advertised; SecAggError for fewer than two (a sum of one is
        that device's update)."""
        devices = sorted(self.keys)
        self.stage, self.awaiting = "shares", set(devices) - self.gone
        self.counts["advertised"] = len(devices)
        if len(devices) < 2:
            raise SecAggError("too-few-devices", f"{len(devices)} device advertised keys: a sum needs two")
        degree = self.settings.degree_for(len(devices))
        self.threshold = self.settings.threshold_for(degree)
        self.neighbours = neighbourhoods(devices, degree, rng)
        self.points = {d: i + 1 for i, d in enumerate(devices)}
        return {d: wire.encode(
            "neighbours", round=self.round, session=self.session, count=len(devices), threshold=self.threshold,
            index=self.points[d], neighbours={
                n: [self.points[n], self.keys[n].cipher_key, self.keys[n].mask_key] for n in self.neighbours[d]})
            for d in devices}

    def begin_masking(self) -> dict[str, bytes]:
        """The relayed message of every device that shared: the shares its sharing neighbours sealed for it."""
        shared = set(self.sealed)
        self.stage, self.awaiting = "masked", shared - self.gone
        self.counts["shared"] = len(shared)
        return {d: wire.encode("relayed", round=self.round, session=self.session, shares={
            sender: self.sealed[sender][d] for sender in self.neighbours[d] if sender in shared})
            for d in sorted(shared)}

    def begin_unmasking(self) -> dict[str, bytes]:
        """The unmask message of every survivor; SecAggError when fewer survived than a neighbourhood's threshold
        (unmasking so few would reveal too much of each)."""
        self.stage, self.awaiting = "reveal", self.survivors - self.gone
        self.counts["masked"] = len(self.survivors)
        if len(self.survivors) < max(2, self.threshold):
            raise SecAggError("too-few-survivors", f"{len(self.survivors)} masked vectors came, the threshold is "
                                                   f"{self.threshold}")
        shared = set(self.sealed)
        return {d: wire.encode("unmask", round=self.round, session=self.session,
                               survivors=[n for n in self.neighbours[d] if n in self.survivors],
                               dropped=[n for n in self.neighbours[d] if n in shared and n not in self.survivors])
                for d in sorted(self.survivors)}

    def take(self, event: SecureMessage) -> None:
        """A device's answer in the current stage (anything else: SecAggError, counted by the caller)."""
        if event.round != self.round or event.session != self.session:
            raise SecAggError("session", f"{event.kind} of {event.device} for another session")
        if event.device not in self.awaiting or event.kind != self.stage:
            raise SecAggError("stage", f"{event.kind} of {event.device} out of its stage ({self.stage})")
        self.awaiting.discard(event.device)
        if event.kind == "shares":
            sealed = event.message["shares"]
            if set(sealed) != set(self.neighbours[event.device]):
                raise SecAggError("shares", f"{event.device} sealed shares for others than its neighbours")
            self.sealed[event.device] = sealed
        elif event.kind == "masked":
            assert event.words is not None
            np.add(self.total, event.words, out=self.total)  # mod 2^32: uint32 wraps
            self.survivors.add(event.device)
        else:
            self.reveals[event.device] = event.message

    # --- the sum ----------------------------------------------------------------------------------

    def result(self) -> SecureSum:
        """The unmasked, decoded sum of the survivors' contributions; SecAggError when it cannot be had."""
        self.counts["revealed"] = len(self.reveals)
        total = self.total.copy()
        for device in sorted(self.survivors):
            add_mask(total, self._reconstruct(device, "masks"), -1)
        for device in sorted(set(self.sealed) - self.survivors):
            keys = KeyPair.from_private(self._reconstruct(device, "keys"))
            for neighbour in self.neighbours[device]:
                if neighbour in self.survivors:  # it added its pair's mask with `device`: taken off here
                    seed = agree(keys, self.keys[neighbour].mask_key, MASK, self.session, device, neighbour)
                    add_mask(total, seed, -pairwise_sign(neighbour, device))
        quantiser = Quantiser(self.settings.clip_range, len(self.keys))
        change, weight = quantiser.decode(total, len(self.survivors))
        if not quantiser.in_range(change, weight, len(self.survivors)):
            raise SecAggError("sum-out-of-range", "the unmasked sum is not one the survivors' honest vectors can give "
                                                  "(a device sent more than its clip range or weight)")
        mean = change / weight if weight > 0 else np.zeros_like(change)
        samples = weight * self.settings.max_weight if self.weighted else weight
        return SecureSum(frozenset(self.survivors), mean, samples, 2 * self.settings.clip_range / quantiser.levels)

    def _fits(self, device: str, kind: str, secret: bytes) -> bool:
        """Whether `secret` is what `device` advertised: its self-mask seed's commitment, or its masking key's public
        half."""
        if kind == "masks":
            return commitment(secret) == self.keys[device].commitment
        return KeyPair.from_private(secret).public == self.keys[device].mask_key

    def _reconstruct(self, device: str, kind: str) -> bytes:
        """A secret of `device` from its neighbours' reveals, b ("masks") or its masking key ("keys"), that fits
        what the device advertised: from the first t shares, else from up to RECONSTRUCTION_TRIES other subsets of
        t (a share that is no field element is passed over). SecAggError: too few shares, or none fits."""
        shares = {}
        for neighbour in self.neighbours[device]:
            given = self.reveals.get(neighbour, {}).get(kind, {})
            try:
                shares[self.points[neighbour]] = share_value(given.get(device))
            except SecAggError:
                continue  # none revealed, or not a field element: as if none
        t = self.threshold
        if len(shares) < t:
            revealed = sum(neighbour in self.reveals for neighbour in self.neighbours[device])
            if revealed >= t:  # they answered, holding no share of it: it sealed garbage for them (or they lie)
                raise SecAggError("shares-withheld", f"{revealed} of {device}'s neighbours revealed, {len(shares)} "
                                                     f"of them its {kind} share: {t} needed")
            raise SecAggError("too-few-shares", f"{len(shares)} of {device}'s neighbours revealed its {kind} share, "
                                                f"{t} needed")
        points = sorted(shares)
        draw = random.Random(f"{self.session} {device} {kind}")  # the subsets tried: the same on every run
        subsets = [points[:t], *(sorted(draw.sample(points, t)) for _ in range(RECONSTRUCTION_TRIES))]
        for subset in subsets[:1] if len(points) == t else subsets:
            try:
                secret = combine({p: shares[p] for p in subset}, t)
            except SecAggError:
                continue
            if self._fits(device, kind, secret):
                return secret
        raise SecAggError("shares-inconsistent", f"no {t} of the {len(points)} {kind} shares of {device} give back "
                                                 f"what it advertised")
