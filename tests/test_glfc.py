"""GLFC (edge_client/policies/glfc.py, coordinator/strategies/glfc.py): its arithmetic against hand-computed
values, its detector on real digits, its memory, its steps on every backend, the proxy's label inference and
reconstruction, and a fleet with the proxy through a real broker."""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from fleet_harness import SPARE_WAIT_S
from thread_fleet import ThreadFederation
from torch.nn import functional as F

from coordinator.background import Deadline
from coordinator.broker import mosquitto_path
from coordinator.strategies import ClientUpdate, RoundContext, make_strategy
from coordinator.strategies.base import settled
from coordinator.strategies.glfc import GlfcProxy
from edge_client.budget import Budget, DeviceBudget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import POLICIES, Samples, make_policy
from edge_client.policies.glfc import (
    WeightSpread,
    compensation_weights,
    glfc_loss,
    mean_entropy,
    relation_targets,
    shifted_logits_loss,
)
from edge_client.store import ReplayStore
from edge_client.stream import Chunk
from edge_client.trainers.base import loss_arrays
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from firmware_sim.payload_attacks import PAYLOAD_ATTACKS, PayloadContext
from models.glfc import (
    MAX_PROTOTYPES,
    decode_gradient,
    decode_old_model,
    encode_gradient,
    infer_label,
    prototype_name,
)
from models.loss import training_loss
from models.manifest import HEAD_WEIGHT, ParameterInfo, class_head_positions, load_manifest, named_parameter
from models.zoo import build_model

OPTIONS = {"gamma": "glfc_mlp"}
needs_broker = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")


def test_compensation_weights_are_each_groups_gradient_over_its_mean():
    p_true = np.array([0.9, 0.5, 0.2, 0.8])
    old = np.array([True, True, False, False])
    # |G| = 0.1, 0.5 (old: mean 0.3), 0.8, 0.2 (new: mean 0.5)
    np.testing.assert_allclose(compensation_weights(p_true, old), [1 / 3, 5 / 3, 1.6, 0.4], rtol=1e-6)
    np.testing.assert_allclose(compensation_weights(np.array([1.0, 1.0]), np.array([True, False])), [1.0, 1.0])


def test_the_weight_spread_is_the_effective_sample_share_and_the_unlearnt_samples_share_of_the_weight():
    spread = WeightSpread()
    assert spread.metrics() == {}  # no compensation, nothing to say
    spread.add(np.array([1.0, 1.0, 1.0, 1.0]), np.array([0.9, 0.8, 0.7, 0.2]))  # even: ess 1, 1 of 4 unlearnt
    spread.add(np.array([3.0, 1.0, 0.0, 0.0]), np.array([0.1, 0.9, 0.9, 0.9]))  # (4)^2 / (4 * 10) = 0.4; 3/4
    assert spread.metrics() == pytest.approx({"compensation_ess": 0.7, "compensation_on_unlearnt": 0.5,
                                              "unlearnt": 0.25})


def _loss_of(logits, inputs):
    """models/loss.py's batch loss of these logits (every class visible) under GLFC's loss inputs."""
    n, k = logits.shape
    arrays = loss_arrays(np.zeros(n, np.int64), k, inputs)
    return float(training_loss(logits, torch.ones(k), *(torch.from_numpy(a) for a in arrays)))


