"""pFedGRP's pieces: the label-quantity scaling rule, the alignment term, simplex weights, attachments on the wire."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.strategies import RoundContext
from coordinator.strategies.pfedgrp import simplex_weights
from edge_client.policies.generator import replay_counts
from edge_client.trainers.base import LossInputs
from edge_client.trainers.pytorch import TorchTrainer
from edgefil import wire
from models.export import export_registered
from models.manifest import load_manifest

# --- the scaling rule (spec section 2, worked example) ---------------------------------------------------------

def test_the_scaling_rule_reproduces_the_worked_example():
    """Loop {0,1},{2,3}, 200 per class: round 2 replays 200 of 0 and 1; round 3 (s = 0.5) 100 of 2 and 3; a brand
    new task after a long history has s = 1 and caps every old class at 200."""
    cumulative = np.zeros(10, dtype=np.int64)
    expected = [[0, 0, 0, 0], [200, 200, 0, 0], [0, 0, 100, 100]]
    for t, classes in enumerate([(0, 1), (2, 3), (0, 1)]):
        current = np.zeros(10, dtype=np.int64)
        current[list(classes)] = 200
        cumulative += current
        assert replay_counts(cumulative, current)[:4].tolist() == expected[t]
    for _ in range(20):  # a long history of the loop
        for classes in [(2, 3), (0, 1)]:
            current = np.zeros(10, dtype=np.int64)
            current[list(classes)] = 200
            cumulative += current
    current = np.zeros(10, dtype=np.int64)
    current[[4, 5]] = 200
    cumulative += current
    counts = replay_counts(cumulative, current)
    assert counts[:4].tolist() == [200] * 4 and counts[4:].tolist() == [0] * 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=3, max_size=8))
def test_replay_counts_are_bounded_and_never_ask_for_a_class_new_this_round(pairs):
    before = np.array([p[0] for p in pairs], dtype=np.int64)
    current = np.array([p[1] for p in pairs], dtype=np.int64)
    counts = replay_counts(before + current, current)
    assert (counts >= 0).all() and (counts <= max(current.max(), 0)).all()
    assert (counts[before == 0] == 0).all()  # never seen before this round: no generator to sample


def test_replay_counts_refuse_counts_that_do_not_include_the_round():
    with pytest.raises(ValueError, match="include"):
        replay_counts(np.array([1, 0]), np.array([2, 0]))


# --- simplex weights (Eq. 8) -------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 40), st.floats(0.01, 5.0), st.integers(0, 2**16))
def test_simplex_weights_stay_on_the_simplex(n, steps, lr, seed):
    g = torch.Generator().manual_seed(seed)
    models = torch.randn(n, 7, generator=g) * 10
    target = torch.randn(7, generator=g) * 10
    w = simplex_weights(models, lambda theta, _: (theta - target).pow(4).sum(), steps=steps, lr=lr)
    assert (w >= 0).all() and abs(float(w.sum()) - 1.0) < 1e-5


def test_simplex_weights_move_towards_the_model_that_fits():
    models = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    w = simplex_weights(models, lambda theta, _: (theta - models[1]).pow(2).sum(), steps=60, lr=0.2)
    assert int(w.argmax()) == 1 and float(w[1]) > 0.8


def test_personalized_mixing_finds_the_device_whose_model_knows_the_replayed_classes(tmp_path):
    """Three device models, one trained on classes 0/1: a replay set of 0/1 puts most weight on it."""
    from sklearn.datasets import load_digits

    manifest = export_registered("mlp", 10, tmp_path / "m", (1, 8, 8), seed=0, backends=("ort", "torch"))
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    models = []
    for classes in [(0, 1), (5, 6), (7, 8)]:
        trainer = TorchTrainer(manifest, optimizer="adamw", lr=3e-3, seed=0)
        pick = np.isin(y, classes)
        trainer.fit(x[pick], y[pick], epochs=10, batch_size=32, rng=np.random.default_rng(0))
        models.append(torch.from_numpy(trainer.get_weights()))
    from coordinator.strategies.pfedgrp import PFedGRP

    rule = PFedGRP(manifest, device="cpu")
    pick = np.isin(y, (0, 1))
    mask = torch.zeros(10)
    mask[[0, 1]] = 1.0
    xs, ys = torch.from_numpy(x[pick][:100]), torch.from_numpy(y[pick][:100])
    w = simplex_weights(torch.stack(models), lambda theta, _: rule._loss(theta, xs, ys, mask), steps=20, lr=0.1)
    assert int(w.argmax()) == 0 and float(w[0]) > 0.5


# --- the alignment term (Eq. 6) ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    out = tmp_path_factory.mktemp("lenet")
    export_registered("lenet", 10, out, (1, 8, 8), seed=0, backends=("torch",))
    return load_manifest(out)


def test_alignment_adds_lambda_times_the_mse_to_the_teacher_on_flagged_samples(manifest):
    rng = np.random.default_rng(0)
    x = rng.random((8, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 4, 8)
    mask = np.zeros(10, dtype=np.float32)
    mask[:4] = 1.0
    trainer = TorchTrainer(manifest, lr=0.0, seed=0)
    teacher = TorchTrainer(manifest, seed=1).get_weights()
    t_logits = trainer.teacher_logits(teacher, x)
    applies = np.array([1, 0] * 4, dtype=np.float32)
    plain = trainer.train_step(x, y, mask)
    with_term = trainer.train_step(x, y, mask, LossInputs(teacher_logits=t_logits, teacher_weights=2.0 * applies))
    raw = trainer.teacher_logits(trainer.get_weights(), x)
    mse = (((raw - t_logits)[:, :4]) ** 2).mean(1)
    assert with_term == pytest.approx(plain + 2.0 * float((applies * mse).mean()), rel=1e-5)


def test_alignment_pulls_the_student_towards_the_teacher(manifest):
    rng = np.random.default_rng(1)
    x = rng.random((64, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 4, 64)
    teacher = TorchTrainer(manifest, seed=1).get_weights()
    gaps = {}
    for weight in (0.0, 10.0):
        trainer = TorchTrainer(manifest, optimizer="adamw", lr=1e-3, seed=0)
        t_logits = trainer.teacher_logits(teacher, x)
        trainer.fit(x, y, epochs=5, batch_size=16, rng=np.random.default_rng(0),
                    loss=LossInputs(teacher_logits=t_logits, teacher_weights=np.full(64, weight, np.float32)))
        gaps[weight] = float(((trainer.teacher_logits(trainer.get_weights(), x) - t_logits) ** 2).mean())
    assert gaps[10.0] < 0.5 * gaps[0.0]


def test_the_alignment_term_trains_on_the_ort_backend_as_on_torch(tmp_path):
    """pFedGRP's Eq. 6 term is the generic loss's teacher term: the ORT graph takes it as inputs."""
    from edge_client.trainers.ort import OrtTrainer

    export_registered("lenet", 10, tmp_path, (1, 8, 8), seed=0, backends=("ort", "torch"))
    rng = np.random.default_rng(3)
    x, y = rng.random((24, 1, 8, 8), dtype=np.float32), rng.integers(0, 4, 24)
    mask = np.isin(np.arange(10), range(4)).astype(np.float32)
    ort = OrtTrainer(tmp_path, optimizer="sgd", lr=0.05)
    torch_trainer = TorchTrainer(load_manifest(tmp_path), optimizer="sgd", lr=0.05)
    torch_trainer.set_weights(ort.get_weights())
    teacher = TorchTrainer(load_manifest(tmp_path), seed=5).get_weights()
    loss = LossInputs(teacher_logits=ort.teacher_logits(teacher, x),
                      teacher_weights=np.array([1, 0] * 12, dtype=np.float32))
    losses = [t.fit(x, y, epochs=2, batch_size=8, class_mask=mask, rng=np.random.default_rng(0), loss=loss)
              for t in (ort, torch_trainer)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    np.testing.assert_allclose(ort.get_weights(), torch_trainer.get_weights(), rtol=1e-4, atol=1e-6)


# --- attachments on the wire -------------------------------------------------------------------------------------

def test_an_update_carries_attachments_after_its_weights():
    weights = np.arange(10, dtype=np.float32)
    data, layout = wire.pack_attachments(wire.weights_bytes(weights), {"generator/3": b"abcde", "generator/7": b""})
    blob_message = wire.encode_blob("update", data, chunk_bytes=1024, device="d", round=1, task=0, model="m",
                                    num_samples=1, metrics={}, attachments=layout, label_counts=[1, 2])
    reassembler = wire.Reassembler(max_blob_bytes=1 << 20)
    blob = [reassembler.add("d", wire.decode(c)) for c in blob_message.chunks][-1]
    values, attachments = blob.split(10)
    assert values.tolist() == weights.tolist()
    assert {k: bytes(v) for k, v in attachments.items()} == {"generator/3": b"abcde", "generator/7": b""}
    with pytest.raises(wire.WireError, match="weights-length"):
        blob.split(11)


@pytest.mark.parametrize("attachments", [[["a", -1]], [["a", 1], ["a", 1]], [[3, 1]], [["a"]]])
def test_malformed_attachment_layouts_are_refused(attachments):
    with pytest.raises(wire.WireError, match="attachments"):
        wire.encode_blob("update", b"\0" * 8, device="d", round=1, task=0, model="m", num_samples=1, metrics={},
                         attachments=attachments)


# --- the strategy: the gate, the cache, its checkpoint ------------------------------------------------------------

def _record(label: int, seed: int = 0):
    from models.generator_record import GeneratorRecord
    from models.generators import build_sampler, default_spec, flatten_module

    spec = default_spec("vae", (1, 8, 8))
    return GeneratorRecord(label, spec.to_dict(), "float32", flatten_module(build_sampler(spec, seed=seed)), None,
                           10, 5)


def _update_chunks(weights, attachments, label_counts=(5, 5, 0, 0, 0, 0, 0, 0, 0, 0)):
    data, layout = wire.pack_attachments(wire.weights_bytes(weights), attachments)
    return wire.encode_blob("update", data, device="d1", round=1, task=0, model="ab" * 32, num_samples=10,
                            metrics={}, attachments=layout, label_counts=list(label_counts)).chunks


def test_the_rule_decodes_generator_attachments_and_refuses_bad_ones(manifest):
    """The gate hands an update's attachments over as named bytes; the pFedGRP rule decodes them on arrival and
    refuses what is not a record of the class its name says (the coordinator counts the reason)."""
    from coordinator.inbox import Inbox
    from coordinator.strategies.base import ClientUpdate, RefusedUpdate
    from coordinator.strategies.pfedgrp import PFedGRP
    from edgefil import topics
    from models.generator_record import encode_record

    inbox = Inbox("f", {"d1"}, "m" * 64, manifest.num_parameters)
    rule = PFedGRP(manifest, device="cpu")
    weights = np.zeros(manifest.num_parameters, np.float32)
    topic = topics.from_device("f", "d1", "update")
    good = encode_record(_record(1))

    def arrive(weights, attachments):
        event = [inbox.accept(topic, c) for c in _update_chunks(weights, attachments)][-1]
        return ClientUpdate(event.device, event.weights, event.num_samples, event.metrics, event.label_counts,
                            event.attachments)

    update = arrive(weights, {"generator/1": good})
    assert update.label_counts[:2] == (5, 5) and list(update.attachments) == ["generator/1"]
    rule.inspect(update)
    rule.aggregate(torch.zeros(manifest.num_parameters), [update])
    np.testing.assert_array_equal(rule.generators["d1"][1].sampler, _record(1).sampler)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    cases = {"generator": {"generator/1": bytes(bad)}, "attachments": {"weights/1": good}}
    cases["generator "] = {"generator/2": good}  # a record of class 1 named as class 2
    cases["attachments "] = {"generator/\u0663": good}  # a non-ASCII digit is no class label
    for k, (reason, attachments) in enumerate(cases.items()):
        with pytest.raises(RefusedUpdate) as refused:
            rule.inspect(arrive(weights + k + 1, attachments))  # other bytes: a blob's id is its content
        assert refused.value.reason == reason.strip()


def test_the_rule_caches_generators_answers_requests_and_survives_a_checkpoint(manifest, tmp_path):
    from coordinator.strategies.base import ClientUpdate
    from coordinator.strategies.pfedgrp import PFedGRP
    from models.generator_record import encode_record

    rule = PFedGRP(manifest, device="cpu", weight_steps=3, quality_check=False)  # random models recognise nothing
    rng = np.random.default_rng(0)
    updates = [
        ClientUpdate("a", rng.standard_normal(manifest.num_parameters).astype(np.float32), 10, {},
                     (5, 5) + (0,) * 8, {"generator/0": encode_record(_record(0)),
                                         "generator/1": encode_record(_record(1))}),
        ClientUpdate("b", rng.standard_normal(manifest.num_parameters).astype(np.float32), 10, {},
                     (0, 0, 5, 5) + (0,) * 6, {"generator/2": encode_record(_record(2, seed=1))}),
    ]
    result = rule.aggregate(torch.zeros(manifest.num_parameters), updates)
    assert set(result.personalized) == {"a", "b"}
    mean = (torch.from_numpy(updates[0].weights) + torch.from_numpy(updates[1].weights)) / 2
    torch.testing.assert_close(result.global_weights, mean)
    for device, w in rule.weights_used.items():
        expected = w[0] * torch.from_numpy(updates[0].weights) + w[1] * torch.from_numpy(updates[1].weights)
        torch.testing.assert_close(result.personalized[device], expected, rtol=1e-5, atol=1e-5)
    assert rule.configure(RoundContext(round=2), ["a"]) == {"a": {"generator_classes": [0, 1, 2]}}
    assert sorted(rule.answer("c", ["generator/1", "generator/2", "generator/7", "other"])) == [
        "generator/1", "generator/2"]
    rule.save(tmp_path)
    again = PFedGRP(manifest, device="cpu", weight_steps=3, quality_check=False)
    again.load(tmp_path)
    asked = ["generator/0", "generator/1", "generator/2"]
    assert again.answer("c", asked) == rule.answer("c", asked)
    assert again.weights_used == rule.weights_used and again.label_counts == rule.label_counts
    x1 = rule.replay_set("a")
    x2 = again.replay_set("a")
    torch.testing.assert_close(x1[0], x2[0])  # the sampling generator's state was checkpointed too
    mean_personal = PFedGRP(manifest, device="cpu", weight_steps=3, global_model="mean-personalized",
                            quality_check=False)
    result = mean_personal.aggregate(torch.zeros(manifest.num_parameters), updates)
    torch.testing.assert_close(result.global_weights, (result.personalized["a"] + result.personalized["b"]) / 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_personalized_aggregation_on_cuda_matches_the_cpu(manifest):
    from coordinator.strategies.base import ClientUpdate
    from coordinator.strategies.pfedgrp import PFedGRP
    from models.generator_record import encode_record

    rng = np.random.default_rng(0)
    updates = [ClientUpdate(d, rng.standard_normal(manifest.num_parameters).astype(np.float32) * 0.1, 10, {},
                            (5, 5) + (0,) * 8, {"generator/0": encode_record(_record(0)),
                                                "generator/1": encode_record(_record(1, seed=i))})
               for i, d in enumerate("ab")]
    results = {}
    for device in ("cpu", "cuda"):
        rule = PFedGRP(manifest, device=device, weight_steps=5)
        results[device] = rule.aggregate(torch.zeros(manifest.num_parameters, device=device), updates)
    for d in "ab":
        torch.testing.assert_close(results["cuda"].personalized[d].cpu(), results["cpu"].personalized[d],
                                   rtol=1e-3, atol=1e-4)


def _favouring(manifest, label: int) -> np.ndarray:
    """Flat weights of a model that classifies every input as `label`: all zero but the head's bias."""
    weights = np.zeros(manifest.num_parameters, np.float32)
    head_bias = manifest.parameters[-1]
    assert head_bias.size == manifest.num_classes  # the last parameter is the head's bias
    weights[manifest.num_parameters - head_bias.size + label] = 10.0
    return weights


