"""VAE generators trained with ONNX Runtime Training on the exported artifacts (no torch, no onnx).

Drives ORT's binding layer (CheckpointState, Module, Optimizer) like `edge_client.trainers.ort`. Every call loads
the checkpoint afresh, so the optimizer's moments start from zero for each class, and a generator trained from
scratch starts from the checkpoint's seeded weights. Weights move between ORT's flat parameter buffer and the
sampler/encoder buffers through the layout in generator.json.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_client.generators.training import GeneratorTrainer, batch_indices
from edge_client.trainers.ort import ALL_PARAMETERS, ORT_ERROR, session_options
from edge_client.trainers.ort_capi import C
from models.generator_artifacts import load_generator_artifacts
from models.generator_kinds import VAE_KINDS
from models.manifest import CHECKPOINT, EVAL_MODEL, OPTIMIZER_MODELS, TRAINING_MODEL, ManifestError


class OrtVaeTrainer(GeneratorTrainer):
    """Trains VAE class generators (encoder and decoder) with the artifacts' AdamW."""

    def __init__(self, artifact_dir: str | Path, batch_size: int = 64, lr: float = 1e-3, threads: int = 1) -> None:
        super().__init__()
        self._dir = Path(artifact_dir)
        info = load_generator_artifacts(self._dir)
        if info.kind not in VAE_KINDS or not info.ort_layout:
            raise ManifestError(f"{self._dir} holds no ORT training artifacts for a VAE generator")
        self.spec, self.sampler_size, self.auxiliary_size = info.spec, info.sampler_size, info.auxiliary_size
        self._latent = info.latent_dim
        self._sampler_index, self._auxiliary_index = info.ort_indices()
        self.batch_size, self.lr = batch_size, lr
        self._options = session_options(threads)
        self._optimizer_options = session_options(threads, log_severity=ORT_ERROR)
        self._device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)

    def _fit(self, x: np.ndarray, sampler: np.ndarray | None, auxiliary: np.ndarray | None, steps: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        state = C.load_checkpoint(str(self._dir / CHECKPOINT))
        module = C.Module(str(self._dir / TRAINING_MODEL), state, str(self._dir / EVAL_MODEL), self._device,
                          self._options)
        # An OrtValue made from numpy aliases the array's memory without owning it: keep both.
        host = np.zeros(module.get_parameters_size(ALL_PARAMETERS), dtype=np.float32)
        buffer = C.OrtValue.ortvalue_from_numpy(host, self._device)
        module.copy_parameters_to_buffer(buffer, ALL_PARAMETERS)
        if sampler is not None:
            host[self._sampler_index] = sampler
        if auxiliary is not None:
            host[self._auxiliary_index] = auxiliary
        module.copy_buffer_to_parameters(buffer, ALL_PARAMETERS)
        optimizer = C.Optimizer(str(self._dir / OPTIMIZER_MODELS["adamw"]), state, self._device,
                                self._optimizer_options)
        optimizer.set_learning_rate(self.lr)
        for _ in range(steps):
            batch = np.ascontiguousarray(x[batch_indices(len(x), self.batch_size, rng)])
            eps = rng.standard_normal((len(batch), self._latent)).astype(np.float32)
            fetches = C.OrtValueVector()
            module.train_step([batch, eps], fetches)
            optimizer.optimizer_step()
            module.lazy_reset_grad()
            self.losses.append(float(fetches[0].numpy()))
        module.copy_parameters_to_buffer(buffer, ALL_PARAMETERS)
        return host[self._sampler_index], host[self._auxiliary_index]
