"""ORT artifacts and the torch model they came from compute the same things."""
import numpy as np
import pytest
import torch

from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.flat_weights import flatten_weights, load_flat_weights
from models.zoo import build_model

CASES = [("lenet", (1, 8, 8)), ("cnn1d", (1, 40)), ("small_cnn", (3, 32, 32)), ("mlp", (1, 8, 8))]


def _batch(shape, n=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, *shape), dtype=np.float32), rng.integers(0, classes, n).astype(np.int64)


@pytest.mark.parametrize("name,shape", CASES)
def test_flat_buffer_round_trips_exactly(export_artifacts, name, shape):
    trainer = OrtTrainer(export_artifacts(name, 10, shape))
    first = trainer.get_weights()
    new = np.random.default_rng(1).standard_normal(first.size).astype(np.float32)
    trainer.set_weights(new)
    assert np.array_equal(trainer.get_weights(), new)
    trainer.set_weights(first)
    assert np.array_equal(trainer.get_weights(), first)


@pytest.mark.parametrize("name,shape", CASES)
def test_exported_weights_are_the_torch_models_in_manifest_order(export_artifacts, name, shape):
    trainer = OrtTrainer(export_artifacts(name, 10, shape))
    model = build_model(name, 10, shape, seed=0)
    assert np.array_equal(trainer.get_weights(), flatten_weights(model, trainer.manifest))


@pytest.mark.parametrize("name,shape", CASES)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_step_gives_the_same_loss_and_weights(export_artifacts, name, shape, optimizer):
    _check_one_step(export_artifacts, name, shape, optimizer)


def test_resnet18_sgd_step_matches_torch(export_artifacts):
    """Through 18 GroupNorm layers the two runtimes' float32 sums differ in order, so single weights can drift
    by ~1e-4 of their gradient; the step as a whole must still agree to 1e-3 (norm-wise) and the loss to 1e-5."""
    ort_trainer = OrtTrainer(export_artifacts("resnet18_cifar", 10, (3, 32, 32)), optimizer="sgd", lr=0.05)
    torch_trainer = TorchTrainer(ort_trainer.manifest, optimizer="sgd", lr=0.05, seed=7)
    start = ort_trainer.get_weights()
    torch_trainer.set_weights(start)
    x, y = _batch((3, 32, 32))
    mask = ort_trainer.mask(None)
    np.testing.assert_allclose(ort_trainer.train_step(x, y, mask), torch_trainer.train_step(x, y, mask), rtol=1e-5)
    step_ort = ort_trainer.get_weights() - start
    step_torch = torch_trainer.get_weights() - start
    assert np.linalg.norm(step_torch) > 0
    assert np.linalg.norm(step_ort - step_torch) / np.linalg.norm(step_torch) < 1e-3

def _check_one_step(export_artifacts, name, shape, optimizer):
    ort_trainer = OrtTrainer(export_artifacts(name, 10, shape), optimizer=optimizer, lr=0.05)
    torch_trainer = TorchTrainer(ort_trainer.manifest, optimizer=optimizer, lr=0.05, seed=7)
    initial = ort_trainer.get_weights()  # the model's own initialisation, moved so torch cannot match by chance
    noise = np.random.default_rng(2).normal(0, 0.01, initial.size).astype(np.float32)
    start = initial + noise
    ort_trainer.set_weights(start)
    torch_trainer.set_weights(start)
    x, y = _batch(shape)
    mask = ort_trainer.mask(None)
    ort_loss = ort_trainer.train_step(x, y, mask)
    torch_loss = torch_trainer.train_step(x, y, mask)
    np.testing.assert_allclose(ort_loss, torch_loss, rtol=1e-5)
    after_ort, after_torch = ort_trainer.get_weights(), torch_trainer.get_weights()
    assert not np.array_equal(after_ort, start)  # the step moved the weights
    if optimizer == "sgd":
        np.testing.assert_allclose(after_ort, after_torch, rtol=1e-5, atol=1e-7)
    else:
        # Adam's first step is about lr * g / (|g| + eps): where |g| is near eps, float32 noise in the gradient
        # moves the step by up to lr. So AdamW must agree to 0.1 % of lr on all but 0.1 % of the weights.
        close = np.isclose(after_ort, after_torch, rtol=0, atol=1e-3 * 0.05)
        assert close.mean() > 0.999


