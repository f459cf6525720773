"""The device's persistent replay store: the samples it may replay, in one SQLite file under hard budgets.

Re-Fed's budget M counts the current task's samples and the cached samples of earlier tasks together, so the
store holds both. `Budget.max_samples` is M; `Budget.max_bytes` counts every byte the store has on disk: its
directory, the database and the rollback journal, at every instant, not only between operations.

Layout. One database, `replay.sqlite`, in a directory that holds nothing else (the journal appears beside it).
A sample is a row (id, task, label, crc, x): x holds the raw little-endian float32 bytes (no pickle), crc is a
CRC-32 over task, label and x, so `get()` and `check()` also catch bit rot that SQLite's own checks cannot see.
`meta` holds the format, the sample shape and the next id (ids are never reused); `doomed` lists the ids of a
delete that is being carried out in steps (see Deletes).

Durability. Rollback journal in TRUNCATE mode with synchronous=FULL: a transaction commits when its journal is
truncated and synced, so a process killed at any instant (or a machine that loses power) leaves the old or the new
state, and the next open rolls a hot journal back. In a process whose writes need survive only its own crash (a
simulated fleet's worker: edgefil.durable `power_loss_safe`), synchronous=OFF: the same commits without the syncs.
TRUNCATE rather than DELETE because its commit point is synced at FULL (DELETE's unlink is synced only at EXTRA);
the journal stays as an empty file. Not WAL: a WAL holds every page a
transaction writes, so an insert would sit on disk twice (in the WAL, then in the database at checkpoint),
and the -shm file is one more file to budget. auto_vacuum=INCREMENTAL with an incremental vacuum inside each
write transaction returns freed pages to the file system at commit, without VACUUM's full temporary copy.
Exclusive locking: one process owns the store and no lock files appear. temp_store=MEMORY and cache_spill=OFF
keep every byte of a transaction in this directory or in memory, and give its journal a single header.

Ownership and the connection. The store holds a lock (flock) on its directory from open to close, so one store
object owns it at a time, in any process, whether or not it has SQLite open. The SQLite connection itself is
opened at first use and let go by `release()`: an open connection costs ~120 KiB (its lookaside and page cache)
even when it holds nothing, which a fleet worker would pay once per device (`benchmarks/device_memory.py`), so a
learner that keeps nothing between rounds (`between_rounds = "disk"`) lets it go. The next use opens it again (no
checks repeated: nothing else may have written meanwhile), at a price in CPU (its settings and exclusive lock, its
schema and pages read again: `benchmarks/learner_round.py`), so a learner that keeps its state in memory keeps
its connection too. Its count of live samples is kept between writes, so a device's heartbeat asks no connection.

Budget bound. Before a write, the store bounds the bytes the directory can hold at any instant of it:

    peak = now + file(G * page) + max(journal now, file(header + J * (page + 8)))

`now` is the size of the directory and the database as M counts them (`budget.charged_bytes`: the larger of the
allocated bytes and the file-size rule below applied to the apparent size, so the same in every run). G bounds the
pages the database grows by: rows, overflow pages, B-tree pages and pointer-map pages (`_append_bound`), less
pages a crash left past its end. J bounds the pages the transaction copies into the rollback journal, which
only ever holds pages that existed before it began, each at most once (so J <= pages now); a record is a page
plus its number and checksum, after one sector of header. The journal is empty between transactions; after a
crash it may hold an old one, which the next journal overwrites from the start, hence the max. file(n) rounds
n up to file-system blocks and adds ceil(blocks / 128) + 2 blocks of mapping metadata (ext4 extent blocks hold
340 extents, ext2/3 indirect blocks 1024 pointers, XFS bmbt blocks over 250 records), none for a new journal
of at most 4 blocks (mapped from its inode). The database grows only at commit, after the journal is
complete, and shrinks only once the commit has truncated the journal, so the directory never holds more than
the database at its larger size plus the whole journal. (A kill between those two steps leaves a committed
database longer than its pages; the next commit trims it.) A write whose bound exceeds `max_bytes` is refused
before anything is written, and SQLite's `max_page_count` is set to the bound's page count as a backstop. The
bound assumes a file system that allocates blocks as files are written (ext4, tmpfs, XFS without speculative
preallocation).

Deletes. Shrinking costs journal: SQLite journals every page a commit cuts off the file and every page vacuum
moves a live page into, so a delete needs about as much headroom as it frees. A delete whose bound fits runs
as one transaction. Otherwise the delete is committed by writing its ids to `doomed` (reads skip them from
then on), and the rows are purged in transactions sized to the headroom; each frees room for the next, an
open finishes a purge a crash interrupted, and inserts keep enough headroom for a delete of every sample to
start. `keep_only` is a delete of the complement.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import math
import os
import sqlite3
import struct
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from edge_client.budget import Budget, BudgetShare, DeviceBudget, charged_bytes, directory_bytes, file_bytes
from edgefil.durable import power_loss_safe

DB_NAME = "replay.sqlite"
STORE_HOLDER = "store"  # the store's name among the holders of a DeviceBudget
JOURNAL_NAME = DB_NAME + "-journal"
STORE_FILES = frozenset({DB_NAME, JOURNAL_NAME})
FORMAT = 1
APPLICATION_ID = 0x45464C52  # "EFLR" in the database header: tells a replay store from any SQLite file

PAGE = 4096
# A journal starts with one sector. SQLite uses 512 bytes when the file system overwrites sectors power-safely
# (its unix default) and SQLITE_DEFAULT_SECTOR_SIZE, 4096, otherwise; count the larger.
JOURNAL_HEADER = 4096
JOURNAL_RECORD = PAGE + 8  # page number + page image + checksum
PTRMAP_SPAN = PAGE // 5  # pages one auto-vacuum pointer-map page describes
DIVIDER = 4 + 9 + 2  # an interior cell at most: child page number, rowid varint, cell pointer
EMPTY_PAGES = 5  # page 1 (schema), pointer map, samples, doomed, meta
DOOMED_CELL = 1 + 9 + 2 + 2  # payload-size varint, rowid varint, 2-byte record, cell pointer


class StoreError(Exception):
    """Base of the store's errors."""


