"""The device's budget M, owned by one object: its limits, and the on-disk accounting of everything kept under it.

M is a number of samples (Re-Fed's M: the current task's samples and the cache of earlier ones together) and a
number of bytes on disk. Everything the device keeps for learning — the replay store, a method's files (pFedGRP's
generator bank, an old model, prototypes) — is a holder registered here with a function that says how many bytes
it occupies right now. A holder may use what M leaves after every other holder (`room`); each holder enforces
that bound before it writes (the store with its transaction bound, the bank with its put bound), so the sum over
holders never exceeds M. The device daemon's own state files (weights, state.json) are not under M: a simulated
device's disk leaves room for them (firmware_sim/fleet.py).

`file_bytes` is the one file-size rule every holder uses: a write of n bytes occupies its file-system blocks plus
the blocks that map them (see ReplayStore's docstring for the sources of the numbers).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FS_META_SPAN = 128  # data blocks one block of file-system mapping metadata covers, at least


def file_bytes(size: int, block: int, fresh: bool = False) -> int:
    """The most a file (or a file's growth) of `size` bytes occupies: its blocks plus file-system mapping metadata.

    A fresh file of at most 4 blocks is mapped from its inode (ext4 holds 4 extents there, ext2/3 12 block
    pointers); otherwise count one metadata block per FS_META_SPAN blocks and 2 for a split and a new level."""
    blocks = -(-size // block)
    meta = 0 if fresh and blocks <= 4 else -(-blocks // FS_META_SPAN) + 2 if blocks else 0
    return (blocks + meta) * block


def directory_bytes(directory: Path, block: int) -> int:
    """A holder's folder and its files on disk, each by the larger of its allocated bytes (st_blocks * 512) and its
    apparent size rounded up to the block: what a holder that keeps whole files (not a database) counts."""
    stats = [os.stat(directory)] + [e.stat(follow_symlinks=False) for e in os.scandir(directory)]
    return sum(max(s.st_blocks * 512, -(-s.st_size // block) * block) for s in stats)


def replace_peak(directory: Path, size: int, block: int) -> int:
    """The most a holder's folder occupies while a file of `size` bytes is written beside the one it replaces
    (`write_atomically`): what is there now, the new file, and a block the folder may grow by for its entry."""
    return directory_bytes(directory, block) + file_bytes(size, block, fresh=True) + block


def replacement_peak(size: int, block: int) -> int:
    """`replace_peak` of a folder holding one file of `size` bytes that is replaced by one of the same size, known
    before any file exists: the folder's own block, the old file, the new one, a block of growth. A holder checks
    with it at open that its file can ever be replaced within its share."""
    return block + file_bytes(size, block) + file_bytes(size, block, fresh=True) + block


@dataclass(frozen=True)
class Budget:
    """Hard limits: samples (Re-Fed's M) and bytes on disk; None means no limit of that kind."""

    max_samples: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_samples", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, not {value!r}")


class DeviceBudget:
    """M and its holders. `room(name)`: the bytes holder `name` may occupy now (None without a byte limit)."""

    def __init__(self, limits: Budget) -> None:
        self.limits = limits
        self._holders: dict[str, Callable[[], int]] = {}

    @property
    def max_samples(self) -> int | None:
        return self.limits.max_samples

    @property
    def max_bytes(self) -> int | None:
        return self.limits.max_bytes

    def register(self, name: str, bytes_on_disk: Callable[[], int]) -> None:
        """Count a holder's bytes against M from now on (a holder registers once, by a name of its own)."""
        if name in self._holders:
            raise ValueError(f"a budget holder named {name!r} is registered already")
        self._holders[name] = bytes_on_disk

    def held(self) -> dict[str, int]:
        """Bytes on disk per holder, now."""
        return {name: measure() for name, measure in self._holders.items()}

    def used(self) -> int:
        return sum(self.held().values())

    def room(self, name: str) -> int | None:
        """M in bytes less what every other holder occupies now (never negative)."""
        if self.max_bytes is None:
            return None
        others = sum(measure() for holder, measure in self._holders.items() if holder != name)
        return max(self.max_bytes - others, 0)

    def share(self, name: str) -> BudgetShare:
        """The limits one holder works under: M's sample limit, and its byte room (looked up at every use)."""
        return BudgetShare(self, name)


class BudgetShare:
    """A holder's view of M: reads like a Budget (`max_samples`, `max_bytes`), computed live from the owner."""

    def __init__(self, owner: DeviceBudget, name: str) -> None:
        self.owner = owner
        self.name = name

    @property
    def max_samples(self) -> int | None:
        return self.owner.max_samples

    @property
    def max_bytes(self) -> int | None:
        return self.owner.room(self.name)

    def __repr__(self) -> str:
        return f"BudgetShare({self.name!r}, max_samples={self.max_samples}, max_bytes={self.max_bytes})"
