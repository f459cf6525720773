"""The coordinator's gate: every payload from the broker passes here before anything else sees it.

A message is turned into an event only when its topic belongs to this fleet's devices, its device is on the
roster and is the one named in the payload, it decodes under the current schema, and (for updates) its chunks
reassemble into exactly the model's number of finite float32 values, followed by the declared attachments (named
byte strings, at most `MAX_ATTACHMENT_BYTES` together; what they mean is the strategy's business, which may refuse
an update in `Strategy.inspect`). Registrations and requests are rate-limited per device (coordinator/limits.py).
A retained message is taken only on the kinds the protocol retains (`topics.RETAINED`); every retained message
the gate refuses is listed in `to_clear`, for the coordinator to delete from the broker's store, so garbage left
there is not met again on every (re)subscribe. An empty payload is such a deletion, passed over without a count.
Everything else is rejected with a logged reason and counted; nothing raises: an exception that is not a
refusal (a gap in the checks) is counted as "unexpected" and dropped like one. Round-level checks (right round,
selected, before the deadline) are the round's business (`rounds.py`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from coordinator.limits import RateLimits, TokenBuckets
from coordinator.secagg import Advertised, SecureMessage
from coordinator.strategies.base import ClientUpdate
from edgefil import topics, wire

log = logging.getLogger("edgefil.coordinator")


@dataclass(frozen=True)
class Registration:
    device: str
    backend: str
    profile: str
    instance: str = ""  # the device process's random id ("" from a device that sends none)


@dataclass(frozen=True)
class Status:
    device: str
    state: str
    round: int
    error: str = ""  # state "error": why the device cannot train (its data, its configuration)
    instance: str = ""
    task: int | None = None  # state "no-data": the task it holds no data for (None: not said)


@dataclass(frozen=True)
class Update:
    device: str
    round: int
    task: int
    model: str
    num_samples: int
    metrics: Mapping[str, float]
    weights: np.ndarray  # flat float32 view over the reassembled bytes (no copy)
    label_counts: tuple[int, ...] = ()
    attachments: Mapping[str, bytes] = dataclasses.field(default_factory=dict)  # named, as the device sent them
    trained_counts: tuple[tuple[int, int, int], ...] = ()

    def for_strategy(self) -> ClientUpdate:
        """What a rule and the guard see of the update (the round's bookkeeping is the coordinator's)."""
        return ClientUpdate(self.device, self.weights, self.num_samples, dict(self.metrics), self.label_counts,
                            self.attachments, self.trained_counts)


@dataclass(frozen=True)
class Request:
    """A device asks the coordinator's strategy for named payloads (answered at once)."""

    device: str
    round: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class UpdateRefused:
    """A device's whole update was refused (counted under `reason`): the round it answers need not wait for it."""

    device: str
    round: int
    reason: str


Event = Registration | Status | Update | Request | UpdateRefused | Advertised | SecureMessage
# refusals of a whole update, once its chunks are all in (a chunk's own refusals say nothing of the update yet)
WHOLE_UPDATE_REFUSALS = frozenset({"blob-hash", "weights-length", "weights-nonfinite"})
MAX_ATTACHMENT_BYTES = 64 << 20  # what an update may carry besides the model
UNEXPECTED = "unexpected"  # the reason counted for a message that raised something other than a WireError


