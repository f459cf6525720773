"""The weights an exported artifact set starts from, in manifest order (host side).

The coordinator starts every run from these, so every device and the coordinator begin at the same model. They
are a flat float32 file (`weights.bin`), readable without ONNX Runtime Training."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from models.manifest import WEIGHTS, ManifestError, load_manifest


def checkpoint_weights(artifacts: str | Path) -> np.ndarray:
    """The set's initial parameters as one flat float32 buffer (manifest order); a nominal set has none."""
    manifest = load_manifest(artifacts)
    if manifest.nominal_checkpoint:
        raise ManifestError(f"{artifacts} ships a nominal (weight-less) checkpoint: export it without --nominal "
                            "for the coordinator")
    weights = np.fromfile(Path(artifacts) / WEIGHTS, dtype="<f4")
    if weights.size != manifest.num_parameters:
        raise ManifestError(f"{artifacts}/{WEIGHTS} holds {weights.size} values, the manifest lists "
                            f"{manifest.num_parameters}")
    return weights.astype(np.float32, copy=False)