@pytest.mark.parametrize("name,shape", CASES + [("resnet18_cifar", (3, 32, 32))])
def test_eval_logits_and_features_match_torch(export_artifacts, name, shape):
    trainer = OrtTrainer(export_artifacts(name, 10, shape))
    model = build_model(name, 10, shape, seed=0).eval()
    x, y = _batch(shape, n=8)
    mask = np.ones(10, dtype=np.float32)
    mask[[0, 3]] = 0.0
    loss, logits, features = trainer.forward(x, y, mask)
    with torch.no_grad():
        ref_logits, ref_features = model(torch.from_numpy(x), torch.from_numpy(mask))
        ref_loss = torch.nn.functional.cross_entropy(ref_logits, torch.from_numpy(y))
    np.testing.assert_allclose(features, ref_features.numpy(), rtol=1e-4, atol=1e-5)
    visible = mask == 1
    np.testing.assert_allclose(logits[:, visible], ref_logits.numpy()[:, visible], rtol=1e-4, atol=1e-5)
    assert np.all(logits[:, ~visible] < -1e8)
    np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-4)


def test_torch_flat_buffer_round_trips(export_artifacts):
    trainer = OrtTrainer(export_artifacts("lenet"))
    model = build_model("lenet", 10, seed=5)
    buffer = np.arange(trainer.manifest.num_parameters, dtype=np.float32)
    load_flat_weights(model, trainer.manifest, buffer)
    assert np.array_equal(flatten_weights(model, trainer.manifest), buffer)
    with pytest.raises(ValueError, match="float32 buffer"):
        load_flat_weights(model, trainer.manifest, buffer[:-1])


LOSS_INPUTS = {
    "sample-weights": lambda rng, n: dict(sample_weights=rng.random(n).astype(np.float32) * 2),
    "soft-targets": lambda rng, n: dict(targets=rng.dirichlet(np.ones(10), n).astype(np.float32)),
    "teacher": lambda rng, n: dict(teacher_logits=rng.normal(size=(n, 10)).astype(np.float32),
                                   teacher_weights=rng.random(n).astype(np.float32)),
    "bce-multi-hot": lambda rng, n: dict(targets=(rng.random((n, 10)) < 0.3).astype(np.float32), head="sigmoid-bce"),
    "soft-target-term": lambda rng, n: dict(soft_targets=rng.random((n, 10)).astype(np.float32),
                                            soft_weights=rng.random(n).astype(np.float32), head="sigmoid-bce"),
}


@pytest.mark.parametrize("inputs", sorted(LOSS_INPUTS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_loss_input_trains_the_same_on_ort_and_torch(export_artifacts, inputs, optimizer):
    """The generic loss (models/loss.py) is the ORT graph's and the torch backend's: one epoch with each input."""
    from edge_client.trainers.base import LossInputs

    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    x, y = _batch((1, 8, 8), n=24)
    mask = np.ones(10, dtype=np.float32)
    mask[8:] = 0.0
    y = y % 8
    loss = LossInputs(**LOSS_INPUTS[inputs](np.random.default_rng(4), len(y)))
    ort = OrtTrainer(artifacts, optimizer=optimizer, lr=0.01)
    torch_trainer = TorchTrainer(ort.manifest, optimizer=optimizer, lr=0.01)
    torch_trainer.set_weights(ort.get_weights())
    losses = [t.fit(x, y, epochs=1, batch_size=8, class_mask=mask, rng=np.random.default_rng(0), loss=loss)
              for t in (ort, torch_trainer)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    moved = np.abs(ort.get_weights() - torch_trainer.get_weights())
    if optimizer == "sgd":
        assert moved.max() < 1e-5
    else:  # a first Adam step is ~lr * g / (|g| + eps): float noise in tiny gradients moves single weights
        assert np.mean(moved < 1e-3 * 0.01) > 0.999
