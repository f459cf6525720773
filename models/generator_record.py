"""One stored class generator: the record and its byte format (numpy only).

Byte layout (little-endian throughout; every section starts at a multiple of 4):

    offset  size  field
    0       4     magic b"EFGN"
    4       4     uint32 format version (1)
    8       8     int64 label
    16      8     int64 trained_samples
    24      8     int64 steps
    32      8     int64 sampler length (values)
    40      8     int64 auxiliary length (values), -1 when no auxiliary model is kept
    48      4     uint32 header length H
    52      H     JSON header, UTF-8, sorted keys: {"precision": ..., "spec": ...}, padded with spaces to 4n
    52+H    ...   the sampler array, then the auxiliary array, each encoded as below and zero-padded to 4n
    end-4   4     uint32 CRC-32 of every byte before it

An array of n values: float32 -> n * 4 bytes; float16 -> n * 2 bytes; int8 -> ceil(n / 1024) float32 scales, then
n int8 values. int8 is symmetric per block of 1024 values: scale = max|v| / 127 (0 for an all-zero block),
q = round(v / scale) in [-127, 127], value = q * scale. Errors: float16 rounds to 11 significant bits (relative
error <= 2**-11 in the normal range); int8 is off by at most scale / 2 = max|v| / 254 of its block.

The integers sit in fixed-width fields so that `encoded_size` depends only on the spec, the precision and the
lengths. `decode_record` checks everything it can without torch: magic, version, checksum, lengths against the
payload, precision, finite values. Whether the lengths fit the spec's architecture needs torch to count a spec's
parameters, so the caller knows it: a receiver that knows which generators it expects passes their
`RecordLayout`s (`expected`), and a record of another spec, or whose lengths are not that spec's, is refused from
its fixed header, before any array is decoded or anything is built from it (the coordinator's pFedGRP, for records
devices send); the device's sampler and trainers compare a record with generator.json's sizes.
"""
from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

PRECISIONS = ("float32", "float16", "int8")
MAGIC = b"EFGN"
FORMAT_VERSION = 1
INT8_BLOCK = 1024
MAX_HEADER_BYTES = 1 << 16  # a spec's JSON is a few hundred bytes
_FIXED = struct.Struct("<4sIqqqqqI")  # magic, version, label, trained_samples, steps, sampler, auxiliary, H
_CRC = struct.Struct("<I")


class GeneratorFormatError(ValueError):
    """Bytes that are not a valid generator record: foreign, truncated, damaged, or inconsistent."""


@dataclass(frozen=True)
class RecordLayout:
    """A generator a receiver expects: its spec (`GeneratorSpec.to_dict()`) and the lengths of its flat buffers."""

    spec: dict[str, Any]
    sampler_size: int
    auxiliary_size: int


@dataclass(frozen=True, eq=False)
class GeneratorRecord:
    """A class's generator as a device keeps it. `sampler`/`auxiliary` hold the values at `precision`,
    already dequantized (float32), so what a device samples from or trains on is exactly what it stored."""

    label: int
    spec: dict[str, Any]  # GeneratorSpec.to_dict()
    precision: str
    sampler: np.ndarray
    auxiliary: np.ndarray | None  # critic / encoder for warm starts; None when not kept
    trained_samples: int  # real samples it has been trained on so far
    steps: int  # optimisation steps so far


def _pad4(n: int) -> int:
    return -n % 4


def _array_bytes(n: int, precision: str) -> int:
    if precision == "float32":
        size = 4 * n
    elif precision == "float16":
        size = 2 * n
    else:
        size = 4 * math.ceil(n / INT8_BLOCK) + n
    return size + _pad4(size)


def _header(spec: dict[str, Any], precision: str) -> bytes:
    text = json.dumps({"precision": precision, "spec": spec}, sort_keys=True, separators=(",", ":"))
    data = text.encode()
    return data + b" " * _pad4(len(data))


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")


def encoded_size(spec_dict: dict[str, Any], precision: str, sampler_len: int, auxiliary_len: int | None) -> int:
    """The exact length of `encode_record` for a record of this spec, precision and array lengths."""
    _check_precision(precision)
    arrays = _array_bytes(sampler_len, precision) + (0 if auxiliary_len is None else
                                                     _array_bytes(auxiliary_len, precision))
    return _FIXED.size + len(_header(spec_dict, precision)) + arrays + _CRC.size


def _encode_array(values: np.ndarray, precision: str) -> bytes:
    if precision == "float32":
        data = values.astype("<f4").tobytes()
    elif precision == "float16":
        with np.errstate(over="ignore"):
            half = values.astype("<f2")
        if not np.isfinite(half).all():
            raise ValueError("values beyond float16's range (65504) cannot be stored at float16")
        data = half.tobytes()
    else:
        scales, q = _int8_quantize(values)
        data = scales.astype("<f4").tobytes() + q.tobytes()
    return data + b"\0" * _pad4(len(data))


def _int8_quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(values)
    padded = np.zeros(math.ceil(n / INT8_BLOCK) * INT8_BLOCK, dtype=np.float64)
    padded[:n] = values
    blocks = padded.reshape(-1, INT8_BLOCK)
    scales = (np.abs(blocks).max(axis=1) / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float64)[:, None]
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    return scales, q.ravel()[:n]


def _decode_array(data: memoryview, n: int, precision: str) -> np.ndarray:
    if precision == "float32":
        return np.frombuffer(data, dtype="<f4", count=n).astype(np.float32)
    if precision == "float16":
        return np.frombuffer(data, dtype="<f2", count=n).astype(np.float32)
    blocks = math.ceil(n / INT8_BLOCK)
    scales = np.frombuffer(data, dtype="<f4", count=blocks)
    q = np.frombuffer(data, dtype=np.int8, count=n, offset=4 * blocks)
    return (q.astype(np.float32) * np.repeat(scales, INT8_BLOCK)[:n]).astype(np.float32)


