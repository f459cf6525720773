"""Receive buffers kept for reuse: the next large packet or blob of about the same size is written into memory
that an earlier one used, not into memory fresh from the kernel.

Why: every model of every round reaches each device, and every update reaches the coordinator, as ~1 MB packets,
each read into a buffer of its own and copied into a buffer of the whole blob. Memory fresh from the kernel costs a
page fault and a cleared page the first time each 4 KiB of it is written (each 2 MiB where it has huge pages):
writing 44 MB into a fresh blob buffer took 12.5 ms of CPU here, into one written before 6.4 ms, and a fresh,
zeroed 1 MB packet buffer cost about as much again per byte. With 20 devices and an 11M-parameter model, the
coordinator took 47,000 page faults a round and each device 3,000 (`benchmarks/transport.py`).

A buffer is handed out again only when nothing refers to it any more: no memoryview, array, message or blob made
from it is alive, so no reader ever sees its bytes change. CPython counts references exactly; a kept buffer is free
when its count is back to what the pool's own reference makes, a number measured when the pool is made, not
assumed. On another Python the pool keeps nothing and every buffer is new. Its contents are whatever was written
there before: a caller writes before it reads (a blob exposes only the bytes its chunks wrote).

What a pool keeps is bounded: buffers of `min_bytes` or more (smaller ones cost little to fault), at most `max_bytes`
of them, in use or free. Free ones are memory the process committed earlier and holds on to, never more than
`max_bytes` beyond what is in use; when a new buffer does not fit, free ones go, oldest first.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Buffer = TypeVar("Buffer")

_COUNTS_REFERENCES = sys.implementation.name == "cpython"


def capacity_for(size: int) -> int:
    """The capacity a new buffer gets for `size` bytes: a sixteenth more, so that the next packet or blob of a
    stream, a few bytes longer (a chunk's header varies), fits it too."""
    return size + size // 16


class BufferPool(Generic[Buffer]):
    """Buffers of at least `min_bytes`, made by `allocate(capacity)` and kept (at most `max_bytes` of them) for
    reuse once nothing refers to them (see the module docstring). Thread-safe."""

    def __init__(self, allocate: Callable[[int], Buffer], max_bytes: int, min_bytes: int) -> None:
        self.allocate = allocate
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._buffers: list[Buffer] = []  # kept, oldest first
        self._capacities: list[int] = []  # their capacities, in the same order (never bound to a name: see _free)
        self._kept_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again
        self._idle_references = self._calibrate() if _COUNTS_REFERENCES and max_bytes > 0 else None

    def _calibrate(self) -> int:
        """The reference count `_references` shows for a kept buffer that nothing else refers to."""
        self._buffers.append(object())  # type: ignore[arg-type]  # any object: only its count is read
        try:
            return self._references(0)
        finally:
            self._buffers.clear()

    def _references(self, index: int) -> int:
        return sys.getrefcount(self._buffers[index])

    def take(self, size: int) -> Buffer:
        """A buffer of at least `size` bytes (of capacity at most `size` + an eighth): a kept one that nothing
        refers to, else a new one, kept if the pool has room. What it holds is left from before."""
        if size < self.min_bytes or self._idle_references is None:
            return self.allocate(size)
        with self._lock:
            for index, capacity in enumerate(self._capacities):
                if size <= capacity <= size + size // 8 and self._references(index) == self._idle_references:
                    self.reused += 1
                    return self._buffers[index]
            capacity = capacity_for(size)
            if self._kept_bytes + capacity > self.max_bytes:
                self._drop_free(self._kept_bytes + capacity - self.max_bytes)
            buffer = self.allocate(capacity)
            if self._kept_bytes + capacity <= self.max_bytes:
                self._buffers.append(buffer)
                self._capacities.append(capacity)
                self._kept_bytes += capacity
            return buffer

    def _drop_free(self, excess: int) -> None:
        """Stop keeping free buffers, oldest first, until `excess` bytes are let go (or none is free)."""
        index = 0
        while excess > 0 and index < len(self._buffers):
            if self._references(index) == self._idle_references:
                excess -= self._capacities[index]
                self._kept_bytes -= self._capacities.pop(index)
                del self._buffers[index]
            else:
                index += 1

    @property
    def kept_bytes(self) -> int:
        """The capacity of the buffers kept, in use or free."""
        return self._kept_bytes
