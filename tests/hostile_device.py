"""A poisoning device for tests: one device's valid credentials, speaking the protocol as a real device does
(retained registration and status, global weights reassembled from their chunks, an update for every round it is
selected for, its status again when the run ends, as a device that stays for the next run answers the end: else the
coordinator's end waits its whole grace for it), with the update chosen by an attacker. Attacks rotate by round:

- "huge": every weight 1e30 (finite);
- "samples": a garbage model (the global model plus noise) claiming 10^9 samples;
- "boosted": model replacement, g + BOOST * (garbage - g), with an ordinary sample count.

A test may give its own `answer` instead: what to send for a round, given the global model.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from mqtt_helpers import Peer

from coordinator.broker import BrokerAddress
from edgefil import topics, wire

ATTACKS = ("huge", "samples", "boosted")
BOOST = 10.0


@dataclass(frozen=True)
class Answer:
    """What the hostile device sends for one round: its name (recorded in `sent`) and the update."""

    name: str
    weights: np.ndarray
    num_samples: int = 40
    attachments: Mapping[str, bytes] = field(default_factory=dict)
    label_counts: tuple[int, ...] = ()


def rotating_attacks(round_: int, g: np.ndarray, rng: np.random.Generator) -> Answer:
    """The module docstring's attacks, by turns."""
    attack = ATTACKS[round_ % len(ATTACKS)]
    garbage = g + rng.normal(0, 0.5, g.size).astype(np.float32)
    if attack == "huge":
        return Answer(attack, np.full(g.size, 1e30, dtype=np.float32))
    if attack == "samples":
        return Answer(attack, garbage, 10**9)
    return Answer(attack, (g + BOOST * (garbage - g)).astype(np.float32))


class PoisoningDevice:
    def __init__(self, address: BrokerAddress, fleet: str, device: str, password: str, manifest: str,
                 num_parameters: int,
                 answer: Callable[[int, np.ndarray, np.random.Generator], Answer] = rotating_attacks) -> None:
        self.fleet, self.device, self.manifest, self.num_parameters = fleet, device, manifest, num_parameters
        self.answer = answer
        self.peer = Peer(address, device, password)
        self.models: dict[str, np.ndarray] = {}
        self.reassembler = wire.Reassembler(max_blob_bytes=4 * num_parameters)
        self.sent: dict[int, str] = {}  # round -> the attack sent
        self.waiting: list[wire.Message] = []  # round messages whose global model has not arrived yet
        self.errors: list[str] = []  # what went wrong in the device's thread (a test asserts there is nothing)
        self.rng = np.random.default_rng(666)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        assert not self.peer.connect().is_failure
        for topic in topics.device_subscriptions(self.fleet, self.device):
            self.peer.subscribe(topic)
        self.peer.publish(topics.from_device(self.fleet, self.device, "register"), wire.encode(
            "register", device=self.device, profile="attacker", backend="portable", manifest=self.manifest,
            software="0"), retain=True)
        self._status("idle", 0)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peer.close()

    def _status(self, state: str, round_: int) -> None:
        self.peer.publish(topics.from_device(self.fleet, self.device, "status"),
                          wire.encode("status", device=self.device, state=state, round=round_), retain=True)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # recorded for the test, which would otherwise see only a missed quorum
            self.errors.append(repr(err))
            raise

    def _loop(self) -> None:
        seen, waiting = 0, self.waiting
        while not self._stop.wait(0.05):
            fresh = self.peer.received(seen)
            seen += len(fresh)
            for _, payload in fresh:
                try:
                    message = wire.decode(payload)
                except wire.WireError:
                    continue
                if message["kind"] == "weights":
                    blob = self.reassembler.add("coordinator", message)
                    if blob is not None:
                        self.models[blob.id] = blob.weights(self.num_parameters).copy()
                elif message["kind"] == "round":
                    waiting.append(message)
                elif message["kind"] == "end":
                    self._status("idle", max(self.sent, default=0))
            for message in [m for m in waiting if m["model"] in self.models]:
                waiting.remove(message)
                self._attack(message, self.models[message["model"]])

    def _attack(self, message: wire.Message, g: np.ndarray) -> None:
        round_ = message["round"]
        if round_ in self.sent:
            return
        answer = self.answer(round_, g, self.rng)
        data, layout = wire.pack_attachments(wire.weights_bytes(answer.weights), answer.attachments)
        for chunk in wire.encode_blob("update", data, device=self.device, round=round_, task=message["task"],
                                      model=message["model"], num_samples=answer.num_samples, metrics={},
                                      attachments=layout, label_counts=list(answer.label_counts)).chunks:
            self.peer.publish(topics.from_device(self.fleet, self.device, "update"), chunk)
        self.sent[round_] = answer.name
        self._status("idle", round_)