def test_the_quality_check_keeps_only_samples_the_reference_recognises(manifest):
    """A generated sample the reference model does not classify as its class is left out of the personalized
    weights' replay set; a device none of whose samples pass gets the plain mean, as one without generators."""
    from coordinator.strategies.base import ClientUpdate
    from coordinator.strategies.pfedgrp import PFedGRP
    from models.generator_record import encode_record

    counts = (5, 5) + (0,) * 8
    attachments = {"generator/0": encode_record(_record(0)), "generator/1": encode_record(_record(1, seed=1))}
    rule = PFedGRP(manifest, device="cpu", weight_steps=3, replay_per_class=20)
    rule.aggregate(torch.zeros(manifest.num_parameters),
                   [ClientUpdate("a", np.zeros(manifest.num_parameters, np.float32), 10, {}, counts, attachments)])
    everything = rule.replay_set("a")
    assert everything is not None and set(everything[1].tolist()) == {0, 1}
    kept = rule.replay_set("a", torch.from_numpy(_favouring(manifest, 1)))
    assert kept is not None and set(kept[1].tolist()) == {1} and len(kept[1]) == 20
    assert rule.recognised["a"] == pytest.approx(0.5)
    # through a round: the reference is the mean of the round's models, here both favouring class 1, so a device
    # whose only generator is of class 0 has nothing left and gets the plain mean; without the check it does not
    only_zero = {"generator/0": attachments["generator/0"]}
    models = [_favouring(manifest, 1), _favouring(manifest, 1) * 0.5]
    updates = [ClientUpdate(d, w, 10, {}, counts, only_zero) for d, w in zip("ab", models)]
    checked = PFedGRP(manifest, device="cpu", weight_steps=3, replay_per_class=20)
    result = checked.aggregate(torch.zeros(manifest.num_parameters), updates)
    assert checked.recognised == {"a": 0.0, "b": 0.0}
    assert result.metrics == {"a": {"recognised": 0.0, "not_served": 1.0},  # the round's history shows it
                              "b": {"recognised": 0.0, "not_served": 1.0}}
    assert checked.weights_used["a"] == [0.5, 0.5]
    unchecked = PFedGRP(manifest, device="cpu", weight_steps=3, replay_per_class=20, quality_check=False)
    result = unchecked.aggregate(torch.zeros(manifest.num_parameters), updates)
    assert unchecked.recognised == {} and unchecked.weights_used["a"] != [0.5, 0.5] and result.metrics == {}


