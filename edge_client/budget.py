"""The device's budget M, owned by one object: its limits, and the on-disk accounting of everything kept under it.

M is a number of samples (Re-Fed's M: the current task's samples and the cache of earlier ones together) and a
number of bytes on disk. Everything the device keeps for learning — the replay store, a method's files (pFedGRP's
generator bank, an old model, prototypes) — is a holder registered here with a function that says how many bytes
it occupies right now. A holder may use what M leaves after every other holder (`room`); each holder enforces
that bound before it writes (the store with its transaction bound, the bank with its put bound), so the sum over
holders never exceeds M. A holder that needs bytes to shrink registers that headroom too, and no other holder may
take it: the store journals before a delete frees anything, so a method's file written into its headroom once
refused every cache cut after it, and locked pFedGRP, GLFC and iCaRL devices out of rounds at tight budgets.
The device daemon's own state files (edge_client/state.py: its records, weights and optimiser state) are not
under M: a simulated device's disk leaves room for them (firmware_sim/fleet.py).

`file_bytes` is the one file-size rule every holder uses: a write of n bytes occupies its file-system blocks plus
the blocks that map them (see ReplayStore's docstring for the sources of the numbers). A method that keeps a whole
file (FedCIL's ACGAN, GLFC's old model) keeps it in a `BudgetedFile`, the one holder of that kind.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgefil.durable import TEMP_SUFFIX, write_atomically

FS_META_SPAN = 128  # data blocks one block of file-system mapping metadata covers, at least


def file_bytes(size: int, block: int, fresh: bool = False) -> int:
    """The most a file (or a file's growth) of `size` bytes occupies: its blocks plus file-system mapping metadata.

    A fresh file of at most 4 blocks is mapped from its inode (ext4 holds 4 extents there, ext2/3 12 block
    pointers); otherwise count one metadata block per FS_META_SPAN blocks and 2 for a split and a new level."""
    blocks = -(-size // block)
    meta = 0 if fresh and blocks <= 4 else -(-blocks // FS_META_SPAN) + 2 if blocks else 0
    return (blocks + meta) * block


def charged_bytes(entry: os.stat_result, block: int) -> int:
    """What one entry of a holder's folder counts against M: the larger of its allocated bytes (st_blocks * 512)
    and what `file_bytes` says a file of its apparent size occupies (a folder: its size in blocks).

    The rule bounds what the file system allocates, so the charge is a function of the apparent size, which the
    same operations reproduce in every run. The allocated count alone is not: it depends on how the disk happened
    to place the blocks (an ext4 file past 4 extents takes an index block), and a byte-budgeted fleet of one seed
    kept 64 samples on a device in one run and 65 in the next, and ended 7 points apart (docs/results.md). Where
    the allocation exceeds the rule (a file system it does not describe) the allocation counts: the bound holds."""
    if stat.S_ISREG(entry.st_mode):
        rule = file_bytes(entry.st_size, block, fresh=True)
    else:
        rule = -(-entry.st_size // block) * block
    return max(entry.st_blocks * 512, rule)


def directory_bytes(directory: Path, block: int) -> int:
    """A holder's folder and its files, each as `charged_bytes` counts it: what a holder of whole files counts."""
    stats = [os.stat(directory)] + [e.stat(follow_symlinks=False) for e in os.scandir(directory)]
    return sum(charged_bytes(s, block) for s in stats)


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
        self._headroom: dict[str, Callable[[], int]] = {}

    @property
    def max_samples(self) -> int | None:
        return self.limits.max_samples

    @property
    def max_bytes(self) -> int | None:
        return self.limits.max_bytes

    def register(self, name: str, bytes_on_disk: Callable[[], int],
                 headroom: Callable[[], int] | None = None) -> None:
        """Count a holder's bytes against M from now on (a holder registers once, by a name of its own), and the
        bytes beyond them it needs to give bytes back (`headroom`), which other holders may not take."""
        if name in self._holders:
            raise ValueError(f"a budget holder named {name!r} is registered already")
        self._holders[name] = bytes_on_disk
        if headroom is not None:
            self._headroom[name] = headroom

    def held(self) -> dict[str, int]:
        """Bytes on disk per holder, now."""
        return {name: measure() for name, measure in self._holders.items()}

    def used(self) -> int:
        return sum(self.held().values())

    def room(self, name: str) -> int | None:
        """M in bytes less what every other holder occupies now and the headroom it needs (never negative)."""
        if self.max_bytes is None:
            return None
        others = sum(measure() for holder, measure in self._holders.items() if holder != name)
        others += sum(needs() for holder, needs in self._headroom.items() if holder != name)
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


class BudgetedFile:
    """One file a method keeps within M (an ACGAN, an old model, a fixed encoding network): a holder of the device's
    budget by `name`, alone in its folder, replaced atomically (`write_atomically`) and written only when the
    replacement's peak — the new file beside the old one — fits what M leaves (`room`) and, with `share`, that
    fraction of M's bytes, so the store keeps the rest for the next task's real data.

    Every method that keeps a file uses this one rule rather than writing it again. `can_ever_hold(size)` tells at
    open whether a file of that size could ever be replaced within the share (a method refuses its options in one
    line when not: its file would be written once and never updated); `write` returns False, and keeps the previous
    file, when the new one does not fit now. A write interrupted by a crash leaves a temporary file, removed at open.
    """

    def __init__(self, budget: DeviceBudget, name: str, path: Path, share: float = 1.0) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a budgeted file's share of M must lie in (0, 1], got {share}")
        self.budget, self.name, self.path, self.share = budget, name, Path(path), share
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.with_name(self.path.name + TEMP_SUFFIX).unlink(missing_ok=True)  # an interrupted write
        self.block = os.statvfs(self.path.parent).f_frsize
        budget.register(name, self.bytes_on_disk)

    @property
    def limit(self) -> int | None:
        """The most bytes the file's folder may take: its share of M's bytes (None without a byte limit)."""
        return None if self.budget.max_bytes is None else int(self.share * self.budget.max_bytes)

    def room(self) -> int | None:
        """What the file's folder may occupy now: M less the other holders, within the share."""
        room, limit = self.budget.room(self.name), self.limit
        return None if room is None or limit is None else min(room, limit)

    def can_ever_hold(self, size: int) -> bool:
        """Whether a file of `size` bytes could be replaced by one of the same size within the share."""
        limit = self.limit
        return limit is None or replacement_peak(size, self.block) <= limit

    def write(self, data: bytes) -> bool:
        """Replace the file with `data` if the replacement fits what M leaves now; False (the old file stays) if not."""
        room = self.room()
        if room is not None and replace_peak(self.path.parent, len(data), self.block) > room:
            return False
        write_atomically(self.path, data)
        return True

    def read(self) -> bytes | None:
        """The file's bytes; None when there is none."""
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        return self.path.exists()

    def remove(self) -> bool:
        """Give the file's bytes back to M; True if there was a file."""
        if not self.path.exists():
            return False
        self.path.unlink()
        return True

    def bytes_on_disk(self) -> int:
        return directory_bytes(self.path.parent, self.block)
