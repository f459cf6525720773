import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_client.state import ClientState, StateError, load_state, save_state, save_state_keeping_weights
from edge_client.trainers.base import OptimizerState
from edgefil import durable

ROOT = Path(__file__).resolve().parents[1]
SLOT_FILES = {"state-a.rec", "state-b.rec", "weights.a.f32", "weights.b.f32"}


def state(k: int, size: int = 5) -> ClientState:
    return ClientState(task=k, round=k, seen_classes=list(range(k + 1)), n_seen=10 * k,
                       weights=np.full(size, k, dtype=np.float32))


def assert_is(loaded: ClientState, k: int) -> None:
    assert (loaded.task, loaded.round, loaded.seen_classes, loaded.n_seen) == (k, k, list(range(k + 1)), 10 * k)
    assert np.array_equal(loaded.weights, np.full(len(loaded.weights), k, np.float32))
    assert loaded.weights.dtype == np.float32


def test_state_round_trips_and_saves_again_in_the_same_two_slots(tmp_path):
    assert load_state(tmp_path) is None
    save_state(tmp_path, state(0))
    assert_is(load_state(tmp_path), 0)
    assert set(os.listdir(tmp_path)) == SLOT_FILES  # the first save fills both slots
    files = {name: os.stat(tmp_path / name).st_ino for name in SLOT_FILES}
    for k in range(1, 5):  # from the second save on every file is written in place, none created, renamed or removed
        save_state(tmp_path, state(k))
        assert_is(load_state(tmp_path), k)
    assert {name: os.stat(tmp_path / name).st_ino for name in os.listdir(tmp_path)} == files


def test_the_first_save_s_state_is_whole_in_either_slot(tmp_path):
    """The older slot the first save fills holds the same state, under its own files: a damaged newer slot leaves
    it, and the next save goes into the damaged one."""
    save_state(tmp_path, state(0, size=8))
    assert b'"weights_file": "weights.b.f32"' in (tmp_path / "state-b.rec").read_bytes()
    (tmp_path / "weights.a.f32").write_bytes(b"\x01" * 32)
    with pytest.raises(StateError, match="weights.a.f32 .* does not match its crc32c"):
        load_state(tmp_path)
    (tmp_path / "state-a.rec").write_bytes(b"torn")
    assert_is(load_state(tmp_path), 0)
    save_state(tmp_path, state(1, size=8))
    assert (tmp_path / "state-a.rec").read_bytes().startswith(durable.RECORD_MAGIC + b"1 ")
    assert_is(load_state(tmp_path), 1)


def test_a_save_after_this_process_s_own_save_there_reads_no_record(tmp_path, monkeypatch):
    """The process's last save in a folder names the newest slot: the next save there neither reads nor checks the
    records again."""
    save_state(tmp_path, state(0))

    def unread(directory):
        raise AssertionError(f"{directory}'s records read again")

    monkeypatch.setattr(durable, "_newest_slot", unread)
    for k in range(1, 4):
        save_state(tmp_path, state(k))
    monkeypatch.undo()
    assert_is(load_state(tmp_path), 3)
    (tmp_path / "state-b.rec").write_bytes(b"torn")  # the newest (the fourth save's): the third's is whole
    assert_is(load_state(tmp_path), 2)


def test_a_save_after_another_hand_changed_the_records_reads_them_again(tmp_path):
    """Records another process wrote since this one's last save (newer ones, as another save makes, put in place by
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
    (ours / "state-a.rec").write_bytes(b"torn")  # this save's record: theirs, the newest before it, stays
    assert_is(load_state(ours), 6)


def test_a_save_after_another_process_saved_in_place_reads_the_records_again(tmp_path):
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
    (tmp_path / "state-b.rec").write_bytes(b"torn")  # this save's record: theirs, the newest before it, stays
    assert_is(load_state(tmp_path), 5)


@pytest.mark.parametrize("full_from", [3, 4])  # the older slot's weights, or its record
def test_a_first_save_whose_older_slot_finds_the_disk_full_is_whole_without_it(tmp_path, monkeypatch, full_from):
    """The first save's copy in the older slot is a bonus: where the disk has no room for it (ENOSPC), the save is
    whole without it, the files it made removed; the next save makes the slot as before."""
    writes, full = 0, True
    real_write = os.write

    def write(fd, data):
        nonlocal writes
        writes += 1
        if full and writes >= full_from:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(durable.os, "write", write)
    save_state(tmp_path, state(0))  # writes: the weights, the record; then the older slot's weights and record
    assert_is(load_state(tmp_path), 0)
    assert set(os.listdir(tmp_path)) == {"state-a.rec", "weights.a.f32"}
    full = False
    save_state(tmp_path, state(1))
    assert_is(load_state(tmp_path), 1)
    assert set(os.listdir(tmp_path)) == SLOT_FILES


def test_damaged_weights_are_refused_and_a_damaged_record_leaves_the_one_before(tmp_path):
    for k in range(2):
        save_state(tmp_path, state(k, size=8))
    (tmp_path / "weights.b.f32").write_bytes(b"\x00" * 31)  # the newest record's (the second save's slot)
    with pytest.raises(StateError, match="weights.b.f32 .* does not match its crc32c"):
        load_state(tmp_path)
    (tmp_path / "weights.b.f32").write_bytes(np.full(8, 1, "<f4").tobytes())
    assert_is(load_state(tmp_path), 1)
    record = (tmp_path / "state-b.rec").read_bytes()
    assert b'"round": 1' in record
    (tmp_path / "state-b.rec").write_bytes(record.replace(b'"round": 1', b'"round": 7'))  # its checksum fails
    assert_is(load_state(tmp_path), 0)
    (tmp_path / "state-a.rec").write_bytes(b"{broken")
    with pytest.raises(StateError, match="unreadable"):
        load_state(tmp_path)


def test_a_slotted_state_whose_buffers_sha256_names_is_read_checked_and_saved_again_with_crc32c(tmp_path):
    """A device's state saved before its buffers took CRC32C names their sha256: read and checked by it, kept by a
    record-only save, and the next whole save names CRC32C."""
    optimizer = np.arange(10, dtype=np.float32)
    record = save_state(tmp_path, state(1).with_optimizer(adamw_state(optimizer)))
    for name in ("weights", "optimizer"):  # the record as the save before CRC32C wrote it
        blob = (tmp_path / record[f"{name}_file"]).read_bytes()
        del record[f"{name}_crc32c"]
        record[f"{name}_sha256"] = hashlib.sha256(blob).hexdigest()
    payload = json.dumps(record).encode()
    (tmp_path / "state-a.rec").write_bytes(
        durable.RECORD_MAGIC + f"1 {hashlib.sha256(payload).hexdigest()}\n".encode() + payload)
    loaded = load_state(tmp_path)
    assert_is(loaded, 1)
    assert np.array_equal(loaded.optimizer, optimizer)
    save_state_keeping_weights(tmp_path, ClientState(task=1, round=2, seen_classes=[0, 1], n_seen=10))
    kept = load_state(tmp_path)  # the record alone: the weights and moments the sha256 record named, still checked
    assert kept.round == 2 and np.array_equal(kept.weights, np.ones(5, np.float32))
    assert np.array_equal(kept.optimizer, optimizer)
    (tmp_path / "optimizer.a.f32").write_bytes(np.zeros(10, "<f4").tobytes())  # damaged
    with pytest.raises(StateError, match="optimizer.a.f32 .* does not match its sha256"):
        load_state(tmp_path)
    assert load_state(tmp_path, optimizer=False).round == 2  # the weights' sha256 holds
    saved = save_state(tmp_path, state(3))
    assert "weights_crc32c" in saved and "weights_sha256" not in saved
    assert_is(load_state(tmp_path), 3)


class Cut(Exception):
    """The process's end in the middle of a write."""


