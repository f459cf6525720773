"""Where aggregation runs, and how a weight buffer from the network becomes a tensor without a copy.

Updates arrive as `np.frombuffer(payload, dtype="<f4")`, read-only when the payload is `bytes`. On the CPU they
are wrapped, never copied: a 1000-client round of an 11M-parameter model is 44 GB of updates, and a copy would
double the memory traffic of a rule that is memory-bound. Aggregation only ever reads these tensors.
"""
from __future__ import annotations

import re
import warnings

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
