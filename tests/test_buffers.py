"""Receive buffers kept for reuse (edgefil/buffers.py): a kept buffer is handed out again once nothing refers to it,
never while a view, an array or a blob made from it is alive; what a pool keeps stays within its bound; and a blob
reassembled into a kept buffer commits no new memory (the page faults the pool exists to save)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from edgefil import wire
from edgefil.buffers import BufferPool, capacity_for

MIN = 1024


def pool(max_bytes: int = 1 << 20) -> BufferPool[bytearray]:
    return BufferPool(bytearray, max_bytes=max_bytes, min_bytes=MIN)


def test_a_buffer_nothing_refers_to_is_handed_out_again():
    buffers = pool()
    first = buffers.take(4096)
    assert len(first) == capacity_for(4096)
    first_id = id(first)
    del first
    again = buffers.take(4096)
    assert id(again) == first_id and buffers.reused == 1  # kept by the pool, so the id names the same object


@pytest.mark.parametrize("hold", ["buffer", "memoryview", "slice", "array", "readonly view"])
def test_a_buffer_something_refers_to_is_never_handed_out(hold):
    buffers = pool()
    first = buffers.take(4096)
    first[:] = b"\x01" * len(first)
    held = {"buffer": lambda b: b, "memoryview": memoryview, "slice": lambda b: memoryview(b)[10:20],
            "array": lambda b: np.frombuffer(b, np.uint8), "readonly view": lambda b: memoryview(b).toreadonly()}[hold]
    kept = held(first)
    del first
    second = buffers.take(4096)
    second[:] = b"\x02" * len(second)
    assert bytes(kept) == b"\x01" * len(bytes(kept)) and buffers.reused == 0
    del kept, second
    buffers.take(4096)
    assert buffers.reused == 1  # the view gone, its buffer is free again


def test_a_kept_buffer_serves_sizes_it_fits_closely_and_small_ones_are_never_kept():
    buffers = pool()
    capacity = len(buffers.take(8000))
    assert len(buffers.take(capacity)) == capacity and buffers.reused == 1  # the largest size it serves
    assert len(buffers.take(capacity * 9 // 10)) == capacity and buffers.reused == 2  # a tenth smaller
    assert len(buffers.take(capacity // 2)) != capacity and buffers.reused == 2  # half: a new buffer
    kept = buffers.kept_bytes
    buffers.take(MIN - 1)
    buffers.take(MIN - 1)
    assert buffers.kept_bytes == kept and buffers.reused == 2  # below min_bytes: never kept


def test_what_a_pool_keeps_stays_within_its_bound_and_free_buffers_go_first():
    buffers = pool(max_bytes=3 * capacity_for(4096))
    held = [buffers.take(4096) for _ in range(5)]  # 3 kept, 2 ordinary allocations
    assert buffers.kept_bytes == 3 * capacity_for(4096)
    newest = id(held[2])
    held[0][:6] = b"oldest"  # told apart by contents: a freed buffer's id may well be reused by `larger`
    del held
    larger = buffers.take(8192)  # does not fit beside the 3 free ones: free ones go, oldest first, to make room
    kept = [id(b) for b in buffers._buffers]
    assert kept == [newest, id(larger)]
    assert buffers.kept_bytes == capacity_for(4096) + capacity_for(8192) <= buffers.max_bytes
    assert not any(bytes(b[:6]) == b"oldest" for b in buffers._buffers)  # bytearray() is zeroed: no false match


def test_a_pool_of_no_bytes_keeps_nothing():
    buffers = pool(max_bytes=0)
    for _ in range(3):
        assert len(buffers.take(4096)) == 4096
    assert buffers.kept_bytes == 0 and buffers.reused == 0


def blob_chunks(values: np.ndarray, round_: int) -> list[wire.Message]:
    return [wire.decode(bytes(frame)) for frame in wire.encode_blob(
        "update", wire.weights_bytes(values), device="d", round=round_, task=0, model="0" * 64, num_samples=1,
        metrics={}).frames]


def assemble(reassembler: wire.Reassembler, chunks: list[wire.Message]) -> wire.Blob:
    blobs = [blob for chunk in chunks if (blob := reassembler.add("d", chunk)) is not None]
    assert len(blobs) == 1
    return blobs[0]


def test_a_reassembler_puts_a_blob_into_the_buffer_of_one_that_is_gone_and_never_of_one_still_held():
    n = 600_000  # 2.4 MB: kept (>= 1 MiB)
    rng = np.random.default_rng(0)
    first, second, third = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    buffers: BufferPool = BufferPool(wire._blob_buffer, max_bytes=64 << 20, min_bytes=wire.REUSED_BLOB_BYTES)
    reassembler = wire.Reassembler(max_blob_bytes=4 * n, buffers=buffers)
    held = assemble(reassembler, blob_chunks(first, 1)).weights(n)
    received = assemble(reassembler, blob_chunks(second, 2)).weights(n)
    assert buffers.reused == 0  # the first blob's weights are still held: the second got a buffer of its own
    np.testing.assert_array_equal(held, first)
    np.testing.assert_array_equal(received, second)
    del received
    received = assemble(reassembler, blob_chunks(third, 3)).weights(n)
    assert buffers.reused == 1
    np.testing.assert_array_equal(received, third)
    np.testing.assert_array_equal(held, first)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux /proc")
def test_a_blob_put_into_a_kept_buffer_commits_no_new_memory():
    """The second of two 40 MB blobs, the first one dropped, takes the first one's pages: resident memory does not
    grow by a blob (without the pool it grew by the blob's 40 MB, its pages faulted and cleared afresh)."""
    n = 10_000_000
    values = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    buffers: BufferPool = BufferPool(wire._blob_buffer, max_bytes=256 << 20, min_bytes=wire.REUSED_BLOB_BYTES)
    reassembler = wire.Reassembler(max_blob_bytes=4 * n, buffers=buffers)
    first, second = blob_chunks(values, 1), blob_chunks(values, 2)
    assemble(reassembler, first)  # dropped at once
    before = resident_bytes()
    blob = assemble(reassembler, second)
    grown = resident_bytes() - before
    assert buffers.reused == 1
    assert grown < 4 * n // 10, f"the second blob made {grown / 1e6:.1f} MB resident"
    np.testing.assert_array_equal(blob.weights(n), values)
