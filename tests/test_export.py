"""Artifact export, the manifest, and every way an artifact set is refused."""
import json
import os
import shutil

import numpy as np
import pytest

from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edgefil import __version__
from edgefil.cli import main
from models import manifest as manifest_module
from models.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    MANIFEST_NAME,
    MAX_IR_VERSION,
    OPTIMIZER_MODELS,
    TRAINING_MODEL,
    WEIGHTS,
    ManifestError,
    load_manifest,
    read_ir_version,
    sha256_file,
)
from models.zoo import build_model


@pytest.fixture
def lenet_copy(export_artifacts, tmp_path):
    target = tmp_path / "lenet"
    shutil.copytree(export_artifacts("lenet"), target)
    return target


def _edit_manifest(directory, **changes):
    path = directory / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "name,classes,shape",
    [("lenet", 10, (1, 28, 28)), ("cnn1d", 10, (1, 40)), ("small_cnn", 100, (3, 32, 32)), ("mlp", 4, (2, 5))],
)
def test_manifest_describes_the_exported_model(export_artifacts, name, classes, shape):
    directory = export_artifacts(name, classes, shape)
    manifest = load_manifest(directory)
    model = build_model(name, classes, shape)
    assert manifest.model == name
    assert manifest.input_shape == shape
    assert manifest.num_classes == classes
    assert manifest.feature_dim == model.head.in_features
    assert manifest.edgefil_version == __version__
    assert manifest.opset == 17
    assert manifest.ir_version == read_ir_version(directory / TRAINING_MODEL) <= MAX_IR_VERSION
    # whatever IR version the host's onnx stamps on the graphs it builds (14 for onnx 1.23's, the optimizer
    # graphs ORT's artifact builder makes), every graph is written as one the devices' ONNX Runtime reads
    assert all(read_ir_version(f) <= MAX_IR_VERSION for f in directory.glob("*.onnx"))
    torch_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {p.name: p.shape for p in manifest.parameters} == torch_shapes
    assert manifest.num_parameters == sum(p.numel() for p in model.parameters())
    assert manifest.backends == ("ort", "torch")
    expected_files = {TRAINING_MODEL, EVAL_MODEL, CHECKPOINT, *OPTIMIZER_MODELS.values(), WEIGHTS}
    assert set(manifest.files) == expected_files
    for file_name, digest in manifest.files.items():
        assert sha256_file(directory / file_name) == digest


def test_eval_model_returns_loss_logits_and_penultimate_features(export_artifacts):
    trainer = OrtTrainer(export_artifacts("cnn1d", 10, (1, 40)))
    x = np.random.default_rng(0).random((5, 1, 40), dtype=np.float32)
    loss, logits, features = trainer.forward(x, np.zeros(5, dtype=np.int64), trainer.mask(None))
    assert np.isfinite(loss)
    assert logits.shape == (5, 10)
    assert features.shape == (5, trainer.manifest.feature_dim)


def test_cli_export_writes_a_loadable_artifact_set(tmp_path, capsys):
    out = tmp_path / "lenet"  # the README's export (test_first_federation then finds it in the cache)
    assert main(["export", "--model", "lenet", "--classes", "10", "--out", str(out), "--input-shape", "1,8,8"]) == 0
    assert "for the ort, portable, torch backends" in capsys.readouterr().out
    trainer = OrtTrainer(out)
    assert trainer.manifest.num_classes == 10
    assert np.array_equal(PortableTrainer(out).get_weights(), trainer.get_weights())
    assert main(["export", "--list"]) == 0
    assert "resnet18_cifar" in capsys.readouterr().out


def test_nominal_checkpoint_is_smaller_and_needs_weights_before_use(export_artifacts):
    full_dir = export_artifacts("lenet")
    nominal_dir = export_artifacts("lenet", nominal=True)
    assert load_manifest(nominal_dir).nominal_checkpoint
    assert (nominal_dir / CHECKPOINT).stat().st_size < (full_dir / CHECKPOINT).stat().st_size / 10
    weights = OrtTrainer(full_dir).get_weights()
    trainer = OrtTrainer(nominal_dir)
    x = np.zeros((2, 1, 8, 8), dtype=np.float32)
    y = np.zeros(2, dtype=np.int64)
    with pytest.raises(RuntimeError, match="nominal"):
        trainer.evaluate(x, y)
    with pytest.raises(RuntimeError, match="nominal"):
        trainer.fit(x, y)
    trainer.set_weights(weights)
    assert np.array_equal(trainer.get_weights(), weights)
    trainer.fit(x, y)
    assert not np.array_equal(trainer.get_weights(), weights)


