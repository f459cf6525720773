"""A paho 2 client for tests: connects synchronously (so a refused CONNACK is a value, not a reconnect loop),
then runs paho's network thread and records every message it receives."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode

from coordinator.broker import BrokerAddress, Credentials, TlsFiles
from coordinator.pki import make_ca
from coordinator.pki import make_server_cert as pki_server_cert
from edgefil import topics, wire

WAIT_S = 30.0  # every wait below is a ceiling for an event that comes in milliseconds on a quiet machine
_RUNNING: set[Peer] = set()  # peers whose network thread runs: closed after each test (conftest), so none outlives
# its broker and keeps reconnecting into a later test


def close_running_peers() -> None:
    """Close every peer a test left open (one that failed before its close, or never closed one)."""
    for peer in list(_RUNNING):
        peer.close()


class Peer:
    def __init__(self, address: BrokerAddress, username: str | None = None, password: str | None = None,
                 tls: bool | None = None, client_id: str = "") -> None:
        self.address = address
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        self.client.reconnect_delay_set(0.1, 0.2)  # paho's default (1 s) makes close() wait that long after a drop
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls if tls is not None else address.cafile is not None:
            self.client.tls_set(ca_certs=address.cafile)
        self.connack: ReasonCode | None = None
        self.disconnected = threading.Event()
        self.messages: list[tuple[str, bytes]] = []
        self.qos: list[int] = []  # each message's QoS as delivered: its publisher's, at most the subscription's
        self._changed = threading.Condition()
        self._subacks: dict[int, list[ReasonCode]] = {}
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *args: self.disconnected.set()
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connack = reason_code

    def _on_message(self, client, userdata, message) -> None:
        with self._changed:
            self.messages.append((message.topic, bytes(message.payload)))
            self.qos.append(message.qos)
            self._changed.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._changed:
            self._subacks[mid] = list(reason_codes)
            self._changed.notify_all()

    def connect(self, timeout: float = WAIT_S) -> ReasonCode | None:
        """The CONNACK's reason, or None when the connection broke first; on success the network thread runs."""
        self.client.connect(self.address.host, self.address.port, keepalive=30)
        deadline = time.monotonic() + timeout
        while self.connack is None and time.monotonic() < deadline:
            if self.client.loop(timeout=0.05) != mqtt.MQTT_ERR_SUCCESS:
                break
        if self.connack is not None and not self.connack.is_failure:
            self.client.loop_start()
            _RUNNING.add(self)
        else:
            self.client.disconnect()
        return self.connack

    def subscribe(self, topic: str, qos: int = 1, timeout: float = WAIT_S) -> list[ReasonCode]:
        _, mid = self.client.subscribe(topic, qos)
        with self._changed:
            assert self._changed.wait_for(lambda: mid in self._subacks, timeout), f"no SUBACK for {topic}"
            return self._subacks[mid]

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout: float = WAIT_S) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(timeout)
        assert info.is_published(), f"publish on {topic} not acknowledged"

    def publish_all(self, messages: list[tuple[str, bytes]], timeout: float = WAIT_S) -> None:
        """QoS 1, in order, without waiting for each acknowledgement before the next (as fast as the broker takes
        them), then for all of them."""
        infos = [self.client.publish(topic, payload, qos=1) for topic, payload in messages]
        deadline = time.monotonic() + timeout
        for (topic, _), info in zip(messages, infos):
            info.wait_for_publish(max(deadline - time.monotonic(), 0.0))
            assert info.is_published(), f"publish on {topic} not acknowledged"

    def expect(self, topic: str, timeout: float = WAIT_S, index: int = 0) -> bytes:
        """The payload of the index-th message received on `topic`, waiting for it up to `timeout`."""
        def on_topic() -> list[bytes]:
            return [payload for t, payload in self.messages if t == topic]

        with self._changed:
            assert self._changed.wait_for(lambda: len(on_topic()) > index, timeout), f"no message {index} on {topic}"
            return on_topic()[index]

    def received(self, start: int = 0) -> list[tuple[str, bytes]]:
        """The (topic, payload) messages received so far, from the start-th on."""
        with self._changed:
            return self.messages[start:]

    def topics(self) -> list[str]:
        with self._changed:
            return [topic for topic, _ in self.messages]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        _RUNNING.discard(self)


def device_of(fleet: str, topic: str) -> str | None:
    """The device a protocol topic names, at its own broker or relayed by its site's bridge."""
    found = topics.parse_at_any_broker(fleet, topic)
    return None if found is None else found[1].device


def wait_online(address: BrokerAddress, watcher: Credentials, fleet: str, devices: list[str], timeout: float,
                failed: Callable[[], str | None] = lambda: None) -> None:
    """Until each of `devices` has said it is online (its retained status, read with `watcher`, an account that may
    read them), or `failed` names why it never will."""
    peer = Peer(address, watcher.username, watcher.password)
    assert not peer.connect().is_failure
    try:
        for device in devices:  # at the broker itself, or relayed by a site's bridge (topics.via_site)
            peer.subscribe(topics.from_device(fleet, device, "status"))
            peer.subscribe(f"{topics.prefix(fleet)}/{topics.SITE}/+/{topics.FROM_DEVICE}/{device}/status")
        deadline = time.monotonic() + timeout
        while True:
            said = {device_of(fleet, topic): wire.decode(payload)["state"]  # the latest each
                    for topic, payload in peer.received()}
            offline = [d for d in devices if said.get(d, "offline") == "offline"]
            if not offline:
                return
            why = failed()
            assert why is None, why
            assert time.monotonic() < deadline, f"{', '.join(offline)} not online after {timeout} s"
            time.sleep(0.05)
    finally:
        peer.close()


def make_server_cert(folder: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1, as `edgefil credentials` makes them."""
    make_ca(folder, "edgefil test")
    return pki_server_cert(folder, ["127.0.0.1"], days=2)