def test_relation_targets_and_both_forms_of_eq_6_are_its_two_terms():
    y = np.array([0, 2])
    old_probs = np.array([[0.7, 0.2, 0.9], [0.1, 0.6, 0.3]])
    targets = relation_targets(y, 3, old_probs, np.array([0, 1]))
    np.testing.assert_allclose(targets, [[0.7, 0.2, 0.0], [0.1, 0.6, 1.0]], rtol=1e-6)
    weights = np.array([1.0, 2.0], np.float32)
    logits = torch.tensor([[1.5, -0.3, 0.2], [-1.0, 0.4, 2.2]])
    onehot = np.eye(3, dtype=np.float32)[y]
    bce = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(onehot), reduction="none").mean(1).numpy()
    bce_hat = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(targets), reduction="none").mean(1).numpy()
    # the authors' form: one BCE, weight a_i + b and target (a_i onehot + b Y-hat) / (a_i + b)
    merged = glfc_loss(y, 3, weights, 0.5, 0.5, targets, "bce")
    np.testing.assert_allclose(merged.sample_weights, [1.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(merged.targets, [[0.85, 0.1, 0.0], [0.1 / 3, 0.2, 1.0]], rtol=1e-6)
    assert merged.head == "sigmoid-bce"
    expected = (0.5 * weights * bce + 0.5 * bce_hat).mean()
    assert _loss_of(logits, merged) == pytest.approx(float(expected), rel=1e-6)
    # the paper's form: the same BCE term, and lambda_2 times the cross-entropy of softmax(z) against Y-hat,
    # summed over the classes as Eq. 5 prints it, or (the default) averaged over them as the authors' BCE is
    cross = -(targets * F.log_softmax(logits, dim=1).numpy()).sum(1)
    for scale, per_class in (("sum", 1.0), ("mean", 1 / 3)):
        kl = glfc_loss(y, 3, weights, 0.5, 0.5, targets, "kl", scale)
        expected = (0.5 * weights * bce + 0.5 * per_class * cross).mean()
        assert _loss_of(logits, kl) == pytest.approx(float(expected), rel=1e-6)
    summed = glfc_loss(y, 3, weights, 0.5, 0.5, targets, "bce", "sum")  # the authors' BCE, summed over classes
    expected = (0.5 * weights * bce + 0.5 * 3 * bce_hat).mean()
    assert _loss_of(logits, summed) == pytest.approx(float(expected), rel=1e-6)
    plain = glfc_loss(y, 3, weights, 1.0, 0.0, None)  # the first task: the compensated BCE alone
    assert _loss_of(logits, plain) == pytest.approx(float((weights * bce).mean()), rel=1e-6)


def _relation_gradient(z, y, targets, mask, form, scale=None):
    """The gradient w.r.t. the logits of GLFC's relation term alone (lambda_1 = 0, lambda_2 = 0.5) as the one loss
    (models/loss.py) computes it, under a class mask."""
    n, k = z.shape
    args = () if scale is None else (scale,)
    inputs = glfc_loss(y, k, np.ones(n, np.float32), 0.0, 0.5, targets, form, *args, visible=int(mask.sum()))
    logits = torch.tensor(z, dtype=torch.float32, requires_grad=True)
    arrays = loss_arrays(y, k, inputs)
    training_loss(logits, torch.from_numpy(mask), *(torch.from_numpy(a) for a in arrays)).backward()
    return logits.grad.numpy()


def test_the_relation_terms_gradient_is_the_authors_formula_at_the_default_scale():
    """Hand-computed, B = 2 samples, 4 classes of which 3 visible (class 3 hidden), Y-hat with the old class 0 from
    an old model: the authors' BCE gives dL/dz = lambda_2 (sigmoid(z) - Y-hat) / (3 B) on the visible classes; the
    paper's KL at the default scale lambda_2 (softmax(z) sum(Y-hat) - Y-hat) / (3 B), the same size (its first
    moment is the BCE's), where Eq. 5 as printed (scale "sum") is 3 times that; a hidden class gets nothing."""
    z = np.array([[1.2, -0.4, 0.3, 5.0], [-0.7, 0.9, 2.1, -3.0]])
    y = np.array([1, 2])
    mask = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
    targets = relation_targets(y, 4, np.array([[0.8, 0.1, 0.2, 0.5], [0.3, 0.6, 0.4, 0.5]]), np.array([0]))
    visible = mask.astype(bool)
    sigmoid = 1 / (1 + np.exp(-z))
    authors = 0.5 * (sigmoid - targets) / (3 * 2) * mask
    np.testing.assert_allclose(_relation_gradient(z, y, targets, mask, "bce"), authors, rtol=1e-5, atol=1e-7)
    soft = np.exp(z[:, visible]) / np.exp(z[:, visible]).sum(1, keepdims=True)
    paper = np.zeros_like(z)
    paper[:, visible] = soft * targets[:, visible].sum(1, keepdims=True) - targets[:, visible]
    np.testing.assert_allclose(_relation_gradient(z, y, targets, mask, "kl"), 0.5 * paper / (3 * 2), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(_relation_gradient(z, y, targets, mask, "kl", "sum"), 0.5 * paper / 2, rtol=1e-5,
                               atol=1e-7)
    assert make_policy("glfc", **OPTIONS).relation_scale == "mean"


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


def test_the_payload_attacks_send_what_they_say_of_the_devices_own_prototype_gradients(artifacts, tmp_path):
    """firmware_sim/payload_attacks/glfc.py on a real device's upload: the flood is 256 scaled copies of its
    gradients, the lie names the other class of its task and changes nothing but the two classes' head values, the
    extreme gradient is the honest one x 1e10 and finite."""
    learner = _learner(artifacts, tmp_path)
    learner.start_task(0, *_digits([3, 7], 60))
    learner.train()
    learner.finish_round()
    honest = learner.policy.attachments(learner.view())
    parameters = load_manifest(POLICIES.get("glfc").gamma_folder(OPTIONS, artifacts)).parameters
    sent = [decode_gradient(honest[prototype_name(k)], parameters) for k in range(2)]
    context = PayloadContext(learner.policy, learner.trainer.manifest, artifacts, np.array([3, 7]))

    def crafted(name):
        attached = PAYLOAD_ATTACKS.get(name)().craft(honest, context)
        return [decode_gradient(attached[prototype_name(k)], parameters) for k in range(len(attached))]

    flood = crafted("prototype-flood")
    assert len(flood) == MAX_PROTOTYPES and {infer_label(g, parameters) for g in flood} == {3, 7}
    np.testing.assert_allclose(flood[3], sent[1] * np.float32(1.03), rtol=1e-6)
    lies = crafted("prototype-lie")
    assert [infer_label(g, parameters) for g in lies] == [7 if infer_label(g, parameters) == 3 else 3 for g in sent]
    head = class_head_positions(parameters, [3, 7])
    rest = np.setdiff1d(np.arange(sent[0].size), head)
    assert np.array_equal(lies[0][rest], sent[0][rest]) and not np.array_equal(lies[0][head], sent[0][head])
    extreme = crafted("prototype-extreme")
    assert all(np.isfinite(g).all() for g in extreme)
    np.testing.assert_allclose(extreme[0], sent[0] * np.float32(1e10), rtol=1e-6)
    learner.store.close()


def test_the_sigmoid_head_lowers_the_fleets_classes_the_device_does_not_hold_and_leaves_unnamed_ones_alone(
        artifacts, tmp_path):
    """A device holding only 0s, in a fleet whose task names classes 0 and 1 (`known_classes`): one round of SGD
    lowers class 1's bias (its BCE pushes every visible logit but the label's down) and leaves the head rows of
    classes no task named (2-9) as they were. Without the fleet's classes, class 1 would stay hidden and untouched:
    nothing would ever push it down on this device."""
    manifest = load_manifest(artifacts)
    offset, weight = _offset(manifest), _offset(manifest, "head.weight")
    moved = {}
    for known in ((0, 1), ()):
        learner = _learner(artifacts, tmp_path / f"known-{len(known)}",
                           trainer=OrtTrainer(artifacts, optimizer="sgd", lr=0.1))
        learner.known_classes, learner.task_classes = known, known
        before = learner.trainer.get_weights()
        learner.start_task(0, *_digits([0], 30))
        learner.train()
        after = learner.trainer.get_weights()
        learner.store.close()
        rows = (after - before)[weight:offset].reshape(10, -1)
        moved[known] = (after - before)[offset : offset + 10], np.abs(rows).sum(1)
    bias, rows = moved[(0, 1)]
    assert bias[1] < 0 and bias[0] > 0
    assert not bias[2:].any() and not rows[2:].any()
    bias, rows = moved[()]
    assert bias[1] == 0 and not rows[1:].any()
    assert make_policy("glfc", **OPTIONS).head_classes == "fleet"


def test_what_an_option_turns_off_costs_no_byte_of_m(artifacts, tmp_path):
    """iCaRL+FL's GLFC (no prototypes) keeps no Gamma under M, and without a relation term no old model is kept;
    GLFC at its defaults keeps both once a second task starts."""
    held = {}
    for name, options in (("glfc", {}), ("icarl", {"prototypes": False, "relation": "bce"}),
                          ("no-rd", {"relation": "none"})):
        learner = _learner(artifacts, tmp_path / name, **options)
        learner.global_model_arrived(learner.trainer.get_weights())
        learner.start_task(0, *_digits([0, 1], 30))
        learner.train()
        learner.start_task(1, *_digits([2, 3], 30))
        learner.train()
        held[name] = {holder for holder, size in learner.budget.held().items() if size > 0}
        learner.store.close()
    assert {"glfc-old-model", "glfc-gamma"} <= held["glfc"]
    assert "glfc-gamma" not in held["icarl"] and "glfc-old-model" in held["icarl"]
    assert "glfc-old-model" not in held["no-rd"] and "glfc-gamma" in held["no-rd"]


@pytest.mark.parametrize("first_task", [True, False])
def test_the_compensation_runs_in_the_first_task_only_when_asked(artifacts, tmp_path, first_task):
    """`compensate_first_task = false`: no weights (and no extra forward pass) while no class is old; from the
    second task on the compensation runs either way."""
    learner = _learner(artifacts, tmp_path, compensate_first_task=first_task)
    passes = []
    for task, classes in enumerate(([0, 1], [2, 3])):
        learner.global_model_arrived(learner.trainer.get_weights())
        learner.start_task(task, *_digits(classes, 40))
        learner.train()
        learner.finish_round()
        passes.append(learner.policy.metrics().get("extra_forward_passes", 0.0))
    learner.store.close()
    assert passes[1] > 0 and (passes[0] > 0) == first_task


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


def _proxy(artifacts, **options):
    return make_strategy("glfc", device="cpu", manifest=load_manifest(artifacts), **options)


@pytest.mark.parametrize("gamma", ["glfc_mlp", "glfc_lenet"])
def test_the_proxy_reconstructs_a_prototype_from_its_gradient(artifacts, gamma):
    """Gradient matching by L-BFGS from noise: the reconstruction is nearer its prototype than any other digit of
    the class is, and within the input range."""
    proxy = _proxy(artifacts, gamma=gamma, lbfgs_iterations=60)
    x, y = _digits([4], 60)
    gradient, _ = _gamma_gradient(gamma, x[0], 4)
    made, labels = proxy.reconstruct([gradient], Deadline(600))
    assert labels.tolist() == [4] and made.shape == (1, 1, 8, 8)
    assert made.min() >= 0.0 and made.max() <= 1.0
    distances = np.linalg.norm((x - made[0]).reshape(len(x), -1), axis=1)
    assert distances.argmin() == 0 and distances[0] < 0.5 * np.median(distances[1:])


def test_the_proxy_handles_no_gradients_and_keeps_the_best_model_of_each_task(artifacts):
    proxy = _proxy(artifacts, gamma="glfc_mlp", lbfgs_iterations=5)
    made, labels = proxy.reconstruct([], Deadline(10))
    assert made.shape == (0, 1, 8, 8) and labels.shape == (0,)
    size = proxy.manifest.num_parameters
    base = np.fromfile(artifacts / "weights.bin", dtype="<f4")
    update = ClientUpdate("d0", base.copy(), 10)
    ctx = RoundContext(round=1, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=1,
                       rounds_per_task=2)
    result = proxy.aggregate(torch.from_numpy(base), [update], ctx)  # no prototypes: nothing starts
    assert not proxy.job.running and result.broadcast == {}
    assert proxy.configure(ctx, ["d0"]) == {"d0": {"known_classes": True}}  # the head covers the fleet's classes
    last = RoundContext(round=2, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=2,
                        rounds_per_task=2)
    result = settled(proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", base.copy(), 10)], last))
    weights, task = decode_old_model(result.broadcast, size)  # no reconstructions: the task's last model
    assert task == 0 and np.allclose(weights, base)


def _offset(manifest, name="head.bias"):
    """Where a parameter starts in the flat weights (manifest order)."""
    offset = 0
    for p in manifest.parameters:
        if p.name == name:
            return offset
        offset += p.size
    raise AssertionError(f"no {name}")


def _predicting(artifacts, classes):
    """The exported initial weights, and for each class a copy whose head bias makes it predict that class for
    every input."""
    base = np.fromfile(artifacts / "weights.bin", dtype="<f4")
    offset = _offset(load_manifest(artifacts))
    says = {}
    for c in classes:
        says[c] = base.copy()
        says[c][offset + c] += 100.0
    return base, says


def test_the_proxy_makes_the_same_choice_on_a_slow_host(artifacts):
    """The proxy's work is bounded by counts: a proxy whose every reconstruction takes longer (a busy host)
    reconstructs the same samples and chooses the same old model as one at full speed, because both wait for
    the task's reconstructions at its last round (off the coordinator's loop). Round 1 brings three prototype
    gradients (two of class 1, one of class 0); the rounds' models predict 0, 1 and 0 everywhere: round 2's is
    the best on the reconstructions."""
    import time

    class SlowProxy(GlfcProxy):
        name = "test-glfc-slow"

        def invert(self, gradient, label, generator, deadline):
            time.sleep(0.5)
            return super().invert(gradient, label, generator, deadline)

    base, says = _predicting(artifacts, (0, 1))
    ones, _ = _digits([1], 2)
    zeros, _ = _digits([0], 1)
    gradients = [encode_gradient(_gamma_gradient("glfc_mlp", x, label)[0])
                 for x, label in ((ones[0], 1), (ones[1], 1), (zeros[0], 0))]

    def ctx(r):
        return RoundContext(round=r, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=r,
                            rounds_per_task=3)

    chosen = []
    for kind in ("glfc", "test-glfc-slow"):
        proxy = make_strategy(kind, device="cpu", manifest=load_manifest(artifacts), gamma="glfc_mlp",
                              lbfgs_iterations=20)
        for r, model in enumerate((says[0], says[1], says[0]), start=1):
            updates = [ClientUpdate(f"d{k}", model.copy(), 10, attachments={prototype_name(0): g} if r == 1 else {})
                       for k, g in enumerate(gradients)]
            result = settled(proxy.aggregate(torch.from_numpy(base), updates, ctx(r)))
        weights, _ = decode_old_model(result.broadcast, proxy.manifest.num_parameters)
        chosen.append((weights, proxy.monitor, result.metrics["proxy"]))
    (fast, fast_monitor, fast_metrics), (slow, slow_monitor, slow_metrics) = chosen
    assert fast_metrics == slow_metrics and np.array_equal(fast, slow) and np.array_equal(fast, says[1])
    assert np.array_equal(fast_monitor[1], slow_monitor[1]) and np.array_equal(fast_monitor[2], slow_monitor[2])
    assert fast_metrics["monitor_samples"] == 3.0 and fast_metrics["best_round_of_task"] == 2.0


def test_under_central_dp_the_proxy_keeps_released_models_and_chooses_by_noisy_counts(artifacts):
    """Central DP with the proxy, three rounds of one task, three devices each sending one prototype gradient in
    round 1, each round's updates answering the exported model g: every round's model is released inside the rule,
    once (g + the mean's change + noise of sd z C / 3, from the round's seeded stream), and the task's models the proxy keeps are those released ones; at the task's
    last round the old model it broadcasts is the one whose count of monitor samples right plus noise of sd
    z x 2 sqrt(3) (a device sends at most one gradient per class of the task's two, three models) is the largest,
    and that choice is counted at rate 1 beside the round."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from coordinator.aggregation import RoundAggregate
    from coordinator.containment import ContainedStrategy
    from coordinator.guard import UpdateBounds
    from coordinator.privacy import CentralPrivacy, PrivacySettings

    settings = PrivacySettings(mode="central", clip_norm=150.0, noise_multiplier=0.4, noise_seed=11)
    central = CentralPrivacy(settings)
    proxy = _proxy(artifacts, gamma="glfc_mlp", lbfgs_iterations=20)
    base, says = _predicting(artifacts, (0, 1))
    ones, _ = _digits([1], 2)
    zeros, _ = _digits([0], 1)
    gradients = [encode_gradient(_gamma_gradient("glfc_mlp", x, label)[0])
                 for x, label in ((ones[0], 1), (ones[1], 1), (zeros[0], 0))]
    released, counters = [], Counter()
    for r, model in enumerate((says[0], says[1], says[0]), start=1):
        ctx = RoundContext(round=r, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=r,
                           rounds_per_task=3)
        aggregate = RoundAggregate(ContainedStrategy(proxy, counters), UpdateBounds.only(), base, counters, 1 << 30,
                                   ctx=ctx, privacy=central)
        for k, gradient in enumerate(gradients):
            aggregate.add(ClientUpdate(f"d{k}", model.copy(), 10,
                                       attachments={prototype_name(0): gradient} if r == 1 else {}))
        result = aggregate.close(selected=3, eligible=3)
        noise = np.random.default_rng((11, r)).normal(0.0, 0.4 * 150.0 / 3, size=base.shape)
        np.testing.assert_allclose(result.global_weights.numpy(), (model + noise).astype(np.float32), atol=1e-4)
        released.append(result.global_weights.numpy())
    for kept, out in zip(proxy.task_models[1], released):
        np.testing.assert_array_equal(kept, out)
    _, x, y = proxy.monitor
    assert len(y) == 3
    counts = np.array([proxy.correct(m, x, y, (0, 1)) for m in released], dtype=np.float64)
    noisy = counts + np.random.default_rng((11, 3, 1)).normal(0.0, 0.4 * 2 * math.sqrt(3), 3)
    top = max(range(3), key=lambda i: (noisy[i], i))
    old, task = decode_old_model(result.broadcast, proxy.manifest.num_parameters)
    assert task == 0 and np.array_equal(old, released[top])
    assert result.metrics["proxy"]["best_accuracy"] == pytest.approx(noisy[top] / 3)
    assert aggregate.privacy_spent["further_rates"] == [1.0]
    reference = RdpAccountant()
    reference.compose(dp_accounting.GaussianDpEvent(0.4), 4)  # three rounds at rate 1, and the choice
    assert aggregate.privacy_spent["epsilon"] == pytest.approx(reference.get_epsilon(settings.delta), rel=1e-9)


@needs_broker
def test_a_glfc_fleet_with_the_proxy_runs_through_a_real_broker_with_a_device_joining(tmp_path, artifacts):
    """Two tasks of two rounds, two devices and one that joins after round 1: the proxy pools the prototype
    gradients of each task's first round, reconstructs them, and the old model it broadcasts at the end of task 0
    is what every device distils from in task 1 (the newcomer too: its head covers the fleet's classes)."""
    device = {"store": {"max_samples": 60}, "policy": {"name": "glfc", **OPTIONS},
              "trainer": {"optimizer": "adamw", "lr": 3e-3}}
    strategy = {"name": "glfc", "gamma": "glfc_mlp", "lbfgs_iterations": 30}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2, spares=("dev-2",)) as federation:
        for running in federation.devices:
            assert running.link.wait_subscribed(60)
        federation.wait_online()
        coordinator = federation.coordinator(strategy, rounds_per_task=2, min_clients=2, wait_for_devices_s=SPARE_WAIT_S,
                                             client={"epochs": 2})

        def progress(entry: dict) -> None:
            if entry["round"] == 1:
                federation.join("dev-2")

        coordinator.progress = progress
        results = coordinator.run()
        devices = {d.id: d for d in federation.devices}
    assert results["rounds_completed"] == 4 and results["counters"].get("attachments", 0) == 0
    history = results["history"]
    assert history[0]["rule_metrics"]["proxy"]["prototypes_pooled"] == 4  # 2 devices x 2 new classes
    assert history[1]["rule_metrics"]["proxy"]["reconstructions"] == 4
    assert history[1]["rule_metrics"]["proxy"]["reconstruction_accuracy"] >= 0.5
    first_of_task_1 = history[2]
    assert first_of_task_1["rule_metrics"]["proxy"]["prototypes_pooled"] == 2 * len(first_of_task_1["received"])
    for name in first_of_task_1["received"]:  # the old model came from the proxy, and every device distils from
        metrics = first_of_task_1["metrics"][name]  # it: a newcomer too, whose head covers task 0's classes
        assert metrics["old_model_from_proxy"] == 1.0
        assert metrics["relation_distillation"] == 1.0
    assert any("dev-2" in h["received"] for h in history[1:])
    assert devices["dev-2"].broadcasts_received >= 1


@needs_broker
def test_a_glfc_fleet_under_central_dp_counts_the_proxys_choice_against_its_budget(tmp_path, artifacts):
    """Through a real broker, every device in every round (rate 1), z = 2: a round is one Gaussian mechanism and
    the proxy's choice at a task's last round another. The budget lies between the epsilon of three mechanisms and
    of four: round 1 (one) and round 2 (two, with the choice) run, and round 3 would make four, so the run ends
    before it. Were the choice not counted, round 3 would fit."""
    from coordinator.privacy import Accountant, PrivacySettings

    settings = PrivacySettings(mode="central", clip_norm=1.0, noise_multiplier=2.0)
    spent = []
    for mechanisms in (3, 4):
        accountant = Accountant(settings)
        accountant.add(1.0, mechanisms)
        spent.append(accountant.epsilon())
    device = {"store": {"max_samples": 60}, "policy": {"name": "glfc", **OPTIONS}}
    strategy = {"name": "glfc", "gamma": "glfc_mlp", "lbfgs_iterations": 10}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2) as federation:
        results = federation.coordinator(strategy, rounds_per_task=2, privacy=dataclasses.replace(
            settings, epsilon_budget=sum(spent) / 2)).run()
    assert results["outcome"].startswith("privacy-budget"), results["outcome"]
    assert results["rounds_completed"] == 2
    first, last = (entry["privacy"] for entry in results["history"])
    assert "further_rates" not in first and last["further_rates"] == [1.0]
    assert results["epsilon"] == pytest.approx(spent[0])
    assert results["history"][1]["rule_metrics"]["proxy"]["monitor_samples"] > 0  # the choice read reconstructions


@needs_broker
def test_entropy_detection_finds_an_unannounced_boundary_in_a_fleet(tmp_path, artifacts):
    """Devices that are not told where tasks start and may not look at labels (`detect_new_tasks`,
    `task_detectors = "policy"`): GLFC's entropy jump alone starts task 1 when its data arrive, on every device,
    and never within a task; the run's history says so (`task_detection`)."""
    from edgefil.metrics import task_detection

    device = {"store": {"max_samples": 60}, "policy": {"name": "glfc", **OPTIONS},
              "learner": {"detect_new_tasks": True, "task_detectors": "policy"}}
    strategy = {"name": "glfc", "gamma": "glfc_mlp", "lbfgs_iterations": 10}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2) as federation:
        coordinator = federation.coordinator(strategy, rounds_per_task=3, client={"epochs": 5})
        results = coordinator.run()
        devices = federation.devices
    found = task_detection(results["history"])
    assert found.boundaries == 2 and found.at_once == 2 and found.false_starts == 0
    assert all(d.learner.state.task == 1 for d in devices)
    assert all(m["device_task"] == 1.0 for m in results["history"][-1]["metrics"].values())


@needs_broker
def test_the_coordinator_keeps_running_rounds_while_the_proxy_reconstructs(tmp_path, artifacts):
    """The proxy's reconstruction held back until round 2 is over: round 2 runs (its updates, the devices'
    heartbeats) while it works, and the task's last round uses what it reconstructed."""
    release = threading.Event()

    class HeldProxy(GlfcProxy):
        name = "test-glfc-held"

        def reconstruct(self, gradients, deadline):
            release.wait(120)
            return super().reconstruct(gradients, deadline)

    device = {"store": {"max_samples": 60}, "policy": {"name": "glfc", **OPTIONS}}
    strategy = {"name": "test-glfc-held", "gamma": "glfc_mlp", "lbfgs_iterations": 20}
    running_after: dict[int, bool] = {}
    with ThreadFederation(tmp_path, artifacts, device, tasks=1) as federation:
        coordinator = federation.coordinator(strategy, rounds_per_task=3)
        proxy = coordinator.strategy.strategy

        def progress(entry: dict) -> None:
            running_after[entry["round"]] = proxy.job.running
            if entry["round"] == 2:
                release.set()

        coordinator.progress = progress
        results = coordinator.run()
    assert results["rounds_completed"] == 3
    assert running_after[1] and running_after[2]
    assert results["history"][2]["rule_metrics"]["proxy"]["reconstructions"] == 4


@pytest.mark.parametrize("head", ["softmax-ce", "sigmoid-bce"])
def test_noise_on_the_features_reaches_every_backends_input_gradient_exactly(artifacts, head):
    """Eqs. 10-11's gradient, d/dx loss(head(phi(x) + n), y), from torch's autograd on the model itself, against
    each backend's own input gradient of `shifted_logits_loss` (the logits moved by W n), the classes 0-4 visible."""
    torch_trainer = TorchTrainer(load_manifest(artifacts), optimizer="adamw", lr=3e-3)
    weights = PortableTrainer(artifacts).get_weights()
    torch_trainer.set_weights(weights)
    x, y = _digits([3], 1)
    mask = np.zeros(10, np.float32)
    mask[:5] = 1
    noise = np.random.default_rng(0).normal(0.0, 0.5, 84)
    model = torch_trainer.model
    inputs = torch.from_numpy(x).requires_grad_(True)
    logits = model.head(model.trunk(inputs) + torch.from_numpy(noise).float())
    logits = logits + (torch.from_numpy(mask) - 1.0) * 1e9
    if head == "softmax-ce":
        value = F.cross_entropy(logits, torch.from_numpy(y))
    else:
        visible = torch.from_numpy(mask).bool()
        value = F.binary_cross_entropy_with_logits(logits[0, visible], F.one_hot(torch.from_numpy(y), 10)[0, visible]
                                                   .float(), reduction="sum") / 5
    (expected,) = torch.autograd.grad(value, [inputs])
    shift = named_parameter(weights, torch_trainer.manifest.parameters, HEAD_WEIGHT).astype(np.float64) @ noise
    for trainer in (torch_trainer, PortableTrainer(artifacts, optimizer="adamw", lr=3e-3),
                    OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)):
        trainer.set_weights(weights)
        raw, _ = trainer.outputs(x, y, mask)
        _, gradient = trainer.input_gradient(x, y, mask, shifted_logits_loss(raw[0], mask, shift, head))
        np.testing.assert_allclose(gradient, expected.numpy(), rtol=1e-3, atol=1e-6, err_msg=trainer.backend)


@pytest.mark.parametrize("loss", ["ce", "bce"])
def test_the_prototype_perturbation_descends_its_labels_loss_on_the_onnx_backends(artifacts, tmp_path,
                                                                                  export_artifacts, loss):
    """Eqs. 10-11 (the paper's CE with noise on the features, and the authors' code's BCE without): the perturbed
    prototype has a lower loss of its label under the trained model than the raw one, and its Gamma gradient still
    names its class; the ort backend without the portable graphs refuses the policy."""
    from edge_client.trainers.base import LossInputs

    options = {"refine_steps": 10, "refine_loss": loss, **({"refine_noise": 0.0, "refine_lr": 0.2} if loss == "bce"
                                                            else {})}
    learner = _learner(artifacts, tmp_path, trainer=PortableTrainer(artifacts, optimizer="adamw", lr=3e-3),
                       **options)
    learner.start_task(0, *_digits([3, 7], 60))
    learner.train()
    x, y = _digits([3], 1)
    plain = LossInputs(head="softmax-ce" if loss == "ce" else "sigmoid-bce")
    _, features = learner.trainer.outputs(*_digits([3], 60), learner.class_mask())
    refined = learner.policy._refined(learner.view(), x, 3, features.std(axis=0))
    before = learner.trainer.input_gradient(x, y, learner.class_mask(), plain)[0]
    after = learner.trainer.input_gradient(refined, y, learner.class_mask(), plain)[0]
    assert after < before and not np.array_equal(refined, x)
    learner.finish_round()
    assert len(learner.policy.attachments(learner.view())) == 2
    learner.store.close()
    ort_only = export_artifacts("lenet", 10, (1, 8, 8))
    POLICIES.get("glfc").export_artifacts(OPTIONS, ort_only)
    with pytest.raises(ValueError, match="policy glfc needs the optional trainer graphs input_gradient"):
        _learner(ort_only, tmp_path / f"ort-{loss}", trainer=OrtTrainer(ort_only))  # on by default


def test_a_fleet_on_the_ort_backend_exports_the_graph_glfcs_perturbation_borrows_and_a_device_starts(tmp_path):
    """ORT Training's artifacts have no input gradient: a fleet of GLFC devices on the ort backend exports the
    portable set's graph beside them (`artifact_backends`), and a device opens on them, where before it was
    refused."""
    from types import SimpleNamespace

    from edge_client.config import StoreSettings, TrainerSettings
    from edge_client.trainers.choice import artifact_backends
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig

    assert artifact_backends("ort", {"input_gradient", "sample_grad_norms"}) == ("ort", "portable")
    assert artifact_backends("ort", set()) == ("ort",)
    assert artifact_backends("portable", {"input_gradient"}) == ("portable",)
    config = FleetConfig(name="g", out=tmp_path / "fleet", devices=1, scenario={"preset": "digits-class"},
                         policy={"name": "glfc", **OPTIONS}, trainer=TrainerSettings(backend="ort"),
                         store=StoreSettings(max_samples=60))
    fleet = Fleet(config)
    artifacts = fleet._export(SimpleNamespace(num_classes=10, input_shape=(1, 8, 8)),
                              SimpleNamespace(step=lambda what: None), "fleet.toml")
    assert "input_gradient" in OrtTrainer(artifacts).graphs
    _learner(artifacts, tmp_path / "device", trainer=OrtTrainer(artifacts)).store.close()  # opens: no refusal


def test_gamma_is_chosen_by_the_inputs_and_a_gamma_that_does_not_fit_them_is_refused_in_one_line(
        tmp_path, export_artifacts):
    """Both halves' default Gamma ("auto"): the authors' LeNet on images, `glfc_mlp` on a signal, the same network
    on both halves (a fleet of GLFC on MNIST-1D stopped at its export with a traceback: the LeNet takes no signal).
    A Gamma named that does not take the inputs: the fleet says so in one line naming [policy]."""
    from types import SimpleNamespace

    from edgefil.settings import ConfigError
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig
    from models.glfc import gamma_model

    assert gamma_model("auto", (1, 8, 8)) == "glfc_lenet" and gamma_model("auto", (1, 40)) == "glfc_mlp"
    assert gamma_model("glfc_mlp", (1, 8, 8)) == "glfc_mlp"
    signal = export_artifacts("cnn1d", 10, (1, 40), backends=("portable", "torch"))
    glfc = POLICIES.get("glfc")
    glfc.export_artifacts({}, signal)
    folder = glfc.gamma_folder({}, signal)
    assert folder.name == "glfc-gamma-glfc_mlp-2021-1x40-10"
    proxy = _proxy(signal)
    assert list(proxy.gamma_parameters) == list(load_manifest(folder).parameters)
    assert glfc.gamma_folder({}, export_artifacts("lenet", 10, (1, 8, 8))).name == "glfc-gamma-glfc_lenet-2021-1x8x8-10"
    # beside a model of other inputs in the same folder (`artifacts`'s Gamma: glfc_mlp on 8x8), a Gamma of its own
    assert glfc.gamma_folder(OPTIONS, export_artifacts("lenet", 10, (1, 8, 8))) != folder
    config = FleetConfig(name="g", out=tmp_path / "fleet", devices=1, scenario={"preset": "mnist1d-class"},
                         model="cnn1d", policy={"name": "glfc", "gamma": "glfc_lenet"})
    (tmp_path / "fleet" / "artifacts").mkdir(parents=True)
    for item in signal.iterdir():  # the model's artifacts, exported above: only the policy's export runs
        (tmp_path / "fleet" / "artifacts" / item.name).symlink_to(item)
    with pytest.raises(ConfigError) as refused:
        Fleet(config)._export(SimpleNamespace(num_classes=10, input_shape=(1, 40)),
                              SimpleNamespace(step=lambda what: None), "fleet.toml")
    assert str(refused.value).startswith("fleet.toml: [policy] ") and "glfc_lenet" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_proxy_scores_every_model_of_the_task_on_its_reconstructions_at_the_tasks_end(artifacts):
    """Round 1's model predicts class 1, round 2's class 0; the reconstructions (all of class 1) are there at the
    task's end: round 1's model is the task's best, and the old model broadcast at the task's end."""
    proxy = _proxy(artifacts, gamma="glfc_mlp")
    manifest = proxy.manifest
    base, says = _predicting(artifacts, (0, 1))
    says_zero, says_one = says[0], says[1]

    def ctx(round_):
        return RoundContext(round=round_, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=round_,
                            rounds_per_task=2)

    proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", says_one, 10)], ctx(1))
    x, y = _digits([1], 5)
    proxy.monitor = (0, x, y)  # the reconstructions of task 0
    result = settled(proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", says_zero, 10)], ctx(2)))
    metrics = result.metrics["proxy"]
    assert metrics["best_round_of_task"] == 1.0 and metrics["reconstruction_accuracy"] == 0.0
    weights, task = decode_old_model(result.broadcast, manifest.num_parameters)
    assert task == 0 and np.allclose(weights, says_one)


def test_the_seen_monitor_scores_old_classes_and_the_task_monitor_only_the_tasks(artifacts):
    """Task 1's rounds: round 1's model predicts class 0 (of task 0) everywhere, round 2's class 3. On task 1's
    reconstructions alone (class 2) both score 0 and the latest wins (the paper's monitor); with task 0's
    reconstructions kept (`monitor = "seen"`) round 1's model gets its class-0 samples right and wins."""
    base, says = _predicting(artifacts, (0, 3))
    x0, y0 = _digits([0], 4)
    x2, y2 = _digits([2], 4)
    chosen = {}
    for monitor in ("task", "seen"):
        proxy = _proxy(artifacts, gamma="glfc_mlp", monitor=monitor)
        proxy.monitor = (0, x0, y0)  # task 0's reconstructions
        proxy.job.start(lambda deadline: (1, x2, y2), 10)  # task 1's, done
        proxy.job.wait(10)

        def ctx(r):
            return RoundContext(round=2 + r, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3),
                                round_in_task=r, rounds_per_task=2)

        proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", says[0], 10)], ctx(1))
        result = settled(proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", says[3], 10)], ctx(2)))
        metrics = result.metrics["proxy"]
        chosen[monitor] = (metrics["best_round_of_task"], metrics["monitor_samples"])
    assert chosen == {"task": (2.0, 4.0), "seen": (1.0, 8.0)}


def test_a_restart_mid_task_keeps_the_old_model_of_the_task(artifacts, tmp_path):
    """The old model is stored with the task it serves: a device restarted in the middle of task 1 does not take
    the round's global model (a model of task 1 itself) for its old model."""
    learner = _learner(artifacts, tmp_path)
    first = learner.trainer.get_weights()
    learner.start_task(0, *_digits([0, 1], 30))
    learner.train()
    learner.global_model_arrived(first)  # the last global model of task 0
    learner.start_task(1, *_digits([2, 3], 30))
    learner.train()
    learner.save(tmp_path)
    learner.store.close()
    restarted = _learner(artifacts, tmp_path)
    assert restarted.restore(tmp_path)
    restarted.global_model_arrived(first + 1.0)  # a model of task 1, after the restart
    restarted.train()
    assert np.array_equal(restarted.policy._old_model(), first)
    restarted.store.close()


def _prototypes(gradients):
    return {prototype_name(k): encode_gradient(g) for k, g in enumerate(gradients)}


def test_one_device_cannot_crowd_the_proxys_pool(artifacts, tmp_path):
    """An honest device sends one prototype gradient per new class of a task, once a task. A device that sends 64
    (of the task's classes, of another task's class) gets one per class of the task pooled, once: the honest
    device's count, not the pool. Its second upload in the task is not pooled, across a restart too."""
    proxy = _proxy(artifacts, gamma="glfc_mlp", lbfgs_iterations=1)
    data = load_dataset("digits")
    gradient = {c: _gamma_gradient("glfc_mlp", data.x_train[data.y_train == c][0], c)[0] for c in (0, 1, 5)}
    assert {c: infer_label(g, proxy.gamma_parameters) for c, g in gradient.items()} == {0: 0, 1: 1, 5: 5}
    base = np.fromfile(artifacts / "weights.bin", dtype="<f4")
    flood = [gradient[0] * (1 + k / 100) for k in range(31)] + [gradient[1] * (1 + k / 100) for k in range(31)]
    flood += [gradient[5], gradient[5]]

    def ctx(round_):
        return RoundContext(round=round_, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=round_,
                            rounds_per_task=4)

    hostile = ClientUpdate("d0", base.copy(), 10, attachments=_prototypes(flood))
    honest = ClientUpdate("d1", base.copy(), 10, attachments=_prototypes([gradient[0], gradient[1]]))
    proxy.inspect(hostile)  # well-formed: the pool's rule, not the gate, bounds it
    proxy.aggregate(torch.from_numpy(base), [hostile, honest], ctx(1))
    assert proxy.last_metrics["prototypes_pooled"] == 4.0 and proxy.last_metrics["prototypes_refused"] == 62.0
    assert proxy.pooled == (0, 4)
    proxy.save(tmp_path)
    restarted = _proxy(artifacts, gamma="glfc_mlp", lbfgs_iterations=1)
    restarted.load(tmp_path)
    for strategy in (proxy, restarted):
        again = ClientUpdate("d0", base.copy(), 10, attachments=_prototypes([gradient[0], gradient[1]]))
        strategy.aggregate(torch.from_numpy(base), [again], ctx(2))
        # nothing of it pooled; round 1's reconstructions may have finished meanwhile (a metric of their own,
        # there or not by the host's speed)
        metrics = strategy.last_metrics
        assert metrics["prototypes_refused"] == 2.0 and "prototypes_pooled" not in metrics, metrics
        assert strategy.pooled[1] in (0, 4)
    proxy.job.wait(60)
    restarted.job.wait(60)


def test_a_reconstruction_that_is_not_finite_is_dropped(artifacts):
    """A finite but extreme gradient (an honest one x 1e10) makes the matching diverge: its reconstruction is not
    finite, and it never reaches the monitor set."""
    proxy = _proxy(artifacts, gamma="glfc_lenet", lbfgs_iterations=5)
    x, _ = _digits([4], 1)
    gradient, _ = _gamma_gradient("glfc_lenet", x[0], 4)
    extreme = gradient * np.float32(1e10)
    assert np.isfinite(extreme).all()
    made, labels = proxy.reconstruct([gradient, extreme], Deadline(600))
    assert labels.tolist() == [4] and made.shape == (1, 1, 8, 8) and np.isfinite(made).all()


def test_one_device_lying_about_labels_does_not_choose_the_tasks_model(artifacts):
    """Three honest devices hold class 0 of task 0 and send its prototype gradient; a fourth floods 64 gradients
    of class 1. Round 1's model says 1 for everything, round 2's says 0. Pooled whole, the flood would make the
    monitor set mostly class 1 and round 1's model the task's best; one per class of the task from each device
    leaves it 3 to 1, and the honest devices' choice (round 2's model) stands."""
    proxy = _proxy(artifacts, gamma="glfc_mlp", lbfgs_iterations=1)
    data = load_dataset("digits")
    gradient = {c: _gamma_gradient("glfc_mlp", data.x_train[data.y_train == c][k], c)[0]
                for c, k in ((0, 0), (1, 0))}
    base, says = _predicting(artifacts, (0, 1))

    def ctx(round_):
        return RoundContext(round=round_, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=round_,
                            rounds_per_task=2)

    honest = [ClientUpdate(f"d{k}", says[1].copy(), 10, attachments=_prototypes([gradient[0] * (1 + k / 10)]))
              for k in range(3)]
    liar = ClientUpdate("d9", says[1].copy(), 10,
                        attachments=_prototypes([gradient[1] * (1 + k / 100) for k in range(64)]))
    proxy.aggregate(torch.from_numpy(base), [*honest, liar], ctx(1))  # round 1's model: says 1
    assert proxy.pooled == (0, 4)
    result = settled(proxy.aggregate(torch.from_numpy(base), [ClientUpdate("d0", says[0].copy(), 10)], ctx(2)))
    metrics = result.metrics["proxy"]
    assert metrics["monitor_samples"] == 4.0 and metrics["best_round_of_task"] == 2.0
    weights, task = decode_old_model(result.broadcast, proxy.manifest.num_parameters)
    assert task == 0 and np.allclose(weights, says[0])
