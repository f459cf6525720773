"""Durable checkpoints: a JSON record plus optional flat float32 buffers, whole after a crash at any instant.

Two forms, one for each way a checkpoint is kept:

- Written once (`save_record`, `load_record`): the coordinator's run state, a new directory per generation. Each
  buffer (the record's `weights`) goes to a file named after its sha256, then `state.json` is replaced with
  rename(2); the record's presence marks the directory complete.
- Saved again and again in one directory (`save_slotted`, `load_slotted`): a device's state, every round. Two slots,
  each one file written in place (SLOT_FILE): a header line with the save's sequence number and its JSON's CRC32C, the
  record's JSON, then the buffers (the weights, and the `optimizer` state where it saves one), each with its own
  CRC32C in the record. A save writes its slot in one system call into the file the newest slot is not in. The newest
  whole slot (its JSON's CRC32C and every buffer's holding) is the state; a crash during a save leaves that slot torn
  (a checksum fails) and the other whole. The first save fills both slots (the older with the same state), so no file
  is created, renamed or removed after it: on ext4 a replace by rename (create, write, rename over the old file,
  unlink the old buffer) costs 2-5 times the CPU and 3-6 times the wall time of writing the same bytes in place
  (`benchmarks/state_save.py`), and a device's flash sees each file rewritten instead of files created and deleted
  every round. The JSON is padded to a multiple of SLOT_JSON_BYTES, so a slot keeps its size from save to save (no
  truncation, and no new block on a full disk). A process's next save in a folder takes the newest slot from its last
  save there (`_last_saves`) where the slot files are as that save left them.

  Two earlier forms of a device's state are read until the first save in one-file slots, which removes their
  files: the written-once form (an older device's state.json), and slots of several files each (SLOT_RECORD and
  SLOT_BUFFER: a record file per slot and a file per buffer and slot), two or three files a save, each opened,
  written, checked and closed, where a slot of one file is opened, written, checked and closed once.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.wire import crc32c

STATE_FILE = "state.json"
BUFFERS = ("weights", "optimizer")  # a record's fields that are flat float32 buffers
SLOTS = ("a", "b")
SLOT_FILE = "state-{}.slot"  # a slot: SLOT_MAGIC, its sequence, its JSON's CRC32C and length; the JSON, the buffers
SLOT_MAGIC = b"edgefil-state 2 "
# A slot's JSON is padded with spaces to a multiple of this many bytes: a record's length changes from save to save
# by a few bytes (its counts, its metrics' digits), and the slot's file then keeps its size and its blocks.
SLOT_JSON_BYTES = 256
# The earlier slotted form's files (read, and removed by the first save in one-file slots): a slot's record, with
# RECORD_MAGIC, its sequence and the sha256 of the JSON after the newline, and its buffers, e.g. weights.a.f32
SLOT_RECORD = "state-{}.rec"
SLOT_BUFFER = "{}.{}.f32"
RECORD_MAGIC = b"edgefil-state 1 "
# How a record names its buffers' checksums (`<buffer>_<kind>`), the first the record holds counting. A slotted
# save (a device's, every round) takes a buffer's CRC32C, which catches a damaged or torn file as sha256 did, at
# memory speed: 1 us for cnn1d's weights (21 KB) here and 10 us for LeNet's (244 KB), against sha256's 14 and 150,
# and a fleet's device checks five buffers a round (its weights and two AdamW moments saved, the moments read back).
# The written-once form, whose files sha256 names, and a slotted save made before: sha256.
CHECKSUMS = ("crc32c", "sha256")
_layouts: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # `_record_layout`'s, by class
# What this process's last whole save in a folder wrote: (slot, sequence, record) and the identity of both slot
# files after it (`_slots_identity`). The next save there takes the newest slot from it instead of reading and
# checking both slots again; where another hand changed, replaced or removed a slot file since (an identity
# differs), the slots are read again, and a save that fails forgets what it knew.
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


def write_atomically(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, then fsync the directory entry (the fsyncs
    where this process's writes are to survive a power cut: `power_loss_safe`). `data`: the bytes, or their parts
    as they are made (a file too large to make whole in memory first)."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(tmp, "wb") as handle:
            if isinstance(data, (bytes, bytearray, memoryview)):
                handle.write(data)
            else:
                handle.writelines(data)
            if _power_loss_safe:
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:  # e.g. ENOSPC, or what made the parts failed: leave no partial file behind
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
    return load_buffers(directory, record, (name,))[name]


def load_buffers(directory: str | Path, record: dict[str, Any], names: Sequence[str]) -> dict[str, np.ndarray | None]:
    """The buffers `names` that `record` names, each checked as `load_buffer` checks it; a file that holds several
    (a slot's) is read once."""
    read: dict[str, memoryview] = {}
    loaded: dict[str, np.ndarray | None] = {}
    for name in names:
        try:
            blob = _buffer_bytes(os.fspath(directory), record, name, read)
        except (OSError, TypeError, ValueError) as err:
            raise StateError(f"saved state in {directory} is unreadable: {err!r}") from err
        if blob is None:
            loaded[name] = None
            continue
        try:
            _check_buffer(record, name, blob)
        except ValueError as err:
            raise StateError(f"saved state in {directory}: {err}") from None
        loaded[name] = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    return loaded


def _check_buffer(record: dict[str, Any], name: str, blob: memoryview) -> None:
    """ValueError where the bytes of buffer `name` do not match the checksum `record` names for it (CHECKSUMS)."""
    kind = next((kind for kind in CHECKSUMS if f"{name}_{kind}" in record), CHECKSUMS[-1])
    if _checksum(kind, blob) != record.get(f"{name}_{kind}"):
        raise ValueError(f"{name} in {record[f'{name}_file']} does not match its {kind}")


def _buffer_bytes(folder: str, record: dict[str, Any], name: str, read: dict[str, memoryview]
                  ) -> memoryview | None:
    """The bytes of the buffer `name` where `record` says they are, unchecked (None where it names none): in a slot
    (`<name>_at`: their offset among the slot's buffers and their length), or a file of their own (the earlier
    forms'). `read`: the buffers of the slots read so far, by file."""
    file = record.get(f"{name}_file")
    if file is None:
        return None
    at = record.get(f"{name}_at")
    if at is None:
        return memoryview(_read(os.path.join(folder, str(file))))
    if str(file) not in read:
        read[str(file)] = _slot_parts(_read(os.path.join(folder, str(file))), str(file))[2]
    return _placed(read[str(file)], at, str(file))


def _placed(buffers: memoryview, at: Any, file: str) -> memoryview:
    """The bytes a record's `<name>_at` ([offset, length]) names among a slot's `buffers`; ValueError where they
    are not there."""
    offset, length = (int(n) for n in at)
    if not 0 <= offset <= offset + length <= len(buffers):
        raise ValueError(f"{file} ends before the buffers its record places in it (a save cut short, or damage)")
    return buffers[offset:offset + length]


def _checksum(kind: str, blob: bytes | memoryview) -> str:
    """A buffer's checksum of `kind` (CHECKSUMS), as its record names it."""
    return f"{crc32c(blob):08x}" if kind == "crc32c" else hashlib.sha256(blob).hexdigest()


# --- saved again and again in one directory: slots ----------------------------------------------------------------

def save_slotted(directory: str | Path, state: Any, keep_buffers: bool = False) -> dict[str, Any]:
    """Save a dataclass as `save_record` takes it into `directory`'s slots (the module docstring): its record and
    buffers into the slot the newest state is not in. `keep_buffers`: every field but the buffers, with the buffers
    the newest record names, copied as they are (their checksums with them): what fits a full disk, whose slot
    files are already as long.

    The first save in a directory (or the first after an earlier form's) fills both slots (`_fill_older_slot`): no
    later save creates a file."""
    directory = directory if isinstance(directory, Path) else Path(directory)  # not parsed again where it is one
    folder = os.fspath(directory)  # the files' paths joined as text: pathlib's joins took a fifth of a save's CPU
    known = _last_save(folder)
    newest = known[:3] if known is not None else _newest_slot(directory)
    if newest is None:
        directory.mkdir(parents=True, exist_ok=True)
    previous = {} if newest is None else newest[2]
    first = newest is None or newest[0] == ""  # no one-file slot here yet
    slot = SLOTS[0] if newest is None or first else next(s for s in SLOTS if s != newest[0])
    sequence = 1 if newest is None else newest[1] + 1
    names, buffers = _record_layout(type(state))
    record: dict[str, Any] = {name: getattr(state, name) for name in names}
    blobs: dict[str, memoryview] = {}
    read: dict[str, memoryview] = {}
    for name in buffers:
        if keep_buffers:  # the newest record's, where it names them
            blob = _buffer_bytes(folder, previous, name, read)
            record.update({f"{name}_{kind}": previous[f"{name}_{kind}"] for kind in CHECKSUMS
                           if f"{name}_{kind}" in previous})
        else:  # its bytes where they are (a copy only where not little-endian float32 already)
            value = getattr(state, name)
            blob = None if value is None else np.ascontiguousarray(value, dtype="<f4").reshape(-1).data.cast("B")
            if blob is not None:
                record[f"{name}_crc32c"] = _checksum("crc32c", blob)
        if blob is not None:
            blobs[name] = blob
    written, found = _write_slot(folder, slot, sequence, record, buffers, blobs)
    if newest is not None and (first or known is None):  # an earlier form's files go, now that a slot holds the
        _remove_earlier_forms(directory)  # state (and any a crash left behind: the first save here since a start)
    if first:
        _fill_older_slot(directory, slot, record, buffers, blobs)
        identity = list(_slots_identity(folder))
    else:  # the other slot as the check before this save found it (stated again where there was none)
        identity = list(known[3] if known is not None else _slots_identity(folder))
        identity[SLOTS.index(slot)] = _file_identity(found)
    _last_saves[folder] = slot, sequence, written, tuple(identity)
    return written


def _record_layout(kind: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A saved dataclass's fields: those its record holds, and its buffers (BUFFERS), found once a class (a device
    saves every round)."""
    layout = _layouts.get(kind)
    if layout is None:
        names = [f.name for f in fields(kind)]
        layout = _layouts[kind] = (tuple(name for name in names if name not in BUFFERS),
                                   tuple(name for name in BUFFERS if name in names))
    return layout


def _write_slot(folder: str, slot: str, sequence: int, record: dict[str, Any], buffers: Sequence[str],
                blobs: dict[str, memoryview]) -> tuple[dict[str, Any], os.stat_result]:
    """Write `record` (its dataclass's fields but the buffers) and `blobs` (the buffers it holds among `buffers`)
    into `slot` as its state of `sequence`, in place; the record as written (with where each buffer is) and the
    slot file's fstat after the write. A slot file made here is on the disk before the save returns, where this
    process's writes are to survive a power cut."""
    file = SLOT_FILE.format(slot)
    written, offset = dict(record), 0
    for name in buffers:
        blob = blobs.get(name)
        written[f"{name}_file"] = None if blob is None else file
        if blob is not None:
            written[f"{name}_at"] = [offset, len(blob)]
            offset += len(blob)
    payload = json.dumps(written).encode()
    payload += b" " * (-len(payload) % SLOT_JSON_BYTES)
    head = SLOT_MAGIC + f"{sequence} {crc32c(payload):08x} {len(payload)}\n".encode()
    path = os.path.join(folder, file)
    created, found = _write_in_place(path, [head, payload, *(blobs[name] for name in buffers if name in blobs)])
    if created:
        fsync_directory(Path(folder))
    return written, found


def _last_save(folder: str) -> tuple[str, int, dict[str, Any], tuple[tuple[int, int, int] | None, ...]] | None:
    """What this process's last save in `folder` left (`_last_saves`), taken back (a save that fails leaves nothing
    known); None where none is known, or a slot file is not as that save left it."""
    known = _last_saves.pop(folder, None)
    if known is None:
        return None
    try:
        return known if _slots_identity(folder) == known[3] else None
    except OSError:  # read again, where the error says what it is
        return None


def _slots_identity(folder: str) -> tuple[tuple[int, int, int] | None, ...]:
    """Each slot file's inode, size and mtime (None where it is missing): what a write, a replace or a removal
    changes (all but a write within the file system's timestamp granularity, a few ms: a slot keeps its size). A
    device's folder has one writer (its store's lock keeps a second process of the device from starting)."""
    identity: list[tuple[int, int, int] | None] = []
    for slot in SLOTS:
        try:
            identity.append(_file_identity(os.stat(os.path.join(folder, SLOT_FILE.format(slot)))))
        except FileNotFoundError:
            identity.append(None)
    return tuple(identity)


def _file_identity(found: os.stat_result) -> tuple[int, int, int]:
    return found.st_ino, found.st_size, found.st_mtime_ns


def _fill_older_slot(directory: Path, newest: str, record: dict[str, Any], buffers: Sequence[str],
                     blobs: dict[str, memoryview]) -> None:
    """The first save's state in the other slot too, as an older one (sequence 0): every later save then writes a
    file that exists, in place. A file created in a later save cost that save the most: a fleet worker's 200 devices
    saved LeNet's weights in 0.92 ms a device in the round that made each device's second slot, 0.52 in the rounds
    after it (docs/results.md, "Both slots at the first save"). A crash while filling it leaves the newer slot,
    written before, whole; a disk without room for it (OSError) leaves the save whole without it, the file removed
    where it made it, and a later save makes the slot as before."""
    with contextlib.suppress(OSError):
        _write_slot(os.fspath(directory), next(s for s in SLOTS if s != newest), 0, record, buffers, blobs)


def load_slotted(directory: str | Path) -> dict[str, Any] | None:
    """The newest whole record that `save_slotted` saved, or an earlier form's where no one-file slot has been
    saved (its buffers: `load_buffers`); None when nothing was ever saved here. StateError when slots are there and
    none can be read."""
    newest = _newest_slot(Path(directory))
    return None if newest is None else newest[2]


def _newest_slot(directory: Path) -> tuple[str, int, dict[str, Any]] | None:
    """(slot, sequence, record) of the newest slot whose checksum holds, one-file slots and the earlier form's
    together; slot "" for an earlier form's (the next save's the first in one-file slots), and for the written-once
    form's state.json where no slot exists; None when nothing does. StateError when slots exist and none is whole.
    The sequence is in each slot's first line, so only the newest is checked and parsed where it is whole (every
    read but the one after a crash)."""
    candidates: list[tuple[int, bool, str, Callable[[], dict[str, Any]]]] = []
    damaged: list[str] = []
    for slot in SLOTS:
        for name, one_file in ((SLOT_FILE.format(slot), True), (SLOT_RECORD.format(slot), False)):
            try:
                data = _read(os.path.join(directory, name))
                if one_file:
                    sequence, whole, _ = _slot_parts(data, name)
                else:
                    sequence, whole = _earlier_record(data)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as err:
                damaged.append(f"{name}: {err}")
                continue
            candidates.append((sequence, one_file, slot if one_file else "", whole))
    for sequence, _, slot, whole in sorted(candidates, key=lambda c: c[:2], reverse=True):
        try:
            return slot, sequence, whole()
        except ValueError as err:
            damaged.append(f"{SLOT_FILE.format(slot) if slot else 'an earlier slot record'}: {err}")
    if damaged:
        raise StateError(f"saved state in {directory} is unreadable: {'; '.join(damaged)}")
    written_once = load_record(directory, weights=False)
    return None if written_once is None else ("", 0, written_once[0])


def _slot_parts(data: bytes, file: str) -> tuple[int, Callable[[], dict[str, Any]], memoryview]:
    """A slot file's sequence, its record (a call that checks that the slot is whole, its JSON's CRC32C and each
    buffer's own checksum, and parses the JSON: ValueError where any fails) and its buffers' bytes, unchecked.
    ValueError where the header is not a slot's. `file`: the slot file's name, which its record names for every
    buffer it holds."""
    head, newline, _ = data.partition(b"\n")
    parts = head.removeprefix(SLOT_MAGIC).split(b" ")
    if not (head.startswith(SLOT_MAGIC) and newline and len(parts) == 3 and parts[0].isdigit()
            and parts[2].isdigit() and len(parts[1]) == 8):
        raise ValueError("not a state slot")
    sequence, check, length = int(parts[0]), parts[1].decode("ascii", "replace"), int(parts[2])
    rest = memoryview(data)[len(head) + 1:]
    if length > len(rest):
        raise ValueError("cut short")

    def record() -> dict[str, Any]:
        if f"{crc32c(rest[:length]):08x}" != check:
            raise ValueError("its CRC32C does not match (a save cut short, or a damaged file)")
        parsed = _json_record(bytes(rest[:length]))
        for name in BUFFERS:  # a save cut short in its buffers, or one damaged there: not whole
            if parsed.get(f"{name}_file") is None:
                continue
            if parsed[f"{name}_file"] != file or f"{name}_at" not in parsed:
                raise ValueError(f"its record places {name} outside it")
            _check_buffer(parsed, name, _placed(rest[length:], parsed[f"{name}_at"], file))
        return parsed

    return sequence, record, rest[length:]


def _earlier_record(data: bytes) -> tuple[int, Callable[[], dict[str, Any]]]:
    """An earlier slot record's sequence and record (a call that checks its sha256 and parses it: ValueError where
    either fails); ValueError where its first line is not a record's."""
    head, _, payload = data.partition(b"\n")
    number, _, digest = head.removeprefix(RECORD_MAGIC).partition(b" ")
    if not head.startswith(RECORD_MAGIC) or not number.isdigit():
        raise ValueError("not a state record")

    def record() -> dict[str, Any]:
        if digest.decode("ascii", "replace") != hashlib.sha256(payload).hexdigest():
            raise ValueError("its sha256 does not match (a save cut short, or a damaged file)")
        return _json_record(payload)

    return int(number), record


def _json_record(payload: bytes) -> dict[str, Any]:
    """A slot's record from its JSON; ValueError where it is not a JSON object."""
    parsed = json.loads(payload)
    if not isinstance(parsed, dict):
        raise ValueError("not a record")
    return parsed


def _read(path: str) -> bytes:
    with open(path, "rb", buffering=0) as file:
        return file.readall()


def _write_in_place(path: str, parts: Sequence[bytes | memoryview]) -> tuple[bool, os.stat_result]:
    """Write `parts`, one after another, over the file at `path` from its start (created if missing) in one
    system call where the kernel takes them whole, and cut it to that length, synced where this process's writes
    are to survive a power cut; whether it created the file, and its fstat after the write. A write that fails
    (ENOSPC) leaves the file empty, or removes it where it made it: no slot is whole in it, and its blocks are what
    a record-only save on a full disk needs next."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        created = False
    except FileNotFoundError:
        fd, created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644), True
    try:
        views = [memoryview(part).cast("B") for part in parts]
        length = sum(len(view) for view in views)
        while views:
            done = os.writev(fd, views)
            while views and done >= len(views[0]):
                done -= len(views.pop(0))
            if views:
                views[0] = views[0][done:]
        found = os.fstat(fd)
        if found.st_size != length:
            os.ftruncate(fd, length)
            found = os.fstat(fd)
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
    return created, found


def _remove_earlier_forms(directory: Path) -> None:
    """After the first save in one-file slots in a directory an earlier form saved: its files (the written-once
    form's state.json, its buffer files and any temporary file it left; the earlier slots' records and buffers),
    now that a slot holds the state."""
    earlier = {STATE_FILE, *(SLOT_RECORD.format(slot) for slot in SLOTS),
               *(SLOT_BUFFER.format(name, slot) for name in BUFFERS for slot in SLOTS)}
    doomed = [name for name in os.listdir(directory) if name in earlier or name.endswith(TEMP_SUFFIX)
              or any(name.startswith(f"{buffer}-") and name.endswith(".f32") for buffer in BUFFERS)]
    for name in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    if doomed:
        fsync_directory(directory)
