"""paho-mqtt without its copies of large messages, and without its bind before a connect.

Every model of every round crosses paho on both sides in ~1 MB messages, and paho 2.x copies them more than it
must:
- reading a PUBLISH, its decoder slices the packet three times with struct.unpack (the packet after the topic
  length, the rest after the topic, the rest after the message id): three copies of the payload;
- writing, each try of a partial socket write slices the unsent rest of the packet: on a busy socket a 1 MB
  packet was copied once per try;
- reading a packet's body, each socket read allocates a buffer of the whole rest (1 MB, then shrunk) and appends
  what it got to a growing bytearray: every byte copied once more, plus the growth's reallocations;
- publishing, it takes the payload as one bytes object, which it then copies into the packet: a blob's chunk
  messages, which the codec can leave as their head and a view of the blob (`wire.Frame`), had to be laid out in
  full first, every chunk of the blob at once, in fresh memory.

`Client` queues each outgoing packet as a memoryview, so a retried write slices a view; it reads the body of a
packet of `IN_PLACE_BYTES` or more with `recv_into` straight into a buffer of the packet's size (the length paho
has just decoded; one an earlier packet used when nothing refers to it any more, `PACKET_BUFFERS`), handing paho
the count of bytes it read in place of them; it publishes a payload
given as parts (an object with `parts()`, like `wire.Frame`) by joining its parts straight into the packet when
paho builds it, which for a message beyond the in-flight window is when the window frees: paho keeps the parts,
never their joined copy. `install()` replaces paho's PUBLISH decoder with one that returns the payload as a
memoryview of the packet buffer (paho starts a new buffer for the next packet, so the view stays valid for as long
as the message is kept), and lets a payload given as parts through paho's `publish` (whose `_encode_payload` takes
bytes only). Consumers read payloads as `bytes | memoryview` (wire.decode does). All rely on paho internals: each
is checked against what paho ships (tests/test_paho_buffers.py) and applied only where those internals have the
shape they were written for; with another paho, paho runs as shipped (and a Link joins a frame itself).

Two costs that are not copies but paho 2.2's MQTT 5 objects on MQTT 3.1.1, where they are always the same: for every
PUBACK it decodes, a `ReasonCode` and a `Properties` (34 us here), and for every QoS 0 publish it writes, the same
two again for an `on_publish` callback that is set (38 us). `install()` replaces paho's PUBACK decoder with one that
returns paho's Success and empty properties as shared constants (`PUBACK_REASON`, `PUBACK_PROPERTIES`: read them,
never change them), and `Client.acknowledge_to(callback)` has the callback told the id of each acknowledged QoS 1 or
2 message (from paho's `_do_on_publish`) with no `on_publish` set: paho then builds nothing and calls nothing for a
QoS 0 publish. A Link counted each QoS 0 publish's callback as an acknowledgement that came early, and kept its
message id until paho gave that id to a QoS 1 message 65,535 messages later (edgefil/link.py).

And one habit that is not about copies, but a fleet's: paho hands `socket.create_connection` a source address of
("", 0) even where none was asked for, and Python then binds the socket before connecting it. A bind picks the
local port from the ephemeral range alone (28,232 ports by default) and for every destination at once, so a host's
clients could hold no more than that many connections whatever the brokers, and the kernel's search for a free
port (`inet_csk_get_port`) took both cores of the host as the range filled: a 100,000-device fleet stalled at
28,000 connections (docs/results.md). `Client` connects without a bind where no local address was asked for: the
kernel then picks the port at connect time, for that destination (a port free for one broker's address serves
another's too).
"""
from __future__ import annotations

import inspect
import socket
import ssl
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgefil.buffers import BufferPool

try:
    from paho.mqtt import _packet
except ImportError:  # paho < 2.2 decodes inside the client class: not patched
    _packet = None  # type: ignore[assignment]

_PUBLISH_FIELDS = ("dup", "qos", "retain", "topic", "mid", "properties", "payload")
_SEND_PUBLISH_PARAMETERS = ["self", "mid", "topic", "payload", "qos", "retain", "dup", "info", "properties"]
_QUEUE_PARAMETERS = ["self", "command", "packet", "mid", "qos", "info"]
_ON_PUBLISH_PARAMETERS = ["self", "mid", "reason_code", "properties"]
# paho's body loop in `_packet_read`, which the in-place read stands in for: it asks for the rest of the body and
# appends what it got, taking only its length besides
_BODY_LOOP = ("data = self._sock_recv(self._in_packet['to_process'])", "self._in_packet['to_process'] -= len(data)",
              "self._in_packet['packet'] += data")
IN_PLACE_BYTES = 64 * 1024  # smaller packets (acknowledgements, statuses, small models) are read as paho does
# The bodies read in place are kept for reuse, PACKET_BUFFER_POOL_BYTES of them a process at most (edgefil/buffers.py):
# a zeroed 1 MB bytearray for every packet was a page fault per 4 KiB wherever glibc had returned the memory.
PACKET_BUFFER_POOL_BYTES = 32 << 20


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


