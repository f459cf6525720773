"""Where aggregation runs, and how a weight buffer from the network becomes a tensor without a copy.

Updates arrive as `np.frombuffer(payload, dtype="<f4")`, read-only when the payload is `bytes`. On the CPU they
are wrapped, never copied: a 1000-client round of an 11M-parameter model is 44 GB of updates, and a copy would
double the memory traffic of a rule that is memory-bound. Aggregation only ever reads these tensors.
"""
from __future__ import annotations

import math
import re
import warnings
import weakref
from collections.abc import Iterator

import numpy as np
import torch

_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def resolve_device(name: str = "auto") -> torch.device:
    """"auto": cuda where torch sees a GPU, else cpu; "cpu"; "cuda" or "cuda:N" (RuntimeError without CUDA)."""
    if not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"unknown device {name!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(name)


def as_tensor(weights: np.ndarray, device: torch.device) -> torch.Tensor:
    """A flat float32 tensor of `weights`: the same memory on the CPU (read-only arrays included), one
    host-to-device copy on a GPU. Callers must not write into the result: it may alias a network buffer."""
    if weights.ndim != 1 or weights.dtype != np.float32 or not weights.flags.c_contiguous:
        raise ValueError(f"weights must be a contiguous flat float32 array, got shape {weights.shape}, dtype "
                         f"{weights.dtype}, strides {weights.strides}")
    try:
        # DLPack 1.0 carries numpy's read-only flag, so torch wraps read-only arrays without a copy or a warning
        host = torch.from_dlpack(weights, copy=False)
    except BufferError:
        # numpy < 2.1 cannot export read-only arrays over DLPack; torch.from_numpy wraps them but warns that writing
        # would be undefined, and nothing here writes
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            host = torch.from_numpy(weights)
    return host if device.type == "cpu" else host.to(device)


BLOCK = 1 << 16  # float32 values widened at a time on the CPU: 512 KiB of float64, cache-sized


def float64_blocks(size: int, buffer: np.ndarray | None = None) -> Iterator[tuple[slice, np.ndarray]]:
    """The CPU's way through a model in float64: BLOCK values at a time, each with the same small float64 buffer
    to widen them into (so no model-sized float64 copy is ever made); `buffer`: one to use, `block_buffer(size)`
    long, where the caller keeps one."""
    buffer = block_buffer(size) if buffer is None else buffer
    for start in range(0, size, BLOCK):
        stop = min(start + BLOCK, size)
        yield slice(start, stop), buffer[: stop - start]


def block_buffer(size: int) -> np.ndarray:
    """The float64 buffer `float64_blocks` widens a model of `size` values into."""
    return np.empty(min(BLOCK, size), dtype=np.float64)


def distance(global_weights: np.ndarray, weights: np.ndarray) -> float:
    """||w - g|| in float64 (finite for any finite float32 weights), a block at a time (`float64_blocks`): no
    model-sized copy. The sum of squares is einsum's, on this thread: np.dot hands it to BLAS, whose threads wait
    for busy cores (measured beside a running test suite: 22 ms per million values, against 1 ms)."""
    total = 0.0
    for block, part in float64_blocks(weights.size):
        np.subtract(weights[block], global_weights[block], out=part, dtype=np.float64)
        total += float(np.einsum("i,i->", part, part))
    return math.sqrt(total)


class UpdateChanges:
    """The changes w - g of a round's updates from its global model g, in float64, for the bounds that measure them
    (coordinator/guard.py, coordinator/influence.py): `of(weights)` widens an update's change once, into one buffer
    the round keeps, however many bounds then read it. A later update of a stream is measured by six (its distance,
    the last step's and the others' directions, the copy check, the way back, the direction check's sum), and each
    widened it again, a block at a time: on MNIST-1D's cnn1d a stream's bounds and fold took 143-158 us an update
    alone, 95-101 with the change widened once, most of it numpy's calls rather than arithmetic (docs/results.md,
    issue 57). The buffer is one more model-sized float64 array for the round, beside its running sum and the
    direction check's sum; on a large model, one widening an update where there were six, each reading its float32
    weights and the global model's.

    The buffer holds the change of the weights asked about last: a caller reads it before asking about other
    weights, and never writes into it. Weights are not changed in place while they are bounded: an update's are a
    read-only view of its message, and a bound that changes an update makes a new array."""

    def __init__(self, global_weights: np.ndarray) -> None:
        self.global_weights = global_weights
        self._buffer = np.empty(global_weights.size, dtype=np.float64)
        # whose change the buffer holds: a weak reference, so that an update's buffer is let go once the round is
        # done with it (tests/test_round_aggregation.py), and a new array at a dead one's address is no match
        self._weights: weakref.ref[np.ndarray] | None = None
        self._squared: float | None = None

    def of(self, weights: np.ndarray) -> np.ndarray:
        """w - g in float64: the round's buffer, valid until the next call with other weights."""
        if self._weights is None or self._weights() is not weights:
            np.subtract(weights, self.global_weights, out=self._buffer, dtype=np.float64)
            self._weights, self._squared = weakref.ref(weights), None
        return self._buffer

    def squared(self, weights: np.ndarray) -> float:
        """||w - g||^2 (einsum, not BLAS: `distance`)."""
        change = self.of(weights)
        if self._squared is None:
            self._squared = float(np.einsum("i,i->", change, change))
        return self._squared

    def length(self, weights: np.ndarray) -> float:
        """||w - g||, as `distance` measures it up to the summation's order."""
        return math.sqrt(self.squared(weights))


