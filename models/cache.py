"""What the host makes once and keeps: generated datasets and exported artifact sets, under one folder.

`cache_dir()` is `$EDGEFIL_CACHE`, else `~/.cache/edgefil`. An artifact set (`cached_export`) is kept under
`artifacts/<key>`, the key a hash of everything the export's bytes depend on: the model's name, classes, input
shape, nominal or not, the backends, the optional graphs, edgefil's version, the source of every module of
`models/` (the exporters, the zoo, the loss, the backward translations), the versions of torch, onnx, onnxscript
and onnxruntime, and the seed only where a graph holds the initial weights (ORT Training's full checkpoint): every
other graph takes the weights as an input, so a set kept for one seed serves every seed, its `weights.bin` (and that
file's hash in the manifest) written anew by `export_registered`. So a fleet run (or `edgefil export`) that asks for
an export made before copies it in a fraction of a second instead of exporting again (a fleet's portable graphs
take 6-14 s for LeNet on 2 cores), and any change to what an export would make is a new key. A cached set is
verified (every file's sha256, as a device verifies it) before it is copied; one that fails is exported anew.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from models.manifest import MANIFEST_NAME, ManifestError, load_manifest, software_version

ARTIFACTS = "artifacts"
_PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime-training-cpu", "onnxruntime")


def cache_dir() -> Path:
    """Where the host keeps what it made once: `$EDGEFIL_CACHE`, else `~/.cache/edgefil`."""
    return Path(os.environ.get("EDGEFIL_CACHE") or Path.home() / ".cache" / "edgefil")


def _versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _source_digest() -> str:
    """The sha256 of every module of this package: an exporter that changed makes other bytes."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def export_key(**fields: Any) -> str:
    """The cache key of an export with these arguments (JSON-able values)."""
    record = {**fields, "versions": _versions(), "source": _source_digest(), "edgefil": software_version()}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _copy_set(source: Path, target: Path) -> None:
    """The artifact set's files (the manifest and what it lists), nothing else of the folder."""
    target.mkdir(parents=True, exist_ok=True)
    for name in [MANIFEST_NAME, *load_manifest(source, check_hashes=False).files]:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target / name)


def cached_export(key: str, out_dir: Path, export: Callable[[Path], Any], backends: Sequence[str]) -> None:
    """Fill `out_dir` with the artifact set of `key`: copied from the cache when a verified one is there, else
    made by `export(folder)` and kept. A cache that cannot be written (a read-only home) only costs the keeping."""
    root = cache_dir() / ARTIFACTS
    kept = root / key
    if (kept / MANIFEST_NAME).is_file():
        try:
            if set(load_manifest(kept).backends) >= set(backends):
                _copy_set(kept, out_dir)
                return
        except ManifestError:
            shutil.rmtree(kept, ignore_errors=True)  # damaged: made anew below
    export(out_dir)
    staging: Path | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        _copy_set(out_dir, staging)
        os.rename(staging, kept)  # whole or not at all; another process's copy may have won meanwhile
    except OSError:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
