"""Export the portable training graphs: a whole training step in standard ONNX ops, for plain `onnxruntime`.

onnxruntime-training stopped at 1.19.2 (x86_64, CPython <= 3.11). These graphs need only the inference build,
which runs on aarch64 and current Pythons. Each graph of the model is a torch function traced into core ATen ops
(make_fx; the backward pass comes from torch.func.grad, so it is torch's own autograd) and converted by torch's ONNX
exporter, with `models/onnx_backward.py` translating the two backward ops the exporter lacks; the optimisers'
updates, elementwise and the same for every model, are written as ONNX nodes (`models/update_graphs.py`). The
weights are a graph input, one flat float32 buffer in manifest order, so a device keeps one buffer and never a
checkpoint.

    portable_gradient.onnx  (weights, input, class_mask, targets, sample_weights, teacher_logits,
                             teacher_weights, soft_targets, soft_weights, class_costs, bce) -> (loss, gradient):
                             models/loss.py's loss and its gradient (optional: the methods whose loss is not
                             plain, models/manifest.py FULL_GRADIENT)
    portable_gradient_plain.onnx
                            (weights, input, class_mask, targets, sample_weights) -> (loss, gradient): the
                             same for a step with the plain loss (models/manifest.py PLAIN_GRADIENT)
    portable_sgd.onnx       (weights, gradient, velocity, lr, momentum, proximal_mu, reference, lr_scale)
                             -> (weights, velocity): torch.optim.SGD (momentum, no dampening), then the pull
    portable_adamw.onnx     (weights, gradient, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay,
                             step_size, bias_correction2_sqrt, proximal_mu, reference, lr_scale)
                             -> (weights, exp_avg, exp_avg_sq): torch.optim.AdamW's update, then the pull
    portable_eval.onnx      (weights, input, class_mask) -> (logits, features): eval-mode forward, masked logits
    portable_sample_grad_norms.onnx
                            (weights, input, class_mask, targets) -> (norms): each sample's squared norm of
                             its full cross-entropy gradient (vmap of the gradient), in chunks of a fixed size
    portable_input_gradient.onnx
                            (the gradient graph's inputs) -> (loss, input_gradient): the loss's gradient w.r.t.
                             the input batch, in train mode (a method that moves samples: GLFC's prototypes)

The optimizers' bias corrections (`step_size = lr / (1 - beta1^t)`, `sqrt(1 - beta2^t)`) are computed by the
device in float64 and fed as scalars, as torch computes them in Python floats: the graphs and torch.optim then
take the same float32 steps (AdamW's within a rounding: models/update_graphs.py). The proximal pull
(`edge_client.trainers.base.proximal_pull`) is in the optimizer graphs, with mu = 0 when unused; so is each
parameter's rate, lr * lr_scale (ones when unused), as torch.optim takes a parameter group's rate: SGD's step,
AdamW's step and decoupled decay, and the pull all scale with it.
Batch size is dynamic everywhere except the per-sample norms, whose vmap folds the batch into convolution groups:
that graph takes SAMPLE_NORM_CHUNK samples and the device pads the last chunk.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import multiprocessing as mp
import os
import queue
import warnings
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.nn import functional as F

from models.loss import plain_training_loss, training_loss
from models.manifest import (
    GRAPH_INPUTS,
    MAX_IR_VERSION,
    OPTIONAL_GRAPHS,
    PLAIN_GRADIENT,
    PLAIN_STEPS,
    PLAIN_UPDATES,
    PORTABLE_MODELS,
    PORTABLE_OPSET,
    ManifestError,
    ParameterInfo,
)
from models.update_graphs import UPDATES, update_graph
from models.zoo import ClassifierModel

log = logging.getLogger("edgefil.export")
SAMPLE_NORM_CHUNK = 16  # samples per run of the per-sample norm graph (fixed: vmap bakes the batch in)

GRADIENT_INPUTS = ("weights", *(name for name, *_ in GRAPH_INPUTS))
PLAIN_GRADIENT_INPUTS = GRADIENT_INPUTS[:5]  # weights, input, class_mask, targets, sample_weights


class _Unflatten:
    """Flat weights (manifest order) -> the model's named parameters, inside a traced function."""

    def __init__(self, parameters: Sequence[ParameterInfo]) -> None:
        self.names = [p.name for p in parameters]
        self.shapes = [p.shape for p in parameters]
        self.sizes = [p.size for p in parameters]

    def __call__(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(weights, self.sizes)
        return {n: part.reshape(s) for n, part, s in zip(self.names, parts, self.shapes)}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in self.names])


