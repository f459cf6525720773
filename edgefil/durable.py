"""Durable checkpoints: a JSON record plus optional flat float32 buffers, whole after a crash at any instant.

Two forms, one for each way a checkpoint is kept:

- Written once (`save_record`, `load_record`): the coordinator's run state, a new directory per generation. Each
  buffer (the record's `weights`) goes to a file named after its sha256, then `state.json` is replaced with
  rename(2); the record's presence marks the directory complete.
- Saved again and again in one directory (`save_slotted`, `load_slotted`): a device's state, every round. Two
  slots of each file, written in place: a save writes the buffers (the weights, and the `optimizer` state where it
  saves one) into the slot files the newest record does not name, each with its CRC32C (CHECKSUMS), then the
  record, with a sequence number and its own sha256, into the other record slot. The newest record whose checksum
  holds is the state; a crash during a save leaves that slot torn or stale and the one before whole. The first save
  fills both slots (the older with the same state), so no file is created, renamed or removed after it: on ext4 a
  replace by rename (create, write, rename over the old file, unlink the old buffer) costs 2-5 times the CPU and 3-6
  times the wall time of writing the same bytes in place (`benchmarks/state_save.py`), and a device's flash sees
  each file rewritten instead of files created and deleted every round. A directory holds at most two of each
  buffer, as the replace held during a save. A process's next save in a folder takes the newest slot from its last
  save there (`_last_saves`) where the record files are as that save left them. A directory saved by the written-once
  form (an older device's state.json) is read until the first whole slotted save, which removes its files.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.wire import crc32c

STATE_FILE = "state.json"
BUFFERS = ("weights", "optimizer")  # a record's fields that are flat float32 buffers, each saved in a file of its own
SLOTS = ("a", "b")
SLOT_RECORD = "state-{}.rec"  # a slot's record: RECORD_MAGIC, its sequence, the sha256 of the JSON after the newline
SLOT_BUFFER = "{}.{}.f32"  # a buffer's slot file, e.g. weights.a.f32 (the written-once form's are weights-<sha>.f32)
RECORD_MAGIC = b"edgefil-state 1 "
_SLOT_FILES = {SLOT_BUFFER.format(name, slot) for name in BUFFERS for slot in SLOTS}
# How a record names its buffers' checksums (`<buffer>_<kind>`), the first the record holds counting. A slotted
# save (a device's, every round) takes a buffer's CRC32C, which catches a damaged or torn file as sha256 did, at
# memory speed: 1 us for cnn1d's weights (21 KB) here and 10 us for LeNet's (244 KB), against sha256's 14 and 150,
# and a fleet's device checks five buffers a round (its weights and two AdamW moments saved, the moments read back).
# The written-once form, whose files sha256 names, and a slotted save made before: sha256.
CHECKSUMS = ("crc32c", "sha256")
# What this process's last whole save in a folder wrote: (slot, sequence, record) and the identity of both record
# files after it (`_records_identity`). The next save there takes the newest slot from it instead of reading and
# checking both records again (in a 200-device fleet worker, 0.12-0.13 of a save's 0.56-0.69 ms); where another hand
# changed, replaced or removed a record file since (an identity differs), the records are read again, and a save
# that fails forgets what it knew.
_last_saves: dict[str, tuple[str, int, dict[str, Any], tuple[tuple[int, int, int] | None, ...]]] = {}


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


def save_record(directory: str | Path, state: Any, encode: Callable[[dict[str, Any]], str] = json.dumps) -> None:
    """Save a dataclass whose `weights` field (and `optimizer` field, where it has one) is a flat float32 buffer
    (or None) and whose other fields are JSON; `encode`: the record's JSON text (one that reuses what it encoded
    before, where the record is large)."""
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
    write_atomically(directory / STATE_FILE, encode(record).encode())
    for name in buffers:
        for stale in directory.glob(f"{name}-*.f32"):
            if stale.name != record[f"{name}_file"]:
                stale.unlink()


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
    """The buffer `name` (one of BUFFERS) that `record` names, checked against its checksum (CHECKSUMS); None when it
    names none."""
    file = record.get(f"{name}_file")
    if file is None:
        return None
    try:
        blob = _read(os.path.join(directory, str(file)))
    except (OSError, TypeError, ValueError) as err:
        raise StateError(f"saved state in {directory} is unreadable: {err!r}") from err
    kind = next((kind for kind in CHECKSUMS if f"{name}_{kind}" in record), CHECKSUMS[-1])
    if _checksum(kind, blob) != record.get(f"{name}_{kind}"):
        raise StateError(f"{file} in {directory} does not match its {kind}")
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)


def _checksum(kind: str, blob: bytes | memoryview) -> str:
    """A buffer's checksum of `kind` (CHECKSUMS), as its record names it."""
    return f"{crc32c(blob):08x}" if kind == "crc32c" else hashlib.sha256(blob).hexdigest()


