"""The default backend: ONNX Runtime Training running the exported artifacts. Needs no torch and no onnx.

It drives ORT's training binding layer (`onnxruntime.capi._pybind_state`: CheckpointState, Module, Optimizer)
directly: the thin `onnxruntime.training.api` wrappers live in a package whose `__init__` imports onnx, and torch
too where torch is installed, which a device must not need. Pinned to onnxruntime-training 1.19.2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_client.trainers.base import LossInputs, Trainer, loss_arrays
from edge_client.trainers.ort_capi import C
from models.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    FULL_GRADIENT,
    OPTIMIZER_MODELS,
    PORTABLE_MODELS,
    TRAINING_MODEL,
    load_manifest,
)

# Every exported parameter is trainable, so "all" and "trainable" name the same buffer; a nominal checkpoint
# accepts only the "all" form.
ALL_PARAMETERS = False  # the `trainable_only` flag of ORT's buffer copies
ORT_WARNING = 2  # session log severity: ORT logs every graph transformer at the default INFO level
# The generated optimizer graph always draws a harmless "Error merging shape info" warning from ORT 1.19.
ORT_ERROR = 3


def session_options(threads: int = 1, log_severity: int = ORT_WARNING) -> C.SessionOptions:
    """Small models train fastest single-threaded; larger ones may gain from more intra-op threads."""
    options = C.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = log_severity
    return options


class OrtTrainer(Trainer):
    """Loads a verified artifact directory and trains it with ORT's on-device training API."""

    backend = "ort"

    def __init__(
        self, artifact_dir: str | Path, optimizer: str = "sgd", lr: float = 0.01, threads: int = 1
    ) -> None:
        directory = self._directory = Path(artifact_dir)
        self.manifest = load_manifest(directory)
        if optimizer not in OPTIMIZER_MODELS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_MODELS)}")
        self._options = session_options(threads)
        self._device = device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        self._load()
        size = self._module.get_parameters_size(False)
        if size != self.manifest.num_parameters:
            raise ValueError(
                f"{directory}: the model holds {size} parameter values, the manifest lists "
                f"{self.manifest.num_parameters}"
            )
        self._optimizer_path = str(directory / OPTIMIZER_MODELS[optimizer])
        self._optimizer_options = session_options(threads, log_severity=ORT_ERROR)
        self._optimizer: C.Optimizer | None = None  # built once the parameters hold data (train_step)
        self.set_learning_rate(lr)
        # An OrtValue made from numpy aliases the array's memory without owning it: keep both.
        self._host_buffer = np.zeros(size, dtype=np.float32)
        self._buffer = C.OrtValue.ortvalue_from_numpy(self._host_buffer, device)
        self._has_weights = not self.manifest.nominal_checkpoint
        # the portable input-gradient graph's session, once asked for: shared sessions are held weakly, and one made
        # anew for each call cost 10 ms of a LeNet's 0.2 ms input gradient
        self._input_gradient_session: Any = None

    def _load(self) -> None:
        """The checkpoint state (parameters, and the optimiser's state once it steps) and the module over it."""
        directory = self._directory
        self._state = C.load_checkpoint(str(directory / CHECKPOINT))
        self._module = C.Module(
            str(directory / TRAINING_MODEL), self._state, str(directory / EVAL_MODEL), self._device, self._options
        )

    def reset_optimizer(self) -> None:
        """ORT keeps the optimiser's state in the checkpoint state, and an optimiser built again over it takes that
        state as it is: the checkpoint is loaded again, with its module, and the weights put back (13.7 ms for a
        LeNet here, once a round where the round asks for it; the portable backend drops two buffers)."""
        if self._optimizer is None:
            return  # no step yet: no state
        weights = self.get_weights()
        self._load()
        self._optimizer = None  # built again at the next step, over the fresh state
        self.set_weights(weights)

    def get_weights(self) -> np.ndarray:
        self._require_weights()
        self._module.copy_parameters_to_buffer(self._buffer, ALL_PARAMETERS)
        return self._host_buffer.copy()

    def set_weights(self, buffer: np.ndarray) -> None:
        buffer = self.check_weights(buffer)
        value = C.OrtValue.ortvalue_from_numpy(buffer, self._device)
        self._module.copy_buffer_to_parameters(value, ALL_PARAMETERS)
        self._has_weights = True

    def _apply_learning_rate(self, lr: float) -> None:
        if self._optimizer is not None:
            self._optimizer.set_learning_rate(lr)

    def _step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> float:
        self._require_weights()
        if self._optimizer is None:
            # ORT sizes the optimizer state from the parameters' data: with a nominal checkpoint that data
            # exists only after set_weights(), and building the optimizer earlier crashes the process.
            self._optimizer = C.Optimizer(
                self._optimizer_path, self._state, self._device, self._optimizer_options
            )
            self._optimizer.set_learning_rate(self.learning_rate)
        fetches = C.OrtValueVector()
        self._module.train_step(self._feeds(x, y, class_mask, loss), fetches)
        self._optimizer.optimizer_step()
        self._module.lazy_reset_grad()
        return float(fetches[0].numpy())

    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        self._require_weights()
        fetches = C.OrtValueVector()
        self._module.eval_step(self._feeds(x, y, class_mask, None), fetches)
        loss, logits, features = (value.numpy() for value in fetches)
        return float(loss), logits, features

    def _gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        """A train step with no optimizer step, the gradients read off the checkpoint state in manifest order,
        then reset so the next training step starts from zero."""
        self._require_weights()
        fetches = C.OrtValueVector()
        try:
            self._module.train_step(self._feeds(x, y, class_mask, loss), fetches)
            gradient = np.concatenate([self._state.get_parameter(p.name).grad.numpy().ravel()
                                       for p in self.manifest.parameters])
        finally:
            self._module.lazy_reset_grad()
        return float(fetches[0].numpy()), gradient.astype(np.float32, copy=False)

    def _exact_grad_norms(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, batch_size: int
    ) -> np.ndarray:
        """The gradient of a batch of one per sample (ORT's graph computes a batch's mean gradient only, so
        `batch_size` has no use here)."""
        norms = np.empty(len(y), dtype=np.float64)
        for i in range(len(y)):
            norms[i] = _squared_norm(self._gradient(x[i : i + 1], y[i : i + 1], class_mask, None)[1])
        return norms

    @property
    def graphs(self) -> frozenset[str]:
        """The whole loss's gradient and per-sample norms of its own (a batch of one per sample); input gradients
        through the portable graph, when the set holds it."""
        return frozenset({FULL_GRADIENT, "sample_grad_norms"}) | (self.manifest.optional_graphs & {"input_gradient"})

    def _input_gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        """ORT Training's graphs give no input gradient: the portable input-gradient graph does, run with an
        inference session at this trainer's weights, where the artifact set serves the portable backend too."""
        from edge_client.trainers.portable import run_input_gradient, shared_session

        if "input_gradient" not in self.graphs:
            raise ValueError("input gradients on the ort backend need the portable input-gradient graph in its "
                             "artifact set (export with backends ort and portable), or the portable or torch backend")
        if self._input_gradient_session is None:
            self._input_gradient_session = shared_session(self._directory / PORTABLE_MODELS["input_gradient"], 1)
        return run_input_gradient(self._input_gradient_session, self.get_weights(), x, y, class_mask,
                                  self.manifest.num_classes, loss)

    def _feeds(self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None) -> list:
        """The graph's inputs in order (models.manifest.GRAPH_INPUTS)."""
        return [x, class_mask, *loss_arrays(y, self.manifest.num_classes, loss)]

    def _require_weights(self) -> None:
        if not self._has_weights:
            raise RuntimeError(
                "this artifact set ships a nominal (weight-less) checkpoint: call set_weights() with the "
                "model's flat weight buffer first"
            )


def _squared_norm(array: np.ndarray) -> float:
    return float(np.square(array, dtype=np.float64).sum())
