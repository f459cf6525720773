import errno
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from edge_client.state import ClientState, StateError, load_state, save_state, save_state_keeping_weights
from edge_client.trainers.base import OptimizerState
from edgefil import durable
from edgefil.wire import crc32c

ROOT = Path(__file__).resolve().parents[1]
SLOT_FILES = {"state-a.slot", "state-b.slot"}


def state(k: int, size: int = 5) -> ClientState:
    return ClientState(task=k, round=k, seen_classes=list(range(k + 1)), n_seen=10 * k,
                       weights=np.full(size, k, dtype=np.float32))


def assert_is(loaded: ClientState, k: int) -> None:
    assert (loaded.task, loaded.round, loaded.seen_classes, loaded.n_seen) == (k, k, list(range(k + 1)), 10 * k)
    assert np.array_equal(loaded.weights, np.full(len(loaded.weights), k, np.float32))
    assert loaded.weights.dtype == np.float32


def damage_end(path: Path) -> None:
    """Flip the last byte of a file (a slot's: its last buffer's last byte)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def earlier_slot(folder: Path, saved: ClientState, sequence: int, checksum: str = "crc32c") -> None:
    """`saved` as the earlier slotted form wrote it (before one file per slot) into its slot a: a record file
    (RECORD_MAGIC, the sequence, the JSON's sha256) and a file per buffer, named by their checksum's `checksum`."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {f.name: getattr(saved, f.name) for f in fields(saved) if f.name not in durable.BUFFERS}
    for name in durable.BUFFERS:
        value, record[f"{name}_file"] = getattr(saved, name), None
        if value is not None:
            blob = value.astype("<f4").tobytes()
            record[f"{name}_file"] = f"{name}.a.f32"
            record[f"{name}_{checksum}"] = (f"{crc32c(blob):08x}" if checksum == "crc32c"
                                            else hashlib.sha256(blob).hexdigest())
            (folder / f"{name}.a.f32").write_bytes(blob)
    payload = json.dumps(record).encode()
    (folder / "state-a.rec").write_bytes(
        durable.RECORD_MAGIC + f"{sequence} {hashlib.sha256(payload).hexdigest()}\n".encode() + payload)


def test_state_round_trips_and_saves_again_in_the_same_two_slots(tmp_path):
    assert load_state(tmp_path) is None
    save_state(tmp_path, state(0))
    assert_is(load_state(tmp_path), 0)
    assert set(os.listdir(tmp_path)) == SLOT_FILES  # the first save fills both slots
    files = {name: os.stat(tmp_path / name).st_ino for name in SLOT_FILES}
    sizes = set()
    for k in range(1, 5):  # from the second save on every file is written in place, none created, renamed or removed
        save_state(tmp_path, state(k))
        assert_is(load_state(tmp_path), k)
        sizes.add(os.stat(tmp_path / f"state-{'ab'[k % 2]}.slot").st_size)
    assert {name: os.stat(tmp_path / name).st_ino for name in os.listdir(tmp_path)} == files
    assert len(sizes) == 1  # its record grew by a few bytes a save: the padded slot kept its length


def test_a_save_opens_and_writes_its_slot_once(tmp_path, monkeypatch):
    """A save after the first: one file opened, written in one system call, its identity taken from it; both
    buffers read back from it in one read."""
    optimizer = np.arange(10, dtype=np.float32)
    save_state(tmp_path, state(0).with_optimizer(adamw_state(optimizer)))
    calls: list[str] = []
    for name in ("open", "writev", "write", "stat", "fstat", "read"):
        real = getattr(durable.os, name)
        monkeypatch.setattr(durable.os, name, lambda *args, _real=real, _name=name: calls.append(_name) or
                            _real(*args))
    saved = save_state(tmp_path, state(1).with_optimizer(adamw_state(optimizer + 1)))
    assert sorted(calls) == ["fstat", "open", "stat", "stat", "writev"]
    monkeypatch.undo()
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *args, **kw: opened.append(str(path)) or
                        real_open(path, *args, **kw))
    loaded = load_state(tmp_path, saved=saved)
    assert opened == [str(tmp_path / "state-b.slot")]
    assert_is(loaded, 1) and np.array_equal(loaded.optimizer, optimizer + 1)


