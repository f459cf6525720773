"""Export a registered model for the device's trainer backends, plus a verified manifest (host side).

The manifest's `backends` lists what the set serves. "portable": the standard-op graphs of
`models/portable_export.py` (plain onnxruntime). "ort": ONNX Runtime Training's artifacts, `training_model.onnx`
and `eval_model.onnx` (both take `input`, `class_mask` and the loss
inputs `targets`, `sample_weights`, `teacher_logits`, `teacher_weights`, `soft_targets`, `soft_weights`,
`class_costs`, `bce`, and return `(loss, logits,
features)`; `models.manifest.GRAPH_INPUTS` says what each means and `models/loss.py` is the loss they shape: the
torch graph computes it, and ORT's artifact generator passes it through), one optimizer model per optimizer
(`optimizer_sgd.onnx`, `optimizer_adamw.onnx`), the `checkpoint` (full, or nominal: shapes without weights, for
shipping when the weights arrive from the coordinator as a flat buffer). "torch": nothing beyond the manifest.
Every set holds `manifest.json` and, unless nominal, `weights.bin` (the initial weights, manifest order).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.loss import TrainingGraph
from models.manifest import (
    BACKEND_FILES,
    CHECKPOINT,
    EVAL_MODEL,
    GRAPH_INPUTS,
    GRAPH_OUTPUTS,
    MANIFEST_NAME,
    MAX_IR_VERSION,
    MAX_OPSET,
    OPTIMIZER_MODELS,
    OPTIONAL_GRAPHS,
    PORTABLE_MODELS,
    PORTABLE_OPSET,
    TRAINING_MODEL,
    WEIGHTS,
    Manifest,
    ManifestError,
    ParameterInfo,
    load_manifest,
    read_ir_version,
    runnable_backends,
    set_files,
    sha256_file,
    software_version,
)
from models.zoo import ClassifierModel, build_model, is_import_path, model_source_digest

log = logging.getLogger("edgefil.export")  # a name of the command line's own (edgefil/cli.py)

OPSET = 17
INPUT_NAMES = [name for name, *_ in GRAPH_INPUTS]
OUTPUT_NAMES = [name for name, *_ in GRAPH_OUTPUTS]


def export_model(
    model: ClassifierModel,
    name: str,
    input_shape: tuple[int, ...],
    out_dir: str | Path,
    nominal: bool = False,
    backends: Sequence[str] | None = None,
    graphs: Collection[str] | None = None,
    model_args: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """Write the artifact set of `model` (its current weights) for `backends` (default: every backend this host
    can export, `exportable_backends()`) to `out_dir` and return its manifest. `graphs`: the optional portable
    graphs to export (`OPTIONAL_GRAPHS`; default all; a run exports those its method needs); `model_args`: what
    built `model` besides its name (a user's model's constructor arguments), recorded for the coordinator;
    `progress`: called with each long step as it starts (a fleet's dashboard shows it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backends = _checked_backends(backends)
    optional = _checked_graphs(graphs)
    num_classes = model.head.out_features
    model = model.cpu().eval()
    ort_ir_version = 0
    parameters = _torch_order(model)
    if "ort" in backends:
        with _step(f"exporting {name} for the ort backend (ORT training artifacts)", progress):
            parameters, ort_ir_version = _export_ort(model, input_shape, num_classes, out_dir, nominal)
    if "portable" in backends:
        _export_portable_graphs(model, name, parameters, input_shape, out_dir, optional, progress=progress)
    if not nominal:
        _write_weights(model, parameters, out_dir)
    template = _template(model, name, input_shape, parameters, nominal, model_args)
    return assemble_manifest(template, out_dir, backends, optional, ort_ir_version)


def _torch_order(model: torch.nn.Module) -> tuple[ParameterInfo, ...]:
    """The flat-buffer order of a set without ORT Training's artifacts (which impose their own): torch's."""
    return tuple(ParameterInfo(n, tuple(p.shape)) for n, p in model.named_parameters())


def _template(model: ClassifierModel, name: str, input_shape: tuple[int, ...], parameters: tuple[ParameterInfo, ...],
              nominal: bool, model_args: Mapping[str, Any] | None) -> Manifest:
    """What a set's manifest says of its model, whatever part of the set it lists (`assemble_manifest`)."""
    return Manifest(model=name, input_shape=tuple(input_shape), num_classes=model.head.out_features,
                    feature_dim=model.head.in_features, parameters=parameters, opset=OPSET, ir_version=0,
                    nominal_checkpoint=nominal, edgefil_version=software_version(), model_args=dict(model_args or {}))


def _export_portable_graphs(model: ClassifierModel, name: str, parameters: tuple[ParameterInfo, ...],
                            input_shape: tuple[int, ...], folder: Path, graphs: Collection[str], base: bool = True,
                            progress: Callable[[str], None] | None = None) -> None:
    """The portable graphs (`export_portable`'s; `base=False`: only the optional `graphs`), a failure said in one
    line where it is the model's, not edgefil's."""
    from models.portable_export import export_portable

    what = "the portable backend (standard-op training graphs; the longest step)" if base else \
        f"the portable backend's {', '.join(sorted(graphs))} graphs"
    with _step(f"exporting {name} for {what}", progress):
        try:
            export_portable(model, parameters, input_shape, folder, graphs, base=base)
        except Exception as err:
            # a user's model: whatever torch's exporter stumbles on, in one line (the zoo's own errors stay
            # whole: they are edgefil's to fix); an op without a gradient graph, for any model
            if not (is_import_path(name) or isinstance(err, (NotImplementedError, torch.onnx.OnnxExporterError))):
                raise
            raise ValueError(f"model {name!r} cannot be exported for the portable backend: {_root_cause(err)} "
                             f"(export for --backends ort,torch, or choose other layers)") from None


def assemble_manifest(template: Manifest, folder: Path, backends: tuple[str, ...], graphs: Collection[str],
                      ort_ir_version: int = 0, known: Mapping[str, str] | None = None) -> Manifest:
    """The manifest of the set in `folder` that serves `backends` (the portable backend with the optional `graphs`),
    written there: its files (`set_files`) and their hashes, the newest ONNX IR version of its graphs (ORT's as
    its export reported it, the portable graphs' read off their files) and the newest opset they use: the one
    rule for a set exported whole (`export_model`) and for a part of a kept set (`export_registered`'s cache).
    `known`: the hashes of files copied from a verified set, not read again (a ResNet-18 set is hundreds of MB)."""
    files = set_files(backends, graphs if "portable" in backends else (), template.nominal_checkpoint)
    portable = set(PORTABLE_MODELS.values())
    ir_version = max([ort_ir_version, *(read_ir_version(folder / f) for f in files if f in portable)])
    opsets = [OPSET] if "ort" in backends else []
    if "portable" in backends:
        opsets.append(PORTABLE_OPSET)
    manifest = replace(template, backends=tuple(backends), ir_version=ir_version, opset=max(opsets, default=OPSET),
                       files={f: (known or {}).get(f) or sha256_file(folder / f) for f in files})
    (folder / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


@contextlib.contextmanager
def _step(what: str, progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """A long step, said before it starts and when it is done (the command line shows edgefil's INFO lines), and
    told to `progress` as it starts."""
    log.info("%s ...", what)
    if progress is not None:
        progress(what)
    started = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - started)


def exportable_backends() -> tuple[str, ...]:
    """The trainer backends this host can export for: "ort" needs onnxruntime-training (CPython <= 3.11 on
    x86_64 Linux), "portable" needs onnxscript (torch's ONNX exporter), "torch" needs nothing more."""
    runnable = runnable_backends()
    found = ["ort"] if "ort" in runnable else []
    if importlib.util.find_spec("onnxscript"):
        found.append("portable")
    return (*found, "torch")


def _checked_graphs(graphs: Collection[str] | None) -> frozenset[str]:
    if graphs is None:
        return OPTIONAL_GRAPHS
    unknown = sorted(set(graphs) - OPTIONAL_GRAPHS)
    if unknown:
        raise ValueError(f"unknown optional graphs {', '.join(unknown)}; "
                         f"choose from {', '.join(sorted(OPTIONAL_GRAPHS))}")
    return frozenset(graphs)


def _checked_backends(backends: Sequence[str] | None) -> tuple[str, ...]:
    if backends is None:
        return exportable_backends()
    chosen = tuple(dict.fromkeys(backends))
    unknown = [b for b in chosen if b not in BACKEND_FILES]
    if unknown or not chosen:
        raise ValueError(f"unknown backends {unknown or chosen!r}; choose from {', '.join(BACKEND_FILES)}")
    missing = [b for b in chosen if b not in exportable_backends()]
    if missing:
        raise ManifestError(f"this host cannot export for {', '.join(missing)}: "
                            "'ort' needs onnxruntime-training, 'portable' needs onnxscript")
    return chosen


def _export_ort(
    model: ClassifierModel, input_shape: tuple[int, ...], num_classes: int, out_dir: Path, nominal: bool
) -> tuple[tuple[ParameterInfo, ...], int]:
    """ONNX Runtime Training's artifacts; returns the flat-buffer order ORT imposes and the graphs' IR version."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="edgefil-export-") as tmp:
        tmp_dir = Path(tmp)
        onnx_model = readable_by_devices(_to_onnx(model, input_shape, num_classes, tmp_dir / "base.onnx"))
        trainable = [p.name for p in onnx_model.graph.initializer if p.name in dict(model.named_parameters())]
        for optimizer, optim_file in OPTIMIZER_MODELS.items():
            gen_dir = tmp_dir / optimizer
            gen_dir.mkdir()  # generate_artifacts needs an existing directory
            _quiet_generate(onnx_model, trainable, optimizer, gen_dir)
            optim_model = onnx.load(str(gen_dir / "optimizer_model.onnx"))
            use_torch_adamw(optim_model)
            onnx.save(readable_by_devices(optim_model), str(out_dir / optim_file))
        generated = tmp_dir / "sgd"
        parameters = ort_flat_order(model, generated)
        shutil.move(generated / TRAINING_MODEL, out_dir / TRAINING_MODEL)
        shutil.move(generated / EVAL_MODEL, out_dir / EVAL_MODEL)
        checkpoint = generated / ("nominal_checkpoint" if nominal else "checkpoint")
        shutil.move(checkpoint, out_dir / CHECKPOINT)
    return parameters, onnx_model.ir_version


def export_registered(
    name: str,
    num_classes: int,
    out_dir: str | Path,
    input_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    nominal: bool = False,
    backends: Sequence[str] | None = None,
    cache: bool = False,
    graphs: Collection[str] | None = None,
    model_args: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """Build a zoo model, or a user's (`package.module:Name` with its constructor's `model_args`: models/zoo.py),
    with seeded initial weights and export it (`graphs`: as `export_model`'s); `cache`: copy the same export made
    before, and keep this one for the next (models/cache.py); `progress`: as `export_model`'s."""
    if input_shape is None and is_import_path(name):
        raise ValueError(f"model {name!r}: a model of your own needs its input shape (--input-shape)")
    shape = tuple(input_shape) if input_shape is not None else _default_shape(name)
    chosen = _checked_backends(backends)
    optional = _checked_graphs(graphs)
    args = dict(model_args or {})
    # built once, before any export starts (a model of one's own that cannot be built is refused in one line): the
    # export traces it and the weights written beside a cached set are its seeded initial ones
    model = build_model(name, num_classes, shape, seed=seed, args=args)

    def export(folder: Path) -> Manifest:
        return export_model(model, name, shape, folder, nominal=nominal, backends=chosen, graphs=optional,
                            model_args=args, progress=progress)

    if not cache:
        return export(Path(out_dir))
    from models.cache import cached_export, copy_files, export_key

    own = _own_model_key(name, args)
    if "ort" in chosen:
        # ORT Training's artifacts impose their own order of the flat weights, which every graph of the set then
        # follows, and its full checkpoint holds the initial weights: such a set is kept whole, for its seed
        key = export_key(model=name, classes=num_classes, shape=shape, seed=None if nominal else seed,
                         nominal=nominal, backends=chosen, graphs=sorted(optional), **own)
        cached_export(key, Path(out_dir), export, chosen)
        return load_manifest(out_dir)
    # Without them every graph takes the weights as an input: one set kept for every seed, backend and optional
    # graph, which each export asks for a part of and adds what it lacks to
    key = export_key(model=name, classes=num_classes, shape=shape, nominal=nominal, layout="torch", **own)
    part = _kept_part(key, model, name, shape, nominal, chosen, optional, args, progress)
    if part is None:  # no cache to keep it in, or one changed while it was read
        return export(Path(out_dir))
    kept, template = part
    out = Path(out_dir)
    try:
        copy_files(kept, out, set_files(chosen, optional, nominal=True))
    except OSError:  # the kept set replaced meanwhile by a larger one: made here instead
        return export(out)
    if not nominal:
        _write_weights(model, template.parameters, out)
    return assemble_manifest(template, out, chosen, optional, known=_copied(template))


def _kept_part(key: str, model: ClassifierModel, name: str, shape: tuple[int, ...], nominal: bool,
               backends: tuple[str, ...], graphs: frozenset[str], args: Mapping[str, Any],
               progress: Callable[[str], None] | None) -> tuple[Path, Manifest] | None:
    """The folder of the set kept under `key` once it holds `backends` and `graphs`, and its manifest: what it
    lacks is exported into a copy of it, which then replaces it (so the demo's set, a fleet's and `edgefil export`'s
    are one, each exported once); None where the cache cannot be written."""
    from models.cache import copy_files, keep_set, kept_set, staging_folder

    found = kept_set(key)
    have_backends, have_graphs = (found[1].backends, found[1].optional_graphs) if found else ((), frozenset())
    union = tuple(dict.fromkeys((*have_backends, *backends)))
    union_graphs = have_graphs | graphs if "portable" in union else frozenset()
    if found is not None and set(union) == set(have_backends) and union_graphs == have_graphs:
        return found
    staging = staging_folder(key)
    if staging is None:
        return None
    try:
        template = found[1] if found else _template(model, name, shape, _torch_order(model), nominal, args)
        if found is not None:
            copy_files(found[0], staging, list(found[1].files))
        if "portable" in union and "portable" not in have_backends:
            _export_portable_graphs(model, name, template.parameters, shape, staging, union_graphs, progress=progress)
        elif union_graphs - have_graphs:
            _export_portable_graphs(model, name, template.parameters, shape, staging, union_graphs - have_graphs,
                                    base=False, progress=progress)
        if not nominal:
            _write_weights(model, template.parameters, staging)
        manifest = assemble_manifest(template, staging, union, union_graphs, known=_copied(found[1]) if found else None)
        return keep_set(key, staging), manifest
    except OSError:  # the cache could not be written (full, read-only, changed meanwhile): exported without it
        shutil.rmtree(staging, ignore_errors=True)
        return None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _copied(kept: Manifest) -> dict[str, str]:
    """The hashes of a verified kept set's files that a copy of it holds as they are: all but the initial weights,
    which each copy writes for its seed."""
    return {name: digest for name, digest in kept.files.items() if name != WEIGHTS}


def _root_cause(err: BaseException) -> str:
    """The innermost error of `err`'s chain, in one line: torch's exporter wraps the op it has no translation for
    (a NotImplementedError of models/onnx_backward.py, or its own) in pages of advice."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _own_model_key(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """What a user's model adds to its export's cache key: its arguments and its source file's digest, so that a
    model edited since, or built otherwise, is exported anew. Nothing for the zoo's (older keys stay valid)."""
    if not is_import_path(name):
        return {}
    return {"model_args": args, "model_source": model_source_digest(name)}


def _write_weights(model: torch.nn.Module, parameters: Sequence[ParameterInfo], out_dir: Path) -> None:
    """The model's initial weights as `weights.bin`: flat float32, little-endian, manifest order."""
    named = dict(model.named_parameters())
    flat = np.concatenate([named[p.name].detach().numpy().astype("<f4").ravel() for p in parameters])
    (out_dir / WEIGHTS).write_bytes(flat.tobytes())


def _default_shape(name: str) -> tuple[int, ...]:
    from models.zoo import REGISTRY

    return REGISTRY[name].default_input_shape


def _to_onnx(
    model: ClassifierModel, input_shape: tuple[int, ...], num_classes: int, path: Path
) -> Any:
    n = 2
    example = (
        torch.zeros(n, *input_shape), torch.ones(num_classes), torch.nn.functional.one_hot(
            torch.arange(n) % num_classes, num_classes).float(),
        torch.ones(n), torch.zeros(n, num_classes), torch.zeros(n), torch.zeros(n, num_classes), torch.zeros(n),
        torch.zeros(n, num_classes), torch.zeros(1),
    )
    batch = {0: "batch"}
    torch.onnx.export(
        TrainingGraph(model),
        example,
        str(path),
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        dynamic_axes={name: batch for name in (*INPUT_NAMES, *OUTPUT_NAMES) if name not in ("class_mask", "bce",
                                                                                             "loss")},
        opset_version=OPSET,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        export_params=True,
        dynamo=False,
    )
    import onnx

    return onnx.load(str(path))


def ort_flat_order(model: torch.nn.Module, directory: Path) -> tuple[ParameterInfo, ...]:
    """Read the flat-buffer layout off ORT itself: it follows neither torch's nor the checkpoint's name order.

    A buffer of 0, 1, 2, ... is copied into the parameters; each parameter's first value is its offset
    (exact in float32 below 2**24 values).
    """
    from onnxruntime import OrtValue, SessionOptions
    from onnxruntime.training.api import CheckpointState, Module

    options = SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 2  # quiet: ORT logs every pass at INFO
    state = CheckpointState.load_checkpoint(str(directory / CHECKPOINT))
    module = Module(
        str(directory / TRAINING_MODEL), state, str(directory / EVAL_MODEL), session_options=options
    )
    size = module.get_parameters_size(trainable_only=True)
    if size >= 2**24:
        raise ManifestError(f"{size} parameters: the layout probe is exact only below 2**24 values")
    numbered = OrtValue.ortvalue_from_numpy(np.arange(size, dtype=np.float32))  # keeps its numpy array alive
    module.copy_buffer_to_parameters(numbered._ortvalue)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    offsets = {name: int(state.parameters[name].data.ravel()[0]) for name in shapes}
    order = tuple(ParameterInfo(n, shapes[n]) for n in sorted(shapes, key=offsets.__getitem__))
    expected = 0
    for info in order:  # the layout must tile the buffer exactly
        if offsets[info.name] != expected:
            raise ManifestError(f"ORT flat buffer has an unexpected layout at parameter {info.name}")
        expected += info.size
    if expected != size:
        raise ManifestError(f"ORT holds {size} trainable values, the torch model {expected}")
    return order


def readable_by_devices(model: Any) -> Any:
    """`model` (an onnx ModelProto), stamped with an IR version the devices' ONNX Runtime reads (MAX_IR_VERSION).
    onnx stamps a graph it builds with its own newest IR version (14 for onnx 1.23: ORT's artifact builder makes the
    optimizer graphs so), which ONNX Runtime 1.19 refuses; what these graphs hold (float and int64 tensors, opset
    <= 18 and ORT's own training ops) was all in IR 10 already, so the stamp is lowered rather than the host's onnx
    pinned. A default-domain opset newer than the devices read is refused."""
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset > MAX_OPSET:
        raise ManifestError(f"the graph {model.graph.name!r} uses ONNX opset {opset}; the devices' ONNX Runtime reads "
                            f"at most {MAX_OPSET}")
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model


def use_torch_adamw(optimizer_model: Any) -> None:
    """Switch ORT's AdamW kernel from Hugging Face mode (eps added before bias correction) to PyTorch mode,
    so that the ORT and torch backends take the same AdamW steps."""
    for node in optimizer_model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[None]:
    """ORT's gradient builder logs every graph pass to file descriptor 2 at INFO level, past any Python
    logging setting. Hold that output back, and show it only if generation fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


@contextlib.contextmanager
def root_info_silenced() -> Iterator[None]:
    """ORT's artifact generator logs every file it writes at INFO through the root logger (`logging.info`); a
    filter on the root logger drops those records and leaves every named logger alone."""
    root = logging.getLogger()
    root.addFilter(_warnings_only)
    try:
        yield
    finally:
        root.removeFilter(_warnings_only)


def _quiet_generate(onnx_model: Any, trainable: list[str], optimizer: str, directory: Path) -> None:
    from onnxruntime.training import artifacts

    kinds = {"sgd": artifacts.OptimType.SGD, "adamw": artifacts.OptimType.AdamW}
    with native_stderr_captured(), root_info_silenced():
        artifacts.generate_artifacts(
            onnx_model,
            requires_grad=trainable,
            loss=None,  # the graph computes models/loss.py's loss itself: ORT passes it through
            optimizer=kinds[optimizer],
            artifact_directory=directory,
            loss_input_names=["loss"],
            additional_output_names=OUTPUT_NAMES[1:],
            nominal_checkpoint=True,
        )
