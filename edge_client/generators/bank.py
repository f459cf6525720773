"""The device's class generators on disk: one `class-<label>.gen` file each, within a byte limit (numpy only).

The directory holds nothing else. A file is `encode_record` bytes. Budget rule: `limit()` says how many bytes the
bank may occupy right now (the device's budget M less what the replay store holds). A put writes a temporary file
beside the old one and renames it over it, so at its peak the directory holds both; the put is refused
(`BankFullError`) before anything is written if that peak would exceed `limit()`:

    peak = bytes_on_disk() + file(len(bytes)) + one block (the directory may grow by a block for the new entry)

where file(n) rounds up to file-system blocks and adds the mapping metadata the replay store counts (none for a
file of at most 4 blocks, else ceil(blocks / 128) + 2 blocks). `bytes_on_disk()` counts the directory and every
file as every holder of M does (`budget.charged_bytes`): the larger of its allocated bytes (st_blocks * 512) and
file(its apparent size), the same in every run however the disk placed the blocks.

Crash safety: temp file, fsync, rename, fsync of the directory; a crash leaves the old file or the new one, and
possibly a temporary file, which the next open removes. A class file that fails verification on open (torn by a
disk fault, not by a crash) is deleted and its label listed in `removed_on_open`: a damaged generator must never
be sampled, and the device can train or fetch a new one. `get` verifies again and raises GeneratorFormatError.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from edge_client.budget import directory_bytes, replace_peak
from edgefil.durable import TEMP_SUFFIX, fsync_directory, write_atomically
from models.generator_record import GeneratorFormatError, GeneratorRecord, decode_record, encode_record

_CLASS_FILE = re.compile(r"class-(0|[1-9][0-9]*)\.gen")
log = logging.getLogger(__name__)


class BankFullError(RuntimeError):
    """A put that would take the bank past its byte limit; nothing was written."""


class GeneratorBank:
    """Class generators kept across restarts within a byte limit (see the module docstring)."""

    def __init__(self, directory: str | Path, limit: Callable[[], int] | None = None) -> None:
        self.directory = Path(directory)
        self.limit = limit
        self.directory.mkdir(parents=True, exist_ok=True)
        self._block = os.statvfs(self.directory).f_frsize
        self.removed_on_open: list[int] = []
        for entry in sorted(os.listdir(self.directory)):
            if entry.endswith(TEMP_SUFFIX) and _CLASS_FILE.fullmatch(entry[: -len(TEMP_SUFFIX)]):
                os.unlink(self.directory / entry)  # an interrupted put
            elif not _CLASS_FILE.fullmatch(entry):
                raise ValueError(f"{self.directory} holds a file that is not the bank's: {entry}")
        for label in self.classes():
            try:
                self.get(label)
            except GeneratorFormatError as e:
                log.warning("removing the damaged generator of class %d: %s", label, e)
                os.unlink(self._path(label))
                self.removed_on_open.append(label)
        fsync_directory(self.directory)

    def _path(self, label: int) -> Path:
        return self.directory / f"class-{label}.gen"

    def classes(self) -> list[int]:
        return sorted(int(m.group(1)) for e in os.listdir(self.directory) if (m := _CLASS_FILE.fullmatch(e)))

    def get(self, label: int) -> GeneratorRecord:
        """The stored record of `label`, verified (KeyError if there is none)."""
        try:
            data = self._path(label).read_bytes()
        except FileNotFoundError:
            raise KeyError(f"no generator for class {label}") from None
        record = decode_record(data)
        if record.label != label:
            raise GeneratorFormatError(f"{self._path(label)} holds the generator of class {record.label}")
        return record

    def bytes_needed(self, record: GeneratorRecord) -> int:
        """The peak the directory reaches while `put(record)` runs: now + the new file + a directory block."""
        return self._peak(len(encode_record(record)))

    def put(self, record: GeneratorRecord) -> None:
        """Store (or replace) the record of its label atomically; BankFullError first if it would not fit."""
        if not isinstance(record.label, int) or record.label < 0:
            raise ValueError(f"a class label is a non-negative int, not {record.label!r}")
        data = encode_record(record)
        if self.limit is not None:
            need = self._peak(len(data))
            allowed = self.limit()
            if need > allowed:
                raise BankFullError(f"class {record.label}: storing {len(data)} bytes needs up to {need} bytes "
                                    f"in {self.directory}, {allowed} allowed")
        write_atomically(self._path(record.label), data)

    def delete(self, label: int) -> None:
        self._path(label).unlink(missing_ok=True)
        fsync_directory(self.directory)

    def bytes_on_disk(self) -> int:
        """The directory and its files, each as M counts it (`budget.charged_bytes`)."""
        return directory_bytes(self.directory, self._block)

    def _peak(self, size: int) -> int:
        return replace_peak(self.directory, size, self._block)
