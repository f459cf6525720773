"""The protocol codec: the only place that knows the byte layout of messages (docs/protocol.md).

Every payload is one msgpack map with the schema version `v` and a `kind`, except a blob's chunks, which are
framed: the byte 0xC1 (which msgpack never uses), the length of a msgpack map of the chunk's fields (u32,
little-endian), that map, then the chunk's raw bytes. Weights travel as raw little-endian float32 bytes straight
from a trainer's flat buffer, in chunks of at most `MAX_MESSAGE_BYTES` per MQTT payload, each chunk carrying its
own CRC32C and the blob's id, the BLAKE3 hash of the whole blob. Framing lets a receiver read the chunk's bytes
where they arrived (a memoryview of the payload) and copy them once, into the blob's buffer at the chunk's offset;
inside a msgpack map they were copied out of the payload first. It also lets a sender keep a chunk as its head and
a view of the blob (`Frame`), laid out in one buffer only in the packet that sends it. `Reassembler` puts blobs
back together idempotently: duplicate or reordered chunks are harmless, and a blob is delivered once, whole and
verified.

The checks run at memory speed, because every byte of every model crosses them on both sides each round: a chunk's
CRC32C (hardware instructions on x86-64 and ARMv8: 16 GB/s here) catches a damaged chunk as it arrives, and the
blob's BLAKE3 (7 GB/s on one core here, SIMD on ARM too) is its identity, which the round message names and which
no device can forge. sha256, which schema 2 used for both, runs at 1.9 GB/s here with SHA extensions, and far
slower on a Raspberry Pi 4, whose cores have none.

Anything that does not match the schema raises `WireError` with a short `reason` the receiver counts.
Unknown extra fields are ignored (additions within a schema version stay compatible); a new `v` is refused.
"""
from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import google_crc32c
import msgpack
import numpy as np
from blake3 import blake3

from edgefil.buffers import BufferPool

# 2: named payloads (request names, payload and answer blobs) replace method-specific messages; 3: a chunk's CRC32C
# and the blob's BLAKE3 replace their sha256 digests
SCHEMA_VERSION = 3
# The payload limit of one message, chunk data and header included: under the 1 MB default packet limit of
# clustered brokers such as EMQX (the topic and MQTT header fit in the difference).
MAX_MESSAGE_BYTES = 1_000_000
CHUNK_HEADER_ROOM = 4_096  # what a chunk's fields other than its data may take
CHUNK_FIELDS_ROOM = 512  # of it, what a chunk's own fields take (blob id, offsets, CRC); the rest is the blob's
CHUNK_BYTES = MAX_MESSAGE_BYTES - CHUNK_HEADER_ROOM
MIN_CHUNK_BYTES = 1024  # every chunk but a blob's last carries at least this much (bounds the chunk count)
WEIGHTS_DTYPE = "<f4"
MAX_METRICS = 64
MAX_ATTACHMENTS = 256
MAX_NAME_CHARS = 128  # an attachment's or a requested payload's name
MAX_REQUEST_NAMES = 64  # payloads one request may ask for
MAX_TEXT_CHARS = 1000  # a free-text field: a status's error, a notice's detail, an instance id
_TEXT_FIELDS = ("error", "detail", "instance", "reason")
# The buffer msgpack packs a message into, to start with (it grows as a message needs). msgpack's own default is
# 256 KiB: above a fleet worker's mmap threshold (firmware_sim/fleet_worker.py), so every message a worker encoded
# was an mmap and a munmap, 4 us more than the pack itself (and a TLB shootdown across a worker's threads); a
# message's fields take a few hundred bytes.
PACK_BUFFER_BYTES = 4096

Message = dict[str, Any]


