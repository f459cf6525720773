"""The budget M has one owner: whatever a device keeps — the replay store, a method's own files — never adds up
to more than M, in samples or in bytes, across a randomized sequence of task switches, chunks, training rounds
and restarts, for every method."""
from __future__ import annotations

import numpy as np
import pytest

from edge_client.budget import Budget, BudgetedFile, DeviceBudget, file_bytes, replace_peak, replacement_peak
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import POLICIES, make_policy, policy_names
from edge_client.store import ReplayStore
from edge_client.stream import Chunk
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.manifest import load_manifest

OPTIONS = {"refed": {"pim_epochs": 1, "importance": "last-layer"},
           "generator": {"init_steps": 3, "transfer_steps": 2, "precision": "int8", "keep_auxiliary": False},
           # width 8: at the default 16 the authors' two generators' replacement (180 KB) exceeds half of 300 KiB
           "fedcil": {"gan_steps": 3, "width": 8}}
TORCH_ONLY = ("dann",)  # trains a second model on the features: the torch backend only


def _sdd_replay(rng: np.random.Generator) -> dict[str, bytes]:
    """A synthetic replay set as SDD's coordinator broadcasts it, of a random size (up to ~80 KB)."""
    from models.sdd import REPLAY, encode_replay

    n = int(rng.integers(10, 600))
    return {REPLAY: encode_replay(rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n))}


PAYLOADS = {"sdd": _sdd_replay}  # what a method's coordinator sends, for a "receive" step
BUILT_IN = [name for name in policy_names() if POLICIES.get(name).__module__.startswith("edge_client.")]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, export_artifacts):
    # with the portable graphs: GLFC's perturbation runs the input gradient, which the ort backend takes from them
    lenet = export_artifacts("lenet", 10, (1, 8, 8), backends=("ort", "torch", "portable"))
    for name in BUILT_IN:  # what each method's devices open besides the model (a generator, an encoding network)
        POLICIES.get(name).export_artifacts(OPTIONS.get(name, {}), lenet)
    return lenet


def _open(artifacts, folder, max_samples, max_bytes, policy, new_share=None):
    budget = DeviceBudget(Budget(max_samples, max_bytes))
    store = ReplayStore.within(budget, folder / "store", (1, 8, 8))
    trainer = (TorchTrainer(load_manifest(artifacts), optimizer="sgd", lr=0.05) if policy in TORCH_ONLY
               else OrtTrainer(artifacts, optimizer="sgd", lr=0.05))
    learner = Learner(trainer, store, make_policy(policy, **OPTIONS.get(policy, {})),
                      LearnerConfig(epochs=1, batch_size=16, new_share=new_share), seed=1)
    assert learner.budget is budget
    learner.open_policy(folder, artifacts)
    return learner, budget



def _splits(policy: str) -> list:
    """Every split of M a policy takes (`new_share`): a policy that admits the stream itself takes only its own."""
    streams = POLICIES.get(policy).admit is not POLICIES.get("random").admit
    return [None, "stream"] if streams else [None, "stream", 0.3]


@pytest.mark.parametrize(("policy", "new_share"), [(p, s) for p in BUILT_IN for s in _splits(p)])
def test_everything_a_device_keeps_stays_within_m(artifacts, tmp_path, policy, new_share):
    rng = np.random.default_rng(sum(map(ord, policy)) + len(str(new_share)))
    max_samples, max_bytes = 60, 300 * 1024
    learner, budget = _open(artifacts, tmp_path, max_samples, max_bytes, policy, new_share)
    task, classes = 0, [0, 1]
    for step in range(14):
        action = rng.choice(["switch", "chunk", "train", "restart", "receive"], p=[0.25, 0.25, 0.25, 0.1, 0.15])
        if action == "switch":
            task += 1
            classes = rng.choice(10, size=2, replace=False).tolist()
        if action in ("switch", "chunk"):
            n = int(rng.integers(5, 50))
            y = rng.choice(classes, n)
            x = (y[:, None, None, None] / 10 + 0.1 * rng.standard_normal((n, 1, 8, 8))).astype(np.float32)
            learner.observe(Chunk(x, y, task))
        elif action == "train" and len(learner.store):
            learner.global_model_arrived(learner.trainer.get_weights())
            learner.train()
            learner.finish_round()
        elif action == "receive" and policy in PAYLOADS:
            learner.policy.receive(learner.view(), PAYLOADS[policy](rng))
        elif action == "restart":
            learner.save(tmp_path)
            learner.store.close()
            learner, budget = _open(artifacts, tmp_path, max_samples, max_bytes, policy, new_share)
            assert learner.restore(tmp_path)
        held = budget.held()
        assert sum(held.values()) <= max_bytes, (step, action, held)
        assert len(learner.store) <= max_samples
    learner.store.close()


