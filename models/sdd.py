"""SDD's replay payload, what both halves read (spec: shared/specs/fewshot-sdd.md). numpy only: a device imports it.
The generator the coordinator trains is `models/sdd_generator.py`.

The replay payload (`sdd/replay`, broadcast to every device): the synthetic samples of every session so far,
float16 inputs (half float32's bytes; digits and MNIST-1D lose nothing a classifier sees) and int16 labels (the
label each was generated for: a device relabels them with its old model before it replays them, Sec. 2.1).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

REPLAY = "sdd/replay"
_HEADER = 12  # count (u32), then the sample shape's size (u32) and the bytes of one label (u32)


def encode_replay(x: np.ndarray, y: np.ndarray) -> bytes:
    """Synthetic samples as one payload: a header, float16 inputs, int16 labels."""
    n = len(y)
    header = np.array([n, int(np.prod(x.shape[1:])), 2], dtype="<u4").tobytes()
    return header + np.ascontiguousarray(x, "<f2").tobytes() + np.ascontiguousarray(y, "<i2").tobytes()


def decode_replay(data: bytes, input_shape: Sequence[int], num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples of a replay payload as float32 inputs and int64 labels; ValueError unless it holds samples of
    this input shape, finite, with labels among the classes."""
    if len(data) < _HEADER:
        raise ValueError("a replay payload shorter than its header")
    n, size, label_bytes = (int(v) for v in np.frombuffer(data[:_HEADER], "<u4"))
    if size != math.prod(input_shape) or label_bytes != 2 or len(data) != _HEADER + n * (2 * size + 2):
        raise ValueError(f"a replay payload of {len(data)} bytes is not {n} samples of shape {tuple(input_shape)}")
    x = np.frombuffer(data, "<f2", n * size, _HEADER).astype(np.float32).reshape(n, *input_shape)
    y = np.frombuffer(data, "<i2", n, _HEADER + 2 * n * size).astype(np.int64)
    if not np.isfinite(x).all() or (len(y) and (y.min() < 0 or y.max() >= num_classes)):
        raise ValueError("a replay payload with values not finite or labels outside the classes")
    return x, y