class WireError(ValueError):
    """A message that must not be used; `reason` is a short tag for counting (e.g. "malformed", "schema")."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# --- schemas --------------------------------------------------------------------------------------

_NUMBER = (int, float)
_CHUNK_FIELDS: Mapping[str, type | tuple[type, ...]] = {
    "blob": str,  # the blob's id (blob_id): BLAKE3 (hex) of its bytes
    "size": int,  # bytes of the whole blob
    "dtype": str,  # element type of the blob: WEIGHTS_DTYPE, or BLOB_DTYPES of its kind
    "index": int,
    "count": int,
    "offset": int,  # where this chunk's data goes in the blob
    "chunk_crc32c": int,  # CRC32C (Castagnoli) of this chunk's data
    "data": (bytes, memoryview),  # a view of the sender's buffer, and of the payload where it arrived
}
SCHEMAS: Mapping[str, Mapping[str, type | tuple[type, ...]]] = {
    # device -> coordinator
    "register": {"device": str, "profile": str, "backend": str, "manifest": str, "software": str},
    "status": {"device": str, "state": str, "round": int},
    "update": {
        **_CHUNK_FIELDS, "device": str, "round": int, "task": int, "model": str, "num_samples": int, "metrics": dict,
    },
    "request": {"device": str, "round": int, "names": list},  # these named payloads, please
    # coordinator -> device
    "round": {"round": int, "task": int, "model": str, "version": int, "deadline_s": _NUMBER, "config": dict},
    "weights": {**_CHUNK_FIELDS, "round": int, "version": int},
    "payload": {**_CHUNK_FIELDS, "round": int},  # named payloads for one device's round: attachments only
    "broadcast": {**_CHUNK_FIELDS, "round": int},  # named payloads for every device, kept by blob id: attachments only
    "answer": {**_CHUNK_FIELDS, "round": int},  # the answer to a request: attachments only
    "notice": {"reason": str, "detail": str},  # something the device's operator must know (e.g. duplicate-device)
    "end": {"outcome": str, "rounds": int},  # the run is over (retained on all/end; cleared when a run starts)
    # secure aggregation (edgefil/secagg.py, edge_client/secagg.py, coordinator/secagg.py), one session at a time:
    # device -> coordinator: its fresh public keys, commitment and update metadata; its shares, sealed for each
    # neighbour; its masked vector (a blob of uint32 words); what it reveals to unmask the sum
    "keys": {"device": str, "round": int, "session": str, "task": int, "model": str, "cipher_key": bytes,
             "mask_key": bytes, "commitment": bytes, "metrics": dict},
    "shares": {"device": str, "round": int, "session": str, "shares": dict},
    "masked": {**_CHUNK_FIELDS, "device": str, "round": int, "session": str},
    "reveal": {"device": str, "round": int, "session": str, "masks": dict, "keys": dict},
    # coordinator -> device: its neighbours ({id: [point, cipher_key, mask_key]}) and the session's size and
    # threshold; the shares its neighbours sealed for it; who survived the masking and who dropped
    "neighbours": {"round": int, "session": str, "count": int, "threshold": int, "index": int, "neighbours": dict},
    "relayed": {"round": int, "session": str, "shares": dict},
    "unmask": {"round": int, "session": str, "survivors": list, "dropped": list},
    # a site's aggregator (coordinator/site_aggregator.py) and the coordinator (coordinator/sites.py), on
    # site/<site>/<kind> over the site's bridge. coordinator -> site: the round (a blob: the global model, then the
    # attachments `plan`, `selected` and the fleet's path), and its close; site -> coordinator: whether its process is
    # up (retained; its will says "gone"), its word on each update it took or refused (the update's fields less its
    # weights), and its share of the round at the close (an attachments-only blob: `partial`, and the rule's arrays)
    "site-open": {**_CHUNK_FIELDS, "round": int, "task": int, "model": str, "manifest": str},
    "site-close": {"round": int},
    "site-state": {"site": str, "instance": str, "state": str},
    "site-heard": {"site": str, "instance": str, "device": str, "round": int, "task": int, "model": str,
                   "num_samples": int, "metrics": dict},
    "site-partial": {**_CHUNK_FIELDS, "site": str, "instance": str, "round": int},
}
# A blob's element type by kind (WEIGHTS_DTYPE for the rest): a masked vector is integers mod 2^32
BLOB_DTYPES: Mapping[str, str] = {"masked": "<u4"}
MAX_NEIGHBOURS = 1024  # a secure session's neighbourhood, at most
MAX_SEALED_BYTES = 1024  # one sealed or revealed share
# Optional fields, checked when present. `attachments`: [[name, length], ...] of byte strings that follow the
# weights in a blob (update, payload, broadcast, answer), each padded to 4 bytes. `payload`: the id of the payload
# blob a round message goes with (the device waits for it as for the weights); `broadcast`: the id of the broadcast
# blob it goes with (the device keeps it by id and waits for it only when it does not hold it). `label_counts`:
# samples seen per class (update); `trained_counts`: [[task, class, samples], ...] of what the update was trained
# on (the device's store; the guard's calibration reference compares the update on that mix, each part on the
# calibration samples of its task: a domain-incremental store holds a class in every domain it has seen).
# `task`: the task the global model's round trains (weights), so that a device not selected learns it too (a device
# that holds no data for it says so in its status and is not selected).
# `instance`: a random id of the device process (register, status): a restarted process has a new one, so an old
# one coming back means two processes share a device id. `error`: why a device cannot train (status "error").
# `task` (status "no-data"): the task the device holds no data for (it may hold some for a later one).
OPTIONAL: Mapping[str, Mapping[str, type | tuple[type, ...]]] = {
    "register": {"instance": str},
    "status": {"instance": str, "error": str, "task": int},
    "update": {"attachments": list, "label_counts": list, "trained_counts": list},
    "payload": {"attachments": list},
    "broadcast": {"attachments": list},
    "answer": {"attachments": list},
    "round": {"payload": str, "broadcast": str},
    "weights": {"task": int},
    "notice": {"instances": list},  # the device processes the notice is about (others ignore it)
    "site-open": {"attachments": list},
    "site-heard": {"reason": str, "label_counts": list},  # `reason`: why the site did not take the update
    "site-partial": {"attachments": list},
}
_PER_CHUNK = frozenset({"index", "count", "offset", "chunk_crc32c", "data"})
BLOB_KINDS = frozenset(kind for kind, schema in SCHEMAS.items() if "data" in schema)


FRAMED = b"\xc1"  # first byte of a framed chunk: msgpack's one never-used byte, so no map starts with it
_FRAME_HEAD = 5  # FRAMED and the header map's length


def encode(kind: str, _verify_chunk: bool = True, **fields: Any) -> bytes:
    """One message; checked against its schema so a sender cannot emit what a receiver would refuse. A blob's chunk
    is framed (module docstring): its `data` is copied once, into the payload."""
    if kind in BLOB_KINDS:
        return bytes(_frame(kind, _verify_chunk, fields))
    message = {"v": SCHEMA_VERSION, "kind": kind, **fields}
    _check_fields(message)
    payload = _packed(message)
    _check_size(kind, len(payload))
    return payload


def _packed(value: Any) -> bytes:
    """msgpack's bytes of `value`, packed from a buffer of PACK_BUFFER_BYTES that grows as it must."""
    return msgpack.packb(value, use_bin_type=True, buf_size=PACK_BUFFER_BYTES)


