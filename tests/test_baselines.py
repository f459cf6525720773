"""The baselines of Re-Fed's Table 1 as named methods: Shared (a head per task on a shared trunk), DANN+FL
(domain-adversarial local training) and FedCIL (a per-client ACGAN's replay within the byte budget) do what they
name, and each runs through a real broker round."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from thread_fleet import run_federation

from coordinator.broker import mosquitto_path
from edge_client.budget import Budget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import PolicyContext, TrainingSet, make_policy
from edge_client.policies.dann import reverse_gradient
from edge_client.store import ReplayStore
from edge_client.trainers.base import LossInputs, Proximal
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from models.manifest import load_manifest

needs_broker = pytest.mark.skipif(mosquitto_path() is None,
                                  reason="mosquitto is not installed (scripts/test installs it)")


def _classes(classes, n, offset=0):
    data = load_dataset("digits")
    pick = np.flatnonzero(np.isin(data.y_train, classes))[offset : offset + n]
    return data.x_train[pick], data.y_train[pick]


def _learner(tmp_path, trainer, policy, max_bytes=None, group_by=None, **options):
    folder = tmp_path / f"device-{len(list(tmp_path.iterdir()))}"
    store = ReplayStore(folder / "store", Budget(200, max_bytes), sample_shape=(1, 8, 8))
    learner = Learner(trainer, store, make_policy(policy, **options), LearnerConfig(batch_size=16, group_by=group_by),
                      seed=3)
    learner.open_policy(folder, tmp_path)
    return learner


def _head_row(trainer, weights, c):
    """Class c's row of the head (weight row and bias) in a flat weight buffer."""
    offset, rows = 0, {}
    for p in trainer.manifest.parameters:
        rows[p.name] = weights[offset : offset + p.size].reshape(p.shape)
        offset += p.size
    return np.concatenate([rows["head.weight"][c], rows["head.bias"][c : c + 1]])


