"""A site's broker bridged to the central one (coordinator/broker.py: Site, Bridge), two real mosquitto processes:
what crosses the bridge and what stays at the site, and what the site's account may say on the central broker."""
from __future__ import annotations

import time

import pytest
from mqtt_helpers import Peer

from coordinator.broker import Bridge, Credentials, MosquittoBroker, Site, mosquitto_path
from edgefil import topics

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"
ARRIVES_S = 30.0  # a ceiling for a message across the bridge: milliseconds on a quiet host
QUIET_S = 1.0  # how long a message that must not arrive is given after one that must (sent after it, same path)


@pytest.fixture
def bridged(tmp_path):
    passwords = {f"d{k}": f"pw-{k}" for k in range(4)}
    site = Site("a", Credentials("site-a", "pw-site-a"))  # d0 and d1 are its devices, at its broker
    central = MosquittoBroker(tmp_path / "central", FLEET, passwords, Credentials("coordinator", "pw-c"),
                              sites=[site])
    central.start()
    local = MosquittoBroker(tmp_path / "site", FLEET, {d: passwords[d] for d in ("d0", "d1")},
                            Credentials("aggregator", "pw-agg"),
                            bridge=Bridge("a", central.host, central.port, site.account))
    local.start()
    peers: list[Peer] = []

    def peer(broker: MosquittoBroker, user: str, password: str, *subscriptions: str) -> Peer:
        made = Peer(broker.address, user, password)
        assert not made.connect().is_failure
        for topic in subscriptions:
            made.subscribe(topic)
        peers.append(made)
        return made

    yield central, local, peer
    for made in peers:
        made.close()
    local.stop()
    central.stop()


def wait_for(peer: Peer, topic: str, start: int = 0) -> bytes:
    deadline = time.monotonic() + ARRIVES_S
    while time.monotonic() < deadline:
        for got, payload in peer.received(start):
            if got == topic:
                return payload
        time.sleep(0.02)
    raise AssertionError(f"nothing on {topic} within {ARRIVES_S} s; got {peer.topics()}")


def test_a_sites_devices_speak_to_the_coordinator_over_the_bridge_and_their_updates_stay_at_the_site(bridged):
    """A device at the site registers and is heard centrally under the site's prefix (retained, as the protocol
    keeps it); the coordinator's round message, sent under the site's prefix, and its broadcasts reach the device on
    its own topics; its update reaches the site's aggregator and not the central broker; the site's own topics
    cross both ways."""
    central, local, peer = bridged
    prefix = topics.prefix(FLEET)
    coordinator = peer(central, "coordinator", "pw-c", f"{prefix}/{topics.FROM_DEVICE}/+/+", f"{prefix}/site/#")
    aggregator = peer(local, "aggregator", "pw-agg", f"{prefix}/{topics.FROM_DEVICE}/+/update", f"{prefix}/site/#")
    device = peer(local, "d0", "pw-0", topics.to_device(FLEET, "d0", "round"), topics.to_all(FLEET, "weights"))
    deadline = time.monotonic() + ARRIVES_S
    while not coordinator.received() and time.monotonic() < deadline:  # the bridge connects on its own schedule
        device.publish(topics.from_device(FLEET, "d0", "register"), b"register", retain=True)
        time.sleep(0.2)
    assert wait_for(coordinator, relayed("d0", "register")) == b"register"
    for sent, topic in ((topics.via_site(FLEET, "a", topics.TO_DEVICE, "d0", "round"),
                         topics.to_device(FLEET, "d0", "round")),
                        (topics.to_all(FLEET, "weights"), topics.to_all(FLEET, "weights"))):
        deadline = time.monotonic() + ARRIVES_S
        while not any(t == topic for t, _ in device.received()) and time.monotonic() < deadline:
            coordinator.publish(sent, b"to the site")
            time.sleep(0.2)
        assert wait_for(device, topic) == b"to the site"
    device.publish(topics.from_device(FLEET, "d0", "update"), b"an update")
    assert wait_for(aggregator, topics.from_device(FLEET, "d0", "update")) == b"an update"
    aggregator.publish(f"{prefix}/site/a/partial", b"the site's sum")
    assert wait_for(coordinator, f"{prefix}/site/a/partial") == b"the site's sum"
    coordinator.publish(f"{prefix}/site/a/close", b"close")
    assert wait_for(aggregator, f"{prefix}/site/a/close") == b"close"
    device.publish(topics.from_device(FLEET, "d0", "status"), b"after the update")  # the same path, after it
    assert wait_for(coordinator, relayed("d0", "status")) == b"after the update"
    time.sleep(QUIET_S)
    assert not {topics.from_device(FLEET, "d0", "update"), relayed("d0", "update")} & set(coordinator.topics())


def relayed(device: str, kind: str) -> str:
    return topics.via_site(FLEET, "a", topics.FROM_DEVICE, device, kind)


def test_the_sites_account_speaks_under_its_own_prefix_only(bridged):
    """On the central broker the site's account writes under its site's prefix and nowhere else (no device's own
    topics, no update), and reads neither a device's own round messages nor another site's topics; which devices
    it may speak for under its prefix the coordinator checks (`Sites.relayed`, tests/test_sites.py)."""
    central, _, peer = bridged
    prefix = topics.prefix(FLEET)
    coordinator = peer(central, "coordinator", "pw-c", f"{prefix}/{topics.FROM_DEVICE}/+/+", f"{prefix}/site/a/#")
    impostor = peer(central, "site-a", "pw-site-a", topics.to_device(FLEET, "d2", "round"), f"{prefix}/site/b/#")
    impostor.publish(topics.from_device(FLEET, "d2", "register"), b"not its prefix")
    impostor.publish(topics.from_device(FLEET, "d0", "update"), b"not through the bridge")
    coordinator.publish(topics.to_device(FLEET, "d2", "round"), b"for d2 alone")
    coordinator.publish(f"{prefix}/site/b/close", b"another site's")
    impostor.publish(relayed("d1", "register"), b"its own device")
    assert wait_for(coordinator, relayed("d1", "register")) == b"its own device"
    time.sleep(QUIET_S)
    assert coordinator.topics() == [relayed("d1", "register")]
    assert impostor.topics() == []
