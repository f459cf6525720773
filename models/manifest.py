"""The artifact manifest: what an exported model is, and the checks a device runs before trusting it.

Read on devices, so it imports neither torch nor onnx: the IR version is read straight from the model file's
protobuf header.
"""
from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path
from stat import S_ISREG
from typing import Any

import numpy as np

MANIFEST_NAME = "manifest.json"
# 2: the training and eval graphs take the loss inputs below (listed in `inputs`); 3: `backends` says which
# trainer backends the set serves, and the initial weights are a flat file (`weights.bin`)
MANIFEST_FORMAT = 3
# The newest ONNX IR version and default-domain opset that every device runtime edgefil installs reads: the base
# install's onnxruntime (>= 1.19) and `edgefil[ort-training]`'s onnxruntime-training 1.19.2 read IR 10 ("max
# supported IR version: 10") and opset 21. The export writes no newer (models/export.py `readable_by_devices`),
# whatever onnx the host has; a device refuses artifacts that claim newer.
MAX_IR_VERSION = 10
MAX_OPSET = 21
PORTABLE_OPSET = 18  # the default-domain opset of the portable graphs (models/portable_export.py exports them)
TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
CHECKPOINT = "checkpoint"
OPTIMIZER_MODELS = {"sgd": "optimizer_sgd.onnx", "adamw": "optimizer_adamw.onnx"}
# The portable backend's standard-op graphs (models/portable_export.py says what each computes).
PORTABLE_MODELS = {
    "gradient": "portable_gradient.onnx",
    "eval": "portable_eval.onnx",
    "sample_grad_norms": "portable_sample_grad_norms.onnx",
    "input_gradient": "portable_input_gradient.onnx",
    "sgd": "portable_sgd.onnx",
    "adamw": "portable_adamw.onnx",
    "sgd_plain": "portable_sgd_plain.onnx",
    "adamw_plain": "portable_adamw_plain.onnx",
    "gradient_plain": "portable_gradient_plain.onnx",
    "step_sgd_plain": "portable_step_sgd_plain.onnx",
    "step_adamw_plain": "portable_step_adamw_plain.onnx",
}
# Each optimiser's update without the terms a plain step leaves at their neutral values (momentum 0 for SGD, no
# proximal pull, every parameter at the learning rate): 2 of SGD's 9 elementwise passes over the weights and 14 of
# AdamW's 24, the same floats. A trainer takes it where a step is plain and the set holds it (sets exported before
# it do not: they step with the whole update, so it is not required).
PLAIN_UPDATES = {"sgd": "sgd_plain", "adamw": "adamw_plain"}
# The gradient of the plain loss (models/loss.py `plain_training_loss`: a step whose method shapes the loss with
# nothing but targets and sample weights, as most steps are), without the terms it leaves at zero: the same floats
# from half the gradient graph's nodes (75 of 150 on mlp: an SGD step 1.32x faster). Taken as the plain updates are.
PLAIN_GRADIENT = "gradient_plain"
# The plain gradient and each optimiser's plain update as one graph (composed at export, models/portable_export.py
# `fused_step`): a plain step in one session run, its gradient never leaving the graph. Taken likewise.
PLAIN_STEPS = {"sgd": "step_sgd_plain", "adamw": "step_adamw_plain"}
PLAIN_GRAPHS = (PLAIN_GRADIENT, *PLAIN_UPDATES.values(), *PLAIN_STEPS.values())  # exported with every portable
# set (sets exported before them hold the whole gradient and update instead)
# The portable graphs only some methods run (each method says which: `ReplayPolicy.trainer_graphs`): an export may
# leave them out (`export_model(graphs=...)`), and a trainer runs those its set holds (`Trainer.graphs`). Among them
# FULL_GRADIENT, the gradient of the whole loss (models/loss.py `training_loss`), which only a method that shapes its
# loss with more than targets and sample weights runs (a teacher, soft targets, class costs, a sigmoid head: GLFC,
# SDD, generator replay's alignment); every other step is plain and runs PLAIN_GRADIENT. The longest graph to
# export, a third of a small model's export, which a run of a plain method is spared.
FULL_GRADIENT = "gradient"
OPTIONAL_GRAPHS: frozenset[str] = frozenset({FULL_GRADIENT, "sample_grad_norms", "input_gradient"})
# The initial weights: float32, little-endian, manifest order, no header (absent from a nominal set).
WEIGHTS = "weights.bin"
# The files each trainer backend loads: "ort" runs ORT Training's artifacts, "portable" the standard-op graphs on
# plain onnxruntime, "torch" rebuilds the architecture from the model zoo and needs only the manifest.
BACKEND_FILES: dict[str, tuple[str, ...]] = {
    "ort": (TRAINING_MODEL, EVAL_MODEL, CHECKPOINT, *OPTIMIZER_MODELS.values()),
    "portable": tuple(file for graph, file in PORTABLE_MODELS.items()
                      if graph not in OPTIONAL_GRAPHS and graph not in PLAIN_GRAPHS),
    "torch": (),
}


