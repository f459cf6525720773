"""The portable backend: standard ONNX training graphs on plain onnxruntime, against ORT Training and torch.

Parity: one epoch from the same weights over the same batches ends at the same weights on all three backends,
for every zoo model, SGD and AdamW, with and without the proximal term, and with each loss input. The tolerance is
relative to how far the epoch moved the weights (max-norm of the difference over max-norm of the change, against
torch): SGD 1e-3; the gradients themselves agree to ~1e-8, and float32 sums in a different order drift further
through ResNet-18's 20 layers. AdamW 5e-2: Adam divides each gradient by its running RMS plus eps (1e-6), so a
gradient near zero (a dead ReLU's weights, ~1e-9) that two backends round differently (their convolution backward
sums in another order) moves by a visible fraction of a step; ORT Training against torch shows the same effect.
ResNet-18 (slow) gets 2e-2 for SGD: measured worst 1.2e-2 (teacher term with the proximal pull) and 3.1e-3 (momentum),
against ORT Training's < 1e-3 on the same cases, and 1e-1 for AdamW (measured worst 6.4e-2, ORT Training with the proximal
pull and every loss input). What drifts there is most likely the reference: against the same loss's gradient in float64
(the torch model in double), the portable graphs and ORT Training are within 3e-5 of the largest gradient on ResNet-18
(1e-7 to 5e-7 on the other models), torch 2.14's float32 CPU backward 2.5e-5 to 2e-4 (its input gradients 0.2-0.6 %, 1-2 %
of them past a relative 1e-3); so the gradients are checked against that float64 reference (the epochs against torch's).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_client.config import TrainerSettings
from edge_client.trainers.base import LossInputs, Proximal
from edge_client.trainers.choice import make_trainer, resolve_backend
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.manifest import PORTABLE_MODELS, ManifestError, load_manifest

ALL = ("ort", "portable", "torch")
MODELS = [
    ("lenet", (1, 8, 8)),
    ("cnn1d", (1, 40)),
    ("mlp", (1, 8, 8)),
    ("small_cnn", (3, 32, 32)),
    pytest.param(("resnet18_cifar", (3, 32, 32)), marks=pytest.mark.slow, id="resnet18_cifar"),
]
SGD_TOLERANCE = {"resnet18_cifar": 2e-2}  # relative; 1e-3 for the others (module docstring)
ADAMW_TOLERANCE = {"resnet18_cifar": 1e-1}  # relative; 5e-2 for the others (module docstring)
# A gradient's largest gap to the float64 reference, over the reference's largest value (module docstring)
GRADIENT_TOLERANCE = {"torch": 1e-3}  # 1e-4 for the ONNX Runtime backends
LOSSES = ("plain", "sample_weights", "soft_targets", "teacher", "bce", "soft_target_term", "class_costs", "all")
N, BATCH, LR = 24, 8, 0.05


def _loss(kind: str, rng: np.random.Generator) -> LossInputs | None:
    weights = rng.random(N, dtype=np.float32) * 2
    soft = rng.dirichlet(np.ones(10), N).astype(np.float32)
    teacher, teacher_weights = rng.standard_normal((N, 10), dtype=np.float32), rng.random(N, dtype=np.float32)
    return {
        "plain": None,
        "sample_weights": LossInputs(sample_weights=weights),
        "soft_targets": LossInputs(targets=soft),
        "teacher": LossInputs(teacher_logits=teacher, teacher_weights=teacher_weights),
        "bce": LossInputs(targets=(soft > 0.1).astype(np.float32), head="sigmoid-bce"),
        "soft_target_term": LossInputs(targets=(soft > 0.1).astype(np.float32), head="sigmoid-bce",
                                       soft_targets=soft, soft_weights=weights),
        "class_costs": LossInputs(class_costs=rng.normal(1.0, 2.0, (N, 10)).astype(np.float32)),
        "all": LossInputs(weights, soft, teacher, teacher_weights, "softmax-ce", soft, weights,
                          rng.normal(1.0, 2.0, (N, 10)).astype(np.float32)),
    }[kind]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0])
def model(request, export_artifacts):
    name, shape = request.param
    return export_artifacts(name, 10, shape, backends=ALL), shape


def _trainers(directory, optimizer, momentum=0.0):
    manifest = load_manifest(directory)
    trainers = {"portable": PortableTrainer(directory, optimizer, LR, momentum=momentum),
                "torch": TorchTrainer(manifest, optimizer, LR, momentum=momentum)}
    if not momentum:
        trainers["ort"] = OrtTrainer(directory, optimizer, LR)
    start = trainers["portable"].get_weights()
    for trainer in trainers.values():
        trainer.set_weights(start)
    return trainers


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("proximal", [False, True], ids=["", "proximal"])
@pytest.mark.parametrize("loss", LOSSES)
def test_one_epoch_ends_at_the_same_weights_on_every_backend(model, optimizer, proximal, loss):
    directory, shape = model
    rng = np.random.default_rng(7)
    x, y = rng.random((N, *shape), dtype=np.float32), rng.integers(0, 10, N)
    mask = (np.arange(10) < 8).astype(np.float32)
    trainers = _trainers(directory, optimizer)
    start = trainers["torch"].get_weights()
    pull = Proximal(0.5, trainers["torch"].get_weights() + 0.05) if proximal else None
    inputs = _loss(loss, rng)
    results = {name: (t.fit(x, y, epochs=1, batch_size=BATCH, class_mask=mask, rng=np.random.default_rng(1),
                            proximal=pull, loss=inputs), t.get_weights()) for name, t in trainers.items()}
    reference_loss, reference = results["torch"]
    for name in ("portable", "ort"):
        value, weights = results[name]
        assert value == pytest.approx(reference_loss, rel=1e-4, abs=1e-5), name
        model_name = load_manifest(directory).model
        tolerance = SGD_TOLERANCE.get(model_name, 1e-3) if optimizer == "sgd" else ADAMW_TOLERANCE.get(model_name, 5e-2)
        assert _relative_gap(weights, reference, start) <= tolerance, name


def _float64_gradients(trainer: TorchTrainer, x: np.ndarray, y: np.ndarray, loss: LossInputs | None
                       ) -> tuple[float, np.ndarray, np.ndarray]:
    """The training loss at `trainer`'s weights (train mode, no class mask) and its gradients w.r.t. the weights (in
    manifest order) and the inputs, computed in float64 on a copy of its torch model: the reference the backends'
    float32 gradients are measured against (module docstring)."""
    import copy

    import torch

    from edge_client.trainers.base import loss_arrays
    from models.loss import training_loss

    model = copy.deepcopy(trainer.model).double()
    model.train()
    inputs = torch.from_numpy(x).double().requires_grad_(True)
    raw, _ = model(inputs)
    arrays = loss_arrays(y, trainer.manifest.num_classes, None if loss is None else trainer._check_loss(loss, len(y)))
    terms = [torch.from_numpy(a).double() if a.dtype.kind == "f" else torch.from_numpy(a) for a in arrays]
    value = training_loss(raw, torch.from_numpy(trainer.mask(None)).double(), *terms)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(value, [inputs, *(params[p.name] for p in trainer.manifest.parameters)])
    weights = np.concatenate([g.detach().numpy().ravel() for g in grads[1:]])
    return float(value.item()), weights, grads[0].detach().numpy()


def _relative_gap(weights: np.ndarray, reference: np.ndarray, start: np.ndarray) -> float:
    """How far two backends' weights differ, relative to how far training moved them."""
    return float(np.abs(weights - reference).max() / np.abs(reference - start).max())


