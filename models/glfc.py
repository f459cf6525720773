"""GLFC's file formats and the arithmetic both of its halves share (spec: shared/specs/glfc.md).

- A device's prototype gradient (Sec. 4.2): the gradient of the cross-entropy of the fixed encoding network Gamma
  at one prototype sample, w.r.t. Gamma's parameters, float32 in Gamma's manifest order, attached to its update as
  `glfc/prototype/<k>` (k = 0, 1, ...; no label: the proxy reads it from the gradient, `infer_label`).
- The proxy's old model (the best global model of the previous task), broadcast to every device as
  `glfc/old-model` (float32 weights, manifest order) with `glfc/old-task` (the task it is the best of, int32).
"""
from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from models.manifest import HEAD_WEIGHT, ParameterInfo, named_parameter

PROTOTYPE_PREFIX = "glfc/prototype/"
OLD_MODEL = "glfc/old-model"
OLD_TASK = "glfc/old-task"
MAX_PROTOTYPES = 256  # per update: a device uploads one per new class of its task
GAMMA_AUTO = "auto"  # Gamma chosen by the model's inputs (`gamma_model`): both halves' default
IMAGE_GAMMA, ANY_GAMMA = "glfc_lenet", "glfc_mlp"
_NAME = re.compile(r"glfc/prototype/(\d{1,3})")


def gamma_model(gamma: str, input_shape: Sequence[int]) -> str:
    """The registered model Gamma is: `gamma` where it names one; for "auto" (both halves' default) the authors'
    sigmoid LeNet where the inputs are images (channels, height, width) and the small `glfc_mlp` otherwise. The
    paper encodes images only; a fleet of GLFC on a signal (MNIST-1D's) stopped at its export with the LeNet, so a
    user had to know to name `glfc_mlp` on both halves (the benchmarks did)."""
    if gamma != GAMMA_AUTO:
        return gamma
    return IMAGE_GAMMA if len(input_shape) == 3 else ANY_GAMMA


def prototype_name(k: int) -> str:
    return f"{PROTOTYPE_PREFIX}{k}"


def is_prototype(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def encode_gradient(gradient: np.ndarray) -> bytes:
    return np.ascontiguousarray(gradient, dtype="<f4").tobytes()


def decode_gradient(data: bytes, parameters: Sequence[ParameterInfo]) -> np.ndarray:
    """A prototype gradient as float32; ValueError unless it is exactly Gamma's parameters, all finite."""
    size = sum(p.size for p in parameters)
    if len(data) != 4 * size:
        raise ValueError(f"a prototype gradient of {len(data)} bytes is not Gamma's {size} float32 values")
    gradient = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(gradient).all():
        raise ValueError("a prototype gradient holds NaN or Inf values")
    return gradient


def head_gradient(gradient: np.ndarray, parameters: Sequence[ParameterInfo]) -> np.ndarray:
    """The gradient of the last layer's weight (classes x features) inside a flat gradient."""
    return named_parameter(gradient, parameters, HEAD_WEIGHT)


def infer_label(gradient: np.ndarray, parameters: Sequence[ParameterInfo]) -> int:
    """The label of a single-sample cross-entropy gradient: the last layer's row j gets (p_j - [j = y]) h, and with
    non-negative features h (Gamma's sigmoid) only the label's row sums below zero: argmin_j sum_k dW_jk
    (iDLG's rule, as GLFC's authors' code)."""
    return int(head_gradient(gradient, parameters).sum(axis=1).argmin())


def encode_old_model(weights: np.ndarray, task: int) -> dict[str, bytes]:
    return {OLD_MODEL: np.ascontiguousarray(weights, dtype="<f4").tobytes(), OLD_TASK: struct.pack("<i", task)}


def decode_old_model(payloads: Mapping[str, bytes], num_parameters: int) -> tuple[np.ndarray, int] | None:
    """(weights, task) of a broadcast old model; None when there is none or it is not this model's (or not
    finite)."""
    data, task = payloads.get(OLD_MODEL), payloads.get(OLD_TASK)
    if data is None or task is None or len(task) != 4 or len(data) != 4 * num_parameters:
        return None
    weights = np.frombuffer(data, dtype="<f4").astype(np.float32)
    return (weights, struct.unpack("<i", task)[0]) if np.isfinite(weights).all() else None
