"""paho without its copies of large messages (edgefil/paho_buffers.py): the replaced PUBLISH decoder agrees with
paho's own on every packet, well-formed or not; received payloads are views of paho's packet, sent packets are
queued as views, large packets are read in place; a payload given as parts (a chunk's `wire.Frame`) goes out as the
very bytes of the joined message; a model-sized message crosses a real broker intact both ways, over TCP and over
TLS, sent as frames one way and as bytes the other."""
from __future__ import annotations

import socket
import threading

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mqtt_helpers import make_server_cert
from test_link import LISTENING_S, next_message
from test_link import settings as broker_settings

from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from edgefil import paho_buffers, topics, wire
from edgefil.link import Link

MQTT311 = mqtt.MQTTv311


def publish_packet(topic: bytes, qos: int, mid: int, payload: bytes) -> tuple[int, bytearray]:
    """A PUBLISH's fixed-header byte and the rest of the packet, as paho reads them (MQTT 3.1.1)."""
    header = 0x30 | (qos << 1)
    body = bytearray(len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"") + payload)
    return header, body


def decoded(decoder, header: int, packet: bytearray):
    try:
        result = decoder(header, packet, MQTT311)
    except mqtt.MalformedPacket:
        return "malformed"
    return result._replace(payload=bytes(result.payload))


def test_this_paho_has_the_internals_the_patches_were_written_for():
    assert paho_buffers.decoder_fits() and paho_buffers.queue_fits() and paho_buffers.read_fits()
    assert paho_buffers.connect_fits()
    assert paho_buffers.parts_fit()
    assert paho_buffers.puback_decoder_fits() and paho_buffers.acknowledgements_fit()
    assert paho_buffers.install() and paho_buffers.publishes_parts()


def sent_bytes(payload, qos: int, dup: bool = False) -> bytes:
    """What a connected paho_buffers.Client writes to its socket for one publish of `payload` (then, with `dup`,
    for its resend as paho makes it after a reconnect)."""
    paho_buffers.install()
    ours, theirs = socket.socketpair()
    try:
        client = paho_buffers.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t", protocol=MQTT311)
        client._sock = ours  # "connected": paho writes each packet as it is queued
        info = client.publish("edgefil/lab/all/weights", payload, qos=qos)
        assert info.rc == mqtt.MQTT_ERR_SUCCESS
        if dup:
            message = client._out_messages[info.mid]
            client._send_publish(message.mid, message.topic.encode(), message.payload, qos, False, True,
                                 message.info)
        client._sock = None
        ours.close()
        return b"".join(iter(lambda: theirs.recv(1 << 20), b""))
    finally:
        theirs.close()


@pytest.mark.parametrize(("qos", "dup"), [(0, False), (1, False), (1, True)], ids=["qos0", "qos1", "qos1-resent"])
def test_a_frame_goes_out_as_the_bytes_of_its_joined_message(qos, dup):
    data = wire.weights_bytes(np.arange(20_000, dtype=np.float32))
    frame = wire.encode_blob("weights", data, chunk_bytes=50_000, round=1, version=0).frames[1]
    assert isinstance(frame, wire.Frame) and len(frame) == len(bytes(frame))
    assert sent_bytes(frame, qos, dup) == sent_bytes(bytes(frame), qos, dup)


@settings(max_examples=300, deadline=None)
@given(topic=st.binary(max_size=40), qos=st.integers(0, 2), mid=st.integers(0, 65535),
       payload=st.binary(max_size=200), flags=st.integers(0, 15), cut=st.none() | st.integers(0, 50))
def test_the_decoder_agrees_with_paho_on_every_packet(topic, qos, mid, payload, flags, cut):
    header, packet = publish_packet(topic, qos, mid, payload)
    header |= flags & 0x09  # dup and retain bits
    if cut is not None:
        del packet[cut:]  # truncated: both must refuse it (or both read the same shorter message)
    ours = decoded(paho_buffers.decode_publish, header, bytearray(packet))
    assert ours == decoded(paho_buffers._original_decode_publish, header, bytearray(packet))