@pytest.mark.parametrize("safe", [True, False])
def test_a_save_cut_short_at_any_write_leaves_the_state_before_it_or_the_new_one_whole(tmp_path, monkeypatch, safe):
    """A save ended at its k-th write (half of that write done, nothing after it) leaves the last whole state, with
    its weights and optimiser state; the save after it is whole again."""
    monkeypatch.setattr(durable, "_power_loss_safe", durable.power_loss_safe())  # restored after the test
    durable.set_power_loss_safe(safe)
    monkeypatch.setattr(durable.os, "fsync", lambda fd: None)
    optimizer = None
    writes, cut_at = 0, 0
    real_write = os.write

    def counted_write(fd, data):
        nonlocal writes
        writes += 1
        if writes == cut_at:
            real_write(fd, bytes(data)[:len(data) // 2])
            raise Cut
        return real_write(fd, data)

    monkeypatch.setattr(durable.os, "write", counted_write)
    for cut_at in range(1, 4):  # a save writes the weights, the optimiser state and the record: 3 writes
        folder, writes = tmp_path / str(cut_at), -100  # no cut in the saves before
        for k in range(2):
            optimizer = np.arange(10, dtype=np.float32) + 10 * k
            save_state(folder, state(k).with_optimizer(adamw_state(optimizer)))
        writes = 0
        with pytest.raises(Cut):
            save_state(folder, state(2).with_optimizer(adamw_state(np.full(10, 99, np.float32))))
        loaded = load_state(folder)
        assert_is(loaded, 1)
        saved = loaded.optimizer_state(5)
        assert np.array_equal(saved.buffers["m"], optimizer[:5]) and np.array_equal(saved.buffers["v"], optimizer[5:])
        writes = -100  # no more cuts
        save_state(folder, state(3))
        assert_is(load_state(folder), 3)


def adamw_state(values: np.ndarray) -> OptimizerState:
    """An AdamW state of a 5-parameter model: its two moments, the first and second half of `values`."""
    return OptimizerState(7, {"m": values[:5].copy(), "v": values[5:].copy()})


def test_a_state_saved_by_the_earlier_form_is_read_and_its_files_go_with_the_first_whole_save(tmp_path):
    durable.save_record(tmp_path, state(0))  # state.json and weights-<sha256>.f32
    (tmp_path / "state.json.tmp").write_bytes(b"a crash's leftover")
    assert_is(load_state(tmp_path), 0)
    save_state_keeping_weights(tmp_path, ClientState(task=1, round=1, seen_classes=[0, 1], n_seen=10))
    kept = load_state(tmp_path)  # the record alone saved: the earlier form's weights stay, named by it
    assert (kept.round, kept.seen_classes) == (1, [0, 1]) and np.array_equal(kept.weights, np.zeros(5, np.float32))
    assert any(name.startswith("weights-") for name in os.listdir(tmp_path))
    save_state(tmp_path, state(2))
    assert_is(load_state(tmp_path), 2)
    assert set(os.listdir(tmp_path)) == {"state-a.rec", "state-b.rec", "weights.a.f32"}


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


def test_a_power_loss_safe_save_syncs_each_new_file_s_name_before_a_record_names_it(tmp_path, monkeypatch):
    """Where writes are to survive a power cut: each file's data, then the folder where a save made a file, before
    the record that names it is written; in a steady state the three files alone, the record last."""
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
            assert synced == [f"{folder}/weights.a.f32", folder, f"{folder}/state-a.rec", folder,
                              f"{folder}/weights.b.f32", f"{folder}/state-b.rec", folder]
        else:
            assert synced == [f"{folder}/weights.{slot}.f32", f"{folder}/state-{slot}.rec"]


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
