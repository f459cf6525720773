"""paho-mqtt without its copies of large messages.

Every model of every round crosses paho on both sides in ~1 MB messages, and paho 2.x copies them more than it
must:
- reading a PUBLISH, its decoder slices the packet three times with struct.unpack (the packet after the topic
  length, the rest after the topic, the rest after the message id): three copies of the payload;
- writing, each try of a partial socket write slices the unsent rest of the packet: on a busy socket a 1 MB
  packet was copied once per try.

`Client` queues each outgoing packet as a memoryview, so a retried write slices a view. `install()` replaces paho's
PUBLISH decoder with one that returns the payload as a memoryview of the packet buffer (paho starts a new buffer
for the next packet, so the view stays valid for as long as the message is kept). Consumers read payloads as
`bytes | memoryview` (wire.decode does). Both rely on paho internals: each is checked against what paho ships
(tests/test_paho_buffers.py) and applied only where those internals have the shape they were written for; with
another paho, paho runs as shipped.
"""
from __future__ import annotations

import inspect
from typing import Any

import paho.mqtt.client as mqtt

try:
    from paho.mqtt import _packet
except ImportError:  # paho < 2.2 decodes inside the client class: not patched
    _packet = None  # type: ignore[assignment]

_PUBLISH_FIELDS = ("dup", "qos", "retain", "topic", "mid", "properties", "payload")
_QUEUE_PARAMETERS = ["self", "command", "packet", "mid", "qos", "info"]


def decode_publish(header: int, packet: bytes | bytearray, protocol: Any) -> Any:
    """paho's `decode_publish` for MQTT 3.1.x without copying the payload (MQTT 5 goes to paho's own)."""
    if protocol == mqtt.MQTTv5 and _original_decode_publish is not None:
        return _original_decode_publish(header, packet, protocol)
    view = memoryview(packet).toreadonly()  # consumers read it (and may hash it, as bytes), never write
    if len(view) < 2:
        raise mqtt.MalformedPacket("PUBLISH shorter than its topic length")
    end = 2 + int.from_bytes(view[:2], "big")
    qos = (header & 0x06) >> 1
    if len(view) < end + (2 if qos else 0):
        raise mqtt.MalformedPacket("PUBLISH shorter than its topic and message id")
    topic = bytes(view[2:end])
    if not topic:
        raise mqtt.MalformedPacket("topic can't be empty in MQTTv3")
    mid = 0
    if qos:
        mid, end = int.from_bytes(view[end:end + 2], "big"), end + 2
    return _packet.PublishPacket(dup=bool(header & 0x08), qos=qos, retain=bool(header & 0x01), topic=topic,
                                 mid=mid, properties=None, payload=view[end:])  # type: ignore[arg-type]


_original_decode_publish = getattr(_packet, "decode_publish", None)


def decoder_fits() -> bool:
    """paho has the PUBLISH decoder this replaces, with the result it builds."""
    return _original_decode_publish is not None and getattr(_packet.PublishPacket, "_fields", ()) == _PUBLISH_FIELDS


def queue_fits() -> bool:
    """paho queues outgoing packets through `_packet_queue(command, packet, mid, qos, info)`."""
    queue = getattr(mqtt.Client, "_packet_queue", None)
    return queue is not None and list(inspect.signature(queue).parameters) == _QUEUE_PARAMETERS


def install() -> bool:
    """Use `decode_publish` for every paho client in this process (idempotent); False where paho differs."""
    if not decoder_fits():
        return False
    _packet.decode_publish = decode_publish
    return True


class Client(mqtt.Client):
    """A paho client whose queued packets are memoryviews: a partial write's retry slices a view, not a copy."""

    if queue_fits():
        def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int,
                          info: mqtt.MQTTMessageInfo | None = None) -> mqtt.MQTTErrorCode:
            return super()._packet_queue(command, memoryview(packet), mid, qos, info)  # type: ignore[arg-type]
