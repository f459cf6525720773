"""The paho link every device and the coordinator use: refusals are errors, reconnects are announced and
re-subscribe, QoS 1 messages published while the broker is down go out after it comes back, TLS works."""
from __future__ import annotations

import pytest
from mqtt_helpers import make_server_cert

from coordinator.broker import Credentials, MosquittoBroker, free_port, mosquitto_path
from edgefil.link import CONNECTED, BrokerSettings, ConnectionRefused, Link

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
TOPIC = "edgefil/lab/dev/dev-a/update"


def settings(broker: MosquittoBroker, user: str, password: str) -> BrokerSettings:
    address = broker.address
    return BrokerSettings(address.host, address.port, user, password, address.cafile, keepalive=2)


def next_message(link: Link, timeout: float = 10.0) -> tuple[str, bytes]:
    while (item := link.get(timeout)) is not None and item[0] == CONNECTED:
        pass
    assert item is not None, "nothing arrived"
    return item


@pytest.fixture
def broker(tmp_path):
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    broker.start()
    yield broker
    broker.stop()


def test_refused_credentials_and_a_missing_broker_raise(broker):
    with pytest.raises(ConnectionRefused):
        Link(settings(broker, "dev-a", "wrong"), "x").start(timeout=10)
    with pytest.raises(ConnectionError, match="no MQTT broker"):
        Link(BrokerSettings(port=free_port()), "y").start(timeout=1.5)


def test_reconnect_resubscribes_and_delivers_what_was_published_while_down(broker):
    coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=["edgefil/lab/#"])
    device = Link(settings(broker, "dev-a", "pw-a"), "d")
    coordinator.start()
    device.start()
    try:
        assert coordinator.get(5) == (CONNECTED, b"")
        device.publish(TOPIC, b"before")
        assert next_message(coordinator) == (TOPIC, b"before")
        broker.stop()
        # queued by paho; retained, so it does not matter which of the two links reconnects first
        device.publish(TOPIC, b"while down", retain=True)
        broker.start()
        assert coordinator.get(20) == (CONNECTED, b"")  # the owner is told, to announce itself again
        assert next_message(coordinator, 20) == (TOPIC, b"while down")  # re-subscribed, and the queue flushed
        assert device.wait_idle(10) and coordinator.connects == 2
    finally:
        device.stop()
        coordinator.stop()


def test_tls(tmp_path):
    tls = make_server_cert(tmp_path)
    broker = MosquittoBroker(tmp_path / "b", "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"), tls=tls)
    with broker:
        coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=["edgefil/lab/#"])
        device = Link(settings(broker, "dev-a", "pw-a"), "d")
        coordinator.start()
        device.start()
        device.publish(TOPIC, b"sealed")
        assert next_message(coordinator) == (TOPIC, b"sealed")
        device.stop()
        coordinator.stop()