def decode_puback(header: int, packet: bytes | bytearray, protocol: Any) -> Any:
    """paho's `decode_puback` for MQTT 3.1.x, whose PUBACK is a message id and nothing more: its reason and
    properties are the shared `PUBACK_REASON` and `PUBACK_PROPERTIES` (MQTT 5 goes to paho's own)."""
    if protocol == mqtt.MQTTv5 and _original_decode_puback is not None:
        return _original_decode_puback(header, packet, protocol)
    if len(packet) != 2:
        raise mqtt.MalformedPacket("wrong size of packet")
    return _packet.PubackPacket(mid=int.from_bytes(packet, "big"), reason=PUBACK_REASON, properties=PUBACK_PROPERTIES)


_original_decode_puback = getattr(_packet, "decode_puback", None)
# What every MQTT 3.1.x PUBACK says, made once: paho's ReasonCode (Success) and Properties (empty) for a PUBACK
PUBACK_REASON = ReasonCode(PacketTypes.PUBACK)
PUBACK_PROPERTIES = Properties(PacketTypes.PUBACK)


def puback_decoder_fits() -> bool:
    """paho has the PUBACK decoder this replaces, with the result it builds."""
    return (_original_decode_puback is not None
            and getattr(_packet.PubackPacket, "_fields", ()) == ("mid", "reason", "properties"))


def acknowledgements_fit() -> bool:
    """paho hands the acknowledgement of a QoS 1 or 2 message to `_do_on_publish(mid, reason_code, properties)`."""
    handler = getattr(mqtt.Client, "_do_on_publish", None)
    return handler is not None and list(inspect.signature(handler).parameters) == _ON_PUBLISH_PARAMETERS


def decoder_fits() -> bool:
    """paho has the PUBLISH decoder this replaces, with the result it builds."""
    return _original_decode_publish is not None and getattr(_packet.PublishPacket, "_fields", ()) == _PUBLISH_FIELDS


def queue_fits() -> bool:
    """paho queues outgoing packets through `_packet_queue(command, packet, mid, qos, info)`."""
    queue = getattr(mqtt.Client, "_packet_queue", None)
    return queue is not None and list(inspect.signature(queue).parameters) == _QUEUE_PARAMETERS


def connect_fits() -> bool:
    """paho opens a TCP connection in `_create_socket_connection`, from `_host`, `_port`, `_connect_timeout`,
    `_bind_address`, `_bind_port` and a proxy from `_get_proxy`."""
    opener = getattr(mqtt.Client, "_create_socket_connection", None)
    if opener is None or not hasattr(mqtt.Client, "_get_proxy"):
        return False
    source = inspect.getsource(opener)
    return all(name in source for name in ("self._bind_address", "self._bind_port", "self._connect_timeout",
                                              "source_address="))


def read_fits() -> bool:
    """paho reads a packet's body in the loop `_BODY_LOOP` quotes, through `_sock_recv`, into `_in_packet`."""
    read = getattr(mqtt.Client, "_packet_read", None)
    if read is None or not hasattr(mqtt.Client, "_sock_recv"):
        return False
    source = inspect.getsource(read)
    return all(line in source for line in _BODY_LOOP)


class _Body(bytearray):
    """A packet body allocated at its full size and filled in place: paho's `packet += data` then gets the
    `_Count` of bytes already there, and adds nothing. Made with room to spare (its `capacity`), so that a later
    packet of about the same size reuses it (`PACKET_BUFFERS`), resized by `fit` within the memory it has."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.capacity = capacity

    def fit(self, size: int) -> _Body:
        """This body, `size` bytes long (at most its capacity, at least half of it: CPython then resizes a bytearray
        in place, without reallocating). The bytes are left from before: the read overwrites them."""
        if size > len(self):
            self.extend(bytes(size - len(self)))
        elif size < len(self):
            del self[size:]
        return self

    def __iadd__(self, received: Any) -> _Body:  # type: ignore[misc]  # takes a _Count, unlike __add__
        if not isinstance(received, _Count):
            raise TypeError(f"a packet read in place was given {type(received).__name__}")
        return self


class _Count:
    """What an in-place read hands paho instead of the bytes: their number (paho takes only `len` of it)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


PACKET_BUFFERS: BufferPool[_Body] = BufferPool(_Body, PACKET_BUFFER_POOL_BYTES, IN_PLACE_BYTES)


def parts_fit() -> bool:
    """paho checks a payload with the module's `_encode_payload` and builds a PUBLISH in
    `_send_publish(mid, topic, payload, qos, retain, dup, info, properties)` with `_pack_remaining_length`."""
    send = getattr(mqtt.Client, "_send_publish", None)
    return (callable(getattr(mqtt, "_encode_payload", None)) and send is not None
            and list(inspect.signature(send).parameters) == _SEND_PUBLISH_PARAMETERS
            and hasattr(mqtt.Client, "_pack_remaining_length") and queue_fits())


def _is_parts(payload: Any) -> bool:
    return callable(getattr(payload, "parts", None)) and not isinstance(payload, (bytes, bytearray, str))