def set_files(backends: Collection[str], graphs: Collection[str], nominal: bool) -> list[str]:
    """The files of a set that serves `backends`, the portable ones with the optional `graphs` (and the plain ones
    every portable set holds), and, unless nominal, the initial weights: what its manifest lists."""
    files = [file for backend in backends for file in BACKEND_FILES[backend]]
    if "portable" in backends:
        files += [PORTABLE_MODELS[graph] for graph in (*sorted(graphs), *PLAIN_GRAPHS)]
    if not nominal:
        files.append(WEIGHTS)
    return files


# The inputs of the training and eval graphs, in order: (name, dtype, shape, meaning). "N" is the batch size,
# "C" the class count; `input` has the model's input shape after N. The loss they shape is models/loss.py's.
GRAPH_INPUTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("input", "float32", ("N", "*input_shape"), "a batch of samples, channels first"),
    ("class_mask", "float32", ("C",), "1 for classes the model may predict, 0 for hidden ones"),
    ("targets", "float32", ("N", "C"), "target distribution per sample: one-hot labels, soft or multi-hot"),
    ("sample_weights", "float32", ("N",), "weight of each sample's loss (ones: the plain batch mean)"),
    ("teacher_logits", "float32", ("N", "C"), "a teacher model's raw logits per sample (zeros when unused)"),
    ("teacher_weights", "float32", ("N",), "weight of each sample's teacher term (zeros: no teacher)"),
    ("soft_targets", "float32", ("N", "C"), "a distribution to distil into the softmax of the visible classes"),
    ("soft_weights", "float32", ("N",), "weight of each sample's soft-target term (zeros: none)"),
    ("class_costs", "float32", ("N", "C"), "each class's cost per sample; adds the expected cost under the softmax"),
    ("bce", "float32", ("1",), "the head: 0 = softmax cross-entropy, 1 = sigmoid binary cross-entropy"),
)
LOSS_INPUT_NAMES = tuple(name for name, *_ in GRAPH_INPUTS[2:])  # what models/loss.py takes after the logits
LOSS_HEADS = ("softmax-ce", "sigmoid-bce")  # the `bce` input's two values, 0 and 1, by name
GRAPH_OUTPUTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("loss", "float32", (), "the batch loss (models/loss.py)"),
    ("logits", "float32", ("N", "C"), "logits with hidden classes at -1e9"),
    ("features", "float32", ("N", "feature_dim"), "the penultimate features"),
)


HEAD_WEIGHT, HEAD_BIAS = "head.weight", "head.bias"  # every zoo model's last layer: one row and one bias per class