def test_tampered_file_is_refused(lenet_copy):
    with open(lenet_copy / EVAL_MODEL, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ManifestError, match="sha256"):
        OrtTrainer(lenet_copy)


def test_a_file_changed_after_it_was_found_good_is_hashed_again_and_refused(lenet_copy):
    """verify_files reads a file found good only once while it stays unchanged (a fleet worker loads one artifact
    set for thousands of devices); writing to it, even keeping its size, is seen and refused."""
    load_manifest(lenet_copy)
    hashed = []
    real = manifest_module.sha256_file
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest_module, "sha256_file", lambda path: hashed.append(path) or real(path))
        load_manifest(lenet_copy)
        assert hashed == []  # nothing changed: nothing read again
        path = lenet_copy / EVAL_MODEL
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))  # the same size
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))  # a coarse clock's same tick
        with pytest.raises(ManifestError, match="sha256"):
            load_manifest(lenet_copy)
        assert path in hashed


def test_missing_file_and_missing_manifest_are_refused(lenet_copy):
    (lenet_copy / OPTIMIZER_MODELS["adamw"]).unlink()
    with pytest.raises(ManifestError, match="missing"):
        load_manifest(lenet_copy)
    (lenet_copy / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="no manifest.json"):
        load_manifest(lenet_copy)


def test_wrong_parameter_count_is_refused(lenet_copy):
    data = json.loads((lenet_copy / MANIFEST_NAME).read_text())
    _edit_manifest(lenet_copy, num_parameters=data["num_parameters"] + 1)
    with pytest.raises(ManifestError, match="parameters"):
        load_manifest(lenet_copy)
    # a consistent manifest whose parameter list does not match the model files
    data["parameters"][0]["shape"][0] += 1
    data["num_parameters"] = sum(int(np.prod(p["shape"])) for p in data["parameters"])
    (lenet_copy / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="parameter values"):
        OrtTrainer(lenet_copy)


def test_ir_version_too_new_is_refused(lenet_copy):
    _edit_manifest(lenet_copy, ir_version=MAX_IR_VERSION + 1)
    with pytest.raises(ManifestError, match="IR version"):
        load_manifest(lenet_copy)


def test_model_file_with_a_newer_ir_is_refused_even_if_the_manifest_hides_it(lenet_copy):
    path = lenet_copy / TRAINING_MODEL
    data = bytearray(path.read_bytes())
    assert data[0] == 0x08  # field 1 (ir_version), varint: the first field torch's exporter writes
    data[1] = MAX_IR_VERSION + 4
    path.write_bytes(bytes(data))
    files = json.loads((lenet_copy / MANIFEST_NAME).read_text())["files"]
    _edit_manifest(lenet_copy, files={**files, TRAINING_MODEL: sha256_file(path)})
    with pytest.raises(ManifestError, match=f"IR version {MAX_IR_VERSION + 4}"):
        load_manifest(lenet_copy)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"model": "lenet"}'])
def test_malformed_manifest_is_refused(lenet_copy, text):
    (lenet_copy / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError, match="malformed"):
        load_manifest(lenet_copy)


def test_unknown_manifest_format_is_refused(lenet_copy):
    _edit_manifest(lenet_copy, format=99)
    with pytest.raises(ManifestError, match="format 99"):
        load_manifest(lenet_copy)


def test_bad_weight_buffers_are_refused_and_leave_the_weights_alone(export_artifacts):
    trainer = OrtTrainer(export_artifacts("lenet"))
    weights = trainer.get_weights()
    nan = weights.copy()
    nan[3] = np.nan
    inf = weights.copy()
    inf[-1] = np.inf
    for bad, message in [
        (weights[:-1], "float32 buffer"),
        (weights.astype(np.float64), "float32 buffer"),
        (weights.reshape(1, -1), "float32 buffer"),
        (nan, "NaN"),
        (inf, "NaN or Inf"),
    ]:
        with pytest.raises(ValueError, match=message):
            trainer.set_weights(bad)
    assert np.array_equal(trainer.get_weights(), weights)