# --- saved again and again in one directory: slots ----------------------------------------------------------------

def save_slotted(directory: str | Path, state: Any, keep_buffers: bool = False) -> dict[str, Any]:
    """Save a dataclass as `save_record` takes it into `directory`'s slots (the module docstring): its buffers into
    the slot files the newest record does not name, then its record into the older record slot. `keep_buffers`: the
    record alone (every field but the buffers), naming the buffers the newest record names, unwritten: a few hundred
    bytes where a full disk has no room for a weight file, so what the record holds survives a restart.

    The first whole save in a directory fills both slots (`_fill_older_slot`): no later save creates a file."""
    directory = Path(directory)
    folder = os.fspath(directory)  # the files' paths joined as text: pathlib's joins took a fifth of a save's CPU
    newest = _last_save(folder) or _newest_slot(directory)
    if newest is None:
        directory.mkdir(parents=True, exist_ok=True)
    previous = {} if newest is None else newest[2]
    names = [f.name for f in fields(state)]
    buffers = [name for name in BUFFERS if name in names]
    record: dict[str, Any] = {name: getattr(state, name) for name in names if name not in BUFFERS}
    created = False
    blobs: dict[str, memoryview] = {}
    for name in buffers:
        if keep_buffers:  # the newest record's files (None where it names none, or where there is no record)
            record[f"{name}_file"] = previous.get(f"{name}_file")
            record.update({f"{name}_{kind}": previous[f"{name}_{kind}"] for kind in CHECKSUMS
                           if f"{name}_{kind}" in previous})
            continue
        record[f"{name}_file"] = None
        value = getattr(state, name)
        if value is not None:  # its bytes where they are (a copy only where not little-endian float32 already)
            blob = np.ascontiguousarray(value, dtype="<f4").reshape(-1).data.cast("B")
            file = next(SLOT_BUFFER.format(name, slot) for slot in SLOTS
                        if SLOT_BUFFER.format(name, slot) != previous.get(f"{name}_file"))
            record[f"{name}_file"], record[f"{name}_crc32c"] = file, _checksum("crc32c", blob)
            created |= _write_in_place(os.path.join(folder, file), blob)
            blobs[name] = blob
    if created:  # a new buffer file's name is on the disk before a record names it
        fsync_directory(directory)
    sequence = 1 if newest is None else newest[1] + 1
    slot = next(s for s in SLOTS if newest is None or s != newest[0])
    if _write_in_place(os.path.join(folder, SLOT_RECORD.format(slot)), _slot_record(sequence, record)):
        fsync_directory(directory)
    if not keep_buffers and (newest is None or newest[0] == ""):  # the first slotted save here
        _fill_older_slot(directory, slot, record, blobs)
    # the first whole save after the written-once form's (read, or kept by a record-only save): its files go
    written_once = {previous.get(f"{name}_file") for name in BUFFERS} - {None, *_SLOT_FILES}
    if not keep_buffers and newest is not None and (newest[0] == "" or written_once):
        _remove_written_once(directory, record)
    _last_saves[folder] = slot, sequence, record, _records_identity(folder)
    return record


def _last_save(folder: str) -> tuple[str, int, dict[str, Any]] | None:
    """The newest slot as this process's last save in `folder` left it (`_last_saves`), taken back (a save that
    fails leaves nothing known); None where none is known, or a record file is not as that save left it."""
    known = _last_saves.pop(folder, None)
    if known is None:
        return None
    slot, sequence, record, identity = known
    try:
        return (slot, sequence, record) if _records_identity(folder) == identity else None
    except OSError:  # read again, where the error says what it is
        return None


def _records_identity(folder: str) -> tuple[tuple[int, int, int] | None, ...]:
    """Each slot record file's inode, size and mtime (None where it is missing): what a write, a replace or a
    removal changes (all but a write of the same size within the file system's timestamp granularity, a few ms)."""
    identity: list[tuple[int, int, int] | None] = []
    for slot in SLOTS:
        try:
            found = os.stat(os.path.join(folder, SLOT_RECORD.format(slot)))
        except FileNotFoundError:
            identity.append(None)
            continue
        identity.append((found.st_ino, found.st_size, found.st_mtime_ns))
    return tuple(identity)