class Inbox:
    def __init__(self, fleet: str, roster: set[str], manifest: str, num_parameters: int,
                 limits: RateLimits | None = None) -> None:
        self.fleet = fleet
        self.roster = roster
        self.manifest = manifest
        self.num_parameters = num_parameters
        # each device holds at most one update's bytes part-way (its own flood evicts only its own partial
        # blobs): at most len(roster) x (model + MAX_ATTACHMENT_BYTES) in all, allocated only as bytes arrive
        self.reassembler = wire.Reassembler(max_blob_bytes=4 * num_parameters + MAX_ATTACHMENT_BYTES)
        self.rejections: Counter[str] = Counter()
        self.to_clear: list[str] = []  # topics of refused retained messages, to be deleted from the broker
        limits = limits or RateLimits()
        self._registrations = TokenBuckets(limits.registrations_per_minute)
        self._requests = TokenBuckets(limits.requests_per_minute)

    def accept(self, topic: str, payload: bytes | bytearray | memoryview, retained: bool = False) -> Event | None:
        """The event this message makes, or None (rejected and counted, or a chunk of an unfinished update)."""
        if not payload:
            return None  # a retained message being deleted (MQTT's empty payload), by its device or by us
        reason = None
        try:
            return self._accept(topic, payload, retained)
        except wire.WireError as err:
            reason = err.reason
            self.reject(err.reason, f"{topic}: {err}")
        except Exception as err:  # a refusal the codec has no reason for yet: counted and dropped, never raised
            reason = UNEXPECTED
            self.reject(UNEXPECTED, f"{topic}: {type(err).__name__}: {err!s:.200}")
            log.debug("unexpected refusal", exc_info=True)
        if retained and reason not in ("rate", "topic"):  # not ours to delete: another fleet's, or a good one
            self.to_clear.append(topic)
        return None

    def reject(self, reason: str, detail: str) -> None:
        self.rejections[reason] += 1
        log.warning("rejected (%s) %s", reason, detail)

    def drop_partial_updates(self, before_round: int) -> int:
        """Free the chunks of updates for rounds that are closed."""
        return self.reassembler.drop(lambda header: header["round"] < before_round)

    def _accept(self, topic: str, payload: bytes | bytearray | memoryview, retained: bool) -> Event | None:
        parsed = topics.parse(self.fleet, topic)
        if parsed is None or parsed.direction != topics.FROM_DEVICE:
            if parsed is not None:
                return None  # the coordinator's own messages to devices, echoed by a wildcard subscription
            raise wire.WireError("topic", "not a topic of this fleet")
        if parsed.kind not in topics.DEVICE_SENDS:
            raise wire.WireError("kind", f"devices do not send {parsed.kind!r}")
        if retained and parsed.kind not in topics.RETAINED:
            raise wire.WireError("retained", f"a {parsed.kind} message is never retained")
        if parsed.device not in self.roster:
            raise wire.WireError("unknown-device", f"{parsed.device!r} is not on the roster")
        message = wire.decode(payload)
        if message["kind"] != parsed.kind:
            raise wire.WireError("kind", f"a {message['kind']} message on the {parsed.kind} topic")
        if message.get("device") != parsed.device:
            raise wire.WireError("impersonation", f"{parsed.device!r} sent a message signed {message['device']!r}")
        if message["kind"] == "register":
            if message["manifest"] != self.manifest:
                raise wire.WireError("manifest-mismatch", f"{parsed.device} trains another model")
            if not self._registrations.allow(parsed.device):
                raise wire.WireError("rate", f"{parsed.device} registers too often")
            return Registration(parsed.device, message["backend"], message["profile"], message.get("instance", ""))
        if message["kind"] == "status":
            return Status(parsed.device, message["state"], message["round"], message.get("error", ""),
                          message.get("instance", ""), message.get("task"))
        if message["kind"] == "request":
            return self._take_request(parsed.device, message)
        if message["kind"] == "keys":
            return Advertised(parsed.device, message["round"], message["task"], message["model"], message["session"],
                              message["cipher_key"], message["mask_key"], message["commitment"],
                              dict(message["metrics"]))
        if message["kind"] in ("shares", "reveal"):
            return SecureMessage(parsed.device, message["kind"], message["round"], message["session"], message)
        if message["kind"] == "masked":
            return self._take_masked(parsed.device, message)
        return self._take_chunk(parsed.device, message)

    def _take_masked(self, device: str, message: wire.Message) -> SecureMessage | None:
        """A secure session's masked vector, once whole: the model's parameters and the weight, as uint32 words."""
        blob = self.reassembler.add(device, message)
        if blob is None:
            return None
        return SecureMessage(device, "masked", message["round"], message["session"], blob.header,
                             blob.words(self.num_parameters + 1))

    def _take_request(self, device: str, message: wire.Message) -> Request:
        if not self._requests.allow(device):
            raise wire.WireError("rate", f"{device} asks too often")
        return Request(device, message["round"], tuple(message["names"]))

    def _take_chunk(self, device: str, message: wire.Message) -> Update | UpdateRefused | None:
        if message["num_samples"] < 0:
            raise wire.WireError("field", f"negative sample count {message['num_samples']}")
        try:
            blob = self.reassembler.add(device, message)
            if blob is None:
                return None
            weights, attachments = blob.split(self.num_parameters)
        except wire.WireError as err:
            if err.reason not in WHOLE_UPDATE_REFUSALS:
                raise
            self.reject(err.reason, f"update of {device} for round {message['round']}: {err}")
            return UpdateRefused(device, message["round"], err.reason)
        header = blob.header
        return Update(
            device=device, round=header["round"], task=header["task"], model=header["model"],
            num_samples=header["num_samples"], metrics=dict(header["metrics"]), weights=weights,
            label_counts=tuple(header.get("label_counts", ())),
            trained_counts=tuple(tuple(part) for part in header.get("trained_counts", ())),
            attachments={name: bytes(data) for name, data in attachments.items()},
        )
