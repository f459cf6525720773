"""The default backend: ONNX Runtime Training running the exported artifacts. Needs no torch and no onnx."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from onnxruntime import OrtValue, SessionOptions
from onnxruntime.training.api import CheckpointState, Module, Optimizer

from edge_client.trainers.base import Trainer
from models.manifest import CHECKPOINT, EVAL_MODEL, OPTIMIZER_MODELS, TRAINING_MODEL, load_manifest

ORT_WARNING = 2  # session log severity: ORT logs every graph transformer at the default INFO level


def session_options(threads: int = 1) -> SessionOptions:
    """Small models train fastest single-threaded; larger ones may gain from more intra-op threads."""
    options = SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = ORT_WARNING
    return options


class OrtTrainer(Trainer):
    """Loads a verified artifact directory and trains it with ORT's on-device training API."""

    def __init__(
        self, artifact_dir: str | Path, optimizer: str = "sgd", lr: float = 0.01, threads: int = 1
    ) -> None:
        directory = Path(artifact_dir)
        self.manifest = load_manifest(directory)
        if optimizer not in OPTIMIZER_MODELS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_MODELS)}")
        self._state = CheckpointState.load_checkpoint(str(directory / CHECKPOINT))
        self._module = Module(
            str(directory / TRAINING_MODEL),
            self._state,
            str(directory / EVAL_MODEL),
            session_options=session_options(threads),
        )
        if self._module.get_parameters_size(trainable_only=True) != self.manifest.num_parameters:
            raise ValueError(
                f"{directory}: the model holds {self._module.get_parameters_size(True)} trainable values, "
                f"the manifest lists {self.manifest.num_parameters}"
            )
        self._optimizer = Optimizer(str(directory / OPTIMIZER_MODELS[optimizer]), self._module)
        self._optimizer.set_learning_rate(lr)
        self._has_weights = not self.manifest.nominal_checkpoint

    def get_weights(self) -> np.ndarray:
        self._require_weights()
        return self._module.get_contiguous_parameters(trainable_only=True).numpy().copy()

    def set_weights(self, buffer: np.ndarray) -> None:
        buffer = self.check_weights(buffer)
        value = OrtValue.ortvalue_from_numpy(buffer)  # the wrapper owns the numpy array: keep it alive
        self._module.copy_buffer_to_parameters(value._ortvalue, trainable_only=True)
        self._has_weights = True

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def train_step(self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray) -> float:
        self._require_weights()
        self._module.train()
        loss, _, _ = self._module(x, class_mask, y)
        self._optimizer.step()
        self._module.lazy_reset_grad()
        return float(loss)

    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        self._require_weights()
        self._module.eval()
        loss, logits, features = self._module(x, class_mask, y)
        return float(loss), logits, features

    def _require_weights(self) -> None:
        if not self._has_weights:
            raise RuntimeError(
                "this artifact set ships a nominal (weight-less) checkpoint: call set_weights() with the "
                "model's flat weight buffer first"
            )