def test_sgd_momentum_matches_torch(model):
    directory, shape = model
    rng = np.random.default_rng(3)
    x, y = rng.random((N, *shape), dtype=np.float32), rng.integers(0, 10, N)
    trainers = _trainers(directory, "sgd", momentum=0.9)
    start = trainers["torch"].get_weights()
    weights = [t.fit(x, y, epochs=2, batch_size=BATCH, rng=np.random.default_rng(1)) and t.get_weights()
               for t in trainers.values()]
    assert _relative_gap(weights[0], weights[1], start) <= SGD_TOLERANCE.get(load_manifest(directory).model, 1e-3)


@pytest.mark.parametrize("mode", ["exact", "last-layer"])
def test_per_sample_gradient_norms_agree_with_torch_func(model, mode):
    directory, shape = model
    rng = np.random.default_rng(5)
    x, y = rng.random((21, *shape), dtype=np.float32), rng.integers(0, 10, 21)  # 21: the last chunk is padded
    trainers = _trainers(directory, "sgd")
    mask = (np.arange(10) < 6).astype(np.float32)
    y = y % 6
    portable = trainers["portable"].per_sample_grad_norms(x, y, mode, class_mask=mask)
    reference = trainers["torch"].per_sample_grad_norms(x, y, mode, class_mask=mask)
    # rtol 1e-3: the graph sums 11M squares (ResNet-18) in float32, torch.func in float64
    np.testing.assert_allclose(portable, reference, rtol=1e-3, atol=1e-7 * reference.max())