def test_shared_trains_each_sample_against_its_own_tasks_classes_only(tmp_path, export_artifacts):
    """Task 1 holds one class, so its head's softmax is certain and gives no gradient, and task 0's head never sees
    class 2: class 2's row of the head stays exactly as it was. The plain loss (FedAvg) moves it."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    rows = {}
    for policy in ("shared", "random"):
        learner = _learner(tmp_path, OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), policy)
        learner.start_task(0, *_classes([0, 1], 60))
        learner.start_task(1, *_classes([2], 30))
        before = _head_row(learner.trainer, learner.trainer.get_weights(), 2)
        learner.train(epochs=2)
        after = learner.trainer.get_weights()
        rows[policy] = np.abs(_head_row(learner.trainer, after, 2) - before).max()
    assert rows["shared"] == 0.0
    assert rows["random"] > 1e-4


def test_the_gradient_reversal_layer_passes_values_and_reverses_gradients():
    features = torch.randn(5, 7, requires_grad=True)
    weights = torch.randn(7)
    reversed_ = reverse_gradient(features, 0.3)
    assert torch.equal(reversed_, features)
    (grad,) = torch.autograd.grad((reversed_ @ weights).sum(), features)
    assert torch.allclose(grad, -0.3 * weights.expand(5, 7))


def test_dann_with_lambda_zero_is_fedavgs_local_training_and_with_lambda_it_trains_an_adversary(
        tmp_path, export_artifacts):
    manifest = load_manifest(export_artifacts("lenet", 10, (1, 8, 8)))
    finals, discriminators = {}, {}
    for name, policy, options in (("plain", "random", {}), ("dann-0", "dann", {"domain_weight": 0.0}),
                                  ("dann", "dann", {"domain_weight": 0.5})):
        learner = _learner(tmp_path, TorchTrainer(manifest, optimizer="adamw", lr=3e-3), policy, **options)
        learner.start_task(0, *_classes([0, 1], 60))
        learner.train(epochs=1)
        learner.start_task(1, *_classes([2, 3], 60))
        if policy == "dann":
            discriminators[name] = [p.detach().clone() for p in learner.policy._discriminator.parameters()]
        learner.train(epochs=3)
        finals[name] = learner.trainer.get_weights()
        if policy == "dann":
            moved = [not torch.equal(a, b) for a, b in
                     zip(discriminators[name], learner.policy._discriminator.parameters(), strict=True)]
            assert all(moved) == (options["domain_weight"] > 0) and any(moved) == all(moved)
            assert ("domain_loss" in learner.policy.metrics()) == (options["domain_weight"] > 0)
    assert np.array_equal(finals["plain"], finals["dann-0"])
    assert not np.array_equal(finals["plain"], finals["dann"])
    assert np.isfinite(finals["dann"]).all()


@pytest.mark.parametrize("bad, message", [
    ("labels", "labels must lie in \\[0, 10\\)"),
    ("mu", "proximal mu must be finite and >= 0, got -1.0"),
    ("weights", "loss input sample_weights contains NaN or Inf values"),
])
def test_dann_refuses_what_the_trainers_fit_refuses(tmp_path, export_artifacts, bad, message):
    """DANN steps in a loop of its own, from the same checked inputs as the trainer's fit: each bad input is
    refused by both, in the same line, before any step changes the model."""
    manifest = load_manifest(export_artifacts("lenet", 10, (1, 8, 8)))
    for policy in ("random", "dann"):
        learner = _learner(tmp_path, TorchTrainer(manifest, optimizer="adamw", lr=3e-3), policy)
        learner.start_task(0, *_classes([0, 1], 30))
        x, y = learner.store.get(learner.store.ids())
        weights = np.ones(len(y), dtype=np.float32)
        proximal = Proximal(-1.0 if bad == "mu" else 0.1, learner.trainer.get_weights())
        if bad == "labels":
            y = np.where(np.arange(len(y)) == 0, 10, y)
        if bad == "weights":
            weights[0] = np.nan
        before = learner.trainer.get_weights()
        with pytest.raises(ValueError, match=message):
            learner.policy.fit(learner.view(), TrainingSet(x, y, LossInputs(sample_weights=weights)), 1, proximal)
        assert np.array_equal(learner.trainer.get_weights(), before)


def test_dann_refuses_a_backend_without_a_second_model_on_the_features(tmp_path, export_artifacts):
    trainer = OrtTrainer(export_artifacts("lenet", 10, (1, 8, 8)), optimizer="adamw", lr=3e-3)
    with pytest.raises(ValueError, match='needs \\[trainer\\] backend = "torch"; this device trains with \'ort\''):
        _learner(tmp_path, trainer, "dann")


def test_fedcil_replays_its_acgans_earlier_classes_and_keeps_no_raw_old_sample(tmp_path, export_artifacts):
    learner = _learner(tmp_path, OrtTrainer(export_artifacts("lenet", 10, (1, 8, 8)), optimizer="adamw", lr=3e-3),
                       "fedcil", gan_steps=20)
    learner.start_task(0, *_classes([0, 1], 60))
    learner.train(epochs=1)
    learner.finish_round()
    assert learner.policy.metrics()["acgan_dropped"] == 0 and learner.policy.metrics()["acgan_bytes"] > 0
    learner.start_task(1, *_classes([2, 3], 40))
    assert set(learner.store.tasks().tolist()) == {1}  # the raw samples of task 0 are gone
    x, y = learner.store.get(learner.store.ids())
    batch = learner.policy.training_set(learner.view(), x, y)
    replayed = batch.y[len(y):]
    assert sorted(np.unique(replayed).tolist()) == [0, 1] and (np.bincount(replayed) == 20).all()
    assert batch.x.shape == (80, 1, 8, 8) and np.isfinite(batch.x).all()
    assert learner.policy.metrics()["replayed_samples"] == 40
    learner.trainer.fit(batch.x, batch.y, epochs=1)
    learner.finish_round()  # the ACGAN learns classes 2 and 3 and keeps 0 and 1 through its own replay
    assert learner.policy._load().classes == {0, 1, 2, 3}


def test_fedcil_replays_from_the_generator_frozen_when_the_task_began(tmp_path, export_artifacts):
    """Under `replay_from = "task"` (the authors' `last_generator`) the earlier classes come, for the whole task, from
    the generator as the device ended its previous task, while the trained generator moves every round; under
    `"round"` they come from the generator stored at the round's start and no second generator is kept."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    stored = {}
    for replay_from in ("task", "round"):
        learner = _learner(tmp_path, OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), "fedcil", gan_steps=5,
                           replay_from=replay_from)
        learner.start_task(0, *_classes([0, 1], 60))
        learner.finish_round()
        end_of_task_0 = learner.policy._load()
        assert end_of_task_0.replay is None  # nothing earlier to replay in the first task
        learner.start_task(1, *_classes([2, 3], 40))
        rounds = []
        for _ in range(2):
            x, y = learner.store.get(learner.store.ids())
            replay_source = learner.policy._replay(learner.view(), learner.policy._load())
            learner.policy.training_set(learner.view(), x, y)
            learner.finish_round()
            rounds.append((replay_source, learner.policy._load()))
        stored[replay_from] = rounds
        (first_source, after_first), (second_source, after_second) = rounds
        assert not np.array_equal(after_first.generator, after_second.generator)  # the trained generator moves
        if replay_from == "task":
            for source, after in rounds:
                assert np.array_equal(source[0], end_of_task_0.generator) and source[1] == {0, 1}
                assert np.array_equal(after.replay, end_of_task_0.generator) and after.replay_task == 1
                assert after.replay_classes == {0, 1} and after.classes == {0, 1, 2, 3}
        else:
            assert np.array_equal(first_source[0], end_of_task_0.generator)
            assert np.array_equal(second_source[0], after_first.generator) and second_source[1] == {0, 1, 2, 3}
            assert after_second.replay is None
    assert learner.policy._held().bytes_on_disk() > 0