def test_a_read_only_weight_buffer_is_looked_at_for_nan_once_a_process(export_artifacts, monkeypatch):
    """Whoever makes a buffer read-only promises it never changes: found finite once, it is not looked at again (a
    fleet worker's devices all set one global model's array); a writable one is looked at every time, and a
    read-only one with NaN is refused every time."""
    trainer = OrtTrainer(export_artifacts("lenet"))
    shared = trainer.get_weights()
    shared.flags.writeable = False
    nan = trainer.get_weights()
    nan[3] = np.nan
    nan.flags.writeable = False
    writable = trainer.get_weights()
    looked = []
    real_isfinite = np.isfinite
    monkeypatch.setattr(np, "isfinite", lambda array: looked.append(len(array)) or real_isfinite(array))
    for _ in range(3):
        trainer.set_weights(shared)
        trainer.set_weights(writable)
        with pytest.raises(ValueError, match="NaN or Inf"):
            trainer.set_weights(nan)
    assert len(looked) == 1 + 3 + 3
    assert np.array_equal(trainer.get_weights(), writable)


def test_bad_batches_are_refused(export_artifacts):
    trainer = OrtTrainer(export_artifacts("lenet"))
    good_x = np.zeros((4, 1, 8, 8), dtype=np.float32)
    good_y = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="inputs must have shape"):
        trainer.fit(np.zeros((4, 1, 28, 28), dtype=np.float32), good_y)
    with pytest.raises(ValueError, match="labels must have shape"):
        trainer.fit(good_x, good_y[:3])
    with pytest.raises(ValueError, match="labels must lie"):
        trainer.fit(good_x, good_y + 10)
    with pytest.raises(ValueError, match="class mask"):
        trainer.fit(good_x, good_y, class_mask=np.ones(3))
    with pytest.raises(ValueError, match="unknown optimizer"):
        OrtTrainer(export_artifacts("lenet"), optimizer="lamb")


def test_a_cached_export_is_the_same_set_copied_and_a_damaged_one_is_made_anew(tmp_path, monkeypatch):
    """models/cache.py: the second export of the same arguments is the first one's files, verified and copied;
    other arguments are another key; a cached file that no longer matches its sha256 is exported again."""
    from models.cache import ARTIFACTS, cache_dir
    from models.export import export_registered

    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path / "cache"))
    calls = []
    import models.export as export_module

    real = export_module.export_model
    monkeypatch.setattr(export_module, "export_model", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    first = export_registered("lenet", 10, tmp_path / "a", (1, 8, 8), backends=("ort", "torch"), cache=True)
    second = export_registered("lenet", 10, tmp_path / "b", (1, 8, 8), backends=("ort", "torch"), cache=True)
    assert calls == ["lenet"] and first == second
    for name in [*first.files, "manifest.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    export_registered("lenet", 10, tmp_path / "c", (1, 8, 8), seed=1, backends=("ort", "torch"), cache=True)
    assert calls == ["lenet", "lenet"] and len(list((cache_dir() / ARTIFACTS).iterdir())) == 2
    kept = next(p for p in (cache_dir() / ARTIFACTS).iterdir() if (p / "checkpoint").exists()
                and (p / "checkpoint").read_bytes() == (tmp_path / "a" / "checkpoint").read_bytes())
    (kept / "checkpoint").write_bytes(b"\0" * (kept / "checkpoint").stat().st_size)
    export_registered("lenet", 10, tmp_path / "d", (1, 8, 8), backends=("ort", "torch"), cache=True)
    assert len(calls) == 3  # the damaged set was not copied
    assert (tmp_path / "d" / "checkpoint").read_bytes() == (tmp_path / "a" / "checkpoint").read_bytes()


def test_a_cache_that_cannot_be_written_costs_only_the_keeping(tmp_path, monkeypatch):
    """A home folder the cache cannot be made in (here a file where its folder would be, which even root cannot
    write into): the export is made without it, the same set."""
    from models.export import export_registered

    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path / "not-a-folder"))
    made = export_registered("mlp", 10, tmp_path / "made", (1, 8, 8), seed=3, backends=("torch",), cache=True)
    assert made == export_registered("mlp", 10, tmp_path / "direct", (1, 8, 8), seed=3, backends=("torch",))
    assert load_manifest(tmp_path / "made") == made


