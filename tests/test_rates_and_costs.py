"""Two seams of the trainer contract, on every backend: the expected-cost term of the loss (a reverse
cross-entropy: symmetric cross-entropy's noise-robust half) and a learning rate per parameter (a new head trained
fast over a slowly tuned backbone)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edge_client.trainers.base import LossInputs, Proximal, class_rate_scale, loss_arrays, reverse_ce_costs, softmax
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.flat_weights import flatten_weights, load_flat_weights
from models.loss import training_loss
from models.manifest import class_head_positions, load_manifest
from models.zoo import build_for

ALL = ("ort", "portable", "torch")
SHAPE = (1, 8, 8)
LR = 0.05


def _trainers(directory, optimizer):
    manifest = load_manifest(directory)
    trainers = {"portable": PortableTrainer(directory, optimizer, LR), "torch": TorchTrainer(manifest, optimizer, LR),
                "ort": OrtTrainer(directory, optimizer, LR)}
    start = trainers["portable"].get_weights()
    for trainer in trainers.values():
        trainer.set_weights(start)
    return trainers


@pytest.fixture(scope="module")
def lenet(export_artifacts):
    return export_artifacts("lenet", 10, SHAPE, backends=ALL)


@pytest.mark.parametrize("log_zero", [math.log(1e-4), -4.0], ids=["code-1e-4", "text-A-4"])
@pytest.mark.parametrize("visible", [6, 10], ids=["old-classes-only", "new-classes-visible"])
def test_symmetric_cross_entropy_matches_hand_computed_values_on_every_backend(lenet, log_zero, visible):
    """alpha CE + beta RCE on one-hot labels among the old classes C_B = {0..5}: the softmax runs over the visible
    classes, both sums over C_B, log 0 clamped to A. By hand: CE = -log p_y, RCE = -A (sum_{k in C_B} p_k - p_y),
    which is -A (1 - p_y) when only the old classes are visible (the spec's closed form)."""
    rng = np.random.default_rng(0)
    n, alpha, beta, old = 12, 0.7, 1.3, np.arange(6)
    x, y = rng.random((n, *SHAPE), dtype=np.float32), rng.integers(0, 6, n)
    mask = (np.arange(10) < visible).astype(np.float32)
    loss = LossInputs(sample_weights=np.full(n, alpha, np.float32),
                      class_costs=reverse_ce_costs(y, old, 10, log_zero, weight=beta))
    for name, trainer in _trainers(lenet, "sgd").items():
        p = softmax(trainer.outputs(x, y, mask)[0])  # eval logits: lenet has no train-only layer
        p_label = p[np.arange(n), y]
        rce = -log_zero * (p[:, old].sum(1) - p_label)
        if visible == 6:
            np.testing.assert_allclose(rce, -log_zero * (1 - p_label), rtol=1e-6)
        expected = float(np.mean(alpha * -np.log(p_label) + beta * rce))
        value, _ = trainer.gradient(x, y, mask, loss)
        assert value == pytest.approx(expected, rel=1e-5), name


def test_the_reverse_term_is_bounded_where_the_forward_one_is_not():
    """A confidently wrong label: the forward CE grows without bound as the model grows surer, the reverse term
    stays below -A (why SCE tolerates the generator's mislabelled samples)."""
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0]])
    label = np.array([1])

    def term(weight: float, costs: np.ndarray) -> float:
        arrays = loss_arrays(label, 4, LossInputs(sample_weights=np.array([weight], np.float32), class_costs=costs))
        return float(training_loss(logits, torch.ones(4), *(torch.from_numpy(a) for a in arrays)))

    reverse = term(0.0, reverse_ce_costs(label, np.arange(4), 4, math.log(1e-4)))
    p_label = 1 / (math.exp(30) + 3)
    assert reverse == pytest.approx(-math.log(1e-4) * (1 - p_label), rel=1e-6)
    assert reverse <= -math.log(1e-4) * (1 + 1e-6)  # float32
    assert term(1.0, np.zeros((1, 4), np.float32)) == pytest.approx(30.0, rel=1e-3)


def test_class_costs_are_checked():
    with pytest.raises(ValueError, match="negative"):
        reverse_ce_costs(np.array([0]), np.arange(3), 3, 0.5)


