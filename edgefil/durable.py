"""Durable checkpoints: a JSON record plus optional flat float32 buffers, replaced atomically.

Each buffer (the record's `weights`, and a device's `optimizer` state where it saves one) goes to a new file named
after its sha256, then `state.json` is replaced with rename(2) and the old buffer files removed. A crash at any
point leaves the previous or the new checkpoint, whole. Device state and the coordinator's run state both use this.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

STATE_FILE = "state.json"
BUFFERS = ("weights", "optimizer")  # a record's fields that are flat float32 buffers, each saved in a file of its own


class StateError(ValueError):
    """The saved state cannot be trusted (corrupt file or weights that do not match their hash)."""


TEMP_SUFFIX = ".tmp"  # `write_atomically` writes `<name>.tmp` first: a crash may leave one behind

# Whether this process's writes survive a power cut of its machine, or only its own crash. A rename is atomic for
# every process, and what a killed process wrote stays in the page cache: without fsync a killed process still
# leaves the old file or the new one, whole. Only a machine that loses power needs the data on the disk before the
# rename (fsync), and the rename there before the write counts as done (fsync of the directory). A device's own
# process keeps both (the default). A simulated fleet's worker turns them off unless the fleet asks for them
# (`FleetConfig.power_loss_safe`): its hundreds of virtual devices write to folders of one host, whose power cut
# the simulation does not emulate, and their fsyncs cost the host: they double the CPU of a device's state save,
# which it makes every round (docs/results.md, "A fleet device's round"). The replay store's SQLite follows.
_power_loss_safe = True


def set_power_loss_safe(safe: bool) -> None:
    """Make this process's later writes survive a power cut (True, the default) or only a crash of the process."""
    global _power_loss_safe
    _power_loss_safe = safe


def power_loss_safe() -> bool:
    """Whether this process's writes survive a power cut of its machine (`set_power_loss_safe`)."""
    return _power_loss_safe


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, then fsync the directory entry (the fsyncs
    where this process's writes are to survive a power cut: `power_loss_safe`)."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            if _power_loss_safe:
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
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


# numpy reads each array's header with `ast.literal_eval`. CPython 3.11 (3.11.7 here) keeps the AST constructor's
# recursion depth per interpreter, not per call: when garbage collection lets another thread run in
# the middle of one parse and that thread parses too, one of them fails with "SystemError: AST constructor
# recursion depth mismatch" (gh-106905, fixed by gh-113035). Simulated devices, the coordinator's background jobs
# and paho's threads share a process, so every array file the runtime reads is read whole under this lock.
_ARRAY_HEADERS = threading.Lock()


def read_npz(source: str | Path | bytes) -> dict[str, np.ndarray]:
    """Every array of an .npz file (a path, or the file's bytes), read in full, never pickles. Raises what
    `np.load` raises for a damaged or foreign file (OSError, ValueError, EOFError, zipfile.BadZipFile)."""
    with _ARRAY_HEADERS:
        data = np.load(io.BytesIO(source) if isinstance(source, bytes) else source, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("an .npy array, not an .npz file of named arrays")
        with data:
            return {name: data[name] for name in data.files}


def read_npy(path: str | Path) -> np.ndarray:
    """One .npy file's array, never pickles (see `read_npz` for the lock)."""
    with _ARRAY_HEADERS:
        return np.load(path, allow_pickle=False)


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable (where this process's writes are to survive a power cut:
    `power_loss_safe`; a crash of the process alone cannot undo them)."""
    if not _power_loss_safe:
        return
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_record(directory: str | Path, state: Any) -> None:
    """Save a dataclass whose `weights` field (and `optimizer` field, where it has one) is a flat float32 buffer
    (or None) and whose other fields are JSON."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(state)]
    buffers = [name for name in BUFFERS if name in names]
    record = {name: getattr(state, name) for name in names if name not in BUFFERS}
    for name in buffers:
        record[f"{name}_file"] = None
        value = getattr(state, name)
        if value is not None:
            blob = np.ascontiguousarray(value, dtype="<f4").tobytes()
            digest = hashlib.sha256(blob).hexdigest()
            record[f"{name}_file"] = f"{name}-{digest[:16]}.f32"
            record[f"{name}_sha256"] = digest
            write_atomically(directory / record[f"{name}_file"], blob)
    write_atomically(directory / STATE_FILE, json.dumps(record).encode())
    for name in buffers:
        for stale in directory.glob(f"{name}-*.f32"):
            if stale.name != record[f"{name}_file"]:
                stale.unlink()


def save_record_keeping_weights(directory: str | Path, state: Any) -> None:
    """Save the record of `state` (every field but `weights`) and keep the weights saved before, unwritten: a few
    hundred bytes where a full disk has no room for a weight file, so what the record holds survives a restart."""
    directory = Path(directory)
    path = directory / STATE_FILE
    keys = [f"{name}_{what}" for name in BUFFERS for what in ("file", "sha256")]
    kept: dict[str, Any] = {"weights_file": None}
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            kept = {key: saved[key] for key in keys if key in saved}
        except (OSError, ValueError, TypeError):  # unreadable: the buffers it named cannot be trusted either
            kept = {"weights_file": None}
    record = {f.name: getattr(state, f.name) for f in fields(state) if f.name not in BUFFERS}
    write_atomically(path, json.dumps({**record, **kept}).encode())


def load_record(directory: str | Path, weights: bool = True) -> tuple[dict[str, Any], np.ndarray | None] | None:
    """The last saved (record, weights), or None when nothing was ever saved here; `weights` False: the record
    alone (its weights None)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        record["weights_file"]  # noqa: B018 (every record names its weights, or None)
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise StateError(f"saved state in {directory} is unreadable: {err!r}") from err
    return record, load_buffer(directory, record, "weights") if weights else None


def load_buffer(directory: str | Path, record: dict[str, Any], name: str) -> np.ndarray | None:
    """The buffer `name` (one of BUFFERS) that `record` names, checked against its sha256; None when it names none."""
    file = record.get(f"{name}_file")
    if file is None:
        return None
    try:
        blob = (Path(directory) / str(file)).read_bytes()
    except (OSError, TypeError, ValueError) as err:
        raise StateError(f"saved state in {directory} is unreadable: {err!r}") from err
    if hashlib.sha256(blob).hexdigest() != record.get(f"{name}_sha256"):
        raise StateError(f"{file} in {directory} does not match its sha256")
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)