def test_graphs_exported_with_or_without_a_helper_are_the_same_and_a_set_may_leave_the_optional_ones_out(
        tmp_path, monkeypatch):
    """The portable graphs exported by this process alone and with a helper process beside it (taking graphs as it
    is free) are the same bytes; without the optional graphs the set loads, lists none of them, a portable trainer
    says so when asked for one (per-sample norms in "exact" mode, a loss that is not plain) while everything else
    runs, and a learner refuses to open a method that needs one (Re-Fed's "exact" importance) and opens it without
    ("last-layer")."""
    from edge_client.trainers.base import LossInputs
    from models.export import export_registered
    from models.manifest import OPTIONAL_GRAPHS, PORTABLE_MODELS

    sets = {}
    for helpers in (0, 1):  # two differentiated graphs: the whole loss's and the plain loss's gradient
        monkeypatch.setenv("EDGEFIL_EXPORT_HELPERS", str(helpers))
        sets[helpers] = export_registered("mlp", 4, tmp_path / str(helpers), (1, 8, 8),
                                          backends=("portable", "torch"), graphs=("gradient",))
    assert sets[0].files == sets[1].files
    export_registered("mlp", 4, tmp_path / "plain", (1, 8, 8), backends=("portable", "torch"), graphs=(),
                      cache=True)
    manifest = load_manifest(tmp_path / "plain")
    assert manifest.optional_graphs == frozenset()
    assert {PORTABLE_MODELS[g] for g in OPTIONAL_GRAPHS}.isdisjoint(manifest.files)
    assert not any((tmp_path / "plain" / PORTABLE_MODELS[g]).exists() for g in OPTIONAL_GRAPHS)
    trainer = PortableTrainer(tmp_path / "plain", optimizer="sgd", lr=0.1)
    x = np.random.default_rng(0).standard_normal((6, 1, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3, 0, 1])
    assert trainer.graphs == frozenset()
    assert np.isfinite(trainer.fit(x, y, epochs=1))
    assert np.isfinite(trainer.fit(x, y, epochs=1, loss=LossInputs(sample_weights=np.full(6, 0.5, np.float32))))
    assert trainer.per_sample_grad_norms(x, y, mode="last-layer").shape == (6,)
    with pytest.raises(ValueError, match="no portable_gradient.onnx"):
        trainer.fit(x, y, epochs=1, loss=LossInputs(head="sigmoid-bce"))
    with pytest.raises(ValueError, match="no portable_sample_grad_norms.onnx"):
        trainer.per_sample_grad_norms(x, y, mode="exact")
    with pytest.raises(ValueError, match="no portable_input_gradient.onnx"):
        trainer.input_gradient(x, y)
    from edge_client.budget import Budget, DeviceBudget
    from edge_client.learner import Learner, LearnerConfig
    from edge_client.policies import make_policy
    from edge_client.store import ReplayStore

    for importance, refused in (("exact", True), ("last-layer", False)):
        policy = make_policy("refed", importance=importance)
        folder = tmp_path / importance
        store = ReplayStore.within(DeviceBudget(Budget(30, None)), folder / "store", (1, 8, 8))
        learner = Learner(trainer, store, policy, LearnerConfig(), seed=0)
        if refused:
            with pytest.raises(ValueError, match="policy refed needs the optional trainer graphs sample_grad_norms"):
                learner.open_policy(folder, tmp_path / "plain")
        else:
            learner.open_policy(folder, tmp_path / "plain")
        store.close()


