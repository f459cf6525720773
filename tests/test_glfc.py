"""GLFC (edge_client/policies/glfc.py, coordinator/strategies/glfc.py): its arithmetic against hand-computed
values, its detector on real digits, its memory, its steps on every backend, the proxy's label inference and
reconstruction, and a fleet with the proxy through a real broker."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from edge_client.budget import Budget, DeviceBudget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import POLICIES, Samples, make_policy
from edge_client.policies.glfc import combined_bce, compensation_weights, mean_entropy, relation_targets
from edge_client.store import ReplayStore
from edge_client.stream import Chunk
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from models.glfc import decode_gradient, infer_label, prototype_name
from models.loss import training_loss
from models.manifest import ParameterInfo, load_manifest
from models.zoo import build_model

OPTIONS = {"gamma": "glfc_mlp"}


def test_compensation_weights_are_each_groups_gradient_over_its_mean():
    p_true = np.array([0.9, 0.5, 0.2, 0.8])
    old = np.array([True, True, False, False])
    # |G| = 0.1, 0.5 (old: mean 0.3), 0.8, 0.2 (new: mean 0.5)
    np.testing.assert_allclose(compensation_weights(p_true, old), [1 / 3, 5 / 3, 1.6, 0.4], rtol=1e-6)
    np.testing.assert_allclose(compensation_weights(np.array([1.0, 1.0]), np.array([True, False])), [1.0, 1.0])


def test_relation_targets_and_the_combined_bce_are_the_two_terms_of_eq_6():
    y = np.array([0, 2])
    old_probs = np.array([[0.7, 0.2, 0.9], [0.1, 0.6, 0.3]])
    targets = relation_targets(y, 3, old_probs, np.array([0, 1]))
    np.testing.assert_allclose(targets, [[0.7, 0.2, 0.0], [0.1, 0.6, 1.0]], rtol=1e-6)
    weights = np.array([1.0, 2.0], np.float32)
    loss = combined_bce(y, 3, weights, 0.5, 0.5, targets)
    np.testing.assert_allclose(loss.sample_weights, [1.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(loss.targets, [[0.85, 0.1, 0.0], [0.1 / 3, 0.2, 1.0]], rtol=1e-6)
    assert loss.head == "sigmoid-bce"
    # the one BCE the device trains with equals lambda_1 * w_i BCE(z, onehot) + lambda_2 BCE(z, Y-hat), exactly
    logits = torch.tensor([[1.5, -0.3, 0.2], [-1.0, 0.4, 2.2]])
    mask = torch.ones(3)

    def bce(t, w):
        return training_loss(logits, mask, torch.tensor(t, dtype=torch.float32), torch.tensor(w, dtype=torch.float32),
                             torch.zeros(2, 3), torch.zeros(2), torch.ones(1))

    onehot = np.eye(3, dtype=np.float32)[y]
    expected = 0.5 * bce(onehot, weights) + 0.5 * bce(targets, np.ones(2))
    assert float(bce(loss.targets, loss.sample_weights)) == pytest.approx(float(expected), rel=1e-6)


def test_entropy_is_the_mean_softmax_entropy_over_visible_classes():
    uniform = np.zeros((3, 4))
    assert mean_entropy(uniform) == pytest.approx(-np.log(0.25 + 1e-5), rel=1e-6)
    masked = np.array([[0.0, 0.0, -1e9, -1e9]])
    assert mean_entropy(masked) == pytest.approx(-np.log(0.5 + 1e-5), rel=1e-6)


@pytest.fixture(scope="module")
def artifacts(export_artifacts):
    lenet = export_artifacts("lenet", 10, (1, 8, 8), backends=("ort", "torch", "portable"))
    POLICIES.get("glfc").export_artifacts(OPTIONS, lenet)
    return lenet


def _learner(artifacts, folder, trainer=None, max_samples=400, **options):
    trainer = trainer or OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)
    store = ReplayStore.within(DeviceBudget(Budget(max_samples, None)), folder / "store", (1, 8, 8))
    learner = Learner(trainer, store, make_policy("glfc", **{**OPTIONS, **options}),
                      LearnerConfig(epochs=1, batch_size=32), seed=0)
    learner.open_policy(folder, artifacts)
    return learner


def _digits(classes, n, offset=0):
    data = load_dataset("digits")
    pick = np.flatnonzero(np.isin(data.y_train, classes))[offset : offset + n]
    return data.x_train[pick], data.y_train[pick]


def test_entropy_detection_fires_on_a_class_change_and_not_on_more_samples_of_old_classes(artifacts, tmp_path):
    """A model trained on digits 0 and 1; then unannounced chunks: more 0s and 1s (no task), then 2s and 3s (a
    task). Tasks of two classes: the paper's absolute 1.2 could never fire (ln 2 < 1.2); the scaled one does."""
    learner = _learner(artifacts, tmp_path)
    learner.observe(Chunk(*_digits([0, 1], 120)))
    for _ in range(15):
        learner.train()
    assert not learner.observe(Chunk(*_digits([0, 1], 40, offset=120)))
    assert not learner.observe(Chunk(*_digits([0, 1], 40, offset=160)))
    assert learner.observe(Chunk(*_digits([2, 3], 40))) and learner.state.task == 1
    learner.store.close()


