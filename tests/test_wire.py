"""The protocol codec: message schemas, chunked float32 blobs, idempotent reassembly, and every refusal."""
from __future__ import annotations

import os

import google_crc32c
import msgpack
import numpy as np
import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_frames import pack, unpack

from edgefil import topics, wire
from edgefil.buffers import BufferPool

HEADER = dict(device="dev-0", round=3, task=1, model="ab" * 32, num_samples=40, metrics={"loss": 0.25})


def weights(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_small_messages_round_trip_with_their_schema_version():
    payload = wire.encode("round", round=2, task=0, model="f" * 64, version=1, deadline_s=30, config={"epochs": 2, "mu": 0.1})
    message = wire.decode(payload)
    assert message["v"] == wire.SCHEMA_VERSION and message["kind"] == "round"
    assert message["config"] == {"epochs": 2, "mu": 0.1}


def test_weights_travel_as_raw_little_endian_float32_in_chunks_under_the_limit():
    w = weights(700_000)  # 2.8 MB: three chunks
    encoded = wire.encode_blob("update", wire.weights_bytes(w), **HEADER)
    chunks = encoded.chunks
    assert len(chunks) == 3 and all(len(c) <= wire.MAX_MESSAGE_BYTES for c in chunks)
    decoded = [wire.decode(c) for c in chunks]
    data = b"".join(c["data"] for c in decoded)
    assert data == w.astype("<f4").tobytes()
    # the id is the BLAKE3 of the blob's bytes (however it is chunked); each chunk carries its data's CRC32C
    assert decoded[0]["blob"] == encoded.id == blake3(data).hexdigest() == wire.blob_id(data)
    assert [c["chunk_crc32c"] for c in decoded] == [google_crc32c.value(bytes(c["data"])) for c in decoded]
    # a chunk is framed: 0xC1, the length of its fields' msgpack map, the map, then the raw bytes
    assert all(c[:1] == b"\xc1" and c.endswith(bytes(d["data"])) for c, d in zip(chunks, decoded))


def test_an_update_with_as_many_attachments_as_the_schema_allows_travels_under_the_limit():
    """Every chunk repeats the attachments' layout: with MAX_ATTACHMENTS names of MAX_NAME_CHARS it takes more than
    the header room, and the chunks carry less data to stay under the limit (a flood of 256 of GLFC's prototype
    gradients was refused by its own sender, issue 56)."""
    named = {f"{k:03d}".ljust(wire.MAX_NAME_CHARS, "x"): os.urandom(4_000) for k in range(wire.MAX_ATTACHMENTS)}
    w = weights(300_000)
    data, layout = wire.pack_attachments(wire.weights_bytes(w), named)
    encoded = wire.encode_blob("update", data, attachments=layout, **HEADER)
    assert len(encoded.chunks) > 2 and all(len(c) <= wire.MAX_MESSAGE_BYTES for c in encoded.chunks)
    reassembler = wire.Reassembler(max_blob_bytes=len(data))
    delivered = [b for c in encoded.chunks if (b := reassembler.add("dev-0", wire.decode(c))) is not None]
    weights_back, attachments = delivered[0].split(w.size)
    np.testing.assert_array_equal(weights_back, w)
    assert {name: bytes(value) for name, value in attachments.items()} == named


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.integers(0, 5), min_size=6, max_size=30), n=st.integers(1, 3000))
def test_reassembly_is_idempotent_under_duplicates_and_reordering(order, n):
    w = weights(n, seed=n)
    chunks = wire.encode_blob("update", wire.weights_bytes(w), chunk_bytes=wire.MIN_CHUNK_BYTES, **HEADER).chunks
    sequence = [chunks[i % len(chunks)] for i in order] + chunks  # everything arrives at least once
    reassembler = wire.Reassembler(max_blob_bytes=4 * n)
    delivered = [b for c in sequence if (b := reassembler.add("dev-0", wire.decode(c))) is not None]
    assert len(delivered) == 1
    np.testing.assert_array_equal(delivered[0].weights(n), w)
    assert delivered[0].header["round"] == 3 and "data" not in delivered[0].header