class BudgetExceededError(StoreError):
    """A write would exceed a budget; nothing was written."""


class StoreCorruptError(StoreError):
    """The files are not a valid replay store."""


class StoreDiskFullError(StoreError):
    """The file system filled up during a write; the committed state is intact."""


class _Growth(NamedTuple):
    pages: int  # pages the table gains
    rewritten: int  # pages that existed before and may be rewritten (journaled)
    freed: int  # pages that may be freed on the way (vacuum then moves pages into their place)
    depth: int  # levels of the table afterwards, at most


def _varint_len(value: int) -> int:
    n = 1
    while n < 9 and value >= 1 << (7 * n):
        n += 1
    return n


@functools.lru_cache(maxsize=64)
def _row_geometry(payload_min: int, payload_max: int, rowid_bytes: int) -> tuple[int, int]:
    """Largest leaf cell (with its 2-byte pointer) and most overflow pages of a row, per SQLite's file format."""
    most_local = PAGE - 35
    least_local = (PAGE - 12) * 32 // 255 - 23
    cell = overflow = 0
    for payload in range(payload_min, payload_max + 1):
        local = payload
        if payload > most_local:
            local = least_local + (payload - least_local) % (PAGE - 4)
            local = local if local <= most_local else least_local
        pages = -(-(payload - local) // (PAGE - 4))
        size = _varint_len(payload) + rowid_bytes + local + (4 if pages else 0) + 2
        cell, overflow = max(cell, size), max(overflow, pages)
    return cell, overflow


def _append_bound(n: int, cell: int, overflow: int, depth: int) -> _Growth:
    """Bound an append of n rows with rising rowids to a table B-tree of `depth` levels (1: the root is a leaf).

    Leaves: an append lands on the rightmost leaf; when it is full, SQLite puts the row on a fresh right sibling
    (btree.c balance_quick), which takes rows until it is full, so at most ceil(n / per_leaf) new leaves, plus
    one when the root is a leaf (balance_deeper first copies it into a child). Only the rightmost leaf changes.
    Interior levels: each new page sends one divider up. A full interior page is rebalanced with at most two
    left siblings (balance_nonroot) into at most one more page, as dividers are tiny next to a page; the
    rightmost page then is at most half full plus a few cells, so it takes at least `q` dividers before it
    splits again (q is halved below as a margin): at most ceil(d / q) + 1 new pages for d dividers, the +1 for a
    full page's first split or a root that deepens. A rebalance rewrites its siblings and parent; on a non-root
    level left sparse by deletes it may free up to two pages and pull two more from the left into the next one.
    A full root moves its content into a new child (balance_deeper), so the root is its level's only old page.
    The climb stops at the first level that exists or is a new root and takes its dividers without splitting.
    """
    per_leaf = (PAGE - 8) // cell
    per_interior = (PAGE - 12) // DIVIDER
    q = ((PAGE - 12) // 2 - 4 * DIVIDER) // DIVIDER // 2
    leaves = -(-n // per_leaf) + 1
    pages, rewritten, freed = n * overflow + leaves, 1, 0
    arriving, level = leaves, 1
    while not (level >= depth and arriving <= per_interior):
        splits = -(-arriving // q) + 1
        pages += splits
        if level < depth - 1:
            rewritten += 3 + 2 * splits
            freed += 2 * splits
        elif level == depth - 1:
            rewritten += 1  # the root; a deeper tree gets new pages below it
        arriving, level = splits, level + 1
    return _Growth(pages, rewritten, freed, level + 1)


def _ptrmap_pages(pages: int) -> int:
    """Pointer-map pages among a database's first `pages` pages (one at page 2, then every PTRMAP_SPAN + 1)."""
    return 0 if pages < 2 else 1 + (pages - 2) // (PTRMAP_SPAN + 1)


def _with_ptrmap(pages: int) -> int:
    """Pages added to the file when `pages` B-tree pages are: pointer-map pages fall in between."""
    return pages + (-(-pages // PTRMAP_SPAN) + 1 if pages else 0)


class _State(NamedTuple):
    pages: int  # database pages
    file_pages: int  # pages the database file holds (more than `pages` until a commit trims a crash's leftovers)
    free: int  # pages on the freelist
    depth: int  # levels of the samples B-tree
    doomed: int  # rows in doomed (a delete being purged)
    rows: int  # rows in samples, doomed ones included
    next_id: int
    now: int  # bytes of the directory and the database as M counts them (budget.charged_bytes)
    journal: int  # bytes of the journal file: 0 but after a crash (a new journal overwrites it from the start)


# The rows `ids` and `samples` read: those not doomed by a delete, of the task ?1 (every task where it is NULL), by id
_LIVE_OF_TASK = "WHERE (?1 IS NULL OR task = ?1) AND id NOT IN (SELECT id FROM doomed) ORDER BY id"
# A learner reads every stored sample each round (`samples()`), and the store changes only at its writes (a task's
# start, a chunk of the stream): the store keeps what it read until its next write where the samples, labels and
# tasks take at most this many bytes. Opening the database again for that read was most of what a device's round
# cost beyond training where the learner lets its connection go between rounds (`between_rounds = "disk"`, a fleet's
# default: a learner's round 1.16-1.19 ms before, 0.72-0.73 after, benchmarks/learner_round.py with the CRC32C
# checks of edgefil/durable.py), and a connection kept open instead holds about 70 KiB (its page cache and schema);
# 16 KiB is about 90 samples of MNIST-1D or 5 of Fashion-MNIST.
KEPT_SAMPLES_BYTES = 16 * 1024


class ReplayStore:
    """Samples a device may replay, kept across restarts within a `Budget` (see the module docstring)."""

    def __init__(
        self, directory: str | Path, budget: Budget | BudgetShare, sample_shape: tuple[int, ...] | None = None,
        keep_samples_bytes: int = KEPT_SAMPLES_BYTES,
    ) -> None:
        """`keep_samples_bytes`: the most that `samples()` keeps between writes (KEPT_SAMPLES_BYTES; 0: nothing)."""
        self.directory = Path(directory)
        self.budget = budget
        self.keep_samples_bytes = keep_samples_bytes
        self._db = self.directory / DB_NAME
        self._conn: sqlite3.Connection | None = None
        self._owner: int | None = None  # the directory's descriptor, flocked, from open to close
        self._length: int | None = None  # live samples, known since the last write
        self._counts: list[tuple[int, int, int]] | None = None  # `counts`, known since the last write
        self._kept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # `samples()`, since the last write
        self._bytes: int | None = None  # `bytes_on_disk`, since the last write or connection (`_measured_anew`)
        self._open(sample_shape)

    # ------------------------------------------------------------------ lifecycle

    def _open(self, sample_shape: tuple[int, ...] | None) -> None:
        shape = None if sample_shape is None else _check_shape(sample_shape)
        if self.directory.exists():
            foreign = sorted(set(os.listdir(self.directory)) - STORE_FILES)
            if foreign:
                raise StoreError(f"{self.directory} holds files that are not the store's: {foreign[:5]}")
        if not self._db.exists():
            if shape is None:
                raise ValueError(f"no store at {self.directory}: sample_shape is needed to create one")
            self._check_empty_fits(shape)
        with self._errors():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._block = os.statvfs(self.directory).f_frsize
            self._own()
            try:
                self._connect()
                if self._connection().execute("PRAGMA page_count").fetchone()[0] == 0:  # new, or a create rolled back
                    if shape is None:
                        raise ValueError(f"no store at {self.directory}: sample_shape is needed to create one")
                    self._create(shape)
                self._load(shape)
                self._check_budget_on_open()
                self._finish_purge(quiet=True)  # a delete a crash interrupted
            except BaseException:
                self.close()
                raise
        self.release()

    def _own(self) -> None:
        """Take the directory's lock, or refuse: another store object (here or in another process) owns it."""
        owner = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(owner)
            raise StoreError(f"{self._db}: in use by another process or store") from None
        self._owner = owner
        self._let_go = weakref.finalize(self, os.close, owner)  # a store dropped unclosed lets its lock go too

    def _connect(self) -> sqlite3.Connection:
        self._bytes = None  # a connection may roll a crash's journal back, or make the files
        self._conn = sqlite3.connect(self._db, isolation_level=None, timeout=0, check_same_thread=False)
        try:
            self._configure(self._conn)
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        return self._conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        # Roll back a hot journal left by a crash before locking exclusively: in exclusive mode SQLite leaves
        # the rolled-back journal at full size until the next write; in the default mode it deletes it.
        conn.execute("PRAGMA schema_version").fetchone()
        # synchronous = OFF where the process's writes need survive only its own crash (edgefil.durable
        # `power_loss_safe`): a commit is then whole for any process once SQLite's write calls returned
        synchronous = "FULL" if power_loss_safe() else "OFF"
        for pragma in ("locking_mode = EXCLUSIVE", f"synchronous = {synchronous}", "secure_delete = FAST",
                       "cache_spill = OFF", "temp_store = MEMORY"):
            conn.execute(f"PRAGMA {pragma}")
        mode = conn.execute("PRAGMA journal_mode = TRUNCATE").fetchone()[0]
        if mode != "truncate":
            raise StoreError(f"{self._db}: cannot use a TRUNCATE rollback journal (got {mode})")

    def _check_empty_fits(self, shape: tuple[int, ...]) -> None:
        """Refuse, before creating anything, a byte budget that an empty store and a delete's headroom exceed."""
        if self.budget.max_bytes is None:
            return
        existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        self._block = os.statvfs(existing).f_frsize
        self._set_shape(shape)
        directory = self._charged(os.stat(self.directory)) if self.directory.exists() else max(self._block, 4096)
        empty = _State(pages=EMPTY_PAGES, file_pages=EMPTY_PAGES, free=0, depth=1, doomed=0, rows=0, next_id=0,
                       now=directory + self._file_bytes(EMPTY_PAGES * PAGE), journal=0)
        need = max(empty.now + self._file_bytes(JOURNAL_HEADER + EMPTY_PAGES * JOURNAL_RECORD, fresh=True),
                   self._reserve_peak(empty, 0, _Growth(0, 0, 0, 1)))
        if need > self.budget.max_bytes:
            raise BudgetExceededError(f"max_bytes {self.budget.max_bytes} is below the {need} bytes an empty store "
                                      f"can take while it is created and emptied")

    def _create(self, sample_shape: tuple[int, ...]) -> None:
        conn = self._connection()
        conn.execute(f"PRAGMA page_size = {PAGE}")
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # only takes effect before the first table
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, task INTEGER NOT NULL, "
                         "label INTEGER NOT NULL, crc INTEGER NOT NULL, x BLOB NOT NULL)")
            conn.execute("CREATE TABLE doomed (id INTEGER PRIMARY KEY)")
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value NOT NULL) WITHOUT ROWID")
            conn.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("format", FORMAT), ("sample_shape", json.dumps(list(sample_shape))), ("next_id", 0)])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _load(self, sample_shape: tuple[int, ...] | None) -> None:
        conn = self._connection()
        if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            raise StoreCorruptError(f"{self._db}: an SQLite database, but not a replay store")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        auto_vacuum = conn.execute("PRAGMA auto_vacuum").fetchone()[0]
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        if page_size != PAGE or auto_vacuum != 2 or set(meta) != {"format", "sample_shape", "next_id"}:
            raise StoreCorruptError(f"{self._db}: replay store settings are damaged (page size {page_size}, "
                                    f"auto_vacuum {auto_vacuum}, meta keys {sorted(meta)})")
        if meta["format"] != FORMAT:
            raise StoreCorruptError(f"{self._db}: store format {meta['format']!r}, this code reads {FORMAT}")
        stored = tuple(json.loads(meta["sample_shape"]))
        if sample_shape is not None and sample_shape != stored:
            raise ValueError(f"the store at {self.directory} holds samples of shape {stored}, not {sample_shape}")
        self._set_shape(stored)

    def _set_shape(self, shape: tuple[int, ...]) -> None:
        self.sample_shape: tuple[int, ...] = shape
        self._sample_bytes = 4 * math.prod(shape)
        # record: header (its size, then the types of id, task, label, crc, x), task and label up to 8 bytes,
        # crc up to 6, x
        header = 5 + _varint_len(2 * self._sample_bytes + 12)
        self._payload = (header + self._sample_bytes, header + self._sample_bytes + 8 + 8 + 6)

    def _check_budget_on_open(self) -> None:
        state = self._state()
        live = state.rows - state.doomed
        if self.budget.max_samples is not None and live > self.budget.max_samples:
            raise BudgetExceededError(f"{self.directory} holds {live} samples, over max_samples "
                                      f"{self.budget.max_samples}; open it with a larger budget and keep_only()")
        if self.budget.max_bytes is not None:
            need = max(state.now + state.journal, self._delete_peak(state))
            if need > self.budget.max_bytes:
                raise BudgetExceededError(
                    f"{self.directory} takes {self.bytes_on_disk()} bytes and needs up to {need} with the headroom "
                    f"a delete needs, over max_bytes {self.budget.max_bytes}; open it with a larger budget and "
                    f"keep_only()")

    @classmethod
    def within(cls, budget: DeviceBudget, directory: str | Path, sample_shape: tuple[int, ...] | None = None
               ) -> ReplayStore:
        """The device's store as one holder of M: it writes within what the budget's other holders leave."""
        store = cls(directory, budget.share(STORE_HOLDER), sample_shape)
        budget.register(STORE_HOLDER, store.bytes_on_disk, store.delete_headroom)
        return store

    def device_budget(self) -> DeviceBudget:
        """The DeviceBudget this store is a holder of. A store opened with plain limits becomes the first holder
        of a budget of those limits, so that a method's own files can share M with it."""
        if isinstance(self.budget, BudgetShare):
            return self.budget.owner
        owner = DeviceBudget(self.budget)
        self.budget = owner.share(STORE_HOLDER)
        owner.register(STORE_HOLDER, self.bytes_on_disk, self.delete_headroom)
        return owner

    def release(self) -> None:
        """Let the SQLite connection go until the next use (the store stays open and owned): for a holder that is
        idle for a while, as a device between rounds. What the store keeps until its next write (its length,
        `counts`, small `samples`) stays: a round that does not write opens no connection."""
        if self._conn is not None:
            if self._length is None:  # counted now: a heartbeat asks len() while idle
                len(self)
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._kept = None
        if self._owner is not None:
            self._let_go()  # closes the directory's descriptor, and with it the lock
            self._owner = None

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes

    def insert(self, x: np.ndarray, y: np.ndarray, task: int) -> np.ndarray:
        """Add samples of one task; returns their new ids. All or nothing; refused if it could exceed a budget."""
        x, y, task = self._check_samples(x, y, task)
        n = len(y)
        if n == 0:
            return np.empty(0, np.int64)
        self._finish_purge()
        state = self._state()
        fit = self._room(state, n)
        if fit < n:
            raise BudgetExceededError(f"insert of {n} samples refused: {fit} fit now ({state.rows} stored, "
                                      f"{self.bytes_on_disk()} bytes on disk, {self.budget}); delete some first")
        growth = _append_bound(n, *self._geometry(state.next_id + n), state.depth)
        ids = np.arange(state.next_id, state.next_id + n, dtype=np.int64)
        blob = x.astype("<f4", copy=False).tobytes()
        size = self._sample_bytes
        rows = []
        for i, (sample_id, label) in enumerate(zip(ids.tolist(), y.tolist())):
            data = blob[i * size : (i + 1) * size]
            rows.append((sample_id, task, label, _crc(task, label, data), data))
        grow = _with_ptrmap(growth.pages)
        peak = self._peak(state, grow, self._insert_journal(state, growth))
        with self._transaction(state.pages + grow, peak) as conn:
            conn.executemany("INSERT INTO samples (id, task, label, crc, x) VALUES (?, ?, ?, ?, ?)", rows)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'next_id'", (state.next_id + n,))
        return ids

    def delete(self, ids: np.ndarray) -> None:
        """Delete samples (unknown ids: KeyError, nothing deleted); all or nothing, and the files shrink."""
        doomed = self._existing(ids)
        if len(doomed):
            self._delete(doomed)

    def keep_only(self, ids: np.ndarray) -> None:
        """Delete every sample not in ids (unknown ids: KeyError, nothing deleted), as one delete."""
        keep = self._existing(ids)
        everything = self.ids()
        doomed = everything[~np.isin(everything, keep)]
        if len(doomed):
            self._delete(doomed)

    def _delete(self, doomed: np.ndarray) -> None:
        self._finish_purge()
        state = self._state()
        peak = self._peak(state, 0, self._purge_journal(state, len(doomed)))
        if self._fits(peak):
            with self._transaction(state.pages, peak) as conn:
                conn.execute("DELETE FROM samples WHERE id IN (SELECT value FROM json_each(?))", (_json(doomed),))
            return
        # Too large for one transaction: commit the ids to `doomed` (the delete itself), then purge them in steps.
        tomb_pages, tomb_peak, step_peak = self._tombstone_peaks(state, len(doomed))
        if not self._fits(max(tomb_peak, step_peak)):
            raise BudgetExceededError(f"delete of {len(doomed)} samples refused: no room for its journal under "
                                      f"max_bytes {self.budget.max_bytes} ({self.bytes_on_disk()} bytes on disk)")
        with self._transaction(state.pages + tomb_pages, tomb_peak) as conn:
            conn.execute("INSERT INTO doomed (id) SELECT value FROM json_each(?) ORDER BY value", (_json(doomed),))
        self._finish_purge(quiet=True)

    def _finish_purge(self, quiet: bool = False) -> None:
        """Purge the rows of a committed delete in transactions as large as the headroom allows, then drop the
        tombstones. quiet: a full disk leaves the rest for later (the delete stands; reads skip the rows)."""
        try:
            while (state := self._state()).doomed:
                left = self._query("SELECT count(*) FROM doomed JOIN samples USING (id)")[0][0]
                if left == 0:
                    with self._transaction(state.pages, self._peak(state, 0, self._clear_journal(state))) as conn:
                        conn.execute("DELETE FROM doomed")
                    continue
                fits = lambda c: self._fits(self._peak(state, 0, self._purge_journal(state, c)))  # noqa: E731
                step = max(self._largest(left, fits), 1)  # a step that does not fit is refused by _transaction
                with self._transaction(state.pages, self._peak(state, 0, self._purge_journal(state, step))) as conn:
                    conn.execute("DELETE FROM samples WHERE id IN (SELECT id FROM doomed JOIN samples USING (id) "
                                 "ORDER BY id LIMIT ?)", (step,))
        except StoreDiskFullError:
            if not quiet:
                raise

    @contextmanager
    def _transaction(self, max_pages: int, peak: int) -> Iterator[sqlite3.Connection]:
        """One write transaction, whose bytes on disk are bounded by `peak`; refused if that exceeds max_bytes.

        It ends with the freelist vacuumed, so the file shrinks at commit."""
        conn = self._connection()
        self._length = self._counts = self._kept = self._bytes = None
        if not self._fits(peak):
            raise BudgetExceededError(f"{self.directory}: a write could take {peak} bytes, over max_bytes "
                                      f"{self.budget.max_bytes}; nothing was written")
        with self._errors():
            if self.budget.max_bytes is not None:  # backstop: SQLite refuses to grow the file past the bound
                conn.execute(f"PRAGMA max_page_count = {max_pages}")
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                # Python's sqlite3 steps this pragma only once, and each step frees one page.
                for _ in range(conn.execute("PRAGMA freelist_count").fetchone()[0]):
                    conn.execute("PRAGMA incremental_vacuum")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._bytes = None  # measured during the write: the files have changed since

    # ------------------------------------------------------------------ reads

    def ids(self, task: int | None = None) -> np.ndarray:
        """Ids of the stored samples (of one task), ascending."""
        task = None if task is None else int(task)
        rows = self._query(f"SELECT id FROM samples {_LIVE_OF_TASK}", (task,))
        return np.array([r[0] for r in rows], dtype=np.int64)

    def labels(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Labels of the given samples in their order (all samples by id when ids is None)."""
        return self._column("label", ids)

    def tasks(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Tasks of the given samples in their order (all samples by id when ids is None)."""
        return self._column("task", ids)

    def counts(self) -> list[tuple[int, int, int]]:
        """(task, label, samples) of what is stored, most samples first (one query: no column read into memory;
        kept until the next write, as a device's every update names them)."""
        if self._counts is None:
            rows = self._query("SELECT task, label, COUNT(*) AS n FROM samples WHERE id NOT IN (SELECT id FROM doomed) "
                               "GROUP BY task, label ORDER BY n DESC, task, label")
            self._counts = [(int(task), int(label), int(n)) for task, label, n in rows]
        elif self._owner is None:
            raise StoreError(f"the store at {self.directory} is closed")
        return list(self._counts)

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x float32 (n, *sample_shape), y int64) in the order of ids; unknown ids raise KeyError."""
        x, y, _ = self._checked(self._rows("s.id, s.task, s.label, s.crc, s.x", _id_array(ids)))
        return x, y

    def samples(self, task: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, task) of every stored sample (of one task), by id: `get(ids(task))` and `tasks` in one query (a
        learner reads its store so every round). All of them, read and checked, are kept until the next write where
        they take at most `keep_samples_bytes` (KEPT_SAMPLES_BYTES), and a read of them or of one task's then
        needs no query; each read returns arrays of its own."""
        task = None if task is None else int(task)
        kept = self._kept
        if kept is None:
            read = self._checked(self._query(f"SELECT id, task, label, crc, x FROM samples {_LIVE_OF_TASK}", (task,)))
            if task is not None or sum(a.nbytes for a in read) > self.keep_samples_bytes:
                return read
            self._kept = kept = read
        x, y, tasks = kept
        if task is None:
            return x.copy(), y.copy(), tasks.copy()
        chosen = tasks == task
        return x[chosen], y[chosen], tasks[chosen]

    def _checked(self, rows: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x float32 (n, *sample_shape), y int64, task int64) of rows (id, task, label, crc, x), each checked
        against its CRC."""
        for sample_id, task, label, crc, data in rows:
            if len(data) != self._sample_bytes or _crc(task, label, data) != crc:
                raise StoreCorruptError(f"{self._db}: sample {sample_id} does not match its checksum")
        x = np.frombuffer(bytearray().join(r[4] for r in rows), dtype="<f4").astype(np.float32, copy=False)
        return (x.reshape(len(rows), *self.sample_shape), np.array([r[2] for r in rows], dtype=np.int64),
                np.array([r[1] for r in rows], dtype=np.int64))

    def __len__(self) -> int:
        if self._length is None:
            self._length = self._query("SELECT count(*) FROM samples WHERE id NOT IN (SELECT id FROM doomed)")[0][0]
        elif self._owner is None:
            raise StoreError(f"the store at {self.directory} is closed")
        return self._length

    def bytes_on_disk(self) -> int:
        """The directory and its files as M counts them (`budget.charged_bytes`): at least their allocated bytes
        (du's measure, what a disk quota charges) and their apparent size (`du --apparent-size`), and the same in
        every run of the same operations, however the disk placed the blocks. Measured again after each write and
        each new connection, and kept between them, as the store's length and counts are: only they change its
        files (the directory's lock keeps every other process of the device out), and a device's every update
        reports them (`stored_bytes`), which cost a scan and a stat of each file a round (docs/results.md)."""
        if self._bytes is None:
            self._bytes = directory_bytes(self.directory, self._block)
        return self._bytes

    def delete_headroom(self) -> int:
        """Bytes beyond `bytes_on_disk()` that starting a delete of every sample may take (its tombstones' and its
        first step's journal): what the store's inserts keep free within its own room, and what the budget's other
        holders must leave it (a delete journals before it frees anything)."""
        return max(self._delete_peak(self._state()) - self.bytes_on_disk(), 0)

    def room_for(self, n: int) -> int:
        """How many of n more samples fit under both budgets right now, so callers can evict first."""
        return self._room(self._state(), n)

    def check(self) -> None:
        """Full consistency check: SQLite's integrity_check, every sample's size and checksum, the counts."""
        db = self._db
        problems = [r[0] for r in self._query("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise StoreCorruptError(f"{db}: integrity_check failed: {'; '.join(problems[:5])}")
        count = max_id = 0
        for sample_id, task, label, crc, data in self._query("SELECT id, task, label, crc, x FROM samples"):
            if not all(isinstance(v, int) for v in (task, label, crc)) or not isinstance(data, bytes):
                raise StoreCorruptError(f"{db}: sample {sample_id} has columns of the wrong type")
            if len(data) != self._sample_bytes or _crc(task, label, data) != crc:
                raise StoreCorruptError(f"{db}: sample {sample_id} does not match its checksum")
            if not np.isfinite(np.frombuffer(data, dtype="<f4")).all():
                raise StoreCorruptError(f"{db}: sample {sample_id} holds NaN or Inf")
            count, max_id = count + 1, max(max_id, sample_id)
        state = self._state()
        if count != state.rows or (count and max_id >= state.next_id):
            raise StoreCorruptError(f"{db}: {count} samples read, {state.rows} counted, largest id {max_id}, "
                                    f"next id {state.next_id}")

    # ------------------------------------------------------------------ budget arithmetic

    def _state(self) -> _State:
        conn = self._connection()
        with self._errors():
            one = lambda sql: conn.execute(sql).fetchone()[0]  # noqa: E731
            pages = one("PRAGMA page_count")
            files = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(self.directory)}
            journal = files.pop(JOURNAL_NAME, None)
            return _State(
                pages=pages,
                file_pages=files[DB_NAME].st_size // PAGE,
                free=one("PRAGMA freelist_count"),
                depth=self._depth("samples", pages),
                doomed=one("SELECT count(*) FROM doomed"),
                rows=one("SELECT count(*) FROM samples"),
                next_id=one("SELECT value FROM meta WHERE key = 'next_id'"),
                now=self._charged(os.stat(self.directory), *files.values()),
                journal=self._charged(journal) if journal else 0,
            )

    def _depth(self, table: str, pages: int) -> int:
        """Levels of a table's B-tree: the leftmost leaf's path (dbstat walks the tree depth first)."""
        try:
            path = self._connection().execute("SELECT path FROM dbstat WHERE name = ? AND pagetype = 'leaf' LIMIT 1",
                                      (table,)).fetchone()[0]
            return path.count("/")
        except sqlite3.OperationalError:  # SQLite built without dbstat: every interior page has 2+ children
            return 1 + int(math.log2(max(pages, 1)))

    def _geometry(self, max_rowid: int) -> tuple[int, int]:
        return _row_geometry(*self._payload, _varint_len(max_rowid))

    def _file_bytes(self, size: int, fresh: bool = False) -> int:
        return file_bytes(size, self._block, fresh)

    def _charged(self, *stats: os.stat_result) -> int:
        """Entries of the directory as M counts them (`budget.charged_bytes`)."""
        return sum(charged_bytes(s, self._block) for s in stats)

    def _peak(self, state: _State, grow_pages: int, journal_pages: int) -> int:
        """Bound on the directory's bytes during a transaction (see the module docstring). Growth first fills
        pages a crash left at the end of the file; the journal is written from the start of its file."""
        extra = max(state.pages + grow_pages - state.file_pages, 0)
        journal = JOURNAL_HEADER + min(journal_pages, state.pages) * JOURNAL_RECORD
        return state.now + self._file_bytes(extra * PAGE) + max(state.journal, self._file_bytes(journal, fresh=True))

    def _committed(self, state: _State, grow_pages: int, **changes: int) -> _State:
        """The state once a transaction that added `grow_pages` pages has committed (its journal empty, its
        freelist vacuumed)."""
        pages = state.pages + grow_pages
        extra = max(pages - state.file_pages, 0)
        return state._replace(pages=pages, file_pages=max(pages, state.file_pages), free=0, journal=0,
                              now=state.now + self._file_bytes(extra * PAGE), **changes)

    def _insert_journal(self, state: _State, growth: _Growth) -> int:
        # page 1, the meta page, the pointer map, the freelist's trunk pages, the B-tree's rewritten pages,
        # and vacuum's moves (see _purge_journal) for pages free before or freed by the insert
        trunks = -(-state.free // (PAGE // 4 - 2))
        return 2 + _ptrmap_pages(state.pages) + trunks + growth.rewritten + 3 * (state.free + growth.freed)

    def _tomb_journal(self, state: _State, tomb: _Growth) -> int:
        trunks = -(-state.free // (PAGE // 4 - 2))
        return 1 + _ptrmap_pages(state.pages) + trunks + tomb.rewritten + 3 * state.free

    def _purge_journal(self, state: _State, c: int) -> int:
        """Journal pages of deleting c rows, with the vacuum that follows.

        A deleted row rewrites its leaf; a leaf left under a third full is rebalanced with two siblings and the
        parent, possibly up every level: at most 4 * depth pages per row. It frees its overflow pages, and each
        level's rebalance at most two pages. Vacuum then journals, per free page, at most the page itself (cut
        off the file, or a live page moved into it) and the page pointing at a moved page: 3 per free page.
        Page 1 and the pointer map come on top; `_peak` caps the total at the pages the file has.
        """
        _, overflow = self._geometry(state.next_id)
        per_row = 4 * state.depth + 3 * (overflow + 2 * state.depth)
        return 1 + _ptrmap_pages(state.pages) + c * per_row + 3 * state.free

    def _clear_journal(self, state: _State) -> int:
        """Journal pages of dropping the tombstones: the table, built by one append, is rewritten and freed."""
        pages = _append_bound(state.doomed, DOOMED_CELL, 0, 1).pages
        return 1 + _ptrmap_pages(state.pages) + 4 * pages + 3 * state.free

    def _tombstone_peaks(self, state: _State, k: int) -> tuple[int, int, int]:
        """Pages and peak of committing k tombstones, and the peak of the smallest step after (purging one row,
        or dropping the tombstones)."""
        tomb = _append_bound(k, DOOMED_CELL, 0, 1)
        pages = _with_ptrmap(tomb.pages)
        after = self._committed(state, pages, doomed=k)
        step = max(self._peak(after, 0, self._purge_journal(after, 1)),
                   self._peak(after, 0, self._clear_journal(after)))
        return pages, self._peak(state, pages, self._tomb_journal(state, tomb)), step

    def _reserve_peak(self, state: _State, n: int, growth: _Growth) -> int:
        """Peak, once n rows (growth) are inserted, of starting a delete of every sample: its tombstones, then
        its smallest step. Inserts keep this within max_bytes, so a delete can always proceed."""
        after = self._committed(state, _with_ptrmap(growth.pages), depth=growth.depth, rows=state.rows + n,
                                next_id=state.next_id + n)
        _, tomb_peak, step_peak = self._tombstone_peaks(after, after.rows)
        return max(tomb_peak, step_peak)

    def _delete_peak(self, state: _State) -> int:
        """Peak of starting a delete of every sample stored now (`_reserve_peak` with nothing inserted)."""
        return self._reserve_peak(state, 0, _Growth(0, 0, 0, state.depth))

    def _room(self, state: _State, n: int) -> int:
        n = int(n)
        if self.budget.max_samples is not None:
            n = min(n, max(self.budget.max_samples - (state.rows - state.doomed), 0))
        if self.budget.max_bytes is None or n <= 0:
            return max(n, 0)

        def fits(m: int) -> bool:
            if m == 0:
                return True
            growth = _append_bound(m, *self._geometry(state.next_id + m), state.depth)
            insert_peak = self._peak(state, _with_ptrmap(growth.pages), self._insert_journal(state, growth))
            return self._fits(max(insert_peak, self._reserve_peak(state, m, growth)))

        return self._largest(n, fits)

    def _fits(self, peak: int) -> bool:
        return self.budget.max_bytes is None or peak <= self.budget.max_bytes

    @staticmethod
    def _largest(n: int, fits) -> int:
        """Largest m in [0, n] with fits(m), for a predicate that holds up to some m and fails above it."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # ------------------------------------------------------------------ helpers

    def _check_samples(self, x: np.ndarray, y: np.ndarray, task: int) -> tuple[np.ndarray, np.ndarray, int]:
        if isinstance(task, bool) or not isinstance(task, (int, np.integer)) or not -2**63 <= task < 2**63:
            raise ValueError(f"task must be an int64, not {task!r}")
        x, y = np.asarray(x), np.asarray(y)
        if x.shape[1:] != self.sample_shape or x.ndim != len(self.sample_shape) + 1:
            raise ValueError(f"x must have shape (n, {', '.join(map(str, self.sample_shape))}), not {x.shape}")
        if x.dtype.kind not in "fiu":
            raise ValueError(f"x must be real numbers, not {x.dtype}")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"y must have shape ({len(x)},), not {y.shape}")
        if y.dtype.kind not in "iu":
            raise ValueError(f"labels must be integers, not {y.dtype}")
        if len(y) and (y.min() < -2**63 or y.max() >= 2**63):
            raise ValueError("labels must fit in int64")
        with np.errstate(over="ignore"):  # values beyond float32 become Inf and are refused below
            x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            raise ValueError("x holds NaN or Inf (or values beyond float32)")
        return x, y.astype(np.int64), int(task)

    def _existing(self, ids: np.ndarray) -> np.ndarray:
        ids = np.unique(_id_array(ids))
        missing = ids[~np.isin(ids, self.ids())]
        if len(missing):
            raise KeyError(f"no samples with ids {missing[:10].tolist()}{' ...' if len(missing) > 10 else ''}")
        return ids

    def _column(self, name: str, ids: np.ndarray | None) -> np.ndarray:
        if ids is None:
            rows = self._query(f"SELECT {name} FROM samples WHERE id NOT IN (SELECT id FROM doomed) ORDER BY id")
        else:
            rows = self._rows(f"s.{name}", _id_array(ids))
        return np.array([r[0] for r in rows], dtype=np.int64)

    def _rows(self, columns: str, ids: np.ndarray) -> list[tuple]:
        """Rows of the given ids in their order (repeats allowed); KeyError names ids that are not stored."""
        rows = self._query(f"SELECT {columns} FROM json_each(?) AS j JOIN samples AS s ON s.id = j.value "
                           "WHERE s.id NOT IN (SELECT id FROM doomed) ORDER BY j.key", (_json(ids),))
        if len(rows) != len(ids):
            missing = ids[~np.isin(ids, self.ids())]
            raise KeyError(f"no samples with ids {missing[:10].tolist()}{' ...' if len(missing) > 10 else ''}")
        return rows

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self._connection()
        with self._errors():
            return conn.execute(sql, params).fetchall()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        if self._owner is None:
            raise StoreError(f"the store at {self.directory} is closed")
        with self._errors():
            return self._connect()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn SQLite and OS errors into the store's errors, naming the file."""
        try:
            yield
        except sqlite3.Error as e:
            code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
            if code == sqlite3.SQLITE_FULL:
                raise StoreDiskFullError(f"{self._db}: disk full, or a write outgrew its bound and met the "
                                         f"max_page_count backstop ({e}); the committed state is intact") from e
            if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise StoreCorruptError(f"{self._db}: not a valid replay store ({e})") from e
            if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise StoreError(f"{self._db}: in use by another process ({e})") from e
            raise StoreError(f"{self._db}: {e}") from e
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreDiskFullError(f"{self.directory}: disk full ({e})") from e
            raise


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"sample_shape must be positive dimensions, not {shape}")
    return shape


def _crc(task: int, label: int, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(struct.pack("<qq", task, label)))


def _id_array(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
        raise ValueError(f"ids must be a 1-d integer array, not {ids.dtype} of shape {ids.shape}")
    return ids.astype(np.int64)


def _json(ids: np.ndarray) -> str:
    return json.dumps(np.asarray(ids, dtype=np.int64).tolist())