def test_the_first_save_s_state_is_whole_in_either_slot(tmp_path):
    """The older slot the first save fills holds the same state, in its own file: a damaged newer slot leaves it,
    and the next save goes into the damaged one."""
    save_state(tmp_path, state(0, size=8))
    assert b'"weights_file": "state-b.slot"' in (tmp_path / "state-b.slot").read_bytes()
    damage_end(tmp_path / "state-a.slot")  # its weights: the slot is not whole
    assert_is(load_state(tmp_path), 0)
    save_state(tmp_path, state(1, size=8))
    assert (tmp_path / "state-a.slot").read_bytes().startswith(durable.SLOT_MAGIC + b"1 ")
    assert_is(load_state(tmp_path), 1)


def test_a_save_after_this_process_s_own_save_there_reads_no_slot(tmp_path, monkeypatch):
    """The process's last save in a folder names the newest slot: the next save there neither reads nor checks the
    slots again."""
    save_state(tmp_path, state(0))

    def unread(directory):
        raise AssertionError(f"{directory}'s slots read again")

    monkeypatch.setattr(durable, "_newest_slot", unread)
    for k in range(1, 4):
        save_state(tmp_path, state(k))
    monkeypatch.undo()
    assert_is(load_state(tmp_path), 3)
    (tmp_path / "state-b.slot").write_bytes(b"torn")  # the newest (the fourth save's): the third's is whole
    assert_is(load_state(tmp_path), 2)


