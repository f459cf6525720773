"""The `generator` policy on a real learner: budget M shared by the store and the generator bank, old real data
deleted every task, replay only from trained generators, the drop rule, warm starts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.budget import Budget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import make_policy
from edge_client.policies.generator import BANK_DIR, replay_counts
from edge_client.store import ReplayStore
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_digits_dataset
from models.export import export_registered
from models.generator_export import export_generator_artifacts
from models.generator_record import encode_record
from models.generators import default_spec
from models.manifest import load_manifest

TASKS = [(0, 1), (2, 3), (0, 1), (4, 5)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    export_registered("lenet", 10, root / "artifacts", (1, 8, 8), seed=0, backends=("ort", "torch"))
    export_generator_artifacts(default_spec("vae", (1, 8, 8)), root / "generator-vae", seed=0)
    return root / "artifacts"


@pytest.fixture(scope="module")
def digits():
    return load_digits_dataset()


def make_learner(artifacts, folder, max_bytes, **options):
    torch.set_num_threads(1)
    trainer = TorchTrainer(load_manifest(artifacts), optimizer="adamw", lr=3e-3, seed=0)
    store = ReplayStore(folder / "store", Budget(max_bytes=max_bytes), (1, 8, 8))
    policy = make_policy("generator", **{"init_steps": 30, "transfer_steps": 10, "precision": "float16",
                                         "keep_auxiliary": False, **options})
    learner = Learner(trainer, store, policy, LearnerConfig(epochs=1, batch_size=32), seed=0)
    learner.open_policy(folder, artifacts)
    return learner


def task_data(digits, classes, n=40):
    pick = np.flatnonzero(np.isin(digits.y_train, classes))
    parts = [pick[digits.y_train[pick] == c][:n] for c in classes]
    idx = np.concatenate(parts)
    return digits.x_train[idx], digits.y_train[idx]


def replayed_labels(learner):
    """The labels of the samples the policy would generate this round (its training set over an empty store)."""
    batch = learner.policy.training_set(learner.view(), np.empty((0, 1, 8, 8), np.float32), np.empty(0, np.int64))
    return batch.y


def run_rounds(learner, digits, tasks, bank_bytes, budget):
    """Each round: new data, train (with a teacher, the coordinator's "personal" payload, from the second round),
    generator update; the combined bytes of store and bank are checked after every step."""
    teacher = None
    for t, classes in enumerate(tasks):
        learner.start_task(t, *task_data(digits, classes))
        assert learner.store.bytes_on_disk() + bank_bytes() <= budget
        assert set(learner.store.labels().tolist()) <= set(classes)  # the old real data are gone
        if teacher is not None:
            learner.policy.receive(learner.view(), {"personal": teacher.tobytes()})
        learner.train()
        learner.finish_round()
        assert learner.store.bytes_on_disk() + bank_bytes() <= budget
        teacher = learner.trainer.get_weights()
        yield t, classes


def test_generators_and_the_store_share_the_budget_and_replay_follows_the_scaling_rule(artifacts, digits, tmp_path):
    budget = 512 * 1024
    learner = make_learner(artifacts, tmp_path, budget)
    bank = learner.policy._bank
    for t, classes in run_rounds(learner, digits, TASKS, bank.bytes_on_disk, budget):
        assert set(classes) <= set(bank.classes())  # this task's generators were stored
        metrics = learner.policy.metrics()
        expected = replay_counts(learner.state.label_counts, learner.state.task_counts)
        assert metrics["replayed_samples"] == expected.sum()  # every old class has a generator here
        if t == 2:  # back to {0, 1}: own generators warm-started, none from scratch
            assert metrics["generators_from_own"] == 2
        assert metrics["generators_dropped"] == 0
    assert sorted(bank.classes()) == [0, 1, 2, 3, 4, 5]


def test_a_tight_budget_drops_generators_by_the_rule_and_never_samples_a_missing_one(artifacts, digits, tmp_path):
    probe = make_learner(artifacts, tmp_path / "probe", 1 << 30)  # what one generator takes on disk
    probe.start_task(0, *task_data(digits, (0, 1)))
    probe.finish_round()
    record_bytes = probe.policy._bank.bytes_on_disk() // 2
    budget = 7 * record_bytes + 4096  # half of it (the bank's share) holds three generators, not four
    learner = make_learner(artifacts, tmp_path / "tight", max(budget, 320 * 1024), bank_share=budget / max(
        budget, 320 * 1024) / 2)
    bank = learner.policy._bank
    dropped = 0
    for _, classes in run_rounds(learner, digits, [(0, 1), (2, 3), (4, 5), (6, 7)], bank.bytes_on_disk,
                                 learner.budget.max_bytes):
        dropped += learner.policy.metrics()["generators_dropped"]
        assert set(classes) <= set(bank.classes())  # the current task's generators go in, older ones make room
        assert bank.bytes_on_disk() <= learner.policy.bank_share * learner.budget.max_bytes
        assert set(np.unique(replayed_labels(learner)).tolist()) <= set(bank.classes()) - set(classes)
    kept = bank.classes()
    assert 2 <= len(kept) <= 3 and dropped == 0
    assert kept == list(range(8 - len(kept), 8))  # evicted: fewest samples seen first (all equal), lowest label first


def test_a_class_without_a_generator_is_never_sampled(artifacts, digits, tmp_path):
    learner = make_learner(artifacts, tmp_path, 1 << 30)
    bank = learner.policy._bank
    for _ in run_rounds(learner, digits, [(0, 1), (2, 3)], bank.bytes_on_disk, 1 << 30):
        pass
    bank.delete(0)  # e.g. dropped for room
    learner.start_task(2, *task_data(digits, (4, 5)))
    replay = replayed_labels(learner)
    assert 0 not in replay and set(np.unique(replay).tolist()) == {1, 2, 3}


def test_offered_generators_warm_start_a_new_class(artifacts, digits, tmp_path):
    donor = make_learner(artifacts, tmp_path / "donor", 1 << 30)
    for _ in run_rounds(donor, digits, [(4, 5)], donor.policy._bank.bytes_on_disk, 1 << 30):
        pass
    learner = make_learner(artifacts, tmp_path / "taker", 1 << 30)
    learner.start_task(0, *task_data(digits, (4, 5)))
    assert learner.policy.requests(learner.view(), {"generator_classes": [4, 5, 7]}) == ["generator/4", "generator/5"]
    learner.train()
    learner.policy.receive(learner.view(), {"generator/4": encode_record(donor.policy._bank.get(4))})
    learner.finish_round()
    metrics = learner.policy.metrics()
    assert metrics["generators_from_coordinator"] == 1 and metrics["generators_from_own"] == 0
    assert learner.policy._bank.get(4).steps == donor.policy._bank.get(4).steps + 10  # transfer steps on top


def test_the_bank_lives_in_the_state_folder_and_survives_a_restart(artifacts, digits, tmp_path):
    learner = make_learner(artifacts, tmp_path, 1 << 30)
    for _ in run_rounds(learner, digits, [(0, 1)], learner.policy._bank.bytes_on_disk, 1 << 30):
        pass
    learner.save(tmp_path)
    learner.store.close()
    again = make_learner(artifacts, tmp_path, 1 << 30)
    assert again.restore(tmp_path) and again.state.label_counts[:2] == [40, 40]
    assert (tmp_path / BANK_DIR).is_dir() and again.policy._bank.classes() == [0, 1]


def test_an_ort_device_trains_its_vae_generators_with_ort(artifacts, digits, tmp_path):
    """The default device path: the task model (alignment term included) and the VAE generators on ONNX Runtime."""
    from edge_client.generators.ort_training import OrtVaeTrainer
    from edge_client.trainers.ort import OrtTrainer

    store = ReplayStore(tmp_path / "store", Budget(max_bytes=512 * 1024), (1, 8, 8))
    policy = make_policy("generator", lambda_align=1.0, init_steps=30, transfer_steps=10, keep_auxiliary=False)
    learner = Learner(OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), store, policy, seed=0)
    learner.open_policy(tmp_path, artifacts)
    assert isinstance(policy._trainer, OrtVaeTrainer)
    for _ in run_rounds(learner, digits, [(0, 1), (2, 3)], policy._bank.bytes_on_disk, 512 * 1024):
        pass
    assert policy._bank.classes() == [0, 1, 2, 3] and policy.metrics()["replayed_samples"] == 80


def test_the_command_line_exports_generator_artifacts(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from models.generator_artifacts import load_generator_artifacts

    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "export", "--generator", "vae", "--input-shape",
                           "1,40", "--out", str(tmp_path / "g")], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert load_generator_artifacts(tmp_path / "g").spec == default_spec("vae", (1, 40)).to_dict()