def named_parameter(flat: np.ndarray, parameters: Sequence[ParameterInfo], name: str) -> np.ndarray:
    """One parameter (or its gradient) inside a flat buffer in manifest order, in its shape (a view);
    ValueError where the model has none of that name."""
    offset = 0
    for p in parameters:
        if p.name == name:
            return flat[offset : offset + p.size].reshape(p.shape)
        offset += p.size
    raise ValueError(f"the model has no {name}")


def class_head_positions(parameters: Sequence[ParameterInfo], classes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Positions in the flat buffer (manifest order) of the head's values of `classes`: their rows of
    head.weight (classes x features) and their entries of head.bias, class by class (each row, then its bias).
    What a method that treats some classes' head apart needs: a rate of their own, an aggregation of their
    own."""
    offsets, shapes, offset = {}, {}, 0
    for p in parameters:
        offsets[p.name], shapes[p.name] = offset, p.shape
        offset += p.size
    if HEAD_WEIGHT not in offsets or HEAD_BIAS not in offsets:
        raise ValueError(f"the model has no {HEAD_WEIGHT} and {HEAD_BIAS}")
    num_classes, width = shapes[HEAD_WEIGHT]
    picked = np.asarray(classes, dtype=np.int64)
    if picked.size and (picked.min() < 0 or picked.max() >= num_classes):
        raise ValueError(f"classes must lie in [0, {num_classes})")
    rows = offsets[HEAD_WEIGHT] + picked[:, None] * width + np.arange(width)[None, :]
    return np.concatenate([rows, (offsets[HEAD_BIAS] + picked)[:, None]], axis=1).ravel()


def runnable_backends() -> tuple[str, ...]:
    """The trainer backends this Python can run, found without importing anything: "ort" where the onnxruntime
    package in place is a training build (`training_build`), "portable" where any onnxruntime is, "torch" where
    torch is."""
    import importlib.util

    found = []
    spec = importlib.util.find_spec("onnxruntime")
    if spec is not None and spec.origin is not None:
        if training_build(Path(spec.origin).parent):
            found.append("ort")
        found.append("portable")
    if importlib.util.find_spec("torch") is not None:
        found.append("torch")
    return tuple(found)


TRAINING_DISTRIBUTIONS = ("onnxruntime-training-cpu", "onnxruntime-training")


@functools.cache
def training_build(package: Path) -> bool:
    """Whether the `onnxruntime` package at `package` is ONNX Runtime Training's build: it holds `training/`, and its
    version (its `__init__.py` says) is that of an installed training distribution. Both builds install this one
    package; the base install's onnxruntime put in over a training build leaves `training/` behind, with a runtime
    that has no training in it. Asked once a process (half a millisecond: every trainer a fleet worker builds asks
    `runnable_backends`), as what is installed does not change under a running process."""
    from importlib import metadata

    init = package / "__init__.py"
    if not (package / "training").is_dir() or not init.is_file():
        return False
    stated = re.search(r'^__version__ = "([^"]+)"', init.read_text(errors="replace"), re.MULTILINE)
    for distribution in TRAINING_DISTRIBUTIONS:
        try:
            if stated is not None and metadata.version(distribution) == stated.group(1):
                return True
        except metadata.PackageNotFoundError:
            continue
    return False


@dataclass(frozen=True)
class GraphValue:
    """One input or output of the training and eval graphs, as the manifest lists it for plain ORT users."""

    name: str
    dtype: str
    shape: tuple[str, ...]
    meaning: str


def graph_values(table: tuple[tuple[str, str, tuple[str, ...], str], ...]) -> tuple[GraphValue, ...]:
    return tuple(GraphValue(*row) for row in table)


class ManifestError(ValueError):
    """An artifact directory that must not be loaded: missing, tampered with, or built for another runtime."""


@dataclass(frozen=True)
class ParameterInfo:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """Everything a device needs to know about an artifact set. `parameters` is the flat-buffer order."""

    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    feature_dim: int
    parameters: tuple[ParameterInfo, ...]
    opset: int
    ir_version: int
    nominal_checkpoint: bool
    edgefil_version: str
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    backends: tuple[str, ...] = ("torch",)  # the trainer backends this set serves (BACKEND_FILES)
    model_args: dict[str, Any] = field(default_factory=dict)  # a user's model's constructor arguments (models/zoo.py)
    inputs: tuple[GraphValue, ...] = graph_values(GRAPH_INPUTS)
    outputs: tuple[GraphValue, ...] = graph_values(GRAPH_OUTPUTS)
    format: int = MANIFEST_FORMAT

    @functools.cached_property
    def num_parameters(self) -> int:  # read on every training step: summed once
        return sum(p.size for p in self.parameters)

    @property
    def optional_graphs(self) -> frozenset[str]:
        """The optional portable graphs (OPTIONAL_GRAPHS) this set holds."""
        return frozenset(graph for graph in OPTIONAL_GRAPHS if PORTABLE_MODELS[graph] in self.files)

    def require_backend(self, backend: str) -> None:
        """ManifestError unless this artifact set was exported for `backend`."""
        require_served(backend, self.backends)

    def to_json(self) -> str:
        data = asdict(self)
        data["num_parameters"] = self.num_parameters
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data: Any = None
        try:
            data = json.loads(text)
            declared_count = data.pop("num_parameters")
            manifest = cls(
                model=str(data["model"]),
                input_shape=tuple(int(d) for d in data["input_shape"]),
                num_classes=int(data["num_classes"]),
                feature_dim=int(data["feature_dim"]),
                parameters=tuple(
                    ParameterInfo(str(p["name"]), tuple(int(d) for d in p["shape"]))
                    for p in data["parameters"]
                ),
                opset=int(data["opset"]),
                ir_version=int(data["ir_version"]),
                nominal_checkpoint=bool(data["nominal_checkpoint"]),
                edgefil_version=str(data["edgefil_version"]),
                files={str(k): str(v) for k, v in data["files"].items()},
                backends=tuple(str(b) for b in data["backends"]),
                model_args=dict(data.get("model_args", {})),
                inputs=tuple(_graph_value(v) for v in data["inputs"]),
                outputs=tuple(_graph_value(v) for v in data["outputs"]),
                format=int(data["format"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(data, dict) and "format" in data and data["format"] != MANIFEST_FORMAT:
                raise ManifestError(f"manifest format {data.get('format')!r} is not supported (this edgefil reads "
                                    f"{MANIFEST_FORMAT}): export the artifacts again") from None
            raise ManifestError(f"malformed manifest: {err!r}") from err
        if data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(
                f"manifest format {manifest.format} is not supported (this edgefil reads {MANIFEST_FORMAT})"
            )
        if declared_count != manifest.num_parameters:
            raise ManifestError(
                f"manifest declares {declared_count} parameters but its parameter list sums to "
                f"{manifest.num_parameters}"
            )
        return manifest


def _graph_value(data: dict) -> GraphValue:
    return GraphValue(str(data["name"]), str(data["dtype"]), tuple(str(d) for d in data["shape"]),
                      str(data["meaning"]))


def manifest_digest(artifacts: str | Path) -> str:
    """What a device and the coordinator compare at registration: the sha256 of manifest.json."""
    return hashlib.sha256((Path(artifacts) / MANIFEST_NAME).read_bytes()).hexdigest()


@functools.cache
def software_version() -> str:
    """The installed edgefil distribution's version (recorded in manifests, sent at registration); "unknown"
    when the code runs from a checkout that was never installed. Looked up once, on first use: importing
    importlib.metadata costs ~20 ms, which no process should pay at import time."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgefil")
    except PackageNotFoundError:
        return "unknown"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_ir_version(path: Path) -> int:
    """The `ir_version` field (number 1) of an ONNX ModelProto, parsed from the protobuf wire format. The file is
    mapped, not read: the field comes first, and a graph's weights (tens of MB for ResNet-18) are skipped unread."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            raise ManifestError(f"{path} is not an ONNX model (empty)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _ir_version(data, path)


def _ir_version(data: Any, path: Path) -> int:
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(data, pos)
            if number == 1:
                return value
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            break
    raise ManifestError(f"{path} is not an ONNX model (no ir_version field)")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ManifestError("truncated protobuf varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def require_served(backend: str, served: Sequence[str]) -> None:
    """ManifestError unless `backend` is among the backends an artifact set serves (the one wording of it)."""
    if backend not in served:
        raise ManifestError(f"the artifacts serve the {', '.join(served)} backends, not {backend!r}: export them "
                            f"again with {backend!r} among --backends")


def load_manifest(directory: str | Path, check_hashes: bool = True) -> Manifest:
    """Read and verify an artifact directory's manifest; raise ManifestError on any mismatch."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{directory} has no {MANIFEST_NAME}: not an edgefil artifact directory")
    manifest = Manifest.from_json(path.read_text())
    unknown = sorted(set(manifest.backends) - BACKEND_FILES.keys())
    if unknown:
        raise ManifestError(f"manifest in {directory} names unknown backends {', '.join(unknown)}")
    required = {name for backend in manifest.backends for name in BACKEND_FILES[backend]}
    if not manifest.nominal_checkpoint:
        required.add(WEIGHTS)
    missing = sorted(required - manifest.files.keys())
    if missing:
        raise ManifestError(f"manifest in {directory} lists no hash for {', '.join(missing)}")
    verify_files(directory, manifest.files, MANIFEST_NAME, check_hashes)
    if [value.name for value in manifest.inputs] != [name for name, *_ in GRAPH_INPUTS]:
        raise ManifestError(f"the artifacts in {directory} take the graph inputs "
                            f"{', '.join(value.name for value in manifest.inputs)}; this edgefil feeds "
                            f"{', '.join(name for name, *_ in GRAPH_INPUTS)}: export them again")
    if manifest.ir_version > MAX_IR_VERSION or manifest.opset > MAX_OPSET:
        raise ManifestError(
            f"artifacts use ONNX IR version {manifest.ir_version} and opset {manifest.opset}; the devices' ONNX "
            f"Runtime reads at most IR {MAX_IR_VERSION} and opset {MAX_OPSET}: export them again with this edgefil"
        )
    return manifest