def test_a_generator_the_fleets_model_does_not_recognise_is_never_served_to_another_device(manifest, tmp_path):
    """Issue 56: a device's well-formed generator of class 0 that makes what the round's models read as class 1 (a
    label lie) used to answer every other device's request for class 0. Now a generator is served only when the
    round's reference model (the mean of its local models) recognises half its samples as its class, among the
    fleet's classes, not those the device claims: the honest one stays served, also across a checkpoint."""
    from coordinator.strategies.base import ClientUpdate
    from coordinator.strategies.pfedgrp import PFedGRP
    from models.generator_record import encode_record

    zero, one = _favouring(manifest, 0), _favouring(manifest, 1)
    honest = encode_record(_record(0))
    rule = PFedGRP(manifest, device="cpu", weight_steps=3, replay_per_class=20)
    fleet = RoundContext(seen_classes=(0, 1))
    rule.aggregate(torch.zeros(manifest.num_parameters),  # a round whose models read everything as class 0
                   [ClientUpdate("a", zero, 10, {}, (5, 5) + (0,) * 8, {"generator/0": honest})], fleet)
    assert rule.answer("c", ["generator/0"]) == {"generator/0": honest}
    lie = encode_record(_record(0, seed=3))  # the same layout, another generator: what the models read decides
    for claimed in ((5,) + (0,) * 9, (5, 5) + (0,) * 8):  # it claims class 0 only, or both
        result = rule.aggregate(torch.zeros(manifest.num_parameters),  # this round's models read class 1
                                [ClientUpdate("x", one, 10, {}, claimed, {"generator/0": lie}),
                                 ClientUpdate("a", one, 10, {}, (5, 5) + (0,) * 8)], fleet)
        assert rule.answer("c", ["generator/0"]) == {"generator/0": honest}, claimed
        assert result.metrics["x"]["not_served"] == 1.0 and "not_served" not in result.metrics.get("a", {})
    assert rule.configure(RoundContext(round=3), ["c"]) == {"c": {"generator_classes": [0]}}
    rule.save(tmp_path)
    again = PFedGRP(manifest, device="cpu", weight_steps=3)
    again.load(tmp_path)
    assert again.answer("c", ["generator/0"]) == {"generator/0": honest}
    unchecked = PFedGRP(manifest, device="cpu", weight_steps=3, quality_check=False)  # as before the check
    for weights, record in ((zero, honest), (one, lie)):
        unchecked.aggregate(torch.zeros(manifest.num_parameters),
                            [ClientUpdate("a", weights, 10, {}, (5, 5) + (0,) * 8, {"generator/0": record})], fleet)
    assert unchecked.answer("c", ["generator/0"]) == {"generator/0": lie}