def _check_array(name: str, values: np.ndarray) -> np.ndarray:
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype != np.float32:
        raise ValueError(f"{name} must be a 1-D float32 array")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} holds NaN or Inf")
    return values


def encode_record(record: GeneratorRecord) -> bytes:
    """The record's bytes at `record.precision` (layout in the module docstring)."""
    _check_precision(record.precision)
    arrays = [_check_array("sampler", record.sampler)]
    if record.auxiliary is not None:
        arrays.append(_check_array("auxiliary", record.auxiliary))
    header = _header(record.spec, record.precision)
    aux_len = -1 if record.auxiliary is None else len(record.auxiliary)
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, record.label, record.trained_samples, record.steps,
                       len(record.sampler), aux_len, len(header)) + header
    body += b"".join(_encode_array(a, record.precision) for a in arrays)
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(data: bytes, expected: Sequence[RecordLayout] | None = None) -> GeneratorRecord:
    """Parse and verify `encode_record` bytes; anything wrong raises GeneratorFormatError, and only that: records
    arrive from devices, so whatever else a hostile one provokes (a header nested past the recursion limit, values
    of the wrong type deep in the spec) is refused the same way. With `expected`, a record must be of one of those
    layouts (its spec, its sampler's length, its auxiliary model's or none), checked before its arrays are read."""
    try:
        return _decode_record(data, expected)
    except GeneratorFormatError:
        raise
    except Exception as err:
        raise GeneratorFormatError(f"generator record is malformed ({type(err).__name__})") from None


def _check_layout(spec: dict[str, Any], n_sampler: int, aux_len: int | None,
                  expected: Sequence[RecordLayout]) -> None:
    layout = next((layout for layout in expected if layout.spec == spec), None)
    if layout is None:
        raise GeneratorFormatError(f"a generator of spec {json.dumps(spec)[:200]}, not one this fleet uses")
    if n_sampler != layout.sampler_size or aux_len not in (None, layout.auxiliary_size):
        raise GeneratorFormatError(f"a {spec.get('kind')} generator of {n_sampler} sampler and {aux_len} auxiliary "
                                   f"values; its spec has {layout.sampler_size} and {layout.auxiliary_size}")


def _decode_record(data: bytes, expected: Sequence[RecordLayout] | None) -> GeneratorRecord:
    view = memoryview(data)
    if len(view) < _FIXED.size + _CRC.size or len(view) % 4:
        raise GeneratorFormatError(f"{len(view)} bytes cannot be a generator record")
    magic, version, label, trained, steps, n_sampler, n_aux, header_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise GeneratorFormatError("not a generator record (bad magic)")
    if version != FORMAT_VERSION:
        raise GeneratorFormatError(f"generator record format {version}; this edgefil reads {FORMAT_VERSION}")
    if _CRC.unpack_from(view, len(view) - _CRC.size)[0] != zlib.crc32(view[: len(view) - _CRC.size]):
        raise GeneratorFormatError("generator record checksum mismatch")
    if n_sampler < 1 or n_aux < -1 or trained < 0 or steps < 0 or header_len % 4 or \
            header_len > MAX_HEADER_BYTES or _FIXED.size + header_len > len(view) - _CRC.size:
        raise GeneratorFormatError("generator record has impossible lengths or counts")
    try:
        header = json.loads(bytes(view[_FIXED.size : _FIXED.size + header_len]).decode())
        precision, spec = header["precision"], header["spec"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise GeneratorFormatError(f"generator record header is malformed: {type(e).__name__}") from None
    if precision not in PRECISIONS or not isinstance(spec, dict):
        raise GeneratorFormatError(f"generator record header names precision {precision!r}, spec {spec!r}")
    aux_len = None if n_aux == -1 else n_aux
    if len(view) != encoded_size(spec, precision, n_sampler, aux_len):
        raise GeneratorFormatError("generator record length does not match its declared array lengths")
    if expected is not None:
        _check_layout(spec, n_sampler, aux_len, expected)
    offset = _FIXED.size + header_len
    arrays = []
    for n in (n_sampler,) if aux_len is None else (n_sampler, aux_len):
        size = _array_bytes(n, precision)
        chunk = view[offset : offset + size]
        values = _decode_array(chunk, n, precision)
        if not np.isfinite(values).all():
            raise GeneratorFormatError("generator record holds NaN or Inf")
        arrays.append(values)
        offset += size
    return GeneratorRecord(label=label, spec=spec, precision=precision, sampler=arrays[0],
                           auxiliary=arrays[1] if aux_len is not None else None, trained_samples=trained, steps=steps)


def quantize(record: GeneratorRecord, precision: str) -> GeneratorRecord:
    """The record with its arrays replaced by their values stored at `precision` (what `get` would return)."""
    return decode_record(encode_record(replace(record, precision=precision)))


# --- how generator replay names its records in an update's attachments and in requests ------------------------
ATTACHMENT_PREFIX = "generator/"
_ATTACHMENT = re.compile(r"generator/(0|[1-9][0-9]{0,5})")  # ASCII digits only: str.isdigit() takes others


def attachment_name(label: int) -> str:
    return f"{ATTACHMENT_PREFIX}{label}"


def attachment_label(name: str) -> int | None:
    """The class a `generator/<label>` attachment name stands for; None for any other name."""
    match = _ATTACHMENT.fullmatch(name)
    return int(match.group(1)) if match else None