class Frame:
    """A blob's chunk message as its two parts: the framed head (FRAMED, the header's length, the header) and the
    chunk's data, a view of the blob, not a copy. `bytes(frame)` is the message `encode` makes. A Link hands a frame
    to paho as it is (edgefil/paho_buffers.py), which copies both parts into the packet it sends, when it sends it:
    the sender of a blob never holds a second copy of it as chunk messages, and the copy is made into memory the
    process reuses packet after packet rather than into fresh pages for the whole blob at once (44 MB of updates
    encoded at once cost 25 ms of page faults here; as frames, none). The data must not change until the frame is
    sent; if it did, the chunk's CRC32C, taken when it was framed, would refuse it at the receiver."""

    __slots__ = ("head", "data")

    def __init__(self, head: bytes, data: memoryview) -> None:
        self.head = head
        self.data = data

    def __len__(self) -> int:
        return len(self.head) + len(self.data)

    def __bytes__(self) -> bytes:
        return b"".join(self.parts())

    def parts(self) -> tuple[bytes, memoryview]:
        return self.head, self.data


def _frame(kind: str, verify_chunk: bool, fields: Mapping[str, Any]) -> Frame:
    message = {"v": SCHEMA_VERSION, "kind": kind, **fields}
    _check_fields(message, verify_chunk=verify_chunk)
    data = memoryview(message.pop("data")).cast("B")
    header = _packed(message)
    frame = Frame(b"".join((FRAMED, len(header).to_bytes(4, "little"), header)), data)
    _check_size(kind, len(frame))
    return frame


def _check_size(kind: str, size: int) -> None:
    if size > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"{kind} message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")