def test_two_sources_sending_the_same_blob_are_kept_apart():
    chunks = wire.encode_blob("update", wire.weights_bytes(weights(10)), **HEADER).chunks
    reassembler = wire.Reassembler(max_blob_bytes=40)
    assert reassembler.add("a", wire.decode(chunks[0])) is not None
    assert reassembler.add("b", wire.decode(chunks[0])) is not None


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1", "malformed"),
    (b"", "malformed"),
    (msgpack.packb([1, 2]), "malformed"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION + 1, "kind": "round"}), "schema"),
    (msgpack.packb({"kind": "round"}), "schema"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "hello"}), "kind"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": ["update"]}), "kind"),  # not a string: refused, no crash
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "status", "device": "d", "state": "idle", "round": "3"}), "field"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "status", "device": "d", "state": "idle", "round": True}), "field"),
    (bytes(wire.MAX_MESSAGE_BYTES + 1), "oversized"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "end", "outcome": "complete", "rounds": "3"}), "field"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "end", "outcome": 1, "rounds": 3}), "field"),
    (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "end", "rounds": 3}), "field"),
])
def test_bad_payloads_are_refused_with_a_reason(payload, reason):
    with pytest.raises(wire.WireError) as err:
        wire.decode(payload)
    assert err.value.reason == reason


def chunk_fields(**overrides) -> bytes:
    message = wire.decode(wire.encode_blob("update", wire.weights_bytes(weights(64)), **HEADER).chunks[0])
    return pack({**message, **overrides})


@pytest.mark.parametrize("overrides, reason", [
    ({"dtype": "<f8"}, "dtype"),
    ({"data": bytes(256)}, "chunk-hash"),
    ({"size": 255}, "field"),  # not whole float32 values
    ({"offset": 4}, "field"),  # runs past the end of the blob
    ({"index": 1}, "field"),  # index >= count
    ({"metrics": {"loss": "low"}}, "field"),
    ({"metrics": {f"m{i}": 1.0 for i in range(wire.MAX_METRICS + 1)}}, "field"),
])
def test_bad_chunks_are_refused_with_a_reason(overrides, reason):
    with pytest.raises(wire.WireError) as err:
        wire.decode(chunk_fields(**overrides))
    assert err.value.reason == reason


def test_reassembler_refuses_blobs_larger_than_the_model_and_bad_weights():
    w = weights(64)
    message = wire.decode(wire.encode_blob("update", wire.weights_bytes(w), **HEADER).chunks[0])
    with pytest.raises(wire.WireError, match="oversized"):
        wire.Reassembler(max_blob_bytes=4 * 63).add("dev-0", message)
    blob = wire.Reassembler(max_blob_bytes=4 * 64).add("dev-0", message)
    with pytest.raises(wire.WireError) as err:
        blob.weights(65)
    assert err.value.reason == "weights-length"
    w[7] = np.inf
    inf_blob = wire.Reassembler(4 * 64).add("d", wire.decode(wire.encode_blob("update", wire.weights_bytes(w), **HEADER).chunks[0]))
    with pytest.raises(wire.WireError) as err:
        inf_blob.weights(64)
    assert err.value.reason == "weights-nonfinite"


def blob_of(values: np.ndarray) -> wire.Blob:
    encoded = wire.encode_blob("update", wire.weights_bytes(values), **HEADER)
    reassembler = wire.Reassembler(values.nbytes)
    return [reassembler.add("d", wire.decode(c)) for c in encoded.chunks][-1]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_nonfinite_value_anywhere_refuses_the_weights_and_huge_finite_ones_pass(bad):
    """The finiteness check sums first: a NaN or infinity must still be found wherever it is, and finite values
    whose sum overflows float32 must not be refused."""
    rng = np.random.default_rng(0)
    huge = np.full(1000, 3e38, dtype=np.float32)  # finite, and their float32 sum is inf
    np.testing.assert_array_equal(blob_of(huge).weights(1000), huge)
    for where in (0, 499, 999):
        values = rng.standard_normal(1000).astype(np.float32)
        values[where] = bad
        for mixed in (values, np.where(np.arange(1000) == where, values, huge)):
            with pytest.raises(wire.WireError) as err:
                blob_of(mixed.astype(np.float32)).weights(1000)
            assert err.value.reason == "weights-nonfinite"


def test_weights_without_attachments_are_packed_without_a_copy_and_frames_are_the_chunks():
    data = wire.weights_bytes(weights(3000))
    packed, layout = wire.pack_attachments(data, {})
    assert packed is data and layout == []
    packed, layout = wire.pack_attachments(data, {"a": b"xyz"})
    assert bytes(packed) == bytes(data) + b"xyz\0" and layout == [["a", 3]]
    encoded = wire.encode_blob("update", data, chunk_bytes=wire.MIN_CHUNK_BYTES, **HEADER)
    assert all(frame.data.obj is data.obj for frame in encoded.frames)  # views of the blob, not copies
    assert [bytes(frame) for frame in encoded.frames] == encoded.chunks
    reassembler = wire.Reassembler(len(data))
    assert [reassembler.add("d", wire.decode(c)) for c in encoded.chunks][-1].id == encoded.id


