"""A device's side of secure aggregation (edgefil/secagg.py has the arithmetic; docs/security.md, "Secure
aggregation", the whole protocol): one `SecureUpload` per session, driven by the coordinator's messages.

1. `advertisement`: after training, the device advertises two fresh X25519 public keys (one to seal shares, one to
   agree masks) and a commitment to its self-mask seed b, with its update's metadata (round, model, metrics): no
   weights.
2. `on_neighbours`: the coordinator names its neighbours (their keys and Shamir points), how many devices the session
   holds and the threshold. The device splits b and its masking key into shares, one per neighbour, each sealed for
   that neighbour, and sends them (`shares`) for the coordinator to relay.
3. `on_relayed`: the shares its neighbours sent it. The device masks its quantised contribution, its change times
   its weight f = min(samples, max_weight) / max_weight (1 where the rule weighs every device alike) and then f
   itself, with its self mask and one pairwise mask per neighbour whose shares the coordinator relayed (+ towards
   the later id, - towards the earlier), and sends it (`masked`).
4. `on_unmask`: the coordinator names the neighbours whose masked vectors it holds (survivors) and those it does not
   (dropped). The device gives b's share of each survivor and the masking key's share of each dropped one that it
   holds, once a session, and refuses a request that names one device in both lists, or a device that is not its
   neighbour, or fewer survivors than the threshold.

A neighbour's share that does not open (a device that sealed garbage) is not held, and the device masks with that
neighbour all the same: its pairwise mask needs only the neighbour's advertised key, so the coordinator's sum still
cancels, and the neighbour's secrets come from its other neighbours' shares. One lying device cannot push its
neighbours out of the session.

Nothing is kept on disk: a device that restarts mid-session has dropped out of it (the coordinator recovers the sum
without it), and answers the round's next attempt with a new session, from its saved update.
"""
from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import numpy as np

from edgefil import wire
from edgefil.secagg import (
    MASK,
    SEAL,
    KeyPair,
    Quantiser,
    SecAggError,
    add_mask,
    agree,
    commitment,
    pairwise_sign,
    seal,
    share_value,
    split,
    unseal,
)

log = logging.getLogger("edgefil.device")