def decode(payload: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate one payload; raises WireError for anything that is not a well-formed message. A framed
    chunk's `data` is a memoryview of `payload` (no copy)."""
    if len(payload) > max_bytes:
        raise WireError("oversized", f"payload of {len(payload)} bytes exceeds {max_bytes}")
    view = memoryview(payload)
    framed = view[:1] == FRAMED
    if framed:
        length = int.from_bytes(view[1:_FRAME_HEAD], "little")
        if len(view) < _FRAME_HEAD + length:
            raise WireError("malformed", f"a framed header of {length} bytes in a payload of {len(view)}")
        view, data = view[_FRAME_HEAD:_FRAME_HEAD + length], view[_FRAME_HEAD + length:]
    message = _unpack_map(view, max_bytes)
    if message.get("v") != SCHEMA_VERSION:
        raise WireError("schema", f"schema version {message.get('v')!r}, this side speaks {SCHEMA_VERSION}")
    kind = message.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise WireError("kind", f"unknown message kind {kind!r:.80}")
    if framed != (kind in BLOB_KINDS) or "data" in message:
        raise WireError("malformed", f"a {kind} message {'is' if kind in BLOB_KINDS else 'is not'} a framed chunk "
                                     "(its raw data after its fields)")
    if framed:
        message["data"] = data
    _check_fields(message)
    return message


def chunks_of_blob(payload: bytes | bytearray | memoryview) -> int:
    """The `count` of a framed chunk's blob, read from its fields without the schema's checks (`decode` makes
    those): 1 for anything that is not such a chunk, which whoever decodes it then refuses. What tells a reader
    sharing a topic with others whether a blob's chunks must be brought together (coordinator/inbox_workers.py)."""
    view = memoryview(payload)
    if view[:1] != FRAMED or len(view) < _FRAME_HEAD:
        return 1
    length = int.from_bytes(view[1:_FRAME_HEAD], "little")
    try:
        count = _unpack_map(view[_FRAME_HEAD:_FRAME_HEAD + length], MAX_MESSAGE_BYTES).get("count", 1)
    except WireError:
        return 1
    return count if isinstance(count, int) and count > 1 else 1


def _unpack_map(view: memoryview, max_bytes: int) -> Message:
    try:
        message = msgpack.unpackb(
            view, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes,
            max_array_len=4096, max_map_len=4096, max_ext_len=0,
        )
    except Exception as err:  # msgpack raises several unrelated types for bad input
        raise WireError("malformed", f"not a msgpack message ({type(err).__name__})") from None
    if not isinstance(message, dict):
        raise WireError("malformed", f"payload is a msgpack {type(message).__name__}, not a map")
    return message


def _check_fields(message: Message, verify_chunk: bool = True) -> None:
    kind = message.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise WireError("kind", f"unknown message kind {kind!r}")
    for name, expected in SCHEMAS[kind].items():
        value = message.get(name)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise WireError("field", f"{kind}.{name} must be {_type_name(expected)}, got {type(value).__name__}")
    for name, expected in OPTIONAL.get(kind, {}).items():
        if name in message and not isinstance(message[name], expected):
            got = type(message[name]).__name__
            raise WireError("field", f"{kind}.{name} must be {_type_name(expected)}, got {got}")
    for name in _TEXT_FIELDS:
        if isinstance(message.get(name), str) and len(message[name]) > MAX_TEXT_CHARS:
            raise WireError("field", f"{kind}.{name} is longer than {MAX_TEXT_CHARS} characters")
    if kind in ("update", "site-heard"):
        _check_metrics(message["metrics"], f"{kind}.metrics")
        _check_ints(message.get("label_counts", []), f"{kind}.label_counts")
        _check_parts(message.get("trained_counts", []), "update.trained_counts")
    if kind == "request":
        _check_names(message["names"])
    if kind in _SECURE_CHECKS:
        _SECURE_CHECKS[kind](message)
    declared = OPTIONAL.get(kind, {})  # a field a kind does not declare is an unknown extra one: ignored
    if "instances" in declared and "instances" in message:
        _check_names(message["instances"], f"{kind}.instances")
    if "attachments" in declared and "attachments" in message:
        _check_attachments(message["attachments"])
    if kind in BLOB_KINDS:
        _check_chunk_fields(message, verify_chunk)


def _type_name(expected: type | tuple[type, ...]) -> str:
    return "number" if expected == _NUMBER else getattr(expected, "__name__", str(expected))


def _check_metrics(metrics: dict, where: str = "update.metrics") -> None:
    if len(metrics) > MAX_METRICS:
        raise WireError("field", f"{where} has {len(metrics)} entries, at most {MAX_METRICS}")
    for key, value in metrics.items():
        if not isinstance(key, str) or not isinstance(value, _NUMBER) or isinstance(value, bool):
            raise WireError("field", f"{where} must map names to numbers, got {key!r:.80}: {value!r:.80}")
        if not math.isfinite(value):  # one NaN would make results.json invalid JSON
            raise WireError("metrics-nonfinite", f"{where}[{key!r:.80}] is {value!r}")


def _check_ints(values: list, where: str) -> None:
    if len(values) > 4096 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise WireError("field", f"{where} must be a list of at most 4096 non-negative ints")


def _check_parts(values: list, where: str) -> None:
    """[[task, class, samples], ...]: at most 4096 triples of non-negative ints."""
    if len(values) > 4096 or not all(
            isinstance(v, list) and len(v) == 3 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                        for n in v) for v in values):
        raise WireError("field", f"{where} must be a list of at most 4096 [task, class, samples] triples of "
                                 "non-negative ints")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _check_names(names: list, where: str = "request.names", most: int = MAX_REQUEST_NAMES) -> None:
    if len(names) > most or not all(_is_name(n) for n in names) or len(set(names)) != len(names):
        raise WireError("field", f"{where} must be at most {most} distinct names of 1 to {MAX_NAME_CHARS} characters")


def _check_sealed(shares: dict, where: str) -> None:
    """{device: bytes}: at most MAX_NEIGHBOURS entries of at most MAX_SEALED_BYTES each."""
    if len(shares) > MAX_NEIGHBOURS or not all(
            _is_name(k) and isinstance(v, bytes) and len(v) <= MAX_SEALED_BYTES for k, v in shares.items()):
        raise WireError("field", f"{where} must map at most {MAX_NEIGHBOURS} names to byte strings of at most "
                                 f"{MAX_SEALED_BYTES} bytes")


def _check_key(value: bytes, where: str) -> None:
    if len(value) != 32:
        raise WireError("field", f"{where} must be 32 bytes, got {len(value)}")


def _check_keys(message: Message) -> None:
    _check_metrics(message["metrics"], "keys.metrics")
    for name in ("cipher_key", "mask_key", "commitment"):
        _check_key(message[name], f"keys.{name}")


def _check_neighbours(message: Message) -> None:
    named = message["neighbours"]
    if len(named) > MAX_NEIGHBOURS or not all(
            _is_name(k) and isinstance(v, list) and len(v) == 3 and isinstance(v[0], int) and not isinstance(v[0], bool)
            and all(isinstance(key, bytes) and len(key) == 32 for key in v[1:]) for k, v in named.items()):
        raise WireError("field", f"neighbours.neighbours must map at most {MAX_NEIGHBOURS} names to [point, key, key]")


def _check_reveal(message: Message) -> None:
    _check_sealed(message["masks"], "reveal.masks")
    _check_sealed(message["keys"], "reveal.keys")


def _check_unmask(message: Message) -> None:
    _check_names(message["survivors"], "unmask.survivors", MAX_NEIGHBOURS)
    _check_names(message["dropped"], "unmask.dropped", MAX_NEIGHBOURS)


_SECURE_CHECKS: Mapping[str, Callable[[Message], None]] = {
    "keys": _check_keys,
    "shares": lambda m: _check_sealed(m["shares"], "shares.shares"),
    "relayed": lambda m: _check_sealed(m["shares"], "relayed.shares"),
    "reveal": _check_reveal,
    "neighbours": _check_neighbours,
    "unmask": _check_unmask,
}