def test_chunks_that_disagree_with_their_blob_are_refused_and_nothing_is_delivered():
    chunks = [wire.decode(c) for c in wire.encode_blob(
        "update", wire.weights_bytes(weights(2000)), chunk_bytes=wire.MIN_CHUNK_BYTES, **HEADER).chunks]
    reassembler = wire.Reassembler(max_blob_bytes=8000)
    assert reassembler.add("dev-0", chunks[0]) is None
    with pytest.raises(wire.WireError) as err:
        reassembler.add("dev-0", {**chunks[1], "num_samples": 4})
    assert err.value.reason == "chunk-mismatch"
    # a forged blob whose chunks are each self-consistent but do not hash to the blob id
    forged = [dict(c) for c in chunks]
    forged[-1]["data"] = bytes(len(forged[-1]["data"]))
    forged[-1]["chunk_crc32c"] = google_crc32c.value(forged[-1]["data"])
    assert last_chunk_refusal(forged) == "blob-hash"
    # genuine chunks placed so they overlap (a gap elsewhere) do not make the blob either
    shifted = [dict(c) for c in chunks]
    shifted[1]["offset"] -= 4
    assert last_chunk_refusal(shifted) == "blob-hash"


def last_chunk_refusal(chunks: list[dict]) -> str:
    """Feed a blob's chunks to a fresh reassembler: all but the last are taken; the reason the last is refused."""
    reassembler = wire.Reassembler(max_blob_bytes=8000)
    for c in chunks[:-1]:
        assert reassembler.add("dev-0", c) is None
    with pytest.raises(wire.WireError) as err:
        reassembler.add("dev-0", chunks[-1])
    return err.value.reason


@pytest.mark.parametrize("field", ["attachments", "instances"])
@pytest.mark.parametrize("value", [5, "x", {"a": 1}, [["a", 1]]])
def test_an_optional_field_on_a_kind_that_does_not_declare_it_is_an_extra_one(field, value):
    """`attachments` (update, payload, answer) and `instances` (notice) on another kind are unknown extra fields:
    ignored, as any other, never met with an exception of the codec's own (a TypeError, before)."""
    message = wire.decode(msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "status", "device": "d", "state": "idle",
                                         "round": 1, field: value}))
    assert message["kind"] == "status"
    with pytest.raises(wire.WireError) as err:  # where the kind declares it, a value of another type is refused
        wire.decode(msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "notice", "reason": "r", "detail": "d",
                                   "instances": 5, "attachments": 5}))
    assert err.value.reason == "field"


@pytest.mark.parametrize("value", [[1, -1], [1.5], [True], ["3"], [0] * 4097])
def test_an_updates_label_counts_are_non_negative_ints_only(value):
    chunk = wire.decode(wire.encode_blob("update", wire.weights_bytes(weights(8)), **HEADER, label_counts=[3, 0]
                                         ).chunks[0])
    assert chunk["label_counts"] == [3, 0]
    with pytest.raises(wire.WireError) as err:  # the codec checks what it writes as what it reads
        wire.encode_blob("update", wire.weights_bytes(weights(8)), **HEADER, label_counts=value)
    assert err.value.reason == "field" and "label_counts" in str(err.value)


@pytest.mark.parametrize("value", [[3, 0], [[0, 1]], [[0, 1, 2, 3]], [[0, -1, 2]], [[0, 1, 1.5]], [[True, 1, 2]],
                                   [[0, "1", 2]], [[0, 0, 1]] * 4097])
def test_an_updates_trained_counts_are_task_class_samples_triples_only(value):
    parts = [[0, 3, 40], [1, 3, 7]]  # class 3 in two tasks (two domains)
    chunk = wire.decode(wire.encode_blob("update", wire.weights_bytes(weights(8)), **HEADER, trained_counts=parts
                                         ).chunks[0])
    assert chunk["trained_counts"] == parts
    with pytest.raises(wire.WireError) as err:
        wire.encode_blob("update", wire.weights_bytes(weights(8)), **HEADER, trained_counts=value)
    assert err.value.reason == "field" and "trained_counts" in str(err.value)


def test_pending_blobs_are_bounded_and_stale_ones_can_be_dropped():
    reassembler = wire.Reassembler(max_blob_bytes=8000, max_pending=2)
    for round_ in range(3):
        first = wire.encode_blob("update", wire.weights_bytes(weights(2000, round_)),
                                 chunk_bytes=wire.MIN_CHUNK_BYTES, **{**HEADER, "round": round_}).chunks[0]
        reassembler.add("dev-0", wire.decode(first))
    assert len(reassembler._pending) == 2
    assert reassembler.drop(lambda header: header["round"] < 2) == 1


