"""Torch modules <-> the flat float32 weight buffer that devices, the wire and the coordinator exchange."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from models.manifest import Manifest


def flatten_weights(model: nn.Module, manifest: Manifest) -> np.ndarray:
    """The model's parameters as one float32 buffer in the manifest's order."""
    params = dict(model.named_parameters())
    return np.concatenate(
        [params[p.name].detach().cpu().numpy().astype(np.float32).ravel() for p in manifest.parameters]
    )


def load_flat_weights(model: nn.Module, manifest: Manifest, buffer: np.ndarray) -> None:
    """Copy a flat float32 buffer (manifest order) into the model's parameters."""
    buffer = np.asarray(buffer)
    if buffer.dtype != np.float32 or buffer.shape != (manifest.num_parameters,):
        raise ValueError(
            f"expected a float32 buffer of {manifest.num_parameters} values, got {buffer.dtype} {buffer.shape}"
        )
    params = dict(model.named_parameters())
    offset = 0
    with torch.no_grad():
        for info in manifest.parameters:
            chunk = buffer[offset : offset + info.size].reshape(info.shape)
            params[info.name].copy_(torch.tensor(chunk))
            offset += info.size
