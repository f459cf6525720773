"""Messages as a sender lays them out but unchecked (edgefil/wire.py checks what it writes): for tests that build
or mutate payloads by hand. A chunk (a message with bytes `data`) is framed: 0xC1, the length of its fields'
msgpack map (u32, little-endian), the map, the raw bytes; anything else is one msgpack map (a non-bytes `data`
stays in the map, which the decoder refuses)."""
from __future__ import annotations

from typing import Any

import msgpack

from edgefil import wire


def pack(message: dict[str, Any]) -> bytes:
    data = message.get("data")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return msgpack.packb(message, use_bin_type=True)
    header = msgpack.packb({k: v for k, v in message.items() if k != "data"}, use_bin_type=True)
    return wire.FRAMED + len(header).to_bytes(4, "little") + header + bytes(data)


def unpack(payload: bytes) -> dict[str, Any]:
    """The fields of a well-formed payload, unchecked (a chunk's data as bytes)."""
    if payload[:1] != wire.FRAMED:
        return msgpack.unpackb(payload, raw=False)
    length = int.from_bytes(payload[1:5], "little")
    return {**msgpack.unpackb(payload[5:5 + length], raw=False), "data": payload[5 + length:]}