def test_the_optimisers_updates_are_written_as_nodes_and_compute_what_torch_does(tmp_path, monkeypatch):
    """The optimisers' updates are the same elementwise graphs for every model but their length: an export traces
    only the model's own graphs through torch's exporter and writes the updates node by node, and onnxruntime takes
    the steps torch takes (SGD with momentum and AdamW, each with a proximal pull and a rate a parameter): SGD's to
    the bit, AdamW's within one float32 rounding at the weights' scale (onnxruntime's square root rounds otherwise
    than torch's: AdamW's new weights differ by an ulp on about 2 % of the values, as in the exported graphs)."""
    import onnxruntime as ort
    import torch

    from models import portable_export
    from models.manifest import PORTABLE_MODELS, ParameterInfo
    from models.update_graphs import UPDATES

    model = build_model("mlp", 4, (1, 8, 8), seed=0).eval()
    parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in model.named_parameters())
    traced = []
    export_graph = portable_export._export_graph
    monkeypatch.setattr(portable_export, "_export_graph",
                        lambda *args: traced.append(args[-1].name) or export_graph(*args))
    written = portable_export.export_portable(model, parameters, (1, 8, 8), tmp_path, optional=(), helpers=0)
    assert sorted(traced) == sorted(PORTABLE_MODELS[g] for g in ("gradient_plain", "eval"))
    assert {PORTABLE_MODELS[u] for u in UPDATES} <= set(written) - set(traced)

    size = sum(p.size for p in parameters)
    rng = np.random.default_rng(0)
    vector = {name: rng.standard_normal(size).astype(np.float32) for name in (
        "weights", "gradient", "velocity", "exp_avg", "reference")}
    vector["exp_avg_sq"] = np.abs(rng.standard_normal(size)).astype(np.float32)
    vector["lr_scale"] = rng.uniform(0.5, 2.0, size).astype(np.float32)
    scalar = {"lr": 0.05, "momentum": 0.9, "proximal_mu": 0.3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
              "weight_decay": 0.01, "step_size": 0.05 / (1 - 0.9 ** 3), "bias_correction2_sqrt": (1 - 0.999 ** 3) ** 0.5}
    t = {name: torch.from_numpy(v) for name, v in vector.items()} | {
        name: torch.tensor(v, dtype=torch.float32) for name, v in scalar.items()}
    rate = t["lr"] * t["lr_scale"]
    pull = rate * t["proximal_mu"] * (t["weights"] - t["reference"])
    velocity = t["momentum"] * t["velocity"] + t["gradient"]
    exp_avg = t["exp_avg"] + (t["gradient"] - t["exp_avg"]) * (1.0 - t["beta1"])
    exp_avg_sq = t["exp_avg_sq"] * t["beta2"] + t["gradient"] * t["gradient"] * (1.0 - t["beta2"])
    denom = torch.sqrt(exp_avg_sq) / t["bias_correction2_sqrt"] + t["eps"]
    expected = {
        "sgd": [t["weights"] - rate * velocity - pull, velocity],
        "adamw": [t["weights"] * (1.0 - rate * t["weight_decay"]) - t["step_size"] * t["lr_scale"] * (
            exp_avg / denom) - pull, exp_avg, exp_avg_sq],
    }
    for update, outputs in expected.items():
        session = ort.InferenceSession(str(tmp_path / PORTABLE_MODELS[update]), providers=["CPUExecutionProvider"])
        feeds = {i.name: vector[i.name] if i.name in vector else np.array(scalar[i.name], np.float32)
                 for i in session.get_inputs()}
        for got, want in zip(session.run(None, feeds), outputs, strict=True):
            rounding = 0.0 if update == "sgd" else float(np.spacing(np.abs(want.numpy()).max()))
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=rounding)


