"""The outbox (coordinator/outbox.py) against a real mosquitto, a test peer reading what a device would: the round's
weights once to all, a round message naming the device's payload blob and the broadcast, a broadcast sent once per
device process, resends within their budget, the run's end retained and cleared."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from mqtt_helpers import Peer

from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from coordinator.inbox import Registration, Status
from coordinator.limits import ResendBudget
from coordinator.outbox import PERSONAL, Outbox
from coordinator.roster import Roster
from coordinator.rounds import OpenRound
from edgefil import topics, wire
from edgefil.link import BrokerSettings, Link

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"


@pytest.fixture
def wired(tmp_path):
    broker = MosquittoBroker(tmp_path / "broker", FLEET, {"d1": "device-password-1", "d2": "device-password-2"},
                             Credentials("coordinator", "coordinator-password"))
    broker.start()
    link = Link(BrokerSettings(port=broker.address.port, username="coordinator", password="coordinator-password"),
                client_id="coordinator-lab")
    link.start()
    device = Peer(broker.address, "d1", "device-password-1")
    assert not device.connect().is_failure
    for topic in topics.device_subscriptions(FLEET, "d1"):
        device.subscribe(topic)
    roster = Roster(["d1"])
    roster.register(Registration("d1", "ort", "pc", "i1"))
    roster.take_status(Status("d1", "idle", 0, instance="i1"), 0)
    counters: Counter[str] = Counter()
    yield Outbox(link, FLEET, roster, ResendBudget(1), counters), device, counters
    device.close()
    link.stop()
    broker.stop()


def kinds(device: Peer, topic: str) -> list[wire.Message]:
    return [wire.decode(p) for t, p in list(device.messages) if t == topic]


def test_a_round_reaches_its_device_with_weights_payload_and_broadcast_each_once(wired):
    outbox, device, counters = wired
    weights = np.arange(10, dtype=np.float32)
    model = outbox.publish_weights(weights, number=1, version=0, task=0)
    outbox.take({"d1": np.ones(10, np.float32)}, {"d1": {"rule/extra": b"x"}})
    outbox.publish_broadcast({"rule/old": b"old"}, 1, "toy")
    current = OpenRound.open(1, 0, model, ["d1"], 60.0)
    assert outbox.send_round("d1", current, 0, {"epochs": 2})
    message = wire.decode(device.expect(topics.to_device(FLEET, "d1", "round"), timeout=30))
    assert (message["round"], message["model"], message["config"]) == (1, model, {"epochs": 2})
    assert message["broadcast"] == outbox.broadcast.id and "payload" in message
    payload = wire.Reassembler(1 << 20).add("p", wire.decode(
        device.expect(topics.to_device(FLEET, "d1", "payload"), timeout=30)))
    assert set(payload.attachments()) == {PERSONAL, "rule/extra"}
    assert kinds(device, topics.to_device(FLEET, "d1", "broadcast")) == []  # it reached d1's process on all/
    assert outbox.send_round("d1", current, 0, {}, with_weights=True)  # d1 came back: the weights again
    assert not outbox.send_round("d1", current, 0, {}, with_weights=True)  # over its one resend: not sent
    assert counters["resend-limited"] == 1
    device.expect(topics.to_device(FLEET, "d1", "weights"), timeout=30)
    saved = outbox.deliveries()
    assert set(saved.models) == {"d1"} and saved.broadcast == {"rule/old": b"old"}


def test_the_runs_end_is_retained_for_late_devices_and_cleared_by_the_next_run(wired, tmp_path):
    outbox, device, _ = wired
    outbox.run_ended("complete", 12)
    end = wire.decode(device.expect(topics.to_all(FLEET, "end"), timeout=30))
    assert (end["outcome"], end["rounds"]) == ("complete", 12)
    outbox.link.wait_idle(10)
    late = Peer(device.address, "d2", "device-password-2")  # a device that connects afterwards
    assert not late.connect().is_failure
    late.subscribe(topics.to_all(FLEET, "end"))
    assert wire.decode(late.expect(topics.to_all(FLEET, "end"), timeout=30))["rounds"] == 12
    late.close()
    outbox.run_started()
    outbox.link.wait_idle(10)
    again = Peer(device.address, "d2", "device-password-2")
    assert not again.connect().is_failure
    again.subscribe(topics.to_all(FLEET, "end"))
    again.subscribe(topics.to_all(FLEET, "weights"))
    outbox.publish_weights(np.zeros(4, np.float32), 1, 0, 0)  # a marker: a retained end would have come before it
    again.expect(topics.to_all(FLEET, "weights"), timeout=30)
    assert [t for t, _ in again.messages if t.endswith("/end")] == []  # nothing retained any more
    again.close()
