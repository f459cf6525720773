"""The weights an exported artifact set starts from, read off its ORT checkpoint in manifest order (host side).

The coordinator starts every run from these, so every device and the coordinator begin at the same model."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from models.manifest import CHECKPOINT, ManifestError, load_manifest


def checkpoint_weights(artifacts: str | Path) -> np.ndarray:
    """The checkpoint's parameters as one flat float32 buffer (manifest order); a nominal checkpoint has none."""
    from onnxruntime.training.api import CheckpointState

    manifest = load_manifest(artifacts)
    if manifest.nominal_checkpoint:
        raise ManifestError(f"{artifacts} ships a nominal (weight-less) checkpoint: export it without --nominal "
                            "for the coordinator")
    state = CheckpointState.load_checkpoint(str(Path(artifacts) / CHECKPOINT))
    parts = [np.asarray(state.parameters[p.name].data, dtype=np.float32).ravel() for p in manifest.parameters]
    return np.ascontiguousarray(np.concatenate(parts))
