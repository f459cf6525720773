"""TensorBoard event files, written without TensorBoard: scalars per step, in the format its reader loads.

An event file is a sequence of TFRecords (a little-endian uint64 length, its masked CRC32C, the bytes, their masked
CRC32C), each holding one `Event` protocol buffer: the first names the file version, the others carry a `Summary`
of tagged scalars at a step. The few fields needed are encoded here by hand (protobuf's wire format: a key of field
number and wire type, then a varint, a fixed 64-bit double, a fixed 32-bit float or length-delimited bytes), so the
coordinator needs neither TensorBoard nor TensorFlow; `tests/test_run_logs.py` checks the file with TensorBoard's
own `EventAccumulator`.

The file's bytes are a function of the scalars and their wall times alone, so rewriting it whole after each round
(as `run_logs` does, which makes a resumed run's log whole again) only ever appends to what a watching TensorBoard
has read.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import google_crc32c

FILE_VERSION = b"brain.Event:2"
_MASK_DELTA = 0xA282EAD8


def _masked_crc(data: bytes) -> bytes:
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    """Event{wall_time = 1 (double), step = 2 (int64), body: file_version = 3 or summary = 5}."""
    return _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step) + body


def _summary(scalars: Mapping[str, float]) -> bytes:
    """Summary{repeated Value value = 1}, Value{tag = 1 (string), simple_value = 2 (float)}."""
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
        for tag, value in scalars.items()
    )
    return _bytes_field(5, values)


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + _masked_crc(length) + data + _masked_crc(data)


def event_file(steps: Iterable[tuple[int, float, Mapping[str, float]]], started: float) -> bytes:
    """The bytes of an event file: the version event at `started`, then each (step, wall time, scalars)."""
    parts = [record(_event(started, 0, _bytes_field(3, FILE_VERSION)))]
    parts += [record(_event(wall_time, step, _summary(scalars))) for step, wall_time, scalars in steps if scalars]
    return b"".join(parts)