def _check_attachments(attachments: list) -> None:
    if len(attachments) > MAX_ATTACHMENTS:
        raise WireError("attachments", f"{len(attachments)} attachments, at most {MAX_ATTACHMENTS}")
    for entry in attachments:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_name(entry[0])
                and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 0):
            raise WireError("attachments", f"an attachment is [name of at most {MAX_NAME_CHARS} characters, "
                                           f"length], got {entry!r}")
    names = [entry[0] for entry in attachments]
    if len(set(names)) != len(names):
        raise WireError("attachments", "attachment names repeat")


def _check_chunk_fields(message: Message, verify_crc: bool) -> None:
    size, index, count, offset, data = (message[k] for k in ("size", "index", "count", "offset", "data"))
    dtype = BLOB_DTYPES.get(message["kind"], WEIGHTS_DTYPE)
    if message["dtype"] != dtype:
        raise WireError("dtype", f"blob dtype {message['dtype']!r}; a {message['kind']} blob travels as {dtype}")
    if size < 0 or size % 4:
        raise WireError("field", f"blob size {size} is not a whole number of float32 values")
    if not 0 <= index < count or not 0 <= offset <= offset + len(data) <= size:
        raise WireError("field", f"chunk {index}/{count} at {offset}+{len(data)} does not fit a blob of {size} bytes")
    if verify_crc and crc32c(data) != message["chunk_crc32c"]:
        raise WireError("chunk-hash", f"chunk {index}/{count} of blob {message['blob'][:12]} fails its CRC32C")


# --- blobs ----------------------------------------------------------------------------------------

def weights_bytes(weights: np.ndarray) -> memoryview:
    """The wire form of a flat weight buffer: little-endian float32, no copy when it already is one."""
    array = np.ascontiguousarray(weights, dtype=WEIGHTS_DTYPE).reshape(-1)
    return array.data.cast("B")


def _padded(n: int) -> int:
    return -(-n // 4) * 4


def pack_attachments(weights: bytes | memoryview, attachments: Mapping[str, bytes]
                     ) -> tuple[bytes | memoryview, list]:
    """One blob of weights followed by named byte strings (each padded to 4 bytes), and the `attachments` field
    that describes them; without attachments, the weights themselves."""
    if not attachments:  # the weights alone: no copy
        return weights, []
    parts: list[bytes | memoryview] = [weights]
    layout = []
    for name, data in attachments.items():
        parts.extend((data, bytes(_padded(len(data)) - len(data))))
        layout.append([name, len(data)])
    return b"".join(parts), layout


@dataclass(frozen=True)
class EncodedBlob:
    id: str  # the blob's identity: see blob_id
    frames: list[Frame]  # its chunk messages, each with the blob's fields repeated (any order works), as frames

    @property
    def chunks(self) -> list[bytes]:
        """The chunk messages as bytes (a copy of the blob; publishing takes the frames)."""
        return [bytes(frame) for frame in self.frames]


def encode_blob(kind: str, data: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES, **fields: Any) -> EncodedBlob:
    """All chunk messages of one blob, as frames over `data` (which must not change until they are sent): the
    blob's BLAKE3 once, and each chunk's CRC32C."""
    if kind not in BLOB_KINDS:
        raise ValueError(f"{kind!r} does not carry a blob; blob kinds: {sorted(BLOB_KINDS)}")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}")
    view = memoryview(data).cast("B")
    # every chunk repeats the blob's fields: where they take more than the header room leaves them (up to
    # MAX_ATTACHMENTS names in an attachments layout), the chunks carry that much less data
    repeated = len(_packed(fields))
    chunk_bytes = min(chunk_bytes, CHUNK_BYTES - max(0, repeated - (CHUNK_HEADER_ROOM - CHUNK_FIELDS_ROOM)))
    pieces = _pieces(view, chunk_bytes)
    blob = blob_id(view)
    frames = [
        _frame(  # the CRCs are computed just here: no need to verify them again
            kind, False, dict(blob=blob, size=len(view), dtype=BLOB_DTYPES.get(kind, WEIGHTS_DTYPE), index=index,
                              count=len(pieces),
                              offset=index * chunk_bytes, chunk_crc32c=crc32c(piece), data=piece, **fields),
        )
        for index, piece in enumerate(pieces)
    ]
    return EncodedBlob(blob, frames)


def blob_id(data: bytes | bytearray | memoryview) -> str:
    """A blob's identity: the BLAKE3 (hex, 256 bits) of its bytes. It commits to every byte however the blob is
    chunked, so the round message can name the weights the devices must start from."""
    return blob_hasher(data).hexdigest()


def blob_hasher(data: bytes | bytearray | memoryview = b"") -> blake3:
    """What `blob_id` computes, fed in pieces: `update` it with the blob's bytes in order, then `hexdigest()`."""
    return blake3(data)


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of a chunk's data: catches damage, not forgery (the blob id does that). google_crc32c
    reads no memoryview, but reads a numpy array over the same bytes: no copy."""
    return int(google_crc32c.value(np.frombuffer(data, dtype=np.uint8)))


def chunk_count(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many messages a blob of `nbytes` travels in (an empty blob still takes one)."""
    return max(1, math.ceil(nbytes / chunk_bytes))


