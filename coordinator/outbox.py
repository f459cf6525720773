"""What the coordinator sends its fleet, and what it holds for devices between rounds.

The round loop decides who gets what and when; the outbox turns it into the protocol's messages (edgefil.topics,
edgefil.wire): a round's global weights (once to every device, again to one that comes back, at most
`resends_per_round` times per device and round), a device's round message with its payload blob (its personalized
model as "personal" and the rule's payloads for it), the fleet's broadcast (once when it changes, then to each
device process it has not reached), the answer to a device's request, a notice to the processes that share a device
id, and the run's end (retained on `all/end`, cleared when a run starts).

It keeps the devices' deliveries (the personalized models and payloads of the last round, and the broadcast), which
the checkpoint saves with each round and a resumed run restores.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from coordinator.broadcast import Broadcast
from coordinator.checkpoint import DeviceDeliveries
from coordinator.limits import ResendBudget
from coordinator.roster import Roster
from coordinator.rounds import OpenRound
from edgefil import topics, wire
from edgefil.link import Link

log = logging.getLogger("edgefil.coordinator")
PERSONAL = "personal"  # the payload that carries a device's personalized model


class Outbox:
    def __init__(self, link: Link, fleet: str, roster: Roster, resends: ResendBudget, counters: Counter[str],
                 sites: Mapping[str, str] | None = None) -> None:
        """`sites`: device -> the site it is at (coordinator/sites.py), whose bridge relays its messages."""
        self.link, self.fleet, self.roster, self.resends, self.counters = link, fleet, roster, resends, counters
        self.sites = dict(sites or {})
        self.personalized: dict[str, np.ndarray] = {}
        self.payloads: dict[str, dict[str, bytes]] = {}  # device -> named payloads for its next round
        self.broadcast = Broadcast()  # what the rule sends to every device, once
        self._weights: list[wire.Frame] = []  # the open round's global weights, as chunk frames

    def to_device(self, device: str, kind: str) -> str:
        """Where a message to `device` goes: its own topic, or its site's relay of it (`topics.via_site`)."""
        site = self.sites.get(device)
        if site is None:
            return topics.to_device(self.fleet, device, kind)
        return topics.via_site(self.fleet, site, topics.TO_DEVICE, device, kind)

    # --- between rounds ---------------------------------------------------------------------------

    def deliveries(self) -> DeviceDeliveries:
        """What the checkpoint keeps of the devices' deliveries."""
        return DeviceDeliveries(self.personalized, self.payloads, self.broadcast.payloads)

    def restore(self, saved: DeviceDeliveries) -> None:
        self.personalized, self.payloads = saved.models, saved.payloads
        self.broadcast.replace(saved.broadcast, saved.broadcast_round)

    def take(self, personalized: Mapping[str, np.ndarray], payloads: Mapping[str, dict[str, bytes]]) -> None:
        """A round's personalized models and payloads, for the devices' next rounds."""
        self.personalized.update(personalized)
        self.payloads.update(payloads)

    # --- a round ----------------------------------------------------------------------------------

    def publish_weights(self, weights: np.ndarray, number: int, version: int, task: int) -> str:
        """The round's global weights to every device; returns their blob id (what the round message names)."""
        encoded = wire.encode_blob("weights", wire.weights_bytes(weights), round=number, version=version, task=task)
        self._weights = encoded.frames
        for frame in self._weights:
            self.link.publish(topics.to_all(self.fleet, "weights"), frame)
        return encoded.id

    def send_round(self, device: str, current: OpenRound, version: int, config: dict[str, Any],
                   with_weights: bool = False) -> bool:
        """The round's message (and payloads) to one device; `with_weights`: a resend after the device came back,
        which also sends the global weights, at most `resends_per_round` times per device and round. False where
        that limit held it back (nothing sent)."""
        if with_weights and not self.resends.allow(device, current.number):
            self.counters["resend-limited"] += 1
            log.warning("%s asked for round %d again: over its %d resends, not sent", device, current.number,
                        self.resends.per_round)
            return False
        if with_weights:
            for frame in self._weights:
                self.link.publish(self.to_device(device, "weights"), frame)
        named: dict[str, Any] = {}
        payloads = self._payloads_for(device)
        if payloads:
            data, layout = wire.pack_attachments(b"", payloads)
            encoded = wire.encode_blob("payload", data, round=current.number, attachments=layout)
            for frame in encoded.frames:
                self.link.publish(self.to_device(device, "payload"), frame)
            named["payload"] = encoded.id
        if self.broadcast.id is not None:
            instance = self.roster.instance(device)
            if self.broadcast.needs(device, instance):
                for frame in self.broadcast.frames:
                    self.link.publish(self.to_device(device, "broadcast"), frame)
                self.broadcast.reached([(device, instance)])
            named["broadcast"] = self.broadcast.id
        self.link.publish(self.to_device(device, "round"), wire.encode(
            "round", round=current.number, task=current.task, model=current.model, version=version,
            deadline_s=max(current.remaining_s(), 0.0), config=config, **named,
        ))
        return True

    def publish_broadcast(self, payloads: dict[str, bytes], round_: int, rule: str) -> None:
        """The rule's payloads for every device: published once to the fleet when they change, the devices online
        now counted as reached (the others get it with their next round message)."""
        try:
            changed = self.broadcast.replace(payloads, round_)
        except ValueError as err:
            self.counters["broadcast-refused"] += 1
            log.warning("round %d: the %s rule's broadcast is not sent: %s", round_, rule, err)
            return
        if not changed:
            return
        for frame in self.broadcast.frames:
            self.link.publish(topics.to_all(self.fleet, "broadcast"), frame)
        self.broadcast.reached((d, self.roster.instance(d)) for d in self.roster.connected())
        log.info("round %d: broadcast %s (%d bytes) to the fleet", round_, ", ".join(sorted(payloads)),
                 sum(len(v) for v in payloads.values()))

    def _payloads_for(self, device: str) -> dict[str, bytes]:
        """What goes to a device with its round: its personalized model and the rule's payloads for it."""
        named = dict(self.payloads.get(device, {}))
        if device in self.personalized:
            named[PERSONAL] = bytes(wire.weights_bytes(self.personalized[device]))
        return named

    # --- outside rounds ---------------------------------------------------------------------------

    def answer(self, device: str, round_: int, given: dict[str, bytes]) -> None:
        """The answer to a device's request: the named payloads the rule gave (possibly none)."""
        data, layout = wire.pack_attachments(b"", given)
        for frame in wire.encode_blob("answer", data, round=round_, attachments=layout).frames:
            self.link.publish(self.to_device(device, "answer"), frame)

    def notice_duplicate(self, device: str, instances: list[str]) -> None:
        """Tell the device's processes (a retained notice) that two of them run with its id."""
        self.link.publish(self.to_device(device, "notice"), wire.encode(
            "notice", reason="duplicate-device", instances=instances,
            detail=f"two processes use device id {device} (instances {' and '.join(instances)}); stop one",
        ), retain=True)

    def run_started(self) -> None:
        """An earlier run's end is not this one's: delete it from the broker's store."""
        self.link.publish(topics.to_all(self.fleet, "end"), b"", retain=True)

    def run_ended(self, outcome: str, rounds: int) -> None:
        """The run is over (retained: a device that connects later learns it too)."""
        self.link.publish(topics.to_all(self.fleet, "end"), wire.encode(
            "end", outcome=outcome[:wire.MAX_TEXT_CHARS], rounds=rounds), retain=True)