def test_the_codec_will_not_write_what_a_receiver_refuses():
    with pytest.raises(wire.WireError):
        wire.encode("status", device="d", state="idle")  # round missing
    with pytest.raises(ValueError):
        wire.encode_blob("round", b"")


def test_topics_parse_and_refuse_bad_names():
    assert topics.parse("f", topics.from_device("f", "dev-1", "update")) == topics.Topic("dev", "dev-1", "update")
    assert topics.parse("f", topics.to_all("f", "weights")) == topics.Topic("all", None, "weights")
    assert topics.parse("f", "edgefil/other/dev/dev-1/update") is None
    assert topics.parse("f", "edgefil/f/dev/a/b/c") is None
    for bad in ("", "a/b", "a+", "#", "x" * 65):
        with pytest.raises(ValueError):
            topics.from_device("f", bad, "update")


def test_the_same_bytes_in_a_later_round_are_delivered_again():
    """A blob's id is its content's hash: a device with nothing new sends the same bytes in the next round, and
    must be heard there (only duplicates within one round are ignored)."""
    reassembler = wire.Reassembler(max_blob_bytes=8000)
    data = wire.weights_bytes(weights(100))
    for round_ in (3, 4):
        chunks = [wire.decode(c) for c in wire.encode_blob("update", data, **{**HEADER, "round": round_}).chunks]
        blob = reassembler.add("dev-0", chunks[0])
        assert blob is not None and blob.header["round"] == round_
        assert reassembler.add("dev-0", chunks[0]) is None  # the same round again: a duplicate


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux /proc")
def test_part_way_blobs_cost_the_pages_that_arrived_and_a_flood_evicts_only_its_sender():
    """A first chunk claiming a large blob commits the memory its bytes are written to, not the claim; one source's
    flood of new blobs pushes out its own part-way blobs, never another source's."""
    claimed = 256 << 20
    reassembler = wire.Reassembler(max_blob_bytes=claimed)
    size = 1 << 20
    honest = [wire.decode(c) for c in wire.encode_blob(
        "update", wire.weights_bytes(weights(size // 4)), chunk_bytes=64 * 1024, **HEADER).chunks]
    assert reassembler.add("dev-1", honest[0]) is None
    before, peak = resident_bytes(), 0
    for i in range(40):  # first chunks of distinct blobs, each claiming 256 MiB
        data = bytes([i]) * wire.MIN_CHUNK_BYTES
        claim = dict(v=wire.SCHEMA_VERSION, kind="update", blob=f"{i:064x}", size=claimed, dtype=wire.WEIGHTS_DTYPE,
                     index=0, count=claimed // wire.MIN_CHUNK_BYTES, offset=0,
                     chunk_crc32c=google_crc32c.value(data), data=data, **HEADER)
        assert reassembler.add("dev-0", claim) is None
        assert reassembler.pending_blobs("dev-0") <= 2  # max_pending
        peak = max(peak, resident_bytes() - before)
    assert peak < 16 << 20, f"40 claims of 256 MiB made {peak >> 20} MiB resident"
    assert reassembler.evicted == 38
    assert reassembler.pending_blobs("dev-1") == 1  # untouched by the flood
    blob = None
    for chunk in honest[1:]:
        blob = reassembler.add("dev-1", chunk)
    assert blob is not None and len(blob.data) == size


def scattered_chunks(blobs: int, per_blob: int, size: int, spacing: int) -> list[bytes]:
    """Chunks of 4 bytes placed `spacing` apart over blobs of `size` bytes (a hostile sender's flood): each one
    valid on its own, none continuing what came before it."""
    data = b"abcd"
    return [pack(dict(v=wire.SCHEMA_VERSION, kind="update", blob=f"{b:064x}", size=size, dtype=wire.WEIGHTS_DTYPE,
                      index=i, count=size // wire.MIN_CHUNK_BYTES, offset=i * spacing, chunk_crc32c=wire.crc32c(data),
                      data=data, **HEADER))
            for b in range(blobs) for i in range(1, per_blob + 1)]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux /proc")
def test_scattered_chunks_cost_the_bytes_sent_not_a_page_each():
    """Chunks of 4 bytes placed a page or more apart each committed a page (a huge page 2 MiB apart: 66 of them grew a
    coordinator by 106 MB for 19 KB sent, 15x the bytes here). A chunk that does not continue its blob's written part
    is held as a copy until it does, so a part-way blob costs what its sender sent, within the stated bound."""
    size = 66 << 20
    messages = scattered_chunks(blobs=2, per_blob=16_000, size=size, spacing=4096)
    sent = sum(map(len, messages))
    reassembler = wire.Reassembler(max_blob_bytes=size)
    before = resident_bytes()
    for message in messages:
        assert reassembler.add("dev-0", wire.decode(message)) is None
    grown = resident_bytes() - before
    bound = wire.PENDING_COST_FACTOR * sent + reassembler.max_pending * wire.PENDING_COST_SLACK
    assert grown <= bound, f"{sent} bytes sent made {grown} bytes resident (bound {bound})"


def test_a_blob_whose_chunks_arrive_out_of_order_is_assembled_from_the_held_ones():
    w = weights(5000)
    chunks = [wire.decode(c) for c in wire.encode_blob("update", wire.weights_bytes(w),
                                                       chunk_bytes=wire.MIN_CHUNK_BYTES, **HEADER).chunks]
    reassembler = wire.Reassembler(max_blob_bytes=4 * 5000)
    order = [3, 1, 4, 0, 2, *range(5, len(chunks))]
    delivered = [b for i in order if (b := reassembler.add("dev-0", chunks[i])) is not None]
    assert len(delivered) == 1
    np.testing.assert_array_equal(delivered[0].weights(5000), w)


def test_a_blob_of_one_chunk_is_a_view_of_the_message_it_came_in_and_a_larger_one_a_buffer_of_the_pool():
    """A one-chunk blob (a model below CHUNK_BYTES) is delivered as a read-only view of its message, taking no
    buffer from the pool and copying nothing; a blob of several chunks is written into a buffer the pool lends. A
    one-chunk blob whose bytes are not its id is refused as ever."""
    pool = BufferPool(bytearray, 1 << 20, 0)
    w = weights(3000)
    message = bytearray(wire.encode_blob("update", wire.weights_bytes(w), **HEADER).chunks[0])
    blob = wire.Reassembler(max_blob_bytes=4 * 3000, buffers=pool).add("dev-0", wire.decode(message))
    assert blob is not None and blob.data.readonly and blob.data.obj is message and pool.kept_bytes == 0
    np.testing.assert_array_equal(blob.weights(3000), w)
    chunks = wire.encode_blob("update", wire.weights_bytes(w), chunk_bytes=wire.MIN_CHUNK_BYTES, **HEADER).chunks
    reassembler = wire.Reassembler(max_blob_bytes=4 * 3000, buffers=pool)
    delivered = [b for c in chunks if (b := reassembler.add("dev-0", wire.decode(c))) is not None]
    assert len(delivered) == 1 and delivered[0].data.obj is not None and pool.kept_bytes >= 4 * 3000
    np.testing.assert_array_equal(delivered[0].weights(3000), w)
    fields = wire.decode(message)
    fields["blob"] = wire.blob_id(b"something else")
    with pytest.raises(wire.WireError, match="does not match its id"):
        wire.Reassembler(max_blob_bytes=4 * 3000, buffers=pool).add("dev-0", fields)


def test_a_chunk_must_be_framed_and_nothing_else_may_be():
    chunk = wire.encode_blob("update", wire.weights_bytes(weights(64)), **HEADER).chunks[0]
    fields = unpack(chunk)
    cases = {
        "a chunk as one map": msgpack.packb(fields, use_bin_type=True),
        "a status framed": pack({"v": wire.SCHEMA_VERSION, "kind": "status", "device": "d", "state": "idle",
                                 "round": 3, "data": b"x"}),
        "a frame longer than its payload": wire.FRAMED + (1 << 20).to_bytes(4, "little") + chunk[5:],
    }
    header_length = int.from_bytes(chunk[1:5], "little")
    with_data = msgpack.packb({**msgpack.unpackb(chunk[5:5 + header_length]), "data": b"x"}, use_bin_type=True)
    cases["data in the framed fields too"] = (wire.FRAMED + len(with_data).to_bytes(4, "little") + with_data
                                              + chunk[5 + header_length:])
    for what, payload in cases.items():
        with pytest.raises(wire.WireError) as err:
            wire.decode(payload)
        assert err.value.reason == "malformed", what
    # the chunk's data is a view of the payload it arrived in, not a copy
    decoded = wire.decode(chunk)
    assert isinstance(decoded["data"], memoryview) and decoded["data"].obj is chunk