def puback(decoder, packet: bytes, protocol: int):
    try:
        result = decoder(0x40, bytearray(packet), protocol)
    except mqtt.MalformedPacket:
        return "malformed"
    return result.mid, result.reason.value, result.reason.getName(), result.properties.json()


@settings(max_examples=200, deadline=None)
@given(packet=st.binary(max_size=6), protocol=st.sampled_from([mqtt.MQTTv31, MQTT311, mqtt.MQTTv5]))
def test_the_puback_decoder_agrees_with_paho_on_every_packet(packet, protocol):
    assert puback(paho_buffers.decode_puback, packet, protocol) == puback(paho_buffers._original_decode_puback,
                                                                          packet, protocol)


def test_a_received_payload_is_a_view_of_the_packet_and_a_queued_packet_a_view():
    header, packet = publish_packet(b"a/b", 1, 7, b"x" * 1000)
    result = paho_buffers.decode_publish(header, packet, MQTT311)
    assert isinstance(result.payload, memoryview) and result.payload.obj is packet and result.payload.readonly
    client = paho_buffers.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t", protocol=MQTT311)
    client._packet_queue(0x30, bytearray(b"packet"), 1, 1)
    assert isinstance(client._out_packet[0]["packet"], memoryview)


def read_in_place(payload: bytes | memoryview) -> bool:
    """A view of a body read in place when its packet is large enough, else of paho's own buffer."""
    large = len(payload) >= paho_buffers.IN_PLACE_BYTES
    return isinstance(payload, memoryview) and isinstance(payload.obj, paho_buffers._Body) == large


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_model_sized_blob_crosses_a_real_broker_both_ways_intact(tmp_path, tls):
    """Every chunk is read in place (each payload a view of an in-place body), over TLS too, where a read may stop
    part-way through a TLS record and resume."""
    weights = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)  # 12 MB: 13 chunks
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"),
                             tls=make_server_cert(tmp_path) if tls else None)
    with broker:
        coordinator = Link(broker_settings(broker, "coordinator", "pw-c"), "c",
                           subscriptions=[f"{topics.prefix('lab')}/dev/+/+"])
        device = Link(broker_settings(broker, "dev-a", "pw-a"), "dev-a",
                      subscriptions=topics.device_subscriptions("lab", "dev-a"))
        coordinator.start()
        device.start()
        try:
            # both listening before either publishes: a chunk that reaches the broker before the SUBSCRIBE is lost
            assert coordinator.wait_subscribed(LISTENING_S) and device.wait_subscribed(LISTENING_S)
            down = wire.encode_blob("weights", wire.weights_bytes(weights), round=1, version=0)
            for frame in down.frames:  # as frames (paho joins each into its packet); the update below as bytes
                coordinator.publish(topics.to_all("lab", "weights"), frame)
            reassembler = wire.Reassembler(max_blob_bytes=weights.nbytes)
            blob = None
            while blob is None:
                _, payload = next_message(device)
                assert read_in_place(payload)
                blob = reassembler.add("coordinator", wire.decode(payload))
            received = blob.weights(weights.size)
            np.testing.assert_array_equal(received, weights)
            up = wire.encode_blob("update", wire.weights_bytes(received), device="dev-a", round=1, task=0,
                                  model=down.id, num_samples=1, metrics={})
            for chunk in up.chunks:
                device.publish(topics.from_device("lab", "dev-a", "update"), chunk)
            reassembler, blob = wire.Reassembler(max_blob_bytes=weights.nbytes), None
            while blob is None:
                _, payload = next_message(coordinator)
                assert read_in_place(payload)
                blob = reassembler.add("dev-a", wire.decode(payload))
            assert blob.id == down.id == up.id
            np.testing.assert_array_equal(blob.weights(weights.size), weights)
        finally:
            device.stop()
            coordinator.stop()


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_packet_s_body_is_read_into_again_once_its_payload_is_dropped_never_while_it_is_held(tmp_path):
    """Three 200 KB messages through a real broker: the second arrives while the first one's payload is held, so
    it gets a body of its own and the first stays intact; with both dropped, the third reuses one of their bodies
    (PACKET_BUFFERS) and arrives intact."""
    rng = np.random.default_rng(2)
    sent = [rng.bytes(200_000) for _ in range(3)]
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    with broker:
        coordinator = Link(broker_settings(broker, "coordinator", "pw-c"), "c")
        device = Link(broker_settings(broker, "dev-a", "pw-a"), "dev-a",
                      subscriptions=topics.device_subscriptions("lab", "dev-a"))
        coordinator.start()
        device.start()
        try:
            assert device.wait_subscribed(LISTENING_S)
            topic = topics.to_all("lab", "weights")
            coordinator.publish(topic, sent[0])
            _, first = next_message(device)
            reused = paho_buffers.PACKET_BUFFERS.reused
            coordinator.publish(topic, sent[1])
            _, second = next_message(device)
            assert read_in_place(first) and read_in_place(second) and second.obj is not first.obj
            assert bytes(first) == sent[0] and bytes(second) == sent[1]
            bodies = {id(first.obj), id(second.obj)}  # both kept by the pool: their ids stay theirs
            del first, second
            coordinator.publish(topic, sent[2])
            _, third = next_message(device)
            assert paho_buffers.PACKET_BUFFERS.reused > reused and id(third.obj) in bodies
            assert bytes(third) == sent[2]
        finally:
            device.stop()
            coordinator.stop()


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_only_a_qos1_message_s_acknowledgement_is_told_and_a_qos0_publish_builds_no_callback_objects(tmp_path):
    """Through a real broker: `acknowledge_to`'s callback hears the ids of the QoS 1 messages, each once, and never
    a QoS 0 one's (paho's on_publish heard those too, as if acknowledged: a Link kept each id); no `on_publish` is
    set, so paho makes no ReasonCode or Properties for a QoS 0 publish written."""
    paho_buffers.install()
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    with broker:
        client = paho_buffers.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dev-a", protocol=MQTT311)
        client.username_pw_set("dev-a", "pw-a")
        heard: list[int] = []
        client.acknowledge_to(heard.append)
        assert client.on_publish is None
        made = []
        real_init = paho_buffers.Properties.__init__

        def counted(properties, *args, **kwargs):
            made.append(args)
            real_init(properties, *args, **kwargs)

        connected = threading.Event()
        client.on_connect = lambda *args: connected.set()
        client.connect(broker.address.host, broker.address.port)
        client.loop_start()
        try:
            assert connected.wait(LISTENING_S)  # the CONNACK (which makes a Properties) read before the count starts
            paho_buffers.Properties.__init__ = counted  # type: ignore[method-assign]
            topic = topics.from_device("lab", "dev-a", "status")
            sent = [client.publish(topic, b"x", qos=qos) for qos in (0, 1, 0, 0, 1, 1, 0)]
            for info in sent:
                info.wait_for_publish(LISTENING_S)
            assert all(info.is_published() for info in sent)
            assert sorted(heard) == sorted(info.mid for info, qos in zip(sent, (0, 1, 0, 0, 1, 1, 0)) if qos)
            assert made == []  # neither for the QoS 0 publishes nor for the PUBACKs (decode_puback's constants)
        finally:
            paho_buffers.Properties.__init__ = real_init  # type: ignore[method-assign]
            client.loop_stop()
            client.disconnect()


def test_a_client_connects_without_binding_unless_a_local_address_is_asked_for(monkeypatch):
    """A bind before a connect takes a local port for every destination at once, from the ephemeral range alone: a
    host ran out at 28,000 connections (paho_buffers). The kernel picks the port at connect time instead, unless the
    client was given a local address to bind."""
    bound: list[object] = []
    real_bind = socket.socket.bind
    monkeypatch.setattr(socket.socket, "bind", lambda sock, address: bound.append(address) or real_bind(sock, address))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for bind_address, binds in (("", []), ("127.0.0.1", [("127.0.0.1", 0)])):
            bound.clear()
            client = paho_buffers.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t", protocol=MQTT311)
            assert client.connect("127.0.0.1", port, bind_address=bind_address) == mqtt.MQTT_ERR_SUCCESS
            try:
                assert client.socket().getpeername() == ("127.0.0.1", port)
                assert bound == binds
            finally:
                client.socket().close()