def verify_files(directory: Path, files: dict[str, str], listing: str, check_hashes: bool = True) -> None:
    """Every file a listing (manifest.json, generator.json) names is present, matches its sha256, and, for an
    ONNX model, has an IR version the devices' ONNX Runtime reads, as its own protobuf header says; ManifestError
    otherwise. A file found good is not read again while it stays the same file, unchanged (its inode, size,
    modification and change times): a fleet worker loads one artifact set for each of its thousands of devices,
    and hashing every file for each was 8 ms of a device's 10-17 ms start."""
    for name, expected in files.items():
        path = directory / name
        try:
            found = path.stat()
        except OSError:
            found = None
        if found is None or not S_ISREG(found.st_mode):
            raise ManifestError(f"artifact file {path} is missing")
        seen = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns, expected,
                check_hashes)  # ctime: a write whose mtime was set back still shows
        if seen in _FOUND_GOOD:
            continue
        if check_hashes and sha256_file(path) != expected:
            raise ManifestError(f"artifact file {path} does not match its sha256 in {listing}")
        if name.endswith(".onnx") and (ir_version := read_ir_version(path)) > MAX_IR_VERSION:
            raise ManifestError(f"{path} has ONNX IR version {ir_version}; the devices' ONNX Runtime reads at most "
                                f"{MAX_IR_VERSION}: export it again with this edgefil")
        _FOUND_GOOD.add(seen)


_FOUND_GOOD: set[tuple[Any, ...]] = set()  # verify_files' files found good, by what would show a change