@pytest.mark.parametrize("loss", ["all"])
def test_the_gradient_is_the_same_on_every_backend_and_moves_nothing(model, loss):
    """Trainer.gradient (what Re-Fed's PIM steps with): the loss and its gradient, in manifest order, on the three
    backends, each within its tolerance of the float64 reference (GRADIENT_TOLERANCE); the weights stay where they
    were."""
    directory, shape = model
    rng = np.random.default_rng(4)
    x, y = rng.random((N, *shape), dtype=np.float32), rng.integers(0, 10, N)
    inputs = _loss(loss, rng)
    trainers = _trainers(directory, "adamw")
    start = trainers["torch"].get_weights()
    results = {name: t.gradient(x, y, None, inputs) for name, t in trainers.items()}
    reference_loss, reference, _ = _float64_gradients(trainers["torch"], x, y, inputs)
    for name, (value, gradient) in results.items():
        assert gradient.dtype == np.float32 and gradient.shape == start.shape
        assert value == pytest.approx(reference_loss, rel=1e-5)
        gap = np.abs(gradient - reference).max() / np.abs(reference).max()
        assert gap <= GRADIENT_TOLERANCE.get(name, 1e-4), name
        assert np.array_equal(trainers[name].get_weights(), start)


def test_steps_reuse_the_process_spares_and_a_trainer_keeps_only_its_weights_and_state(export_artifacts):
    """No step copies a parameter buffer, and after the first few none allocates one: what a step writes comes
    from the process's spares and what it leaves goes back, so between steps a trainer holds its weights and its
    optimiser state (3 buffers with AdamW) and the pool the 4 a step needs besides, whatever the steps."""
    import gc

    from edge_client.trainers.portable import _spares

    gc.collect()  # earlier tests' trainers finalized: their spares gone with them
    trainer = PortableTrainer(export_artifacts("lenet", backends=ALL), "adamw", LR)
    size = trainer.manifest.num_parameters
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 8)
    assert trainer._state == {}  # no optimiser state before the first step
    for _ in range(3):
        trainer.train_step(x, y, trainer.mask(None))
    held = _spares.held(size)
    seen = set()
    for _ in range(8):
        trainer.train_step(x, y, trainer.mask(None))
        seen |= {trainer._weights.data_ptr(), *(state.data_ptr() for state in trainer._state.values())}
        assert _spares.held(size) == held
    assert len(trainer._state) == 2
    assert len(seen) <= 3 + held  # the buffers rotate among the trainer's and the pool's, nothing new