def test_a_holder_gets_what_the_others_leave():
    sizes = {"store": 1000, "bank": 300}
    budget = DeviceBudget(Budget(10, 2000))
    for name in sizes:
        budget.register(name, lambda name=name: sizes[name])
    assert budget.room("store") == 1700 and budget.room("bank") == 1000 and budget.used() == 1300
    share = budget.share("store")
    sizes["bank"] = 1900
    assert share.max_bytes == 100 and share.max_samples == 10  # looked up live
    sizes["bank"] = 2500
    assert share.max_bytes == 0  # never negative
    with pytest.raises(ValueError, match="registered"):
        budget.register("bank", lambda: 0)
    assert DeviceBudget(Budget(5)).room("store") is None


def test_the_headroom_a_holder_needs_to_shrink_is_left_to_it():
    budget = DeviceBudget(Budget(None, 2000))
    budget.register("store", lambda: 1000, headroom=lambda: 300)
    budget.register("bank", lambda: 200)
    assert budget.room("bank") == 2000 - 1000 - 300  # the others may not take the store's headroom
    assert budget.room("store") == 2000 - 200  # the store keeps its own headroom within its room
    assert budget.used() == 1200  # headroom is not held


def test_a_methods_file_never_takes_the_journal_a_store_needs_to_cut_its_cache(tmp_path):
    """The store journals before a delete frees anything. A method's file written as large as M allows, beside a
    full store, must leave that journal's room: a cache cut (keep_only) then goes through and M holds throughout.
    (Without the headroom, pFedGRP's generators, GLFC's and iCaRL's old models took it at tight budgets and every
    task switch after refused the cut, locking the device out of its rounds.)"""
    max_bytes = 400 * 1024
    budget = DeviceBudget(Budget(None, max_bytes))
    store = ReplayStore.within(budget, tmp_path / "store", (1, 8, 8))
    rng = np.random.default_rng(0)
    n = store.room_for(10_000)
    store.insert(rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, n), task=0)
    old_model = BudgetedFile(budget, "old-model", tmp_path / "old-model" / "model.bin")
    size = old_model.room() or 0
    while size > 0 and not old_model.write(b"w" * size):
        size -= 1024
    assert size > 0 and budget.used() <= max_bytes
    assert budget.used() + store.delete_headroom() <= max_bytes
    ids = store.ids()
    store.keep_only(ids[: len(ids) // 10])
    assert len(store) == len(ids) // 10 and budget.used() <= max_bytes
    store.close()


def test_one_file_size_rule():
    assert file_bytes(0, 4096) == 0
    assert file_bytes(1, 4096, fresh=True) == 4096  # a small fresh file is mapped from its inode
    assert file_bytes(1, 4096) == (1 + 1 + 2) * 4096  # growth: a mapping block, and 2 for a split and a level
    assert file_bytes(5 * 4096, 4096, fresh=True) == (5 + 1 + 2) * 4096


def test_what_m_counts_of_a_file_does_not_depend_on_how_the_disk_placed_it(tmp_path):
    """Two files of the same 32 blocks, one written in one piece, one a block at a time interleaved with another
    file's blocks, each synced (so the file system places them apart: on ext4, 17 extents and an index block). What
    M counts of them is the same, and at least what either occupies: a byte-budgeted run does not depend on the
    disk's placement (it did: one seed's fleet kept 64 samples on a device in one run and 65 in the next)."""
    import os

    from edge_client.budget import charged_bytes

    block = os.statvfs(tmp_path).f_frsize
    whole = tmp_path / "whole"
    whole.write_bytes(b"x" * 32 * block)
    pieces, other = (os.open(tmp_path / name, os.O_RDWR | os.O_CREAT) for name in ("pieces", "other"))
    try:
        for k in range(32):
            for fd in (pieces, other):
                os.pwrite(fd, b"y" * block, k * block)
                os.fsync(fd)
    finally:
        os.close(pieces)
        os.close(other)
    placed = {name: os.stat(tmp_path / name) for name in ("whole", "pieces")}
    assert placed["whole"].st_size == placed["pieces"].st_size
    charged = {name: charged_bytes(entry, block) for name, entry in placed.items()}
    assert charged["whole"] == charged["pieces"] == file_bytes(32 * block, block, fresh=True)
    assert all(charged[name] >= entry.st_blocks * 512 for name, entry in placed.items())


def test_the_replacement_peak_known_before_any_file_bounds_the_real_one(tmp_path):
    """What a holder checks at open (`replacement_peak`) is at least what replacing its one file really peaks at."""
    import os

    block = os.statvfs(tmp_path).f_frsize
    for size in (100, 5 * block, 40 * block + 7):
        folder = tmp_path / str(size)
        folder.mkdir()
        (folder / "file").write_bytes(b"x" * size)
        assert replace_peak(folder, size, block) <= replacement_peak(size, block)


def test_budgeted_files_stay_within_m_and_keep_their_last_whole_file(tmp_path):
    """Three methods' files (an old model, an encoding network, a generator) and a holder standing for the store,
    written at random sizes: M's bytes are never exceeded, a write that does not fit returns False and leaves the
    previous file as it was, a file never takes more than its share, and a file too large for its share is known
    before it is written."""
    rng = np.random.default_rng(7)
    max_bytes = 64 * 1024
    budget = DeviceBudget(Budget(None, max_bytes))
    store = {"bytes": 0}
    budget.register("store", lambda: store["bytes"])
    files = {name: BudgetedFile(budget, name, tmp_path / name / "file.bin", share=share)
             for name, share in (("old-model", 0.5), ("gamma", 0.25), ("generator", 1.0))}
    refused = 0
    for _ in range(300):
        if rng.random() < 0.2:
            room = budget.room("store") or 0
            store["bytes"] = int(rng.integers(0, room + 1))
            continue
        name = rng.choice(list(files))
        held = files[name]
        data = rng.bytes(int(rng.integers(1, 40 * 1024)))
        before = held.read()
        if held.write(data):
            assert held.read() == data
        else:
            refused += 1
            assert held.read() == before
        assert budget.used() <= max_bytes, budget.held()
        assert held.bytes_on_disk() <= held.limit
        if rng.random() < 0.05:
            had = held.exists()
            assert held.remove() == had and not held.exists()
    assert refused > 0  # the sequence did press against M
    assert not files["gamma"].can_ever_hold(16 * 1024) and files["old-model"].can_ever_hold(4 * 1024)
    with pytest.raises(ValueError, match="share"):
        BudgetedFile(budget, "other", tmp_path / "other" / "f", share=0.0)
    with pytest.raises(ValueError, match="registered"):
        BudgetedFile(budget, "gamma", tmp_path / "again" / "f")


def test_a_budgeted_file_clears_an_interrupted_write_at_open(tmp_path):
    folder = tmp_path / "held"
    folder.mkdir()
    (folder / "file.bin.tmp").write_bytes(b"half")
    held = BudgetedFile(DeviceBudget(Budget(None, 1 << 20)), "held", folder / "file.bin")
    assert not (folder / "file.bin.tmp").exists() and held.read() is None and not held.remove()