def within_length(global_weights: np.ndarray, weights: np.ndarray, longest: float, moved: float | None = None
                  ) -> np.ndarray:
    """`weights` with its change from `global_weights` at most `longest` long (L2): scaled back onto it in float64
    when longer (a new float32 array), else `weights` itself. `moved`: the change's length where the caller has it
    (`distance`). What the guard's size bound clips to and central DP's clip (coordinator/privacy.py) both are."""
    moved = distance(global_weights, weights) if moved is None else moved
    if moved <= longest:
        return weights
    change = (weights.astype(np.float64) - global_weights) * (longest / moved)
    return (global_weights + change).astype(np.float32)


class RunningSum:
    """sum_k c_k w_k over float32 updates, in one float64 total on `device`: the arithmetic of a rule that folds.

    On the CPU each update is read in place and widened a block at a time into one small buffer, by numpy: torch's
    mixed-precision add_ is not vectorised there (70x slower than a float32 add over 11M values), and torch's
    element-wise ops split even a small block over its threads, which on a machine whose cores are busy (a fleet's
    workers beside the coordinator) wait for a descheduled thread (measured: 5 ms for a 256K block against 0.09 ms
    on one thread). numpy runs each block on this thread: 0.44 ms per million values here.

    On cuda each update goes through one of two pinned host buffers and a copy stream (`_Staging`): `add` returns
    once the update is in pinned memory and its copy and fold are queued, so the next update's host copy overlaps
    this one's transfer and fold, and the transfer runs at pinned-memory speed.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.total = torch.zeros(size, dtype=torch.float64, device=device)
        self._staging = _Staging(size, device) if device.type == "cuda" else None
        # on the CPU: the total's numpy view and the widening buffer, made once (each update made both afresh:
        # 10-15 us an update on a 5k-value model, a few percent of the coordinator's work on it)
        self._on_host = (self.total.numpy(), block_buffer(size)) if self._staging is None else None

    def add(self, weights: np.ndarray, coefficient: float) -> None:
        if weights.ndim != 1 or weights.dtype != np.float32 or weights.size != self.total.numel():
            raise ValueError(f"need {self.total.numel()} flat float32 values, got {weights.dtype} {weights.shape}")
        if self._on_host is None:
            assert self._staging is not None
            self._staging.add(self.total, weights, coefficient)
            return
        out, buffer = self._on_host
        for block, wide in float64_blocks(weights.size, buffer):
            np.multiply(weights[block], coefficient, out=wide, dtype=np.float64)
            np.add(out[block], wide, out=out[block])

    def add_wide(self, total: np.ndarray) -> None:
        """Another running sum's float64 `total` (`values`), added as it is."""
        if total.shape != (self.total.numel(),) or total.dtype != np.float64:
            raise ValueError(f"need {self.total.numel()} flat float64 values, got {total.dtype} {total.shape}")
        self.total.add_(torch.from_numpy(total).to(self.total.device))

    def values(self) -> np.ndarray:
        """The float64 total so far, on the host (a copy where it lives on a GPU)."""
        return self.total.cpu().numpy()

    def clear(self) -> None:
        self.total.zero_()

    def divided(self, divisor: float) -> torch.Tensor:
        """total / divisor as a new float32 tensor (the total is spent: divided in place first)."""
        return self.total.div_(divisor).to(torch.float32)


class _Staging:
    """Two pinned host buffers and their device twins, used in turn; a copy stream moves each to the device and the
    fold waits for it on the compute stream. A buffer is written again only once the fold that read its twin is
    done (which also means its copy is)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pinned = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.staged = [torch.empty(size, dtype=torch.float32, device=device) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def add(self, total: torch.Tensor, weights: np.ndarray, coefficient: float) -> None:
        k, self.turn = self.turn, 1 - self.turn
        done = self.done[k]
        if done is not None:
            done.synchronize()
        np.copyto(self.pinned[k].numpy(), weights)
        with torch.cuda.stream(self.stream):
            self.staged[k].copy_(self.pinned[k], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        total.add_(self.staged[k], alpha=coefficient)
        finished = torch.cuda.Event()
        finished.record(compute)
        self.done[k] = finished