class GradientGraph(torch.nn.Module):
    """models/loss.py's batch loss and its gradient w.r.t. the flat weights (`wrt = "weights"`, the training step)
    or w.r.t. the input batch (`wrt = "input"`, a method that moves samples)."""

    def __init__(self, model: ClassifierModel, parameters: Sequence[ParameterInfo], wrt: str = "weights") -> None:
        super().__init__()
        self.model, self.unflatten, self.wrt = model, _Unflatten(parameters), wrt

    def forward(self, weights: torch.Tensor, x: torch.Tensor, class_mask: torch.Tensor, targets: torch.Tensor,
                sample_weights: torch.Tensor, teacher_logits: torch.Tensor, teacher_weights: torch.Tensor,
                soft_targets: torch.Tensor, soft_weights: torch.Tensor, class_costs: torch.Tensor,
                bce: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def loss(params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
            raw, _ = functional_call(self.model, params, (inputs,))
            return training_loss(raw, class_mask, targets, sample_weights, teacher_logits, teacher_weights,
                                 soft_targets, soft_weights, class_costs, bce)

        if self.wrt == "input":
            gradient, value = grad_and_value(loss, argnums=1)(self.unflatten(weights), x)
            return value, gradient
        by_name, value = grad_and_value(loss)(self.unflatten(weights), x)
        return value, self.unflatten.flatten(by_name)


class PlainGradientGraph(torch.nn.Module):
    """GradientGraph's gradient w.r.t. the flat weights for a step with the plain loss (models/loss.py
    `plain_training_loss`; models/manifest.py PLAIN_GRADIENT): only the inputs that loss reads."""

    def __init__(self, model: ClassifierModel, parameters: Sequence[ParameterInfo]) -> None:
        super().__init__()
        self.model, self.unflatten = model, _Unflatten(parameters)

    def forward(self, weights: torch.Tensor, x: torch.Tensor, class_mask: torch.Tensor, targets: torch.Tensor,
                sample_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def loss(params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
            raw, _ = functional_call(self.model, params, (inputs,))
            return plain_training_loss(raw, class_mask, targets, sample_weights)

        by_name, value = grad_and_value(loss)(self.unflatten(weights), x)
        return value, self.unflatten.flatten(by_name)


class EvalGraph(torch.nn.Module):
    def __init__(self, model: ClassifierModel, parameters: Sequence[ParameterInfo]) -> None:
        super().__init__()
        self.model, self.unflatten = model, _Unflatten(parameters)

    def forward(self, weights: torch.Tensor, x: torch.Tensor, class_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = functional_call(self.model, self.unflatten(weights), (x, class_mask))
        return logits, features


class SampleGradNormsGraph(torch.nn.Module):
    """||grad_w CE(f_w(x_i), t_i)||^2 per sample, as the torch backend's torch.func path computes it."""

    def __init__(self, model: ClassifierModel, parameters: Sequence[ParameterInfo]) -> None:
        super().__init__()
        self.model, self.unflatten = model, _Unflatten(parameters)

    def forward(self, weights: torch.Tensor, x: torch.Tensor, class_mask: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
        def sample_loss(params: dict[str, torch.Tensor], xi: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
            logits, _ = functional_call(self.model, params, (xi[None], class_mask))
            return -(ti[None] * F.log_softmax(logits, dim=1)).sum()

        grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(self.unflatten(weights), x, targets)
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)


GraphSpec = tuple[torch.nn.Module, tuple, Sequence[str], Sequence[str], Sequence[int], bool]


def export_portable(
    model: ClassifierModel, parameters: Sequence[ParameterInfo], input_shape: tuple[int, ...], out_dir: Path,
    optional: Collection[str] = OPTIONAL_GRAPHS, helpers: int | None = None, base: bool = True,
) -> list[str]:
    """Write the portable graphs of `model` to `out_dir`, of the optional ones (`OPTIONAL_GRAPHS`) those in
    `optional`; returns their file names. `base=False`: only those optional ones (added to a set that has the
    others: models/export.py, the export cache).

    The graphs are independent, and each export is single-threaded Python (tracing and translating), so
    `helpers` processes (default `export_helpers()`: one per other core, and none where only one graph is
    differentiated) export some of them while this one exports the others, each taking the next graph, longest
    first, when it is free. A helper that cannot start, dies or fails leaves its graphs to this process, which
    exports them itself (and raises what it raises)."""
    model = model.cpu().eval()
    specs = _graph_specs(model, parameters, input_shape)
    graphs = [graph for graph in specs if (graph in optional if graph in OPTIONAL_GRAPHS else base)]
    if not graphs:
        return []
    # A helper pays its own start before its first graph (an interpreter, torch, the exporter's imports and
    # registry: about 3 s here, what this process pays at its first graph too): worth it where a second
    # differentiated graph (make_fx's trace of a backward pass, a second and more each for LeNet) is left for it,
    # not for the forward-only eval graph alone (a fifth of a second). A plain method's set (one differentiated
    # graph) thus starts none: LeNet's, in a fleet's cold start, 4.0-4.1 s, and 4.2-4.4 s with a helper that took
    # the eval graph (docs/results.md).
    differentiated = sum(1 for graph in graphs if specs[graph][-1])
    updates = list(UPDATES) if base else []
    size = sum(p.size for p in parameters)
    for update in updates:  # written node by node, not traced (models/update_graphs.py): milliseconds
        (out_dir / PORTABLE_MODELS[update]).write_bytes(update_graph(update, size).SerializeToString())
    helpers = export_helpers() if helpers is None else helpers
    with _Helpers(min(helpers, differentiated - 1), (model, parameters, input_shape, out_dir, graphs)) as pool:
        made: set[str] = set()
        while (index := pool.take()) is not None:
            _export_one(graphs[index], model, parameters, input_shape, out_dir)
            made.add(graphs[index])
        made |= pool.wait()
    for graph in graphs:
        if graph not in made:  # a helper's that it did not make
            _export_one(graph, model, parameters, input_shape, out_dir)
    if not base:
        return [PORTABLE_MODELS[graph] for graph in graphs]
    for optimizer, step in PLAIN_STEPS.items():
        fused_step(out_dir / PORTABLE_MODELS[PLAIN_GRADIENT], out_dir / PORTABLE_MODELS[PLAIN_UPDATES[optimizer]],
                   out_dir / PORTABLE_MODELS[step])
    return [PORTABLE_MODELS[graph] for graph in (*graphs, *updates, *PLAIN_STEPS.values())]


def fused_step(gradient_path: Path, update_path: Path, path: Path) -> None:
    """The plain gradient graph and a plain update graph as one (models/manifest.py PLAIN_STEPS): the update's
    nodes after the gradient's, its `weights` the gradient graph's input and its `gradient` that graph's output,
    which stays inside; every other input and output keeps its name, and the update's inner values take a prefix.
    The same nodes as the two graphs run one after the other, so the same floats, in one session run."""
    import onnx
    from onnx import compose

    gradient, update = onnx.load(str(gradient_path)), onnx.load(str(update_path))
    prefix = "update/"
    inner = compose.add_prefix(update, prefix)
    names = {f"{prefix}{value.name}": value.name for value in (*update.graph.input, *update.graph.output)}
    for node in inner.graph.node:
        node.input[:] = [names.get(name, name) for name in node.input]
        node.output[:] = [names.get(name, name) for name in node.output]
    graph = onnx.helper.make_graph(
        [*gradient.graph.node, *inner.graph.node], f"{gradient.graph.name}+{update.graph.name}",
        [*gradient.graph.input, *(value for value in update.graph.input if value.name not in ("weights", "gradient"))],
        [next(value for value in gradient.graph.output if value.name == "loss"), *update.graph.output],
        [*gradient.graph.initializer, *inner.graph.initializer],
    )
    opsets = {o.domain: o.version for o in (*update.opset_import, *gradient.opset_import)}
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
                                   ir_version=min(gradient.ir_version, MAX_IR_VERSION),
                                   functions=[*gradient.functions, *update.functions])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def export_helpers() -> int:
    """`$EDGEFIL_EXPORT_HELPERS`, else one helper process per core beyond this one's (0: export in this one)."""
    value = os.environ.get("EDGEFIL_EXPORT_HELPERS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"EDGEFIL_EXPORT_HELPERS must be a whole number, not {value!r}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - 1


def _graph_specs(model: ClassifierModel, parameters: Sequence[ParameterInfo], input_shape: tuple[int, ...]
                 ) -> dict[str, GraphSpec]:
    """Each graph's (module, example inputs, input names, output names, inputs with a batch dim, traced via
    make_fx), longest export first (the order in which the exporting processes take them)."""
    classes = model.head.out_features
    size = sum(p.size for p in parameters)
    weights = torch.zeros(size)
    # The example batch: above 1 (0 and 1 are specialised) and unlike every other input size, since the tracer
    # gives equal sizes one symbol ("duck sizing") and a batch equal to, say, 3 channels would be fixed at 3.
    n = min(set(range(3, 64)) - {*input_shape, classes, size})
    batch = (torch.zeros(n, *input_shape), torch.ones(classes),
             F.one_hot(torch.arange(n) % classes, classes).float(), torch.ones(n), torch.zeros(n, classes),
             torch.zeros(n), torch.zeros(n, classes), torch.zeros(n), torch.zeros(n, classes), torch.zeros(1))

    chunk = SAMPLE_NORM_CHUNK
    return {
        "gradient": (GradientGraph(model, parameters), (weights, *batch), GRADIENT_INPUTS, ("loss", "gradient"),
                     (1, 3, 4, 5, 6, 7, 8, 9), True),
        "gradient_plain": (PlainGradientGraph(model, parameters), (weights, *batch[:4]), PLAIN_GRADIENT_INPUTS,
                           ("loss", "gradient"), (1, 3, 4), True),
        "input_gradient": (GradientGraph(model, parameters, wrt="input"), (weights, *batch), GRADIENT_INPUTS,
                           ("loss", "input_gradient"), (1, 3, 4, 5, 6, 7, 8, 9), True),
        "sample_grad_norms": (
            SampleGradNormsGraph(model, parameters),
            (weights, torch.zeros(chunk, *input_shape), torch.ones(classes),
             F.one_hot(torch.arange(chunk) % classes, classes).float()),
            ("weights", "input", "class_mask", "targets"), ("norms",), (), True),
        "eval": (EvalGraph(model, parameters), (weights, *batch[:2]), ("weights", "input", "class_mask"),
                 ("logits", "features"), (1,), False),
    }


def _export_one(graph: str, model: ClassifierModel, parameters: Sequence[ParameterInfo],
                input_shape: tuple[int, ...], out_dir: Path) -> None:
    module, example, inputs, outputs, batched, traced = _graph_specs(model, parameters, input_shape)[graph]
    _export_graph(module, example, inputs, outputs, batched, traced, out_dir / PORTABLE_MODELS[graph])


class _Helpers:
    """Helper processes and this one share the graphs through a counter: whoever is free takes the next. Each
    helper reports every graph it exported; `wait` returns those once every graph is taken and the helpers that
    took one reported it or died. A helper still starting when none is left is stopped, not waited for."""

    def __init__(self, count: int, job: tuple) -> None:
        self.count, self.job, self.graphs = count, job, len(job[-1])
        self.processes: list[Any] = []
        self.taken: list[int] = []
        self.next: Any = None  # the shared counter: the next graph to take (None: no helper)
        self.reports: Any = None

    def __enter__(self) -> _Helpers:
        if self.count <= 0:
            return self
        context = mp.get_context("spawn")  # a fresh interpreter: this process may hold threads and locks
        try:
            self.next, self.reports = context.Value("i", 0), context.Queue()
            for _ in range(self.count):
                process = context.Process(target=_help, args=(self.job, self.next, self.reports), daemon=True)
                process.start()
                self.processes.append(process)
        except (OSError, AssertionError) as error:  # AssertionError: a daemonic process may not have children
            log.info("exporting the portable graphs without helper processes (%s)", error)
            if not self.processes:
                self.next = None
        return self

    def take(self) -> int | None:
        """The next graph for this process, or None when all are taken."""
        if self.next is None:
            index = len(self.taken)
        else:
            with self.next.get_lock():
                index = self.next.value
                self.next.value = index + 1
        if index >= self.graphs:
            return None
        self.taken.append(index)
        return index

    def wait(self) -> set[str]:
        """The graphs the helpers made."""
        made: set[str] = set()
        if self.next is None:
            return made
        owed = self.graphs - len(self.taken)  # every graph is taken: the others took these
        while owed > 0:
            try:
                graph, ok = self.reports.get(timeout=0.5)
            except queue.Empty:
                if any(p.is_alive() for p in self.processes):
                    continue
                break  # every helper ended, and what it sent before it ended has been read
            owed -= 1
            if ok:
                made.add(graph)
        return made

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:  # done, or still starting when no graph was left, or this one failed
            process.terminate()
            process.join()


def _help(job: tuple, next_graph: Any, reports: Any) -> None:
    """A helper process: export graphs until none is left, reporting each (name, made or not)."""
    model, parameters, input_shape, out_dir, graphs = job
    while True:
        with next_graph.get_lock():
            index = next_graph.value
            next_graph.value = index + 1
        if index >= len(graphs):
            return
        try:
            _export_one(graphs[index], model, parameters, input_shape, out_dir)
        except Exception:  # noqa: BLE001 (this process exports the graph again and raises what it raises)
            reports.put((graphs[index], False))
        else:
            reports.put((graphs[index], True))


def _export_graph(module: torch.nn.Module, example: tuple, inputs: Sequence[str], outputs: Sequence[str],
                  batched: Sequence[int], traced: bool, path: Path) -> None:
    """Trace `module` (through make_fx into core ATen ops where it differentiates), export it in standard ONNX
    ops with a dynamic batch on the `batched` inputs, and save it without external data."""
    from torch._decomp import core_aten_decompositions
    from torch.export import Dim
    from torch.fx.experimental.proxy_tensor import make_fx

    # onnxscript (2.5 s to import here) at the first graph, not with this module: `export_portable` has started its
    # helper processes by then, which import on the other cores meanwhile (docs/results.md, the export's first use)
    from models.onnx_backward import KEPT_WHOLE, TRANSLATIONS

    target: Any = module
    decompositions = {op: fn for op, fn in core_aten_decompositions().items() if op not in KEPT_WHOLE}
    if traced:
        target = make_fx(module, tracing_mode="symbolic" if batched else "real",
                         decomposition_table=decompositions)(*example)
    batch = Dim("batch", min=1, max=1 << 20)
    dynamic = tuple({0: batch} if i in batched else None for i in range(len(example))) if batched else None
    with _exporter_quiet(), _registry_built_once(), _decomposed_once():
        program = torch.onnx.export(
            target, example, dynamo=True, dynamic_shapes=dynamic, opset_version=PORTABLE_OPSET,
            input_names=list(inputs), output_names=list(outputs), custom_translation_table=TRANSLATIONS,
            optimize=False, verbose=False,
        )
        if program is None:
            raise ManifestError(f"torch's ONNX exporter returned nothing for {path.name}")
        _optimize(program.model)
    # the IR version the devices read, whatever the host's exporter stamps (models/export.py `readable_by_devices`:
    # opset PORTABLE_OPSET and float tensors need nothing newer)
    program.model.ir_version = min(program.model.ir_version, MAX_IR_VERSION)
    program.save(str(path), external_data=False)


@contextlib.contextmanager
def _decomposed_once() -> Iterator[None]:
    """Skip the exporter's second decomposition where it has nothing to decompose.

    torch's exporter decomposes the program it exports into the ops its registry translates, which re-traces the
    whole program (about a third of a gradient graph's export). A graph traced through make_fx is core ATen already:
    when every op of the program is registered and none mutates, that pass would give the program back as it is
    (the same nodes and outputs, with other value names: tests/test_export.py), so the program is passed on as it
    is. Where any target is something else (an unregistered or mutating op, a higher-order op), or the program has
    buffers to mutate, the pass runs. The hook is a private function of the pinned torch (2.14.1); where a torch
    lacks it, the exporter runs unchanged."""
    try:
        from torch.onnx._internal.exporter import _decomp, _fx_passes
    except ImportError:
        yield
        return
    decompose = getattr(_fx_passes, "decompose_with_registry", None)
    if decompose is None or not hasattr(_decomp, "get_onnx_implemented_overloads"):
        yield
        return

    def decompose_if_needed(program: Any, registry: Any) -> Any:
        registered = set(_decomp.get_onnx_implemented_overloads(registry))
        targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
        to_decompose = {target for target in targets if target not in _ASSERTIONS and (
            not isinstance(target, torch._ops.OpOverload) or target not in registered or target._schema.is_mutable)
            and getattr(target, "__module__", None) not in _SYMBOLIC_MODULES}
        if to_decompose or program.graph_signature.buffers_to_mutate:
            return decompose(program, registry)
        return program

    _fx_passes.decompose_with_registry = decompose_if_needed  # type: ignore[assignment]
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = decompose


@contextlib.contextmanager
def _registry_built_once() -> Iterator[None]:
    """Build the exporter's registry of op translations once per process, not once per graph.

    torch's exporter builds its registry (every torchlib function, for about 2000 ops) anew for each export: 1.7 s
    the first time in a process, 0.7-1.1 s each time after, a fifth of a small graph's export (the first build is
    0.4 s without its sources parsed: `_traced_sources_unparsed`). Within this
    context the first registry a process builds is kept, and each export gets a copy of it with lists of its own
    (the export inserts its custom translations, `models/onnx_backward.py`'s, into them), so what every export
    sees is what a fresh build gives (tests/test_export.py). The registry depends only on the opset and on the
    torchlib functions imported, which do not change within a process. The hook is a private classmethod of the
    pinned torch (2.14.1); where a torch lacks it, the exporter runs unchanged."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    registry_class: Any = getattr(_registration, "ONNXRegistry", None)
    descriptor = vars(registry_class).get("from_torchlib") if registry_class is not None else None
    if not isinstance(descriptor, classmethod):
        yield
        return

    def copy_of_kept(cls: type, *args: Any, **kwargs: Any) -> Any:
        key = (cls, args, tuple(sorted(kwargs.items())))
        kept = _REGISTRIES.get(key)
        if kept is None:
            with _traced_sources_unparsed():
                kept = _REGISTRIES[key] = descriptor.__func__(cls, *args, **kwargs)
        registry = copy.copy(kept)
        registry.functions = {target: list(translations) for target, translations in kept.functions.items()}
        return registry

    registry_class.from_torchlib = classmethod(copy_of_kept)
    try:
        yield
    finally:
        registry_class.from_torchlib = descriptor


_REGISTRIES: dict[tuple, Any] = {}  # the exporter's registries this process built: (class, arguments) -> registry


@contextlib.contextmanager
def _traced_sources_unparsed() -> Iterator[None]:
    """Build the exporter's registry without parsing the source of each traced torchlib function.

    The registry asks onnxscript for its list of torchlib functions, which gives each one's domain as read from its
    `function_ir`; for a traced function (497 of the 557 it lists) that property parses the function's source and
    translates its signature anew at every read, about 1 s of a process's first export here, for a domain the
    registry does not use and which is the function's opset's (its `domain`) anyway. Within this context a traced
    function's `function_ir` is a stand-in holding that domain alone; the registry built is the one a plain build
    gives (tests/test_export.py). A private property of the pinned onnxscript (0.7.2); where it differs, the registry
    is built as it is."""
    try:
        from onnxscript._internal import values
    except ImportError:
        yield
        return
    traced: Any = getattr(values, "TracedOnnxFunction", None)
    parsed = vars(traced).get("function_ir") if traced is not None else None
    if not isinstance(parsed, property) or not hasattr(traced, "domain"):
        yield
        return
    traced.function_ir = property(lambda function: SimpleNamespace(domain=function.domain))
    try:
        yield
    finally:
        traced.function_ir = parsed


# Python's operators on symbolic sizes (getitem of a multi-output op, a size's eq): nothing to decompose.
_SYMBOLIC_MODULES = frozenset({"_operator", "operator", "math"})
# Checks the exporter removes after its decomposition (`_fx_passes.remove_assertion_nodes`): nothing to decompose.
_ASSERTIONS = frozenset({torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._assert_async.default,
                         torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default,
                         torch.ops.aten._assert_tensor_metadata.default})


def _optimize(model: Any) -> None:
    """torch's exporter's optimisation (onnxscript's `optimize_ir`) without its pattern rewriter, in place.

    The rewriter matches its ~40 rules against every node: 1.3-1.6 s of a LeNet gradient graph's export, where they
    fire 18 times and merge consecutive Reshapes, Transposes and Squeezes (403 nodes against 417). ONNX Runtime's
    own graph optimisations, when a session opens, take the graphs to the same step time and the same opening time
    within noise (docs/results.md). What is kept: inlining, constant folding, unused nodes and functions,
    constants as shared initializers, common subexpressions, and the output and name fixes. Each node's metadata
    (the FX node it came from and the host's Python stack) is dropped: five sixths of a graph file's bytes, of no use
    to a device."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    import onnxscript.optimizer

    onnxscript.optimizer.inline(model)
    onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
    for node in model.graph:
        node.metadata_props.clear()


@contextlib.contextmanager
def _exporter_quiet() -> Iterator[None]:
    """The exporter reports each stage, onnx_ir warns about empty attribute lists it resolves itself, and both
    onnx_ir's passes and onnxscript's constant folding report each thing they do at INFO."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
