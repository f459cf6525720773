"""`generator.json`: what a generator artifact folder holds, and the checks a device runs before using it.

Written by `models.generator_export` on the host, read on devices (no torch, no onnx). The ORT layout maps ORT's
contiguous training buffer to the `flatten_module` buffers of the sampler and the auxiliary model: ORT orders
parameters neither as torch nor by name, so the export measures the order and records it here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.manifest import ManifestError, verify_files

GENERATOR_JSON = "generator.json"
SAMPLER_MODEL = "sampler.onnx"
GENERATOR_FORMAT = 1
PARTS = ("sampler", "auxiliary")


@dataclass(frozen=True)
class OrtSegment:
    """One parameter of ORT's flat buffer (in buffer order): where it lives in its part's flat buffer."""

    name: str
    shape: tuple[int, ...]
    part: str  # "sampler" or "auxiliary"
    offset: int  # start in the part's flatten_module buffer

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class GeneratorArtifacts:
    """The contents of `generator.json`. `ort_layout` is empty for kinds without ORT training artifacts."""

    spec: dict[str, Any]
    sampler_size: int
    auxiliary_size: int
    opset: int
    ir_version: int
    ort_layout: tuple[OrtSegment, ...] = ()
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    format: int = GENERATOR_FORMAT

    @property
    def kind(self) -> str:
        return str(self.spec["kind"])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.spec["input_shape"])

    @property
    def latent_dim(self) -> int:
        return int(self.spec["latent_dim"])

    def to_json(self) -> str:
        data = {
            "format": self.format, "spec": self.spec, "kind": self.kind, "sampler_size": self.sampler_size,
            "auxiliary_size": self.auxiliary_size, "opset": self.opset, "ir_version": self.ir_version,
            "ort_layout": [{"name": s.name, "shape": list(s.shape), "part": s.part, "offset": s.offset}
                           for s in self.ort_layout],
            "files": self.files,
        }
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GeneratorArtifacts:
        try:
            data = json.loads(text)
            layout = tuple(OrtSegment(str(s["name"]), tuple(int(d) for d in s["shape"]), str(s["part"]),
                                      int(s["offset"])) for s in data["ort_layout"])
            info = cls(spec=dict(data["spec"]), sampler_size=int(data["sampler_size"]),
                       auxiliary_size=int(data["auxiliary_size"]), opset=int(data["opset"]),
                       ir_version=int(data["ir_version"]), ort_layout=layout,
                       files={str(k): str(v) for k, v in data["files"].items()}, format=int(data["format"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{GENERATOR_JSON} is malformed: {e}") from e
        if info.format != GENERATOR_FORMAT:
            raise ManifestError(f"{GENERATOR_JSON} has format {info.format}; this edgefil reads {GENERATOR_FORMAT}")
        if data.get("kind") != info.kind:
            raise ManifestError(f"{GENERATOR_JSON}: kind {data.get('kind')!r} disagrees with its spec")
        info._check_layout()
        return info

    def ort_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Index arrays into ORT's flat buffer: `ort[s]` is the sampler buffer, `ort[a]` the auxiliary one."""
        parts = {part: np.empty(size, dtype=np.int64) for part, size in
                 zip(PARTS, (self.sampler_size, self.auxiliary_size))}
        position = 0
        for segment in self.ort_layout:
            parts[segment.part][segment.offset : segment.offset + segment.size] = \
                np.arange(position, position + segment.size)
            position += segment.size
        return parts["sampler"], parts["auxiliary"]

    def _check_layout(self) -> None:
        """The layout must tile both part buffers exactly (when there is one)."""
        if not self.ort_layout:
            return
        covered = {part: np.zeros(size, dtype=np.int64) for part, size in
                   zip(PARTS, (self.sampler_size, self.auxiliary_size))}
        for s in self.ort_layout:
            if s.part not in covered or s.offset < 0 or s.offset + s.size > len(covered[s.part]):
                raise ManifestError(f"{GENERATOR_JSON}: ORT segment {s.name} lies outside its part")
            covered[s.part][s.offset : s.offset + s.size] += 1
        if any((c != 1).any() for c in covered.values()):
            raise ManifestError(f"{GENERATOR_JSON}: the ORT layout does not cover the part buffers exactly once")


def load_generator_artifacts(directory: str | Path, check_hashes: bool = True) -> GeneratorArtifacts:
    """Read and verify `generator.json`: every listed file present with its sha256, IR versions ORT 1.19 reads."""
    directory = Path(directory)
    path = directory / GENERATOR_JSON
    if not path.is_file():
        raise ManifestError(f"no {GENERATOR_JSON} in {directory}")
    info = GeneratorArtifacts.from_json(path.read_text())
    if SAMPLER_MODEL not in info.files:
        raise ManifestError(f"{path} lists no {SAMPLER_MODEL}")
    verify_files(directory, info.files, GENERATOR_JSON, check_hashes)
    return info
