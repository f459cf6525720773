"""What the host makes once and keeps: generated datasets and exported artifact sets, under one folder.

`cache_dir()` is `$EDGEFIL_CACHE`, else `~/.cache/edgefil`. An artifact set is kept under `artifacts/<key>`, the
key a hash of everything the export's bytes depend on: the model's name, classes, input shape, nominal or not,
edgefil's version, the source of every module of `models/` (the exporters, the zoo, the loss, the backward
translations), the versions of torch, onnx, onnxscript and onnxruntime, and, for a user's model, its arguments and
its source's digest. Any change to what an export would make is a new key.

Two kinds of set are kept (models/export.py `export_registered` says which it asks for):
- **One set for every seed, backend and optional graph** where every graph takes the weights as an input (no ORT
  Training artifacts): the demo, a fleet and `edgefil export` each ask for the part they need (`kept_set`); what the
  kept set lacks (the portable graphs, an optional graph) is exported into a copy of it (`staging_folder`), which
  replaces it whole (`keep_set`); the part asked for is copied out with that seed's initial weights.
- **A whole set per seed, backends and graphs** where ORT Training's artifacts are among them (their checkpoint
  holds the initial weights, and their layout of the flat weights is ORT's, which every other graph of the set
  then follows): `cached_export`.

So an export asked for before (or a part of one) is copied in a fraction of a second instead of exported again (a
fleet's portable graphs take 6-14 s for LeNet on 2 cores). A kept set is verified (every file's sha256, as a
device verifies it) before it is read; one that fails is removed and exported anew. A cache that cannot be written
(a read-only home) costs only the keeping.
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

from models.manifest import MANIFEST_NAME, Manifest, ManifestError, load_manifest, software_version

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


def copy_files(source: Path, target: Path, names: Sequence[str]) -> None:
    """These files of an artifact set, nothing else of the folder."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target / name)


def _copy_set(source: Path, target: Path) -> None:
    """The artifact set's files (the manifest and what it lists)."""
    copy_files(source, target, [MANIFEST_NAME, *load_manifest(source, check_hashes=False).files])


def kept_set(key: str) -> tuple[Path, Manifest] | None:
    """The folder and the verified manifest of the set kept under `key`; None if there is none (one that fails
    its verification is removed)."""
    kept = cache_dir() / ARTIFACTS / key
    if not (kept / MANIFEST_NAME).is_file():
        return None
    try:
        return kept, load_manifest(kept)
    except (ManifestError, OSError):  # damaged, or replaced while it was read: made anew
        shutil.rmtree(kept, ignore_errors=True)
        return None


def staging_folder(key: str) -> Path | None:
    """A new empty folder beside the kept sets, in which the next set of `key` is made (`keep_set`); None where the
    cache cannot be written."""
    root = cache_dir() / ARTIFACTS
    try:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    except OSError:
        return None


def keep_set(key: str, staging: Path) -> Path:
    """`staging` (a `staging_folder`) kept as the set of `key` in place of the one kept before, each whole; returns
    the kept set's folder. Another process's set that took the place first stays, and this one is dropped: a reader
    that then misses a file exports its set itself."""
    root = cache_dir() / ARTIFACTS
    kept, old = root / key, Path(tempfile.mkdtemp(prefix=f".{key}-old-", dir=root))
    try:
        os.rename(kept, old / key)
        os.rename(staging, kept)
    except FileNotFoundError:  # none kept before (or another process moved it aside first)
        try:
            os.rename(staging, kept)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:  # the place was taken again meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return kept


def cached_export(key: str, out_dir: Path, export: Callable[[Path], Any], backends: Sequence[str]) -> None:
    """Fill `out_dir` with the whole artifact set of `key`: copied from the cache when a verified one is there,
    else made by `export(folder)` and kept."""
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