def test_the_exporter_decomposes_again_only_a_graph_with_an_op_it_cannot_translate(tmp_path, monkeypatch):
    """A graph traced through make_fx is core ATen ops the exporter translates: its second decomposition (a re-trace
    of the whole program) is skipped, and the graph is the same as with it (the same nodes in the same order, the same
    outputs to the bit; only the names of values, taken from the trace's counters, differ). A graph holding an op the exporter
    lacks (a model's `1 - x` in its eval graph, exported without make_fx: rsub) is still decomposed."""
    import contextlib

    import torch

    from models import portable_export
    from models.manifest import PORTABLE_MODELS, ParameterInfo

    class Reflected(torch.nn.Module):  # 1 - x: an op (rsub) the exporter's registry does not translate
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 1.0 - x

    model = build_model("mlp", 4, (1, 8, 8), seed=0).eval()
    model.trunk = torch.nn.Sequential(Reflected(), model.trunk)
    parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in model.named_parameters())
    decompositions = []
    run_decompositions = torch.export.ExportedProgram.run_decompositions

    def counted(program, *args, **kwargs):
        decompositions.append(graph)
        return run_decompositions(program, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    for folder in ("skipping", "decomposing"):
        (tmp_path / folder).mkdir()
    for graph in ("gradient", "eval"):
        portable_export._export_one(graph, model, parameters, (1, 8, 8), tmp_path / "skipping")
    assert decompositions == ["eval"]
    monkeypatch.setattr(portable_export, "_decomposed_once", contextlib.nullcontext)
    graph = "gradient"
    portable_export._export_one(graph, model, parameters, (1, 8, 8), tmp_path / "decomposing")
    assert decompositions == ["eval", "gradient"]
    import onnx
    import onnxruntime as ort

    name = PORTABLE_MODELS["gradient"]
    graphs = [onnx.load(tmp_path / folder / name).graph for folder in ("skipping", "decomposing")]
    assert [(n.op_type, list(n.attribute)) for n in graphs[0].node] == [
        (n.op_type, list(n.attribute)) for n in graphs[1].node]
    rng = np.random.default_rng(0)
    feeds = None
    outputs = []
    for folder in ("skipping", "decomposing"):
        session = ort.InferenceSession(str(tmp_path / folder / name), providers=["CPUExecutionProvider"])
        feeds = feeds or {i.name: rng.random([5 if isinstance(d, str) else d for d in i.shape], dtype=np.float32)
                          for i in session.get_inputs()}
        outputs.append(session.run(None, feeds))
    for skipped, decomposed in zip(*outputs):
        np.testing.assert_array_equal(skipped, decomposed)


def test_a_process_builds_the_exporter_s_registry_once_and_each_export_gets_a_fresh_copy(tmp_path, monkeypatch):
    """The exporter's registry of translations is built once in a process (without parsing the traced torchlib
    functions' sources): each later export gets a copy equal to a plain build, whatever an export before it inserted
    (its custom translations), and exports the same graph as with a registry built for it."""
    import contextlib
    from types import SimpleNamespace

    import onnx
    from onnxscript._internal import ast_utils
    from onnxscript._internal.values import TracedOnnxFunction
    from torch.onnx._internal.exporter import _registration

    from models import portable_export
    from models.manifest import PORTABLE_MODELS, ParameterInfo
    from models.onnx_backward import TRANSLATIONS

    registry_class = _registration.ONNXRegistry
    build = registry_class.__dict__["from_torchlib"]
    built = []

    def counted(cls, *args, **kwargs):
        built.append(args)
        return build.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(registry_class, "from_torchlib", classmethod(counted))
    monkeypatch.setattr(portable_export, "_REGISTRIES", {})
    traced = next(entry.onnx_function for entries in registry_class.from_torchlib().functions.values()
                  for entry in entries if isinstance(entry.onnx_function, TracedOnnxFunction))
    built.clear()
    parse = ast_utils.get_src_and_ast
    parsed = []
    monkeypatch.setattr(ast_utils, "get_src_and_ast", lambda f: parsed.append(f) or parse(f))
    op, translation = next(iter(TRANSLATIONS.items()))
    with portable_export._registry_built_once():
        first = registry_class.from_torchlib()
        first.register_op(op, translation)
        second = registry_class.from_torchlib()
    assert parsed == []
    fresh = registry_class.from_torchlib()
    assert len(built) == 2  # once inside the context, once outside
    assert len(parsed) > 100  # a plain build parses every traced function's source
    assert not isinstance(TracedOnnxFunction.function_ir.fget(traced), SimpleNamespace)  # the stand-in is gone
    assert len(first.get_decomps(op)) == len(fresh.get_decomps(op)) + 1
    assert second.functions == fresh.functions and second.opset_version == fresh.opset_version

    model = build_model("mlp", 4, (1, 8, 8), seed=0).eval()
    parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in model.named_parameters())
    for folder in ("kept", "built"):
        (tmp_path / folder).mkdir()
    for _ in range(2):  # the second export's registry is a copy of the one the first used
        portable_export._export_one("gradient", model, parameters, (1, 8, 8), tmp_path / "kept")
    assert len(built) == 3
    monkeypatch.setattr(portable_export, "_registry_built_once", contextlib.nullcontext)
    portable_export._export_one("gradient", model, parameters, (1, 8, 8), tmp_path / "built")
    assert len(built) == 4
    graphs = [onnx.load(tmp_path / folder / PORTABLE_MODELS["gradient"]).graph for folder in ("kept", "built")]
    assert [(n.op_type, list(n.attribute)) for n in graphs[0].node] == [
        (n.op_type, list(n.attribute)) for n in graphs[1].node]