def _slot_record(sequence: int, record: dict[str, Any]) -> bytes:
    """A slot record's bytes: RECORD_MAGIC, its sequence and the sha256 of the JSON that follows the newline."""
    payload = json.dumps(record).encode()
    return RECORD_MAGIC + f"{sequence} {hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def _fill_older_slot(directory: Path, newest: str, record: dict[str, Any], blobs: dict[str, memoryview]) -> None:
    """The first whole save's state in the other slot too, as an older record (sequence 0) naming that slot's buffer
    files: every later save then writes files that exist, in place. A file created in a later save cost that save
    the most: a fleet worker's 200 devices saved LeNet's weights in 0.92 ms a device in the round that made each
    device's second slot, 0.52 in the rounds after it (docs/results.md, "Both slots at the first save"). A crash
    while filling it leaves the newer record, written before, whole; a disk without room for it (OSError) leaves the
    save whole without it, the files it made removed, and a later save makes the slot as before."""
    folder, slot = os.fspath(directory), next(s for s in SLOTS if s != newest)
    older, made = dict(record), []
    try:
        for name, blob in blobs.items():
            older[f"{name}_file"] = file = SLOT_BUFFER.format(name, slot)
            made.append(os.path.join(folder, file))
            _write_in_place(made[-1], blob)
        _write_in_place(os.path.join(folder, SLOT_RECORD.format(slot)), _slot_record(0, older))
    except OSError:
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return
    fsync_directory(directory)


def load_slotted(directory: str | Path, weights: bool = True) -> tuple[dict[str, Any], np.ndarray | None] | None:
    """The newest whole (record, weights) that `save_slotted` saved, or the written-once form's (`load_record`)
    where no slotted save has been made; None when nothing was ever saved here; `weights` False: the record alone
    (its weights None). StateError when records are there and none can be read, or their weights are damaged."""
    directory = Path(directory)
    newest = _newest_slot(directory)
    if newest is None:
        return None
    record = newest[2]
    return record, load_buffer(directory, record, "weights") if weights else None


def _newest_slot(directory: Path) -> tuple[str, int, dict[str, Any]] | None:
    """(slot, sequence, record) of the newest slot record whose checksum holds; slot "" for the written-once form's
    state.json where no slot record exists; None when neither exists. StateError when slot records exist and none
    is whole. The sequence is in each record's first line, so only the newest record is checked and parsed where it
    is whole (every save but the one after a crash)."""
    candidates, damaged = [], []
    for slot in SLOTS:
        name = SLOT_RECORD.format(slot)
        try:
            data = _read(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        except OSError as err:
            damaged.append(f"{name}: {err}")
            continue
        head, _, payload = data.partition(b"\n")
        number, _, digest = head.removeprefix(RECORD_MAGIC).partition(b" ")
        if not head.startswith(RECORD_MAGIC) or not number.isdigit():
            damaged.append(f"{name}: not a state record")
            continue
        candidates.append((int(number), slot, digest, payload))
    for sequence, slot, digest, payload in sorted(candidates, reverse=True):
        try:
            if digest.decode() != hashlib.sha256(payload).hexdigest():
                raise ValueError("its sha256 does not match (a save cut short, or a damaged file)")
            record = json.loads(payload)
            if not isinstance(record, dict):
                raise ValueError("not a record")
            return slot, sequence, record
        except ValueError as err:
            damaged.append(f"{SLOT_RECORD.format(slot)}: {err}")
    if damaged:
        raise StateError(f"saved state in {directory} is unreadable: {'; '.join(damaged)}")
    written_once = load_record(directory, weights=False)
    return None if written_once is None else ("", 0, written_once[0])


def _read(path: str) -> bytes:
    with open(path, "rb", buffering=0) as file:
        return file.readall()


def _write_in_place(path: str, data: bytes | memoryview) -> bool:
    """Write `data` over the file at `path` from its start (created if missing) and cut it to that length, synced
    where this process's writes are to survive a power cut; True when it created the file. A write that fails
    (ENOSPC) leaves the file empty, or removes it where it made it: no record names it, and its blocks are what a
    record-only save on a full disk needs next."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        created = False
    except FileNotFoundError:
        fd, created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644), True
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if os.fstat(fd).st_size != len(data):
            os.ftruncate(fd, len(data))
        if _power_loss_safe:
            os.fsync(fd)
    except OSError:
        if created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            os.ftruncate(fd, 0)
        raise
    finally:
        os.close(fd)
    return created


def _remove_written_once(directory: Path, record: dict[str, Any]) -> None:
    """After the first whole slotted save in a directory the written-once form saved: its state.json, its buffer
    files and any temporary file it left, now that the slot record is the state."""
    kept = {record.get(f"{name}_file") for name in BUFFERS}
    doomed = [directory / STATE_FILE, *directory.glob(f"*{TEMP_SUFFIX}"),
              *(p for name in BUFFERS for p in directory.glob(f"{name}-*.f32") if p.name not in kept)]
    for path in doomed:
        path.unlink(missing_ok=True)
    fsync_directory(directory)