def test_a_save_after_another_hand_changed_the_slots_reads_them_again(tmp_path):
    """Slots another process wrote since this one's last save (newer ones, as another save makes, put in place by
    rename) decide the slot: this save is still the newest, and the one before it stays whole."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for k in range(2):
        save_state(ours, state(k))
    theirs.mkdir()
    for name in SLOT_FILES:
        (theirs / name).write_bytes((ours / name).read_bytes())
    for k in (5, 6):  # their saves: sequences 3 and 4, the newest in the slot ours wrote last
        save_state(theirs, state(k))
    for name in SLOT_FILES:
        os.replace(theirs / name, ours / name)
    save_state(ours, state(7))
    assert_is(load_state(ours), 7)
    (ours / "state-a.slot").write_bytes(b"torn")  # this save's slot: theirs, the newest before it, stays
    assert_is(load_state(ours), 6)


def test_a_save_after_another_process_saved_in_place_reads_the_slots_again(tmp_path):
    """Another process's save in between (in place, into the slot this one's last save left older): this save goes
    into the other slot, so the one before it, theirs, stays whole."""
    for k in range(2):
        save_state(tmp_path, state(k))
    script = ("import sys; import numpy as np; from edge_client.state import ClientState, save_state\n"
              "save_state(sys.argv[1], ClientState(task=5, round=5, seen_classes=list(range(6)), n_seen=50, "
              "weights=np.full(5, 5, dtype=np.float32)))\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120, cwd=ROOT)
    assert_is(load_state(tmp_path), 5)
    save_state(tmp_path, state(7))
    assert_is(load_state(tmp_path), 7)
    (tmp_path / "state-b.slot").write_bytes(b"torn")  # this save's slot: theirs, the newest before it, stays
    assert_is(load_state(tmp_path), 5)


def test_a_first_save_whose_older_slot_finds_the_disk_full_is_whole_without_it(tmp_path, monkeypatch):
    """The first save's copy in the older slot is a bonus: where the disk has no room for it (ENOSPC), the save is
    whole without it, the file it made removed; the next save makes the slot as before."""
    writes, full = 0, True
    real_writev = os.writev

    def writev(fd, parts):
        nonlocal writes
        writes += 1
        if full and writes >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, parts)

    monkeypatch.setattr(durable.os, "writev", writev)
    save_state(tmp_path, state(0))  # writes: the newer slot, then the older
    assert_is(load_state(tmp_path), 0)
    assert set(os.listdir(tmp_path)) == {"state-a.slot"}
    full = False
    save_state(tmp_path, state(1))
    assert_is(load_state(tmp_path), 1)
    assert set(os.listdir(tmp_path)) == SLOT_FILES


def test_saves_on_a_full_disk_write_within_their_slots_lengths(tmp_path, monkeypatch):
    """A disk without a free block (a write past a file's end fails): a save of a state as large as the last, and a
    record-only save, still fit, each in the slot file's own blocks; the record-only one keeps the weights and
    optimiser state of the last whole save, checked."""
    optimizer = np.arange(10, dtype=np.float32)
    for k in range(2):
        save_state(tmp_path, state(k).with_optimizer(adamw_state(optimizer + k)))
    real_writev = os.writev

    def full_disk(fd, parts):
        if sum(len(memoryview(part).cast("B")) for part in parts) > os.fstat(fd).st_size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, parts)

    monkeypatch.setattr(durable.os, "writev", full_disk)
    save_state(tmp_path, state(2).with_optimizer(adamw_state(optimizer + 2)))
    assert_is(load_state(tmp_path), 2)
    save_state_keeping_weights(tmp_path, ClientState(task=3, round=3, seen_classes=[0, 1, 2, 3], n_seen=30))
    kept = load_state(tmp_path)
    assert kept.round == 3 and np.array_equal(kept.weights, np.full(5, 2, np.float32))
    assert np.array_equal(kept.optimizer, optimizer + 2)
    with pytest.raises(OSError, match="No space"):  # a larger state needs blocks the disk has not
        save_state(tmp_path, state(4, size=50))
    assert load_state(tmp_path).round == 3


def test_a_damaged_slot_leaves_the_one_before_and_damaged_buffers_are_refused(tmp_path):
    records = [save_state(tmp_path, state(k, size=8)) for k in range(2)]
    damage_end(tmp_path / "state-b.slot")  # the newest (the second save's): its CRC32C fails
    assert_is(load_state(tmp_path), 0)
    with pytest.raises(StateError, match="weights in state-b.slot does not match its crc32c"):
        load_state(tmp_path, saved=records[1])  # read where a save said it was: the buffer's own check
    slot = (tmp_path / "state-a.slot").read_bytes()
    assert b'"round": 0' in slot
    (tmp_path / "state-a.slot").write_bytes(slot.replace(b'"round": 0', b'"round": 7'))  # its CRC32C fails
    with pytest.raises(StateError, match="unreadable.*CRC32C does not match"):
        load_state(tmp_path)
    (tmp_path / "state-a.slot").write_bytes(b"{broken")
    with pytest.raises(StateError, match="unreadable.*not a state slot"):
        load_state(tmp_path)


def test_an_earlier_form_s_files_that_a_crash_left_beside_the_slots_go_with_the_next_start_s_first_save(
        tmp_path, monkeypatch):
    """A crash after the first save in one-file slots wrote its slot and before it removed the earlier form's files:
    the slot is the state, and the first save of the next process removes them."""
    earlier_slot(tmp_path, state(4), sequence=9)

    def crash(directory):
        raise Cut

    monkeypatch.setattr(durable, "_remove_earlier_forms", crash)
    with pytest.raises(Cut):
        save_state(tmp_path, state(5))
    monkeypatch.undo()
    assert set(os.listdir(tmp_path)) == {"state-a.slot", "state-a.rec", "weights.a.f32"}
    assert_is(load_state(tmp_path), 5)
    monkeypatch.setattr(durable, "_last_saves", {})  # a process started again
    save_state(tmp_path, state(6))
    assert set(os.listdir(tmp_path)) == SLOT_FILES
    assert_is(load_state(tmp_path), 6)


def test_an_earlier_slot_whose_buffers_sha256_names_is_read_checked_and_saved_again_with_crc32c(tmp_path):
    """A device's state saved by the earlier slotted form, before its buffers took CRC32C, names their sha256:
    read and checked by it, carried by a record-only save (the earlier files then gone), and the next whole save
    names CRC32C."""
    optimizer = np.arange(10, dtype=np.float32)
    earlier_slot(tmp_path, state(1).with_optimizer(adamw_state(optimizer)), sequence=1, checksum="sha256")
    loaded = load_state(tmp_path)
    assert_is(loaded, 1)
    assert np.array_equal(loaded.optimizer, optimizer)
    (tmp_path / "optimizer.a.f32").write_bytes(np.zeros(10, "<f4").tobytes())  # damaged
    with pytest.raises(StateError, match="optimizer in optimizer.a.f32 does not match its sha256"):
        load_state(tmp_path)
    assert load_state(tmp_path, optimizer=False).round == 1  # the weights' sha256 holds
    (tmp_path / "optimizer.a.f32").write_bytes(optimizer.astype("<f4").tobytes())
    save_state_keeping_weights(tmp_path, ClientState(task=1, round=2, seen_classes=[0, 1], n_seen=10))
    assert set(os.listdir(tmp_path)) == SLOT_FILES
    kept = load_state(tmp_path)  # the record alone: the weights and moments the sha256 record named, still checked
    assert kept.round == 2 and np.array_equal(kept.weights, np.ones(5, np.float32))
    assert np.array_equal(kept.optimizer, optimizer)
    assert b'"weights_sha256"' in (tmp_path / "state-a.slot").read_bytes()
    saved = save_state(tmp_path, state(3))
    assert "weights_crc32c" in saved and "weights_sha256" not in saved
    assert_is(load_state(tmp_path), 3)


def test_a_state_in_earlier_slots_is_read_and_the_first_save_carries_its_sequence_on(tmp_path, monkeypatch):
    """The earlier slotted form's newest record is the state until the first save in one-file slots, which goes on
    from its sequence and removes its files; that save cut short leaves the earlier state."""
    earlier_slot(tmp_path, state(4), sequence=9)
    assert_is(load_state(tmp_path), 4)
    real_writev = os.writev

    def cut(fd, parts):
        real_writev(fd, [b"".join(bytes(part) for part in parts)[:20]])
        raise Cut

    monkeypatch.setattr(durable.os, "writev", cut)
    with pytest.raises(Cut):
        save_state(tmp_path, state(5))
    monkeypatch.undo()
    assert_is(load_state(tmp_path), 4)
    save_state(tmp_path, state(5))
    assert set(os.listdir(tmp_path)) == SLOT_FILES
    assert (tmp_path / "state-a.slot").read_bytes().startswith(durable.SLOT_MAGIC + b"10 ")
    assert_is(load_state(tmp_path), 5)


class Cut(Exception):
    """The process's end in the middle of a write."""


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("done", [0.5, 0.99])  # of the write: within the slot's record, within its last buffer
def test_a_save_cut_short_at_any_write_leaves_the_state_before_it_or_the_new_one_whole(tmp_path, monkeypatch, safe,
                                                                                       done):
    """Saves ended at their k-th write (part of that write done, nothing after it): the first save's two (its slot,
    then the older slot's copy) and a later save's one. What is read back is the last whole state, with its weights
    and optimiser state (nothing, where the first save's own slot was cut: StateError); the save after it is whole
    again."""
    monkeypatch.setattr(durable, "_power_loss_safe", durable.power_loss_safe())  # restored after the test
    durable.set_power_loss_safe(safe)
    monkeypatch.setattr(durable.os, "fsync", lambda fd: None)
    writes, cut_at = 0, 0
    real_writev = os.writev

    def counted_writev(fd, parts):
        nonlocal writes
        writes += 1
        if writes == cut_at:
            data = b"".join(bytes(part) for part in parts)
            real_writev(fd, [data[:int(len(data) * done)]])
            raise Cut
        return real_writev(fd, parts)

    monkeypatch.setattr(durable.os, "writev", counted_writev)
    for cut_at in range(1, 5):  # the saves of states 0, 1, 2 write 2, 1, 1 times
        folder, writes, whole = tmp_path / str(cut_at), 0, None
        for k in range(3):
            try:
                save_state(folder, state(k).with_optimizer(adamw_state(np.arange(10, dtype=np.float32) + 10 * k)))
            except Cut:
                break
            whole = k
        else:
            raise AssertionError("no save was cut")
        if cut_at == 2:  # the first save's copy in its older slot: the save itself was whole
            whole = 0
        if whole is None:  # as a damaged state, which a device refuses to start from rather than start afresh
            with pytest.raises(StateError, match="unreadable.*(cut short|does not match)"):
                load_state(folder)
            continue
        else:
            loaded = load_state(folder)
            assert_is(loaded, whole)
            saved = loaded.optimizer_state(5)
            assert np.array_equal(saved.buffers["m"], np.arange(5) + 10 * whole)
            assert np.array_equal(saved.buffers["v"], np.arange(5, 10) + 10 * whole)
        writes = -100  # no more cuts
        save_state(folder, state(3))
        assert_is(load_state(folder), 3)


def adamw_state(values: np.ndarray) -> OptimizerState:
    """An AdamW state of a 5-parameter model: its two moments, the first and second half of `values`."""
    return OptimizerState(7, {"m": values[:5].copy(), "v": values[5:].copy()})


def test_a_state_saved_by_the_written_once_form_is_read_and_its_files_go_with_the_first_save(tmp_path):
    durable.save_record(tmp_path, state(0))  # state.json and weights-<sha256>.f32
    (tmp_path / "state.json.tmp").write_bytes(b"a crash's leftover")
    assert_is(load_state(tmp_path), 0)
    save_state_keeping_weights(tmp_path, ClientState(task=1, round=1, seen_classes=[0, 1], n_seen=10))
    kept = load_state(tmp_path)  # the record alone saved: the earlier form's weights copied into the slots
    assert (kept.round, kept.seen_classes) == (1, [0, 1]) and np.array_equal(kept.weights, np.zeros(5, np.float32))
    assert set(os.listdir(tmp_path)) == SLOT_FILES
    save_state(tmp_path, state(2))
    assert_is(load_state(tmp_path), 2)
    assert set(os.listdir(tmp_path)) == SLOT_FILES


@pytest.mark.parametrize("safe", [True, False])
def test_a_save_syncs_to_the_disk_only_where_the_process_s_writes_are_to_survive_a_power_cut(tmp_path, monkeypatch,
                                                                                              safe):
    """With power-loss safety (a device's own process) a save fsyncs its files and their folder; without it (a
    simulated fleet's worker) it fsyncs nothing, and still leaves one whole state, the old weights gone."""
    synced: list[int] = []
    monkeypatch.setattr(durable.os, "fsync", synced.append)
    monkeypatch.setattr(durable, "_power_loss_safe", durable.power_loss_safe())  # restored after the test
    durable.set_power_loss_safe(safe)
    for k in range(2):
        save_state(tmp_path, ClientState(task=k, round=k, weights=np.full(5, k, dtype=np.float32)))
    assert (len(synced) > 0) == safe
    loaded = load_state(tmp_path)
    assert loaded.round == 1 and np.array_equal(loaded.weights, np.ones(5, np.float32))
    assert set(os.listdir(tmp_path)) == SLOT_FILES


def test_a_power_loss_safe_save_syncs_each_slot_and_a_new_slot_s_name(tmp_path, monkeypatch):
    """Where writes are to survive a power cut: each slot file's data, then the folder where a save made the file;
    in a steady state the one slot file alone."""
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or
                        real_fsync(fd))
    monkeypatch.setattr(durable, "_power_loss_safe", durable.power_loss_safe())  # restored after the test
    durable.set_power_loss_safe(True)
    folder = str(tmp_path)
    for k in range(3):
        synced.clear()
        save_state(tmp_path, state(k))
        slot = "ab"[k % 2]
        if k == 0:  # the files are new: the first save fills both slots
            assert synced == [f"{folder}/state-a.slot", folder, f"{folder}/state-b.slot", folder]
        else:
            assert synced == [f"{folder}/state-{slot}.slot"]