def test_the_memory_is_herding_order_and_a_smaller_quota_is_a_truncation(artifacts, tmp_path):
    learner = _learner(artifacts, tmp_path)
    x, y = _digits([0, 1], 80)
    old = Samples(x, y, np.zeros(len(y), np.int64))
    view = learner.view(learner.trainer.get_weights())
    first = learner.policy.rank(old, 20, view)
    assert len(set(first.tolist())) == 20 and np.bincount(y[first]).tolist() == [10, 10]
    learner.trainer.set_weights(learner.trainer.get_weights() * 1.5)  # other features: herding would differ now
    second = learner.policy.rank(old, 8, learner.view())
    for c in (0, 1):
        assert second[y[second] == c].tolist() == first[y[first] == c][:4].tolist()
    learner.store.close()


def _gamma_gradient(name, x, label):
    gamma = build_model(name, 10, (1, 8, 8), seed=2021)
    logits, _ = gamma(torch.from_numpy(x[None]))
    grads = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([label])), list(gamma.parameters()))
    parameters = [ParameterInfo(n, tuple(p.shape)) for n, p in gamma.named_parameters()]
    return torch.cat([g.reshape(-1) for g in grads]).numpy(), parameters


@pytest.mark.parametrize("gamma", ["glfc_lenet", "glfc_mlp"])
def test_the_label_is_read_from_a_prototype_gradient(gamma):
    x, y = _digits(list(range(10)), 30)
    for xi, yi in zip(x, y):
        gradient, parameters = _gamma_gradient(gamma, xi, int(yi))
        assert infer_label(gradient, parameters) == yi


def test_the_device_uploads_one_gamma_gradient_per_new_class_that_names_its_class(artifacts, tmp_path):
    learner = _learner(artifacts, tmp_path)
    learner.start_task(0, *_digits([3, 7], 60))
    learner.train()
    learner.finish_round()
    attached = learner.policy.attachments(learner.view())
    assert sorted(attached) == [prototype_name(0), prototype_name(1)]
    gamma = build_model("glfc_mlp", 10, (1, 8, 8), seed=2021)
    parameters = [ParameterInfo(n, tuple(p.shape)) for n, p in gamma.named_parameters()]
    labels = {infer_label(decode_gradient(data, parameters), parameters) for data in attached.values()}
    assert labels == {3, 7}
    learner.train()
    learner.finish_round()  # the second round of the task uploads nothing
    assert learner.policy.attachments(learner.view()) == {}
    learner.store.close()


@pytest.mark.parametrize("backend", ["ort", "portable"])
def test_every_backend_takes_the_same_glfc_step_as_torch(artifacts, tmp_path, backend):
    """One GLFC round of the second task (compensation weights, relation targets from a stored old model) from the
    same weights on the same data: the ONNX backends end where torch does."""
    def run(trainer, folder):
        learner = _learner(artifacts, folder, trainer=trainer)
        start = load_manifest(artifacts)
        weights = np.fromfile(artifacts / "weights.bin", dtype="<f4")
        assert weights.size == start.num_parameters
        learner.trainer.set_weights(weights)
        learner.global_model_arrived(weights * 0.9)  # the old model: the latest global model before the switch
        learner.start_task(0, *_digits([0, 1], 40))
        learner.start_task(1, *_digits([2, 3], 40))
        learner.trainer.set_weights(weights)
        learner.train()
        out = learner.trainer.get_weights()
        assert learner.policy.metrics()["relation_distillation"] == 1.0
        learner.store.close()
        return out

    manifest = load_manifest(artifacts)
    torch_weights = run(TorchTrainer(manifest, optimizer="sgd", lr=0.1), tmp_path / "torch")
    other = (OrtTrainer(artifacts, optimizer="sgd", lr=0.1) if backend == "ort"
             else PortableTrainer(artifacts, optimizer="sgd", lr=0.1))
    np.testing.assert_allclose(run(other, tmp_path / backend), torch_weights, atol=2e-5)