def test_fedcil_counts_its_frozen_generator_in_the_share_of_the_bytes(tmp_path, export_artifacts):
    """The replay generator frozen for the task is stored in M's bytes: at a share the one-generator form fits, the
    authors' form (a second generator) is refused at open in one line."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    trainer = OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)
    learner = _learner(tmp_path, trainer, "fedcil", gan_steps=2, replay_from="round", max_bytes=400_000)
    learner.start_task(0, *_classes([0, 1], 60))
    learner.finish_round()
    one_generator = learner.policy._held().bytes_on_disk()
    share = 2.5 * one_generator / 400_000  # room for replacing one-generator files, not two-generator ones
    _learner(tmp_path, trainer, "fedcil", gan_steps=2, replay_from="round", max_bytes=400_000, acgan_share=share)
    with pytest.raises(ValueError, match=r"^policy fedcil: replacing its ACGAN \(width 16, float16, \d+ bytes\) "):
        _learner(tmp_path, trainer, "fedcil", gan_steps=2, replay_from="task", max_bytes=400_000, acgan_share=share)
    with pytest.raises(ValueError, match="replay_from must be one of task, round, got 'epoch'"):
        make_policy("fedcil", replay_from="epoch")


def test_fedcil_keeps_its_previous_acgan_when_a_new_one_would_not_fit_the_budget(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    learner = _learner(tmp_path, OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), "fedcil", gan_steps=2,
                       max_bytes=400_000)
    learner.start_task(0, *_classes([0, 1], 60))
    learner.finish_round()
    first = learner.policy._file.read()
    assert learner.policy.metrics()["acgan_dropped"] == 0
    learner.policy.width = 64  # a bigger ACGAN than M leaves room for: refused before anything is written
    learner.policy._spec = type(learner.policy._spec)((1, 8, 8), 10, 16, 64)
    learner.finish_round()
    assert learner.policy.metrics()["acgan_dropped"] == 1
    assert learner.policy._file.read() == first
    assert learner.budget.used() <= 400_000


def test_fedcil_leaves_the_store_its_share_of_the_bytes(tmp_path, export_artifacts):
    """The ACGAN stays within `acgan_share` of M's bytes, its replacement's write peak included, so the next task's
    real samples are never squeezed out (a device would train on nothing); an ACGAN whose replacement could never
    fit that share is refused at open in one line, not written once and then never updated."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    trainer = OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)
    with pytest.raises(ValueError, match=r"^policy fedcil: replacing its ACGAN \(width 16, float16, \d+ bytes\) "
                                         r"peaks at \d+ bytes, more than acgan_share 0.1 .* lower width"):
        _learner(tmp_path, trainer, "fedcil", gan_steps=2, max_bytes=400_000, acgan_share=0.1)
    learner = _learner(tmp_path, trainer, "fedcil", gan_steps=2, max_bytes=400_000, acgan_share=0.5)
    for task, classes in enumerate(([0, 1], [2, 3])):  # the second save replaces the first beside it
        learner.start_task(task, *_classes(classes, 60))
        learner.finish_round()
        assert learner.policy.metrics()["acgan_dropped"] == 0
    assert learner.policy._load().classes == {0, 1, 2, 3}
    assert learner.budget.held()["acgan"] <= 0.5 * 400_000


