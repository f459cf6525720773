"""The portable backend: training steps as standard ONNX graphs, run by plain `onnxruntime` (any build).

onnxruntime-training has no aarch64 wheel and none for CPython >= 3.12; the inference build has both. This
backend runs the graphs of `models/portable_export.py` with `InferenceSession`s only, and imports neither torch,
nor onnx, nor onnxruntime-training's API.

The weights and the optimiser state live in ORT-allocated buffers. A step binds them with I/O binding: the gradient
graph writes the gradient into a buffer, and the optimiser graph reads weights, gradient and state and writes the
new weights and state into other buffers, which then become the trainer's; so no step copies a parameter through
numpy (only get_weights/set_weights copy). The buffers a step writes come from a process-wide pool (`_SparePool`)
and the ones it leaves go back to it: between steps a trainer holds only its weights and its optimiser state (none
before its first step), not the spares and the gradient, which a fleet worker's devices, taking turns, share.
Until its first step a trainer's weights need not be its own either: it reads the artifacts' initial weights, or a
read-only buffer given to set_weights (a device's global model, one per process), in place, and has a buffer of
its own only once a step writes one. A fleet worker's devices that have not trained hold no copy of the weights.
A parked trainer (`park`: a device between rounds, its weights and optimiser state just saved) holds neither: it
takes each back from the saved state when it is next needed, the weights when read, the state at the next step.
"""
from __future__ import annotations

import math
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import numpy as np

from edge_client.trainers.base import (
    OPTIMIZER_BUFFERS,
    LossInputs,
    OptimizerState,
    Proximal,
    Reload,
    Trainer,
    iterate_batches,
    loss_arrays,
)
from edge_client.trainers.ort_capi import ORT
from models.manifest import (
    GRAPH_INPUTS,
    OPTIONAL_GRAPHS,
    PLAIN_GRADIENT,
    PLAIN_STEPS,
    PLAIN_UPDATES,
    PORTABLE_MODELS,
    WEIGHTS,
    load_manifest,
)

ORT_ERROR = 3  # session log severity: the exporter's graphs draw harmless shape-merge warnings from ORT 1.19
OPTIMIZERS = ("sgd", "adamw")
GRAPH_INPUT_NAMES = tuple(name for name, *_ in GRAPH_INPUTS)  # the gradient graphs' inputs after the weights


_shared_sessions: weakref.WeakValueDictionary[tuple[str, int, int, int], Any] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def shared_session(path: Path, threads: int) -> Any:
    """One InferenceSession per graph file (and thread count) in a process, shared by every trainer that runs it.
    A session holds no training state: the weights, the gradient and the optimiser state are each trainer's own
    buffers, bound per run, and ORT runs a session from several threads at once. A fleet worker's hundreds of
    devices thus hold one copy of each graph (LeNet's three sessions take ~5 MB) instead of one each. Keyed by the
    file's identity too (a graph exported again at the same path is a new session); held weakly, so a session
    goes with its last trainer."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, threads)
    with _shared_lock:
        session = _shared_sessions.get(key)
        if session is None:
            options = ORT.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.log_severity_level = ORT_ERROR
            session = ORT.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            _shared_sessions[key] = session
        return session


_shared_initial: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = weakref.WeakValueDictionary()


def shared_initial_weights(path: Path) -> np.ndarray:
    """The artifacts' initial weights, read-only, one array per file in a process (keyed and held as
    `shared_session`'s sessions are)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _shared_lock:
        weights = _shared_initial.get(key)
        if weights is None:
            weights = np.fromfile(path, dtype="<f4").astype(np.float32, copy=False)
            weights.flags.writeable = False
            _shared_initial[key] = weights
        return weights


_shared_filled: weakref.WeakValueDictionary[tuple[int, float], Any] = weakref.WeakValueDictionary()


def _filled(size: int, value: float) -> Any:
    """A new float32 OrtValue of `size` copies of `value`."""
    buffer = ORT.OrtValue.ortvalue_from_shape_and_type([size], np.float32)
    buffer.update_inplace(np.full(size, value, dtype=np.float32))
    return buffer