def _without(artifacts: Path, graphs: tuple[str, ...], folder: Path) -> Path:
    """A copy of the set without `graphs`, as an export from before them wrote it."""
    shutil.copytree(artifacts, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for graph in graphs:
        (folder / PORTABLE_MODELS[graph]).unlink()
        del manifest["files"][PORTABLE_MODELS[graph]]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_plain_step_runs_the_plain_graphs_its_set_holds_and_ends_at_the_same_floats_as_the_whole_graphs(
        export_artifacts, optimizer, tmp_path):
    """A plain step (its loss shaped by targets and sample weights alone; no momentum kept, no proximal pull, every
    rate lr) runs the fused plain step (one session run); a set without it the plain gradient, then the plain update
    (2 passes over the weights for SGD, 14 for AdamW, where the whole update takes 9 and 24); a set without those
    (an export before them) the whole graphs. Every way ends at the same weights and optimiser state. A teacher
    term takes the whole gradient graph, a rate scale the whole update."""
    artifacts = export_artifacts("lenet", backends=ALL)
    rng = np.random.default_rng(0)
    x, y = rng.random((96, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 96)
    mask = (np.arange(10) < 7).astype(np.float32)
    step, update = f"step_{optimizer}_plain", f"{optimizer}_plain"
    steps = ("step_sgd_plain", "step_adamw_plain")
    sets = {  # the graphs a plain step runs on each set
        (step,): artifacts,
        ("gradient_plain", update): _without(artifacts, steps, tmp_path / "no-step"),
        ("gradient", update): _without(artifacts, (*steps, "gradient_plain"), tmp_path / "no-plain-gradient"),
        ("gradient_plain", optimizer): _without(artifacts, (*steps, "sgd_plain", "adamw_plain"), tmp_path / "no-plain-update"),
        ("gradient", optimizer): _without(artifacts, (*steps, "gradient_plain", "sgd_plain", "adamw_plain"),
                                          tmp_path / "older"),
    }
    for loss in (None, LossInputs(sample_weights=rng.random(96, dtype=np.float32),
                                  targets=rng.dirichlet(np.ones(10), 96).astype(np.float32))):
        ends = []
        for graphs, folder in sets.items():
            trainer = PortableTrainer(folder, optimizer, LR)
            trainer.fit(x, y, epochs=2, batch_size=32, class_mask=mask, rng=np.random.default_rng(1), loss=loss)
            assert set(trainer._sessions) == set(graphs), folder.name
            state = trainer.optimizer_state()
            ends.append((trainer.get_weights(), [] if state is None else list(state.buffers.values())))
        for weights, buffers in ends[1:]:
            np.testing.assert_array_equal(weights, ends[0][0])
            assert all(np.array_equal(a, b) for a, b in zip(buffers, ends[0][1]))

    teacher = PortableTrainer(artifacts, optimizer, LR)
    teacher.fit(x, y, epochs=1, batch_size=32,
                loss=LossInputs(teacher_logits=rng.random((96, 10), dtype=np.float32),
                                teacher_weights=np.ones(96, np.float32)))
    assert set(teacher._sessions) == {"gradient", update}
    scaled = PortableTrainer(artifacts, optimizer, LR)
    with scaled.scaled_rates(np.ones(scaled.manifest.num_parameters, np.float32)):
        scaled.fit(x, y, epochs=1, batch_size=32)
    assert set(scaled._sessions) == {"gradient_plain", optimizer}
    momentum = PortableTrainer(artifacts, "sgd", LR, momentum=0.9)  # keeps a velocity: the whole update
    momentum.fit(x, y, epochs=1, batch_size=32)
    assert set(momentum._sessions) == {"gradient_plain", "sgd"}


def test_untrained_trainers_read_shared_weights_in_place_and_a_step_writes_a_buffer_of_their_own(export_artifacts):
    """Two trainers on one artifact set read one copy of the initial weights, and two given the same read-only
    global model read that array itself; a step writes weights of the trainer's own and leaves the shared array as
    it was, so the other trainer still reads it; a writable buffer is copied (its owner may change it)."""
    directory = export_artifacts("lenet", backends=ALL)
    first, second = PortableTrainer(directory, "adamw", LR), PortableTrainer(directory, "adamw", LR)
    assert first._weights.data_ptr() == second._weights.data_ptr()  # the artifacts' weights, once
    rng = np.random.default_rng(5)
    global_model = rng.standard_normal(first.manifest.num_parameters).astype(np.float32) * 0.05
    global_model.flags.writeable = False
    kept = global_model.copy()
    for trainer in (first, second):
        trainer.set_weights(global_model)
        assert trainer._weights.data_ptr() == global_model.ctypes.data
    x, y = rng.random((8, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 8)
    first.train_step(x, y, first.mask(None))
    assert first._weights.data_ptr() != global_model.ctypes.data
    assert not np.array_equal(first.get_weights(), kept)  # it learnt ...
    np.testing.assert_array_equal(global_model, kept)  # ... in a buffer of its own
    np.testing.assert_array_equal(second.get_weights(), kept)
    writable = kept.copy()
    second.set_weights(writable)
    writable[:] = 0.0
    np.testing.assert_array_equal(second.get_weights(), kept)


def test_trainers_on_one_artifact_set_share_sessions_and_train_independently(export_artifacts):
    """A fleet worker's devices share each graph's session (one copy, not one per device) but not their weights
    or optimiser state: two trainers stepping at once in two threads end where each ends alone."""
    import threading

    directory = export_artifacts("lenet", backends=ALL)
    rng = np.random.default_rng(3)
    data = [(rng.random((8, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 8)) for _ in range(2)]

    def train(trainer: PortableTrainer, x, y) -> None:
        for _ in range(20):
            trainer.train_step(x, y, trainer.mask(None))

    alone = []
    for x, y in data:
        trainer = PortableTrainer(directory, "adamw", LR)
        train(trainer, x, y)
        alone.append(trainer.get_weights())
    pair = [PortableTrainer(directory, "adamw", LR) for _ in data]
    assert pair[0]._session("gradient") is pair[1]._session("gradient")
    assert pair[0]._session("adamw") is pair[1]._session("adamw")
    threads = [threading.Thread(target=train, args=(t, x, y)) for t, (x, y) in zip(pair, data)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for trainer, weights in zip(pair, alone):
        np.testing.assert_array_equal(trainer.get_weights(), weights)
    assert not np.array_equal(alone[0], alone[1])


def test_nominal_portable_set_needs_weights_first(export_artifacts):
    full = PortableTrainer(export_artifacts("lenet", backends=ALL))
    trainer = PortableTrainer(export_artifacts("lenet", nominal=True, backends=("portable",)))
    x, y = np.zeros((2, 1, 8, 8), dtype=np.float32), np.zeros(2, dtype=np.int64)
    with pytest.raises(RuntimeError, match="nominal"):
        trainer.fit(x, y)
    trainer.set_weights(full.get_weights())
    trainer.fit(x, y)
    assert not np.array_equal(trainer.get_weights(), full.get_weights())


def test_auto_takes_portable_then_ort_and_named_backends_must_be_served(export_artifacts):
    """The portable graphs first, on any onnxruntime; ONNX Runtime Training (no longer maintained upstream) where
    the artifacts serve no portable graphs, or where a device names it."""
    both = export_artifacts("lenet", backends=ALL)
    assert make_trainer(TrainerSettings(backend="auto"), both).backend == "portable"
    assert make_trainer(TrainerSettings(backend="ort"), both).backend == "ort"
    assert resolve_backend("auto", ("ort", "torch")) == "ort"
    assert resolve_backend("auto", ("portable", "torch")) == "portable"
    assert resolve_backend("auto", ("torch",)) == "torch"
    with pytest.raises(ManifestError, match="serve the ort, torch backends, not 'portable'"):
        make_trainer(TrainerSettings(backend="portable"), export_artifacts("lenet"))
    with pytest.raises(ManifestError, match="serve"):
        PortableTrainer(export_artifacts("lenet"))
    with pytest.raises(ValueError, match="momentum needs the portable or torch backend"):
        make_trainer(TrainerSettings(backend="ort", momentum=0.9), both)


def test_a_torch_device_trains_with_its_configured_threads(export_artifacts):
    """[trainer] threads bounds every backend: ORT and portable set their sessions', torch its process's pool (a
    device daemon is one process; left at torch's default it would take every core of a shared board)."""
    import torch

    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            make_trainer(TrainerSettings(backend="torch", threads=threads), export_artifacts("lenet"))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("loss", ["plain", "soft_target_term"])
def test_input_gradients_agree_with_the_float64_reference(model, loss):
    """The gradient w.r.t. the inputs (what moves a sample, GLFC's prototype refinement): the portable graph, ORT
    Training's trainer through it, and torch's on the models where its float32 backward holds (not ResNet-18:
    module docstring) give the float64 reference's."""
    directory, shape = model
    rng = np.random.default_rng(11)
    x, y = rng.random((N, *shape), dtype=np.float32), rng.integers(0, 10, N)
    inputs = _loss(loss, rng)
    trainers = _trainers(directory, "sgd")
    expected_loss, _, expected = _float64_gradients(trainers["torch"], x, y, inputs)
    assert expected.shape == x.shape and np.abs(expected).max() > 0
    names = ("portable", "ort") if load_manifest(directory).model == "resnet18_cifar" else ("portable", "ort", "torch")
    for name in names:
        value, gradient = trainers[name].input_gradient(x, y, loss=inputs)
        assert value == pytest.approx(expected_loss, rel=1e-5), name
        np.testing.assert_allclose(gradient, expected, rtol=1e-3, atol=1e-6 * np.abs(expected).max(), err_msg=name)
