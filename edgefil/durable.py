"""Durable checkpoints: a JSON record plus an optional flat float32 weight buffer, replaced atomically.

The weights go to a new file named after their sha256, then `state.json` is replaced with rename(2) and the old
weight file removed. A crash at any point leaves the previous or the new checkpoint, whole. Device state and the
coordinator's run state both use this.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

STATE_FILE = "state.json"


class StateError(ValueError):
    """The saved state cannot be trusted (corrupt file or weights that do not match their hash)."""


TEMP_SUFFIX = ".tmp"  # `write_atomically` writes `<name>.tmp` first: a crash may leave one behind


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, then fsync the directory entry."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:  # e.g. ENOSPC: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_directory(path.parent)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (a password, a key), replacing any old one in one step: it is never
    readable by others, not even between its creation and a chmod."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def npz_bytes(arrays: dict[str, Any]) -> bytes:
    """Named arrays as one .npz file's bytes (what `write_atomically` or a budgeted file then writes whole)."""
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_record(directory: str | Path, state: Any) -> None:
    """Save a dataclass whose `weights` field is a flat float32 buffer (or None) and whose other fields are JSON."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {f.name: getattr(state, f.name) for f in fields(state) if f.name != "weights"}
    record["weights_file"] = None
    weights = state.weights
    if weights is not None:
        blob = np.ascontiguousarray(weights, dtype="<f4").tobytes()
        digest = hashlib.sha256(blob).hexdigest()
        record["weights_file"] = f"weights-{digest[:16]}.f32"
        record["weights_sha256"] = digest
        write_atomically(directory / record["weights_file"], blob)
    write_atomically(directory / STATE_FILE, json.dumps(record).encode())
    for stale in directory.glob("weights-*.f32"):
        if stale.name != record["weights_file"]:
            stale.unlink()


def save_record_keeping_weights(directory: str | Path, state: Any) -> None:
    """Save the record of `state` (every field but `weights`) and keep the weights saved before, unwritten: a few
    hundred bytes where a full disk has no room for a weight file, so what the record holds survives a restart."""
    directory = Path(directory)
    path = directory / STATE_FILE
    kept = {"weights_file": None}
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            kept = {key: saved[key] for key in ("weights_file", "weights_sha256") if key in saved}
        except (OSError, ValueError, TypeError):  # unreadable: the weights it named cannot be trusted either
            kept = {"weights_file": None}
    record = {f.name: getattr(state, f.name) for f in fields(state) if f.name != "weights"}
    write_atomically(path, json.dumps({**record, **kept}).encode())


def load_record(directory: str | Path) -> tuple[dict[str, Any], np.ndarray | None] | None:
    """The last saved (record, weights), or None when nothing was ever saved here."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        weights_file = record["weights_file"]
        blob = None if weights_file is None else (Path(directory) / weights_file).read_bytes()
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise StateError(f"saved state in {directory} is unreadable: {err!r}") from err
    if blob is None:
        return record, None
    if hashlib.sha256(blob).hexdigest() != record.get("weights_sha256"):
        raise StateError(f"{weights_file} in {directory} does not match its sha256")
    return record, np.frombuffer(blob, dtype="<f4").astype(np.float32)
