"""Feature statistics a device sends of its data: per-layer means and variances, as a named attachment.

A method that inverts models on the server (a data-free generator matching the statistics of the data the
models saw, as DeepInversion matches BatchNorm's running statistics) needs those statistics. The zoo's models
normalise with GroupNorm, which keeps none (and ORT's training artifacts would not update running statistics
anyway), and a device's flat weight buffer carries parameters only. So a device measures them itself, on its
own samples, with an eval-mode forward pass every backend has (`Trainer.feature_statistics`), and attaches them
to its update:

- "input": each input channel's mean and variance over the samples and positions (C values each);
- "features": each penultimate feature's mean and variance over the samples (feature_dim values each), the
  input of the head.

What they reveal: two moments of the device's data at two layers, no sample. With one sample the "features" mean
is that sample's penultimate features and its variance zero (a model inversion could start from them), so a
policy sends statistics only over at least `MIN_SAMPLES` samples (a setting of the method that sends them).
This module is numpy and msgpack only: the device encodes, the coordinator decodes and checks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

STATISTICS = "stats/features"  # the attachment's name
LAYERS = ("input", "features")
MIN_SAMPLES = 2


@dataclass(frozen=True)
class LayerStatistics:
    """One layer's statistics over `count` samples: `mean` and (population) `var` per channel or feature."""

    name: str
    mean: np.ndarray
    var: np.ndarray
    count: int


def statistics_of(x: np.ndarray, features: np.ndarray) -> tuple[LayerStatistics, LayerStatistics]:
    """The "input" statistics of a batch x (N, C, ...) and the "features" statistics of its features (N, F)."""
    channels = np.moveaxis(np.asarray(x, dtype=np.float64), 1, 0).reshape(x.shape[1], -1)
    feats = np.asarray(features, dtype=np.float64)
    return (LayerStatistics("input", channels.mean(1).astype(np.float32), channels.var(1).astype(np.float32), len(x)),
            LayerStatistics("features", feats.mean(0).astype(np.float32), feats.var(0).astype(np.float32), len(x)))


def layer_sizes(input_shape: Sequence[int], feature_dim: int) -> dict[str, int]:
    """Each layer's count of values of a model with this input shape (C, ...) and feature dimension: what
    `decode_statistics` checks an attachment against."""
    return {"input": int(input_shape[0]), "features": int(feature_dim)}


def encode_statistics(layers: Sequence[LayerStatistics]) -> bytes:
    return msgpack.packb({"layers": [{"name": s.name, "mean": np.ascontiguousarray(s.mean, "<f4").tobytes(),
                                      "var": np.ascontiguousarray(s.var, "<f4").tobytes(), "count": int(s.count)}
                                     for s in layers]}, use_bin_type=True)


def decode_statistics(data: bytes, sizes: Mapping[str, int]) -> dict[str, LayerStatistics]:
    """The statistics of an attachment, checked against the layer sizes of the run's model (`sizes`: name ->
    values); ValueError, in one line, for anything else: an unknown or missing layer, a wrong size, a value that
    is not finite, a negative variance, fewer than MIN_SAMPLES samples."""
    try:
        raw = msgpack.unpackb(data, raw=False, max_bin_len=1 << 24, max_array_len=16, max_map_len=16,
                              max_str_len=64)
        entries = raw["layers"]
        if not isinstance(entries, list):
            raise TypeError("layers is not a list")
    except Exception as err:
        raise ValueError(f"feature statistics do not decode: {type(err).__name__}") from None
    out: dict[str, LayerStatistics] = {}
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("name") not in sizes or entry["name"] in out:
            raise ValueError(f"feature statistics name layers {sorted(sizes)} once each")
        name, size, count = entry["name"], sizes[entry["name"]], entry.get("count")
        arrays = []
        for key in ("mean", "var"):
            value = entry.get(key)
            if not isinstance(value, bytes) or len(value) != 4 * size:
                raise ValueError(f"feature statistics of {name!r}: {key} is not {size} float32 values")
            arrays.append(np.frombuffer(value, "<f4").astype(np.float32))
        if not all(np.isfinite(a).all() for a in arrays) or (arrays[1] < 0).any():
            raise ValueError(f"feature statistics of {name!r}: values not finite or a negative variance")
        if isinstance(count, bool) or not isinstance(count, int) or count < MIN_SAMPLES:
            raise ValueError(f"feature statistics of {name!r}: over {count!r} samples, at least {MIN_SAMPLES}")
        out[name] = LayerStatistics(name, arrays[0], arrays[1], count)
    if set(out) != set(sizes):
        raise ValueError(f"feature statistics name layers {sorted(sizes)} once each")
    return out