def _pieces(view: memoryview, chunk_bytes: int) -> list[memoryview]:
    return [view[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(chunk_count(len(view), chunk_bytes))]


@dataclass(frozen=True)
class Blob:
    """A reassembled, verified blob and the fields its chunks carried (chunk bookkeeping removed)."""

    id: str
    data: memoryview  # read-only bytes: the weights are a read-only view of them
    header: Message

    def weights(self, expected_length: int) -> np.ndarray:
        """The blob's weights: exactly `expected_length` finite float32 values, else WireError."""
        return self.split(expected_length)[0]

    def words(self, expected_length: int) -> np.ndarray:
        """A masked blob's uint32 words: exactly `expected_length` of them, else WireError."""
        if len(self.data) != 4 * expected_length:
            raise WireError("weights-length", f"a blob of {len(self.data)} bytes is not {expected_length} words")
        return np.frombuffer(self.data, dtype=BLOB_DTYPES["masked"], count=expected_length)

    def attachments(self) -> dict[str, bytes]:
        """The named attachments of an attachments-only blob (payload, answer), as bytes."""
        return {name: bytes(data) for name, data in self.split(0)[1].items()}

    def split(self, expected_length: int) -> tuple[np.ndarray, dict[str, memoryview]]:
        """The weights (`expected_length` finite float32 values; 0 for an attachments-only blob) and the named
        attachments after them; WireError unless the declared layout tiles the blob exactly."""
        layout = self.header.get("attachments", [])
        end = 4 * expected_length
        if len(self.data) != end + sum(_padded(n) for _, n in layout):
            raise WireError("weights-length", f"a blob of {len(self.data)} bytes is not {expected_length} values "
                                              f"and {len(layout)} declared attachments")
        attachments = {}
        for name, n in layout:
            attachments[name] = self.data[end:end + n]
            end += _padded(n)
        values = np.frombuffer(self.data, dtype=WEIGHTS_DTYPE, count=expected_length)
        # A NaN or an infinity makes the sum non-finite, so a finite sum proves them all finite without the
        # elementwise test's temporary array (11 MB of fresh pages for an 11M model: 2x the time); a sum that
        # overflows from finite values only sends it to the exact test.
        with np.errstate(over="ignore", invalid="ignore"):
            total = values.sum()
        if not math.isfinite(total) and not np.isfinite(values).all():
            raise WireError("weights-nonfinite", f"{int((~np.isfinite(values)).sum())} NaN/Inf values")
        return values, attachments


HEAD_WITHOUT_HUGE_PAGES = 4 << 20  # a part-way blob's first bytes go in ordinary pages (see _Pending)
# What a part-way blob may cost, the bound on what a sender can make a receiver commit (docs/security.md): the bytes
# written from its start (plus, above HEAD_WITHOUT_HUGE_PAGES, one huge page: at most half of them), or a held copy of
# each chunk that came early with its bookkeeping; plus one ordinary page. Measured by tests/test_bad_input.py.
PENDING_COST_FACTOR = 2
PENDING_COST_SLACK = mmap.PAGESIZE


def _blob_buffer(size: int) -> mmap.mmap | bytearray:
    """Memory for a blob of `size` bytes that commits pages only as they are written: an anonymous mapping whose
    first `HEAD_WITHOUT_HUGE_PAGES` never take huge pages and whose rest does (one fault per 2 MiB instead of 512,
    where the kernel offers them). Written from the front only, it commits at most the bytes written plus one
    ordinary page below 4 MiB and one huge page (2 MiB, at most half of what was written) above.

    The mapping is private: Python's default for an anonymous mmap is MAP_SHARED, which Linux backs with shmem,
    whose huge pages follow `shmem_enabled` ("never" by default) and ignore MADV_HUGEPAGE, so every 4 KiB page
    faulted and was cleared on its own: 40 ms to write 44 MB here, against 10 ms in a private mapping with huge
    pages (the same as rewriting memory already faulted)."""
    if size < mmap.PAGESIZE:
        return bytearray(size)
    private = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    buffer = mmap.mmap(-1, size) if private is None or anonymous is None else mmap.mmap(
        -1, size, flags=private | anonymous)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the platform's default pages
        buffer.madvise(mmap.MADV_NOHUGEPAGE, 0, min(size, HEAD_WITHOUT_HUGE_PAGES))
        if size > HEAD_WITHOUT_HUGE_PAGES:
            buffer.madvise(mmap.MADV_HUGEPAGE, HEAD_WITHOUT_HUGE_PAGES, size - HEAD_WITHOUT_HUGE_PAGES)
    return buffer


# Blob buffers of REUSED_BLOB_BYTES or more are kept for reuse (edgefil/buffers.py), BLOB_BUFFER_POOL_BYTES of them a
# process at most: as much as 20 updates of an 11M-parameter model in flight together at a coordinator, and far more
# than a device holds (the model it has and the one arriving). A smaller blob costs few page faults.
REUSED_BLOB_BYTES = 1 << 20
BLOB_BUFFER_POOL_BYTES = 1 << 30
BLOB_BUFFERS: BufferPool[mmap.mmap | bytearray] = BufferPool(_blob_buffer, BLOB_BUFFER_POOL_BYTES, REUSED_BLOB_BYTES)


class _Pending:
    """A blob part-way: a buffer of its declared size, written from the front as chunks arrive in order, so the
    message that carried a chunk is freed at once (a 44 MB update no longer holds its 45 payloads until the last
    one comes, then joins them: a second copy, into freshly faulted pages; measured for 20 updates of 44 MB: 0.10 s,
    against 0.40 s for joining held chunks).

    The buffer commits memory only where it is written (`_blob_buffer`), and it is written only up to `filled`, the
    end of the chunks that tile it from offset 0 so far. A chunk that arrives ahead of that (MQTT delivers one
    sender's messages in order, so only a re-send after a reconnect, or a hostile sender, does this) is held as a
    copy of its bytes until the chunks before it have come, and never written at its offset: a sender scattering
    small chunks over a blob's length commits no page for them (before, 66 chunks of 4 bytes placed 2 MiB apart
    committed 66 huge pages, 106 MB for 19 KB sent). What a part-way blob costs is therefore the bytes its sender
    sent, about twice over (a held chunk's copy and its bookkeeping), plus one page: the bound that
    docs/security.md states and tests/test_bad_input.py measures. A large blob's buffer may be one that an earlier
    blob used and nothing refers to any more (`BLOB_BUFFERS`): its pages are committed already, and it costs
    nothing new.

    The blob's BLAKE3 is computed as its bytes are written, in order from its start, while each chunk is still in
    the cache from its CRC check and its copy: 8 % less CPU for copy and hash than hashing the whole blob again
    (from memory) once it is complete.

    A blob of one chunk (a model below CHUNK_BYTES, as most are: its every copy at every device and at the
    coordinator) is that chunk's data, a view of the message that carried it: no buffer is taken and nothing
    is copied. Copied, a LeNet's 121 KiB went each time into a fresh mapping, faulted in page by page and unmapped
    again once the blob was read (issue 57). The message's memory stays referenced for as long as the blob is, so a
    pool that lent it (edgefil/paho_buffers.py) does not lend it again before then; it is the blob, the chunk's few
    fields and, in a pooled packet body, up to a sixteenth more (`buffers.capacity_for`): what a device or a
    strategy keeps of a model costs that much over an exact copy."""

    def __init__(self, header: Message, size: int, count: int, buffers: BufferPool[mmap.mmap | bytearray]) -> None:
        self.header = header
        self.buffers = buffers
        # taken from `buffers` at the first write (capacity at least `size`; only [0, filled) is ever read)
        self.buffer: mmap.mmap | bytearray | None = None
        self.whole: memoryview | None = None  # or, for a blob of one chunk, that chunk's data
        self.size = size
        self.hasher = blob_hasher()  # of bytes [0, filled)
        self.chunks: dict[int, tuple[int, int, int]] = {}  # index -> (offset, length, CRC32C)
        self.count = count
        self.filled = 0  # bytes [0, filled) are written: the chunks that tile the blob from its start
        self.written = 0  # chunks written at their offset
        self.ahead: dict[int, bytes] = {}  # offset -> the data of a chunk that came before its predecessors
        self.tiles = True  # False once two chunks claim one offset, or one overlaps the written part

    def put(self, index: int, offset: int, data: bytes | memoryview, digest: int) -> None:
        """Take one chunk (the codec checked that it lies within the blob): written when it continues the written
        part, else held until it does."""
        self.chunks[index] = (offset, len(data), digest)
        if self.count == 1 and offset == 0 and len(data) == self.size:
            self.whole = memoryview(data)
            self.hasher.update(self.whole)
            self.filled, self.written = self.size, 1
            return
        if offset != self.filled:
            if offset < self.filled or offset in self.ahead:
                self.tiles = False  # it can never be written: the blob will not assemble
            else:
                self.ahead[offset] = bytes(data)
            return
        self._write(data)
        while self.filled in self.ahead:
            self._write(self.ahead.pop(self.filled))

    def _write(self, data: bytes | memoryview) -> None:
        if self.buffer is None:
            self.buffer = self.buffers.take(self.size)
        self.buffer[self.filled:self.filled + len(data)] = data
        self.hasher.update(data)
        self.filled += len(data)
        self.written += 1

    def assembled(self, blob: str) -> memoryview | None:
        """The blob when its chunks tile it exactly, in index order, and its BLAKE3 is its id; else None."""
        parts = [self.chunks[i] for i in range(self.count)]
        ends = [offset + length for offset, length, _ in parts]
        in_order = [offset for offset, _, _ in parts] == [0, *ends[:-1]] and ends[-1] == self.size
        if not (in_order and self.tiles and self.written == self.count and self.filled == self.size):
            return None
        if self.hasher.hexdigest() != blob:
            return None
        whole = self.whole if self.whole is not None else memoryview(self.buffer or bytearray())[:self.size]
        return whole.toreadonly()


class Reassembler:
    """Collects chunks per (source, blob, round) and returns each blob once, when it is whole and matches its id.
    The round is part of the key because a blob's id is its content's hash: a device whose weights are byte for
    byte the same in two rounds (it had nothing to learn, or the global model did not change) is heard in both.

    Memory stays bounded per source, whatever the sources send: a blob larger than `max_blob_bytes` is refused
    before anything is allocated, and each source holds at most `max_pending` blobs part-way, each a buffer of its
    declared size whose pages are committed only as the chunks that continue it from its start are written
    (`_Pending`): a first chunk claiming a large blob costs the pages it writes, not the claim, and chunks
    scattered over a blob cost their own bytes, not a page each. A part-way blob costs at most
    `PENDING_COST_FACTOR` times the bytes of the chunk messages its source sent for it, plus `PENDING_COST_SLACK`;
    a source's new blob evicts its own oldest part-way ones, never another source's. The total is at most the
    number of sources times `max_pending` blobs, plus the free buffers that `buffers` keeps for reuse (the
    process's `BLOB_BUFFERS` unless given: at most `BLOB_BUFFER_POOL_BYTES`, memory earlier blobs committed). The
    last `remember` delivered blobs are recognised so their late duplicates are ignored instead of being assembled
    again.
    """

    def __init__(self, max_blob_bytes: int, max_pending: int = 2, remember: int = 4096,
                 buffers: BufferPool[mmap.mmap | bytearray] | None = None) -> None:
        self.max_blob_bytes = max_blob_bytes
        self.max_pending = max_pending
        self.remember = remember
        self.buffers = BLOB_BUFFERS if buffers is None else buffers
        self._pending: dict[tuple[str, str, Any], _Pending] = {}
        self._by_source: dict[str, list[tuple[str, str, Any]]] = {}  # a source's part-way blobs, oldest first
        self._done: OrderedDict[tuple[str, str, Any], None] = OrderedDict()
        self.evicted = 0  # part-way blobs a source's own later blobs pushed out

    def pending_blobs(self, source: str | None = None) -> int:
        """Blobs held part-way, of one source or of all."""
        return len(self._pending) if source is None else len(self._by_source.get(source, []))

    def _forget(self, key: tuple[str, str, Any]) -> _Pending:
        """Stop holding a part-way blob (completed, evicted or dropped)."""
        pending = self._pending.pop(key)
        own = self._by_source[key[0]]
        own.remove(key)
        if not own:
            del self._by_source[key[0]]
        return pending

    def add(self, source: str, message: Message) -> Blob | None:
        """Take one decoded chunk message; returns the blob it completes, else None."""
        key = (source, message["blob"], message.get("round"))
        if key in self._done:
            return None
        if message["size"] > self.max_blob_bytes:
            raise WireError("oversized", f"blob of {message['size']} bytes exceeds {self.max_blob_bytes}")
        header = {k: v for k, v in message.items() if k not in _PER_CHUNK}
        pending = self._pending.get(key)
        if pending is None:
            pending = self._open(key, header, message["size"], message["count"])
        elif header != pending.header or message["count"] != pending.count:
            raise WireError("chunk-mismatch", f"chunk {message['index']} disagrees with earlier chunks of its blob")
        index, data = message["index"], message["data"]
        offset, digest = message["offset"], message["chunk_crc32c"]
        if index in pending.chunks:
            if pending.chunks[index] != (offset, len(data), digest):
                raise WireError("chunk-mismatch", f"chunk {index} arrived twice with different data")
            return None
        pending.put(index, offset, data, digest)
        if len(pending.chunks) < pending.count:
            return None
        self._forget(key)
        assembled = pending.assembled(key[1])
        if assembled is None:
            raise WireError("blob-hash", f"reassembled blob does not match its id {key[1][:12]}")
        self._mark_done(key)
        return Blob(key[1], assembled, pending.header)

    def delivered(self, source: str, blob: str, round_: Any) -> bool:
        """Count a blob of `source` as delivered without its chunks passing here (the very message that carries it
        was verified by another reassembler of the process: edge_client/shared_models.py); False where it was
        delivered before, as `add` returns nothing for a late duplicate."""
        key = (source, blob, round_)
        if key in self._done:
            return False
        self._mark_done(key)
        return True

    def _mark_done(self, key: tuple[str, str, Any]) -> None:
        """Remember a delivered blob, the last `remember` of them."""
        self._done[key] = None
        while len(self._done) > self.remember:
            self._done.popitem(last=False)

    def drop(self, stale: Callable[[Message], bool]) -> int:
        """Forget part-way blobs whose header `stale` accepts (e.g. updates of closed rounds); returns how many."""
        keys = [key for key, pending in self._pending.items() if stale(pending.header)]
        for key in keys:
            self._forget(key)
        return len(keys)

    def _open(self, key: tuple[str, str, Any], header: Message, size: int, count: int) -> _Pending:
        if count > max(1, math.ceil(size / MIN_CHUNK_BYTES)):
            raise WireError("field", f"{count} chunks for a blob of {size} bytes")
        own = self._by_source.get(key[0], [])
        for stale in own[: max(0, len(own) - self.max_pending + 1)]:  # the source's oldest part-way blobs
            self._forget(stale)
            self.evicted += 1
        pending = self._pending[key] = _Pending(header, size, count, self.buffers)
        self._by_source.setdefault(key[0], []).append(key)
        return pending