@dataclass(frozen=True)
class SecureRoundSettings:
    """What a secure round's config (`secure`) tells the device: the session's id, the contribution's clip range, the
    samples that weigh 1, and whether the rule weighs by samples at all (else every device weighs 1)."""

    session: str
    clip_range: float
    max_weight: float
    weighted: bool = True

    @classmethod
    def of(cls, value: object) -> SecureRoundSettings | None:
        """The round config's `secure` entry, checked; None when the round is not secure; SecAggError when it is
        but cannot be used."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise SecAggError("round-config", "the round's `secure` entry is not a table")
        session, clip, weight = value.get("session"), value.get("clip_range"), value.get("max_weight")
        weighted = value.get("weighted", True)
        if not (isinstance(session, str) and 0 < len(session) <= 64 and isinstance(clip, (int, float))
                and isinstance(weight, (int, float)) and 0 < clip < math.inf and 0 < weight < math.inf
                and isinstance(weighted, bool)):
            raise SecAggError("round-config", "the round's `secure` entry needs a session id, a positive "
                                              "clip_range and max_weight, and weighted true or false")
        return cls(session, float(clip), float(weight), weighted)


class SecureUpload:
    """One device's update in one session: `keys`, then each `on_*` answers the coordinator's next message."""

    def __init__(self, device: str, round_: int, settings: SecureRoundSettings, change: np.ndarray,
                 num_samples: int, task: int, model: str, metrics: dict[str, float]) -> None:
        """`change`: the update's weights minus the global model `model` it answers (float64, the device's own
        copy); `task`, `metrics`: what its keys message says of the update."""
        self.device, self.round, self.settings = device, round_, settings
        self.session = settings.session
        self.weight = min(num_samples, settings.max_weight) / settings.max_weight if settings.weighted else 1.0
        self.change: np.ndarray | None = change * self.weight
        self.cipher_keys, self.mask_keys = KeyPair.generate(), KeyPair.generate()
        self.self_seed = secrets.token_bytes(32)
        self.neighbours: dict[str, tuple[int, bytes, bytes]] = {}  # id -> (point, cipher key, mask key)
        self.count = self.threshold = 0
        self.held: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> its (b share, masking key share) for me
        self.revealed = False
        # step 1's message, the same however often it is sent (a round message resent after a broker restart)
        self.advertisement = wire.encode(
            "keys", device=device, round=round_, session=self.session, task=task, model=model,
            cipher_key=self.cipher_keys.public, mask_key=self.mask_keys.public, commitment=commitment(self.self_seed),
            metrics=metrics)

    def on_neighbours(self, message: wire.Message) -> bytes:
        """Step 2: the shares message."""
        if self.neighbours:
            raise SecAggError("stage", "neighbours named twice in one session")
        count, threshold, own = message["count"], message["threshold"], message["index"]
        named = {}
        for device, entry in message["neighbours"].items():
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int) and entry[0] > 0
                    and all(isinstance(k, bytes) for k in entry[1:])):
                raise SecAggError("neighbours", f"neighbour {device!r:.80} is not [point, key, key]")
            named[device] = (entry[0], entry[1], entry[2])
        points = [p for p, _, _ in named.values()]
        if (self.device in named or own <= 0 or own in points or len(set(points)) != len(points)
                or not 1 <= threshold <= len(named) + 1 or count < len(named) + 1):
            raise SecAggError("neighbours", f"a neighbourhood of {len(named)} with threshold {threshold} in a "
                                            f"session of {count} does not hold together")
        self.neighbours, self.count, self.threshold = named, count, threshold
        b_shares = split(self.self_seed, points, threshold)
        key_shares = split(self.mask_keys.private_bytes(), points, threshold)
        sealed = {}
        for device, (point, cipher_key, _) in named.items():
            plain = msgpack.packb([self.device, device, b_shares[point], key_shares[point]], use_bin_type=True)
            key = agree(self.cipher_keys, cipher_key, SEAL, self.session, self.device, device)
            sealed[device] = seal(key, plain, self._associated(self.device, device))
        return wire.encode("shares", device=self.device, round=self.round, session=self.session, shares=sealed)

    def on_relayed(self, message: wire.Message) -> wire.EncodedBlob:
        """Step 3: the masked vector, as a blob."""
        if self.change is None or not self.neighbours:
            raise SecAggError("stage", "shares relayed before neighbours, or twice")
        senders = sorted(message["shares"])
        if not set(senders) <= self.neighbours.keys():
            raise SecAggError("relayed", "shares relayed from devices that are not its neighbours")
        for sender in senders:
            try:
                self.held[sender] = self._opened(sender, message["shares"][sender])
            except SecAggError as err:  # a sender that sealed garbage: its secrets are not held here, no more
                log.warning("%s: the share %s sealed for it does not open (%s); masking with it all the same",
                            self.device, sender, err)
        quantiser = Quantiser(self.settings.clip_range, self.count)
        vector = quantiser.encode(self.change, self.weight, np.random.default_rng(secrets.randbits(128)))
        self.change = None  # sent once a session
        add_mask(vector, self.self_seed, +1)  # b is the self mask's key: fresh, used for nothing else
        for neighbour in senders:  # every neighbour whose shares the coordinator relayed, as it counts on
            seed = agree(self.mask_keys, self.neighbours[neighbour][2], MASK, self.session, self.device, neighbour)
            add_mask(vector, seed, pairwise_sign(self.device, neighbour))
        return wire.encode_blob("masked", vector.data.cast("B"), device=self.device, round=self.round,
                                session=self.session)

    def on_unmask(self, message: wire.Message) -> bytes:
        """Step 4: the reveal message."""
        survivors, dropped = set(message["survivors"]), set(message["dropped"])
        if self.revealed:
            raise SecAggError("stage", "asked to unmask twice in one session")
        if survivors & dropped or not (survivors | dropped) <= self.neighbours.keys() | {self.device}:
            raise SecAggError("unmask", "the survivors and the dropped overlap, or name devices that are not its "
                                        "neighbours")
        if len(survivors | {self.device}) < self.threshold:  # unmasking so few would reveal too much of each
            raise SecAggError("too-few-survivors", f"{len(survivors | {self.device})} of its neighbourhood survived, "
                                                   f"the threshold is {self.threshold}")
        self.revealed = True
        return wire.encode("reveal", device=self.device, round=self.round, session=self.session,
                           masks={d: self.held[d][0] for d in sorted(survivors & self.held.keys())},
                           keys={d: self.held[d][1] for d in sorted(dropped & self.held.keys())})

    def _opened(self, sender: str, sealed: bytes) -> tuple[bytes, bytes]:
        """The (b share, masking key share) `sender` sealed for this device; SecAggError when they do not open or
        name another pair."""
        key = agree(self.cipher_keys, self.neighbours[sender][1], SEAL, self.session, sender, self.device)
        opened = unseal(key, sealed, self._associated(sender, self.device))
        try:
            plain = msgpack.unpackb(opened, raw=False)
        except Exception:  # msgpack raises several unrelated types for bad input
            raise SecAggError("relayed", f"the share from {sender} is not a msgpack list") from None
        if not (isinstance(plain, list) and len(plain) == 4 and plain[:2] == [sender, self.device]):
            raise SecAggError("relayed", f"the share from {sender} names another pair")
        return share_value(plain[2]), share_value(plain[3])

    def _associated(self, sender: str, receiver: str) -> bytes:
        return f"{self.session} {self.round} {sender} {receiver}".encode()