SAVING_FOREVER = """
import itertools, sys
import numpy as np
from edge_client.state import ClientState, save_state
from edge_client.trainers.base import OptimizerState
from edgefil import durable
durable.set_power_loss_safe(sys.argv[2] == "safe")
for k in itertools.count():
    values = np.full(20000, k, np.float32)
    save_state(sys.argv[1], ClientState(task=k, round=k, weights=values).with_optimizer(
        OptimizerState(k + 1, {"m": -values, "v": values + 0.5})))
    if k == 1:
        print("two saves made", flush=True)
"""


@pytest.mark.parametrize("safe", ["safe", "unsafe"])
def test_a_process_killed_at_any_moment_of_its_saves_leaves_a_whole_state(tmp_path, safe):
    """A real process saving again and again, killed (SIGKILL) at a random moment after its second save, ten times:
    the state read back is one save's whole, its record, weights and optimiser state from the same save."""
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(0)
    for kill in range(10):
        folder = tmp_path / str(kill)
        saver = subprocess.Popen([sys.executable, "-c", SAVING_FOREVER, str(folder), safe], stdout=subprocess.PIPE,
                                 text=True)
        try:
            # two saves whole (both slots in use; the second record's file exists as soon as it is opened, before
            # it is written, so its existence says nothing)
            assert saver.stdout.readline() == "two saves made\n", "the saving process ended"
            time.sleep(rng.uniform(0.0, 0.05))  # any moment: every one must leave a whole state
        finally:
            saver.send_signal(signal.SIGKILL)
            saver.wait()
            saver.stdout.close()
        loaded = load_state(folder)
        k = loaded.round
        assert loaded.task == k >= 1 and np.array_equal(loaded.weights, np.full(20000, k, np.float32))
        optimizer = loaded.optimizer_state(20000)
        assert optimizer.steps == k + 1 and np.array_equal(optimizer.buffers["m"], np.full(20000, -k, np.float32))
        assert np.array_equal(optimizer.buffers["v"], np.full(20000, k + 0.5, np.float32))