def _torch_groups_reference(manifest, start, optimizer, x, y, mask, low, high, steps):
    """torch.optim itself with two parameter groups: the head at lr * high, the rest at lr * low."""
    model = build_for(manifest)
    load_flat_weights(model, manifest, start)
    head = [p for name, p in model.named_parameters() if name.startswith("head.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    groups = [{"params": rest, "lr": LR * low}, {"params": head, "lr": LR * high}]
    opt = (torch.optim.SGD(groups, lr=LR) if optimizer == "sgd"
           else torch.optim.AdamW(groups, lr=LR, eps=1e-6, weight_decay=0.0))
    plain = [torch.from_numpy(a) for a in loss_arrays(y, 10, None)]
    for _ in range(steps):
        opt.zero_grad()
        raw, _ = model(torch.from_numpy(x))
        loss = training_loss(raw, torch.from_numpy(mask), *plain)
        loss.backward()
        opt.step()
    return flatten_weights(model, manifest)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_with_two_learning_rates_matches_torch_parameter_groups(lenet, optimizer):
    """The head at 20x the rate, the rest at 0.1x, for three steps (AdamW's moments carry over): the portable and
    ORT backends (and the torch trainer) end where torch.optim with two parameter groups ends."""
    rng = np.random.default_rng(1)
    x, y = rng.random((16, *SHAPE), dtype=np.float32), rng.integers(0, 10, 16)
    mask = np.ones(10, np.float32)
    trainers = _trainers(lenet, optimizer)
    manifest = trainers["torch"].manifest
    start = trainers["torch"].get_weights()
    scale = class_rate_scale(manifest, np.arange(10), 20.0, rest=0.1)
    expected = _torch_groups_reference(manifest, start, optimizer, x, y, mask, 0.1, 20.0, steps=3)
    moved = np.abs(expected - start).max()
    for name, trainer in trainers.items():
        with trainer.scaled_rates(scale):
            for _ in range(3):
                trainer.train_step(x, y, mask)
        assert trainer.rate_scale is None  # the scale is gone on leaving
        gap = np.abs(trainer.get_weights() - expected).max() / moved
        assert gap <= (1e-4 if optimizer == "sgd" else 2e-2), (name, gap)
        if optimizer == "adamw":
            close = np.isclose(trainer.get_weights(), expected, rtol=0, atol=1e-3 * LR)
            assert close.mean() > 0.999, name


def test_a_zero_rate_freezes_exactly_the_old_classes_head(lenet):
    """fit() under a scale that trains only the new classes' rows (4..9) at 10x: the old rows and every other
    parameter stay bit for bit, the new rows move, on every backend, with AdamW and the proximal pull."""
    rng = np.random.default_rng(2)
    x, y = rng.random((24, *SHAPE), dtype=np.float32), rng.integers(0, 10, 24)
    trainers = _trainers(lenet, "adamw")
    manifest = trainers["torch"].manifest
    new = class_head_positions(manifest.parameters, np.arange(4, 10))
    scale = class_rate_scale(manifest, np.arange(4, 10), 10.0, rest=0.0)
    for name, trainer in trainers.items():
        start = trainer.get_weights()
        with trainer.scaled_rates(scale):
            trainer.fit(x, y, epochs=1, batch_size=8, rng=np.random.default_rng(0),
                        proximal=Proximal(0.3, start + 0.1))
        after = trainer.get_weights()
        frozen = np.ones(start.size, bool)
        frozen[new] = False
        assert np.array_equal(after[frozen], start[frozen]), name
        assert (after[new] != start[new]).mean() > 0.9, name


def test_class_head_positions_are_the_rows_and_biases_of_those_classes(lenet):
    manifest = load_manifest(lenet)
    flat = np.arange(manifest.num_parameters)
    offset = 0
    tensors = {}
    for p in manifest.parameters:
        tensors[p.name] = flat[offset: offset + p.size].reshape(p.shape)
        offset += p.size
    positions = class_head_positions(manifest.parameters, [2, 7])
    expected = np.concatenate([tensors["head.weight"][2], tensors["head.bias"][2:3], tensors["head.weight"][7],
                               tensors["head.bias"][7:8]])
    np.testing.assert_array_equal(positions, expected)
    with pytest.raises(ValueError, match="classes must lie"):
        class_head_positions(manifest.parameters, [10])


def test_a_bad_rate_scale_is_refused(lenet):
    trainer = PortableTrainer(lenet, "sgd", LR)
    with pytest.raises(ValueError, match="one value per parameter"):
        with trainer.scaled_rates(np.ones(3, np.float32)):
            pass
    bad = np.ones(trainer.manifest.num_parameters, np.float32)
    bad[0] = -1
    with pytest.raises(ValueError, match=">= 0"):
        with trainer.scaled_rates(bad):
            pass


def test_artifacts_exported_for_other_graph_inputs_are_refused_in_one_line(lenet, tmp_path):
    """A set exported before the class-cost input existed would be fed an input its graphs lack: it is refused at
    load, naming what to do."""
    import json
    import shutil

    from models.manifest import MANIFEST_NAME, ManifestError

    old = tmp_path / "old"
    shutil.copytree(lenet, old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    manifest["inputs"] = [value for value in manifest["inputs"] if value["name"] != "class_costs"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="take the graph inputs .*; this edgefil feeds .*class_costs.*export them again"):
        load_manifest(old)
