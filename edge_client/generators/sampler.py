"""Sampling stored generators on the device: plain onnxruntime inference, no torch.

One `sampler.onnx` per spec takes the class's flat sampler buffer as an input, so a device needs one session for
all its classes. onnxruntime is imported through `ort_capi` first, which keeps its build check from importing
torch and onnx.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime  # noqa: E402

from edge_client.trainers.ort import session_options  # noqa: E402
from edge_client.trainers.ort_capi import C  # noqa: F401  # first: makes `import onnxruntime` torch-free
from models.generator_artifacts import SAMPLER_MODEL, load_generator_artifacts  # noqa: E402
from models.generator_record import GeneratorRecord  # noqa: E402


class OnnxSampler:
    """Draws samples from any class generator of the artifact folder's spec."""

    def __init__(self, artifact_dir: str | Path, threads: int = 1) -> None:
        directory = Path(artifact_dir)
        self.info = load_generator_artifacts(directory)
        self._session = onnxruntime.InferenceSession(
            str(directory / SAMPLER_MODEL), sess_options=session_options(threads), providers=["CPUExecutionProvider"]
        )

    def check(self, record: GeneratorRecord) -> None:
        """Refuse a record of another spec, or one whose sampler length does not fit this spec."""
        if record.spec != self.info.spec:
            raise ValueError(f"class {record.label}: its generator spec {record.spec} is not this sampler's "
                             f"{self.info.spec}")
        if record.sampler.shape != (self.info.sampler_size,):
            raise ValueError(f"class {record.label}: {record.sampler.shape[0]} sampler values, the spec has "
                             f"{self.info.sampler_size}")

    def sample(self, record: GeneratorRecord, n: int, rng: np.random.Generator) -> np.ndarray:
        """n samples (n, *input_shape) float32 from z ~ N(0, I) drawn with `rng`."""
        self.check(record)
        if n < 0:
            raise ValueError(f"n must be >= 0, not {n}")
        if n == 0:
            return np.empty((0, *self.info.input_shape), dtype=np.float32)
        z = rng.standard_normal((n, self.info.latent_dim)).astype(np.float32)
        return self.run(z, record.sampler)

    def run(self, z: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The sampler graph on given latents and flat weights (what `sample` runs; exposed for parity checks)."""
        return self._session.run(["x"], {"z": z, "weights": weights})[0]