def _encode_payload(payload: Any) -> Any:
    """paho's `_encode_payload`, letting a payload given as parts through as it is."""
    return payload if _is_parts(payload) else _original_encode_payload(payload)


_original_encode_payload: Any = getattr(mqtt, "_encode_payload", None)


def install() -> bool:
    """Use `decode_publish` and `decode_puback` for every paho client in this process, and let `Client` publish
    payloads given as parts (idempotent); False where paho's PUBLISH decoder differs (then a caller joins parts
    itself: `publishes_parts`)."""
    if parts_fit():
        mqtt._encode_payload = _encode_payload
    if puback_decoder_fits():
        _packet.decode_puback = decode_puback
    if not decoder_fits():
        return False
    _packet.decode_publish = decode_publish
    return True


def publishes_parts() -> bool:
    """Whether `Client.publish` takes a payload given as parts (after `install`)."""
    return getattr(mqtt, "_encode_payload", None) is _encode_payload


class Client(mqtt.Client):
    """A paho client whose queued packets are memoryviews (a partial write's retry slices a view, not a copy),
    whose large packets are read in place, and which tells `acknowledge_to`'s callback of each acknowledged QoS 1 or 2
    message without paho's `on_publish`."""

    _on_acknowledged: Callable[[int], None] | None = None

    def acknowledge_to(self, callback: Callable[[int], None]) -> None:
        """Call `callback(mid)` on the network thread when the broker acknowledges a QoS 1 or 2 message. Where paho
        differs from what `acknowledgements_fit` checks, through paho's `on_publish`, which also calls it for every
        QoS 0 publish written."""
        self._on_acknowledged = callback
        if not acknowledgements_fit():
            self.on_publish = lambda client, userdata, mid, reason_code, properties: callback(mid)

    if acknowledgements_fit():
        def _do_on_publish(self, mid: int, reason_code: Any, properties: Any) -> mqtt.MQTTErrorCode:
            if self._on_acknowledged is not None:
                self._on_acknowledged(mid)
            return super()._do_on_publish(mid, reason_code, properties)

    if queue_fits():
        def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int,
                          info: mqtt.MQTTMessageInfo | None = None) -> mqtt.MQTTErrorCode:
            return super()._packet_queue(command, memoryview(packet), mid, qos, info)  # type: ignore[arg-type]

    if parts_fit():
        def _send_publish(self, mid: int, topic: bytes, payload: Any = b"", qos: int = 0, retain: bool = False,
                          dup: bool = False, info: mqtt.MQTTMessageInfo | None = None,
                          properties: Any = None) -> mqtt.MQTTErrorCode:
            """paho's PUBLISH (MQTT 3.1.x) for a payload given as parts: the fixed and variable header, then the
            parts, joined once into the packet (MQTT 5, and payloads as bytes, go to paho's own)."""
            if not _is_parts(payload):
                return super()._send_publish(mid, topic, payload, qos, retain, dup, info, properties)
            if self._protocol == mqtt.MQTTv5:
                return super()._send_publish(mid, topic, bytes(payload), qos, retain, dup, info, properties)
            if self._sock is None:
                return mqtt.MQTT_ERR_NO_CONN
            header = bytearray((mqtt.PUBLISH | ((dup & 0x1) << 3) | (qos << 1) | retain,))
            self._pack_remaining_length(header, 2 + len(topic) + (2 if qos else 0) + len(payload))
            header += len(topic).to_bytes(2, "big") + topic
            if qos:
                header += mid.to_bytes(2, "big")
            return self._packet_queue(mqtt.PUBLISH, b"".join((header, *payload.parts())), mid, qos, info)

    if connect_fits():
        def _create_socket_connection(self) -> socket.socket:
            """paho's TCP connection, bound first only where a local address or port was asked for (the module
            docstring: an unasked bind ran a host out of ephemeral ports)."""
            if self._bind_address or self._bind_port or self._get_proxy():
                return super()._create_socket_connection()
            return socket.create_connection((self._host, self._port), timeout=self._connect_timeout)

    if read_fits():
        def _sock_recv(self, bufsize: int) -> Any:
            incoming = self._in_packet
            size = incoming["remaining_length"]
            if size < IN_PLACE_BYTES or not incoming["have_remaining"] or bufsize != incoming["to_process"]:
                return super()._sock_recv(bufsize)  # a small packet, or a header byte
            recv_into = getattr(self._sock, "recv_into", None)
            if recv_into is None:  # a websocket
                return super()._sock_recv(bufsize)
            body = incoming["packet"]
            if not isinstance(body, _Body):  # the body's first read: paho's fresh, empty buffer
                body = incoming["packet"] = PACKET_BUFFERS.take(size).fit(size)
            try:
                return _Count(recv_into(memoryview(body)[size - bufsize:]))
            except ssl.SSLWantReadError as err:  # as paho's own `_sock_recv` maps them
                raise BlockingIOError() from err
            except ssl.SSLWantWriteError as err:
                self._call_socket_register_write()
                raise BlockingIOError() from err