def test_one_kept_set_serves_every_seed_backend_and_graph_and_grows_by_what_it_lacks(tmp_path, monkeypatch):
    """models/cache.py: without ORT Training's artifacts every graph takes the weights as an input, so one set is
    kept for a model. A fleet's part (the portable graphs its method runs) is exported; `edgefil export`'s (every
    optional graph) exports only the optional graphs and adds them; any seed's, backend's or graph's part after that
    is copied without an export. Each part is, byte for byte, the set a direct export of the same arguments writes,
    its seed's initial weights included. A damaged kept set is exported anew; a set holding ORT Training's
    artifacts is kept whole per seed."""
    import models.export as export_module
    import models.portable_export as portable_module
    from models.cache import ARTIFACTS, cache_dir
    from models.export import export_registered

    monkeypatch.setenv("EDGEFIL_CACHE", str(tmp_path / "cache"))
    exported, whole = [], []
    real_portable, real_model = portable_module.export_portable, export_module.export_model
    monkeypatch.setattr(portable_module, "export_portable", lambda *a, **k: exported.append(
        (tuple(sorted(a[4])), k.get("base", True))) or real_portable(*a, **k))
    monkeypatch.setattr(export_module, "export_model", lambda *a, **k: whole.append(a[1]) or real_model(*a, **k))
    asked = {  # folder: (seed, backends, graphs)
        "fleet": (0, ("portable", "torch"), ()),
        "export": (0, ("portable", "torch"), None),  # `edgefil export`'s default: every optional graph
        "torch-1": (1, ("torch",), None),
        "norms-2": (2, ("torch", "portable"), ("sample_grad_norms",)),
    }
    parts = {folder: export_registered("mlp", 10, tmp_path / folder, (1, 8, 8), seed=seed, backends=backends,
                                       graphs=graphs, cache=True) for folder, (seed, backends, graphs) in asked.items()}
    assert exported == [((), True), (("gradient", "input_gradient", "sample_grad_norms"), False)] and whole == []
    assert len(list((cache_dir() / ARTIFACTS).iterdir())) == 1
    for folder in ("torch-1", "norms-2"):  # no graph; the base graphs and an optional one exported apart from them
        seed, backends, graphs = asked[folder]
        direct = export_registered("mlp", 10, tmp_path / f"direct-{folder}", (1, 8, 8), seed=seed,
                                   backends=backends, graphs=graphs)
        assert load_manifest(tmp_path / folder) == parts[folder] == direct
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == sorted(
            p.name for p in (tmp_path / f"direct-{folder}").iterdir())
    assert parts["fleet"].files[WEIGHTS] != parts["torch-1"].files[WEIGHTS]
    kept = next((cache_dir() / ARTIFACTS).iterdir())
    damaged = kept / "portable_eval.onnx"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    assert export_registered("mlp", 10, tmp_path / "again", (1, 8, 8), seed=1, backends=("torch",),
                             cache=True) == parts["torch-1"]
    assert load_manifest(kept).backends == ("torch",)  # the damaged set was dropped, not read: kept anew
    whole.clear()
    for seed in (0, 1, 0):
        export_registered("mlp", 10, tmp_path / f"ort-{seed}", (1, 8, 8), seed=seed, backends=("ort", "torch"),
                          cache=True)
    assert whole == ["mlp"] * 2