@pytest.mark.parametrize("group_by", [None, "class"])
def test_fedcil_gives_up_its_acgan_when_a_new_task_would_not_fit_beside_it(tmp_path, export_artifacts, group_by):
    """At a byte limit where the store's write peaks leave no room for a new task's samples beside the ACGAN (digits
    at the raw caches' 172 KiB), the ACGAN file goes and the store takes the whole task: a device must never train
    on nothing because a method's own file holds the bytes. Class quotas change nothing of it (the class-quota
    wrapper they replaced never forwarded `release_bytes`)."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    learner = _learner(tmp_path, OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), "fedcil", gan_steps=2,
                       max_bytes=172 * 1024, width=8, group_by=group_by)
    learner.start_task(0, *_classes([0, 1], 14))
    learner.finish_round()
    assert learner.policy._file.exists() and learner.policy.metrics()["acgan_dropped"] == 0
    learner.start_task(1, *_classes([2, 3], 14))
    assert len(learner.store) == 14 and set(learner.store.labels().tolist()) == {2, 3}
    assert not learner.policy._file.exists()
    x, y = learner.store.get(learner.store.ids())
    learner.policy.training_set(learner.view(), x, y)
    assert learner.policy.metrics()["acgan_released"] == 1
    assert learner.budget.used() <= 172 * 1024


def test_fedcil_removes_an_acgan_file_that_does_not_load(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    learner = _learner(tmp_path, OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), "fedcil", gan_steps=2)
    learner.start_task(0, *_classes([0, 1], 60))
    learner.finish_round()
    path = learner.policy._file.path
    path.write_bytes(path.read_bytes()[:100])  # torn by a disk fault
    reopened = make_policy("fedcil", gan_steps=2)
    reopened.open(PolicyContext(path.parents[1], artifacts, learner.budget.__class__(Budget(200)), learner.trainer))
    assert not path.exists() and reopened._load() is None


@needs_broker
@pytest.mark.parametrize("policy, trainer", [("shared", "ort"), ("dann", "torch"), ("fedcil", "ort")])
def test_each_baseline_runs_through_a_real_broker_round(tmp_path, export_artifacts, policy, trainer):
    federation = run_federation(
        tmp_path, export_artifacts("lenet", 10, (1, 8, 8)),
        {"store": {"max_samples": 60}, "policy": {"name": policy, **({"gan_steps": 20} if policy == "fedcil" else {})},
         "trainer": {"backend": trainer, "optimizer": "adamw", "lr": 3e-3}},
        {"name": "fedavg", "weighted": False}, tasks=2, rounds_per_task=1, client={"epochs": 3},
    )
    assert federation.results["rounds_completed"] == 2
    history = federation.results["history"]
    assert len(history) == 2 and [len(h["accuracy"]) for h in history] == [1, 2]
    for device in federation.devices:
        assert device.learner.policy.name == policy
        metrics = history[1]["metrics"][device.id]  # what reached the coordinator with the second round's update
        if policy == "dann":
            assert metrics["domain_loss"] > 0
        if policy == "fedcil":
            assert metrics["replayed_samples"] == 40 and metrics["acgan_dropped"] == 0
    # each device trains on task 1's 40 samples and 20 of task 0: cached (M = 60), or generated (2 classes x 20)
    assert history[1]["samples"] == 2 * (60 if policy != "fedcil" else 40)