def shared_filled(size: int, value: float) -> Any:
    """A float32 OrtValue of `size` copies of `value`, one per size and value in a process, only ever read."""
    with _shared_lock:
        filled = _shared_filled.get((size, value))
        if filled is None:
            filled = _shared_filled[(size, value)] = _filled(size, value)
        return filled


class _SparePool:
    """Free float32 OrtValues by size, taken by a step for what it writes and given back when they are left over.

    A step holds at most the gradient and one new buffer for the weights and for each state (4 with AdamW), so the
    pool holds 4 buffers of a size for each trainer that steps at the same time as others, and every trainer
    between steps holds none: a fleet worker's devices, taking turns, share 4 (one LeNet device: 7.2 parameter
    copies before, 3.2 after; `benchmarks/device_memory.py`). A size's free buffers go with its last trainer."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._users: dict[int, int] = {}
        # Re-entrant: a trainer's finalizer calls `leave`, and it runs where the trainer's last reference goes, which
        # may be in a thread inside one of these calls (edge_client/shared_models.py says when)
        self._lock = threading.RLock()

    def join(self, size: int) -> None:
        with self._lock:
            self._users[size] = self._users.get(size, 0) + 1

    def leave(self, size: int) -> None:
        with self._lock:
            self._users[size] -= 1
            if not self._users[size]:
                del self._users[size]
                self._free.pop(size, None)

    def take(self, size: int) -> Any:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return ORT.OrtValue.ortvalue_from_shape_and_type([size], np.float32)

    def give(self, *values: Any) -> None:
        with self._lock:
            for value in values:
                size = int(value.shape()[0])
                if size in self._users:
                    self._free.setdefault(size, []).append(value)

    def held(self, size: int) -> int:
        """How many free buffers of `size` the pool holds."""
        with self._lock:
            return len(self._free.get(size, ()))


_spares = _SparePool()


class PortableTrainer(Trainer):
    """Loads a verified artifact directory exported for "portable" and trains it on plain ONNX Runtime.

    SGD follows torch.optim.SGD (momentum, no dampening, no Nesterov); AdamW follows torch.optim.AdamW (betas,
    eps 1e-6 and weight decay 0 by default, as the other backends)."""

    backend = "portable"

    def __init__(
        self,
        artifact_dir: str | Path,
        optimizer: str = "sgd",
        lr: float = 0.01,
        threads: int = 1,
        momentum: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        directory = Path(artifact_dir)
        self.manifest = load_manifest(directory)
        self.manifest.require_backend(self.backend)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        self._directory, self._optimizer_name, self._threads = directory, optimizer, threads
        self._sessions: dict[str, Any] = {}
        size = self.manifest.num_parameters
        _spares.join(size)
        weakref.finalize(self, _spares.leave, size)
        self._weights = shared_filled(size, 0.0)
        self._own_weights = False  # whether self._weights is this trainer's to write and give back (module doc)
        self._loss = _scalar(0.0)  # bound as an output: cheaper than the binding's get_outputs() on every step
        # Read with mu = 0 too, so it must be finite: the process's shared zeros until a proximal term needs a
        # reference of its own (most policies never do).
        self._reference = shared_filled(size, 0.0)
        self._reference_of: Proximal | None = None
        self._ones = shared_filled(size, 1.0)  # every rate lr: what a plain step is scaled by
        self._lr_scale = self._ones  # each parameter's rate as a multiple of lr (scaled_rates)
        self._graph_state = OPTIMIZER_BUFFERS[optimizer]  # the optimiser graph's state inputs and outputs
        # What is kept from step to step (saved, parked, restored): SGD without momentum carries nothing (its graph's
        # velocity output is the step's gradient, which the next step multiplies by zero), as torch's SGD keeps no
        # buffer then. Keeping it cost a fleet's training devices a weight-sized write and read-back every round.
        self._state_names = () if optimizer == "sgd" and momentum == 0.0 else self._graph_state
        self._state: dict[str, Any] = {}  # the kept buffers; zeros (not held) until the first step writes them
        self._steps = 0  # the steps taken: AdamW's t, whose bias corrections are fed as scalars
        self._reload: Reload | None = None  # while parked: where the weights and the state come back from
        self._weights_parked = self._state_parked = False
        self._betas = betas
        self._scalars = {name: _scalar(0.0) for name in ("lr", "momentum", "proximal_mu", "beta1", "beta2", "eps",
                                                        "weight_decay", "step_size", "bias_correction2_sqrt")}
        for name, value in (("momentum", momentum), ("beta1", betas[0]), ("beta2", betas[1]), ("eps", eps),
                            ("weight_decay", weight_decay)):
            self._scalars[name].update_inplace(np.array(value, dtype=np.float32))
        self.set_learning_rate(lr)
        # The update a plain step takes (models/manifest.py PLAIN_UPDATES), where the set holds it
        plain = PLAIN_UPDATES[optimizer]
        self._plain_update = plain if PORTABLE_MODELS[plain] in self.manifest.files else None
        self._plain_gradient = PORTABLE_MODELS[PLAIN_GRADIENT] in self.manifest.files  # (PLAIN_GRADIENT), likewise
        step = PLAIN_STEPS[optimizer]  # both in one run (PLAIN_STEPS), likewise
        self._plain_step = step if PORTABLE_MODELS[step] in self.manifest.files and self._plain_gradient else None
        # each update graph's inputs, and the buffers it writes (a plain SGD step writes no velocity), looked up once
        self._update_io: dict[str, tuple[list[str], list[str]]] = {}
        self._has_weights = not self.manifest.nominal_checkpoint
        if self._has_weights:
            self._weights = ORT.OrtValue.ortvalue_from_numpy(shared_initial_weights(directory / WEIGHTS))

    @property
    def graphs(self) -> frozenset[str]:
        """The optional graphs its artifact set holds."""
        return self.manifest.optional_graphs

    def _session(self, graph: str) -> Any:
        """The graph's InferenceSession, taken on first use (a device that never asks for exact norms never
        loads that graph) from the ones this process shares."""
        if graph not in self._sessions:
            if graph in OPTIONAL_GRAPHS and graph not in self.graphs:
                raise ValueError(f"this artifact set has no {PORTABLE_MODELS[graph]} (exported without the "
                                 f"optional {graph!r} graph): export it again with that graph")
            self._sessions[graph] = shared_session(self._directory / PORTABLE_MODELS[graph], self._threads)
        return self._sessions[graph]

    def get_weights(self) -> np.ndarray:
        self._require_weights()
        return np.asarray(self._weights.numpy(), dtype=np.float32).copy()

    def set_weights(self, buffer: np.ndarray) -> None:
        """A read-only `buffer` is read in place until a step writes weights of the trainer's own: whoever made it
        read-only promises it never changes (a device's global models: `edge_client.shared_models.shared_model`). A
        writable one is copied."""
        buffer = self.check_weights(buffer)
        self._weights_parked = False  # replaced: what was parked is not needed back
        if not buffer.flags.writeable:
            if self._own_weights:
                _spares.give(self._weights)
            self._weights, self._own_weights = ORT.OrtValue.ortvalue_from_numpy(buffer), False
        else:
            if not self._own_weights:
                self._weights, self._own_weights = _spares.take(self.manifest.num_parameters), True
            self._weights.update_inplace(buffer)
        self._has_weights = True

    def optimizer_state(self) -> OptimizerState | None:
        """None before the first step (the state is zeros then), and where nothing is kept (SGD without momentum)."""
        if not self._steps or not self._state_names:
            return None
        self._unpark(state=True)
        return OptimizerState(self._steps, {name: np.asarray(value.numpy(), dtype=np.float32).copy()
                                            for name, value in self._state.items()})

    def set_optimizer_state(self, state: OptimizerState) -> None:
        if not self._state_names:  # nothing kept: a state saved with momentum, say, has nothing this one needs
            self._state, self._state_parked, self._steps = {}, False, state.steps
            return
        self.check_optimizer_state(state, self._state_names)
        self._state_parked = False
        self._state = {name: self._own_copy(buffer) for name, buffer in state.buffers.items()} if state.steps else {}
        self._steps = state.steps

    def reset_optimizer(self) -> None:
        """The kept buffers go back to the spare pool (a parked state is not read back): the next step reads zeros
        for them and counts from step 1."""
        _spares.give(*self._state.values())
        self._state, self._state_parked, self._steps = {}, False, 0

    def park(self, reload: Reload) -> bool:
        """Drop the trainer's own weights and state (not to the spare pool, which would keep them): the next read
        of the weights and the next step take them back from `reload`."""
        self._reload = reload
        if self._own_weights:
            self._weights, self._own_weights = shared_filled(self.manifest.num_parameters, 0.0), False
            self._weights_parked = True
        if self._state:
            self._state, self._state_parked = {}, True
        return True

    def _unpark(self, weights: bool = False, state: bool = False) -> None:
        """Take back from the saved state what was parked and is needed now."""
        weights, state = weights and self._weights_parked, state and self._state_parked
        if not (weights or state) or self._reload is None:
            return
        saved_weights, saved_state = self._reload(weights, state)
        if weights:
            if saved_weights is None:
                raise RuntimeError("the saved state holds no weights to take back")
            self._weights, self._own_weights = self._own_copy(self.check_weights(saved_weights)), True
            self._weights_parked = False
        if state:
            if saved_state is None or saved_state.steps != self._steps:
                raise RuntimeError(f"the saved optimizer state is not the one parked ({self._steps} steps)")
            self._state = {name: self._own_copy(buffer) for name, buffer in
                           self.check_optimizer_state(saved_state, self._state_names).buffers.items()}
            self._state_parked = False

    def _own_copy(self, buffer: np.ndarray) -> Any:
        """A buffer of the trainer's own (from the spare pool) holding a copy of `buffer`."""
        value = _spares.take(self.manifest.num_parameters)
        value.update_inplace(np.ascontiguousarray(buffer, dtype=np.float32))
        return value

    def _apply_learning_rate(self, lr: float) -> None:
        self._scalars["lr"].update_inplace(np.array(lr, dtype=np.float32))

    def _step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> float:
        return self._update(x, y, class_mask, loss, None, self._ones)

    def _fit_step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None,
        proximal: Proximal | None,
    ) -> float:
        """The gradient graph, then the optimiser graph with the rate scale (ones without one) and the proximal
        pull (mu = 0 without one)."""
        return self._update(x, y, class_mask, loss, proximal, self._lr_scale)

    def _set_rate_scale(self, scale: np.ndarray | None) -> None:
        super()._set_rate_scale(scale)
        size = self.manifest.num_parameters
        if scale is None:
            self._lr_scale = self._ones
        else:
            self._lr_scale = ORT.OrtValue.ortvalue_from_shape_and_type([size], np.float32)
            self._lr_scale.update_inplace(scale)

    def _update(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None,
        proximal: Proximal | None, lr_scale: Any,
    ) -> float:
        """One step: the gradient graph, then the update graph; or, where the step is plain in its loss and its
        update and the set holds the fused step (models/manifest.py PLAIN_STEPS), both in one run: the same floats."""
        self._require_weights()
        self._unpark(state=True)
        size = self.manifest.num_parameters
        self._set_proximal(proximal)
        graph = self._update_graph(proximal, lr_scale)
        fused = graph == self._plain_update and self._plain_step is not None and self._plain_loss(loss)
        gradient = None if fused else _spares.take(size)
        written = {name: _spares.take(size) for name in ("weights", *self._graph_state)}
        try:
            if gradient is not None:
                value = self._run_gradient(x, y, class_mask, loss, gradient)
            else:
                graph = cast(str, self._plain_step)
            update = self._session(graph)
            if graph not in self._update_io:
                outputs = {o.name for o in update.get_outputs()}
                written_by = [name for name in ("weights", *self._graph_state) if f"new_{name}" in outputs]
                self._update_io[graph] = ([i.name for i in update.get_inputs()], written_by)
            inputs, writes = self._update_io[graph]
            zeros = shared_filled(size, 0.0)  # the state before the first step, and always what is not kept
            values = {"weights": self._weights, "gradient": gradient, "reference": self._reference,
                      "lr_scale": lr_scale, **self._scalars,
                      **{name: self._state.get(name, zeros) for name in self._graph_state}}
            batch = {} if gradient is not None else dict(zip(
                GRAPH_INPUT_NAMES, (x, class_mask, *loss_arrays(y, self.manifest.num_classes, loss, plain=True))))
            binding = update.io_binding()
            for name in inputs:
                if name in batch:
                    binding.bind_cpu_input(name, np.ascontiguousarray(batch[name], dtype=np.float32))
                else:
                    binding.bind_ortvalue_input(name, values[name])
            for name in writes:  # a spare the graph does not write goes back unwritten
                binding.bind_ortvalue_output(f"new_{name}", written[name])
            if gradient is None:
                binding.bind_ortvalue_output("loss", self._loss)
            if self._optimizer_name == "adamw":
                beta1, beta2 = self._betas
                step_size = self.learning_rate / (1.0 - beta1**(self._steps + 1))
                self._scalars["step_size"].update_inplace(np.array(step_size, dtype=np.float32))
                self._scalars["bias_correction2_sqrt"].update_inplace(
                    np.array(math.sqrt(1.0 - beta2**(self._steps + 1)), dtype=np.float32))
            update.run_with_iobinding(binding)
            if gradient is None:
                value = float(self._loss.numpy())
        except BaseException:
            _spares.give(*([] if gradient is None else [gradient]), *written.values())
            raise
        left = [*self._state.values()]
        if self._own_weights:
            left.append(self._weights)
        self._weights, self._own_weights = written.pop("weights"), True
        left += [written.pop(name) for name in self._graph_state if name not in self._state_names]
        self._state = written
        self._steps += 1
        _spares.give(*([] if gradient is None else [gradient]), *left)
        return value

    def _plain_loss(self, loss: LossInputs | None) -> bool:
        """Whether this step's loss is the plain loss and the set holds its gradient (models/manifest.py
        PLAIN_GRADIENT)."""
        return self._plain_gradient and (loss is None or loss.plain)

    def _update_graph(self, proximal: Proximal | None, lr_scale: Any) -> str:
        """The optimiser's plain update where this step is plain (no momentum kept, no proximal pull, every rate
        lr) and the set holds it, else its whole update: the same floats either way (models/manifest.py
        PLAIN_UPDATES)."""
        if (self._plain_update is not None and (proximal is None or proximal.mu == 0.0) and lr_scale is self._ones
                and (self._optimizer_name != "sgd" or not self._state_names)):
            return self._plain_update
        return self._optimizer_name

    def _gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        self._require_weights()
        buffer = _spares.take(self.manifest.num_parameters)
        try:
            value = self._run_gradient(x, y, class_mask, loss, buffer)
            return value, np.asarray(buffer.numpy(), dtype=np.float32).copy()
        finally:
            _spares.give(buffer)

    def _run_gradient(self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None,
                      gradient: Any) -> float:
        """Run the gradient graph into `gradient` (an OrtValue of the parameters' size); returns the batch loss. A
        step with the plain loss runs the plain gradient graph where the set holds it (models/manifest.py
        PLAIN_GRADIENT: the same floats), which reads the inputs before the loss terms it leaves out."""
        plain = self._plain_loss(loss)
        session = self._session(PLAIN_GRADIENT if plain else "gradient")
        binding = session.io_binding()
        binding.bind_ortvalue_input("weights", self._weights)
        for name, array in zip(GRAPH_INPUT_NAMES, (x, class_mask, *loss_arrays(y, self.manifest.num_classes, loss,
                                                                                plain))):
            binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.float32))
        binding.bind_ortvalue_output("loss", self._loss)
        binding.bind_ortvalue_output("gradient", gradient)
        session.run_with_iobinding(binding)
        return float(self._loss.numpy())

    def _input_gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        self._require_weights()
        return run_input_gradient(self._session("input_gradient"), self._weights, x, y, class_mask,
                                  self.manifest.num_classes, loss)

    def _set_proximal(self, proximal: Proximal | None) -> None:
        mu = 0.0 if proximal is None else proximal.mu
        self._scalars["proximal_mu"].update_inplace(np.array(mu, dtype=np.float32))
        if proximal is not None and proximal is not self._reference_of:
            if self._reference_of is None:  # still the shared zeros
                self._reference = ORT.OrtValue.ortvalue_from_shape_and_type([self.manifest.num_parameters],
                                                                            np.float32)
            self._reference.update_inplace(proximal.reference)
            self._reference_of = proximal

    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        self._require_weights()
        session = self._session("eval")
        binding = session.io_binding()
        binding.bind_ortvalue_input("weights", self._weights)
        binding.bind_cpu_input("input", np.ascontiguousarray(x, dtype=np.float32))
        binding.bind_cpu_input("class_mask", np.ascontiguousarray(class_mask, dtype=np.float32))
        binding.bind_output("logits", "cpu")
        binding.bind_output("features", "cpu")
        session.run_with_iobinding(binding)
        logits, features = (value.numpy() for value in binding.get_outputs())
        return _cross_entropy(logits, y), logits, features

    def _exact_grad_norms(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, batch_size: int
    ) -> np.ndarray:
        """The per-sample norm graph (vmap of the gradient), over fixed chunks; the last chunk is padded with zero
        samples whose norms are dropped. `batch_size` has no use here: the graph fixes the chunk."""
        self._require_weights()
        session = self._session("sample_grad_norms")
        chunk = int(session.get_inputs()[1].shape[0])
        k = self.manifest.num_classes
        norms = np.empty(len(y), dtype=np.float64)
        for idx in iterate_batches(len(y), chunk, None):
            xs = np.zeros((chunk, *self.manifest.input_shape), dtype=np.float32)
            targets = np.zeros((chunk, k), dtype=np.float32)
            xs[: len(idx)] = x[idx]
            targets[np.arange(len(idx)), y[idx]] = 1.0
            binding = session.io_binding()
            binding.bind_ortvalue_input("weights", self._weights)
            binding.bind_cpu_input("input", xs)
            binding.bind_cpu_input("class_mask", np.ascontiguousarray(class_mask, dtype=np.float32))
            binding.bind_cpu_input("targets", targets)
            binding.bind_output("norms", "cpu")
            session.run_with_iobinding(binding)
            norms[idx] = binding.get_outputs()[0].numpy()[: len(idx)]
        return norms

    def _require_weights(self) -> None:
        self._unpark(weights=True)
        if not self._has_weights:
            raise RuntimeError(
                "this artifact set ships no initial weights (nominal): call set_weights() with the model's flat "
                "weight buffer first"
            )


def run_input_gradient(session: Any, weights: Any, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray,
                       num_classes: int, loss: LossInputs | None) -> tuple[float, np.ndarray]:
    """The portable input-gradient graph at `weights` (an OrtValue or a flat float32 array)."""
    binding = session.io_binding()
    if isinstance(weights, np.ndarray):
        binding.bind_cpu_input("weights", np.ascontiguousarray(weights, dtype=np.float32))
    else:
        binding.bind_ortvalue_input("weights", weights)
    for name, array in zip(GRAPH_INPUT_NAMES, (x, class_mask, *loss_arrays(y, num_classes, loss))):
        binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.float32))
    binding.bind_output("loss", "cpu")
    binding.bind_output("input_gradient", "cpu")
    session.run_with_iobinding(binding)
    value, gradient = (v.numpy() for v in binding.get_outputs())
    return float(value), np.asarray(gradient, dtype=np.float32).reshape(x.shape)


def _scalar(value: float) -> Any:
    return ORT.OrtValue.ortvalue_from_numpy(np.array(value, dtype=np.float32))


def _cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy of (masked) logits against labels, in float64."""
    if not len(y):
        return 0.0
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    return float((log_z - shifted[np.arange(len(y)), y]).mean())
