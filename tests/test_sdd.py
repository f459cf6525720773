"""SDD (spec: shared/specs/fewshot-sdd.md): CSWA against hand-computed aggregates, each generator loss term
moving its quantity the right way on a toy teacher, the generator's refused settings, the replay payload, and a
rule that finishes its round off the coordinator's loop (`Pending`)."""
from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from coordinator.background import BackgroundJob
from coordinator.containment import RULE_FAILED, ContainedStrategy
from coordinator.strategies.base import AggregateResult, ClientUpdate, Pending, RoundContext, Strategy, settled
from coordinator.strategies.sdd import (
    GeneratorSettings,
    SddCoordinator,
    class_accuracies,
    merge_replay,
    model_for,
    plausible_statistics,
    train_generator,
    weighted_rows,
)
from models.feature_stats import LayerStatistics
from models.flat_weights import flatten_weights
from models.manifest import class_head_positions, load_manifest
from models.sdd import decode_replay, encode_replay
from models.sdd_generator import distillation_kl, ensemble_logits, information_entropy, statistics_distance

CPU = torch.device("cpu")


# --- CSWA ----------------------------------------------------------------------------------------------------------

def test_literal_and_normalised_rows_match_hand_computed_aggregates():
    """Three devices, two new classes whose rows sit at positions [0, 1] and [4, 5] of a 6-value model."""
    local = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 4.0],
                          [5.0, 6.0, 9.0, 9.0, 7.0, 8.0],
                          [0.0, 1.0, 9.0, 9.0, 2.0, 2.0]])
    fedavg = local.mean(0)
    accuracies = np.array([[1.0, 0.5], [0.5, 0.0], [0.0, 0.5]])
    positions = np.array([[0, 1], [4, 5]])
    literal = weighted_rows(fedavg, local, accuracies, positions, normalized=False)
    # class 0: 1 * [1, 2] + 0.5 * [5, 6] + 0 = [3.5, 5]; class 1: 0.5 * [3, 4] + 0 + 0.5 * [2, 2] = [2.5, 3]
    np.testing.assert_allclose(literal.numpy(), [3.5, 5.0, 9.0, 9.0, 2.5, 3.0])
    normalised = weighted_rows(fedavg, local, accuracies, positions, normalized=True)
    np.testing.assert_allclose(normalised.numpy(), [3.5 / 1.5, 5 / 1.5, 9.0, 9.0, 2.5, 3.0])
    # a device with a = 1 alone makes the row its own (the spec's check)
    alone = weighted_rows(fedavg, local, np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]), positions, True)
    np.testing.assert_allclose(alone.numpy()[:2], [5.0, 6.0])


@pytest.mark.parametrize("normalized", [False, True])
def test_a_device_that_scales_its_new_rows_moves_them_no_further_than_the_default_row_bound(normalized):
    """Issue 56: one device of four doubles its new-class rows (a sliver of the model: the guard passes it). Under
    the default `row_bound` its rows count at most that many times the lower median length of the rows that count:
    each aggregated row moves by at most (row_bound - 1) of the device's own honest row, x2 not at all more."""
    bound = inspect.signature(SddCoordinator).parameters["row_bound"].default
    rng = np.random.default_rng(0)
    honest = torch.from_numpy(rng.normal(size=(4, 2, 8)) + 3.0)  # 4 devices, 2 new classes' rows of 8
    honest /= torch.linalg.vector_norm(honest, dim=2, keepdim=True)  # rows of one length, as a session trains them
    honest *= torch.tensor([1.0, 1.1, 0.9, 1.05])[:, None, None]
    hostile = honest.clone()
    hostile[3] *= 2.0
    positions = np.arange(16).reshape(2, 8)
    accuracies = np.array([[1.0, 0.8], [0.9, 1.0], [0.7, 0.9], [1.0, 1.0]])
    clean, attacked = (weighted_rows(m.reshape(4, -1).mean(0), m.reshape(4, -1), accuracies, positions, normalized,
                                     row_bound=bound) for m in (honest, hostile))
    own = torch.linalg.vector_norm(honest[3], dim=1)
    for i, row in enumerate(positions):
        total = 1.0 if not normalized else float(accuracies[:, i].sum())
        moved = float(torch.linalg.vector_norm(attacked[row] - clean[row]))
        assert moved <= (bound - 1) * accuracies[3, i] * float(own[i]) / total + 1e-9
        unbounded = weighted_rows(hostile.reshape(4, -1).mean(0), hostile.reshape(4, -1), accuracies, positions,
                                  normalized)
        assert float(torch.linalg.vector_norm(unbounded[row] - clean[row])) > moved + 0.5 * accuracies[3, i] / total
    # the honest rows lie within the bound: it changes nothing of a clean session
    np.testing.assert_allclose(clean.numpy(), weighted_rows(honest.reshape(4, -1).mean(0), honest.reshape(4, -1),
                                                            accuracies, positions, normalized).numpy())


@pytest.mark.parametrize("normalized", [False, True])
def test_a_class_every_model_gets_wrong_keeps_its_fedavg_row(normalized):
    local = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    fedavg = torch.tensor([2.0, 3.0, 4.0])
    out = weighted_rows(fedavg, local, np.zeros((2, 1)), np.array([[0, 1]]), normalized)
    np.testing.assert_array_equal(out.numpy(), fedavg.numpy())


def test_class_accuracies_are_per_model_and_class(export_artifacts):
    manifest = load_manifest(export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",)))
    model = model_for(manifest, np.zeros(manifest.num_parameters, np.float32), CPU)
    with torch.no_grad():
        model.head.bias[:] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # predicts class 1 for every input
    x, y = np.zeros((5, 1, 8, 8), np.float32), np.array([1, 1, 2, 2, 2])
    out = class_accuracies([model, model], x, y, (1, 2, 3), (0, 1, 2, 3), 4, CPU)
    np.testing.assert_array_equal(out, [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # class 3: no sample, 0


@pytest.mark.parametrize("new_bias", ["fedavg", "cswa"])
def test_the_sdd_rule_aggregates_new_rows_by_synthetic_accuracy(export_artifacts, new_bias):
    """The rule end to end on one round of session 1: a device whose model gets the new class right on X~_t
    gives that class its row; the other values are FedAvg, the new class's bias among them (the paper's W_new is
    weights only), unless `new_bias = "cswa"` scales it with its row."""
    manifest = load_manifest(export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",)))
    rule = SddCoordinator(aggregation="cswa-normalized", new_bias=new_bias, generator_epochs=2, generator_iterations=2,
                          warmup_epochs=1, generator_batch_size=8, device="cpu", manifest=manifest)
    rng = np.random.default_rng(0)
    start = rng.normal(0, 0.1, manifest.num_parameters).astype(np.float32)
    right, wrong = start.copy(), start.copy()
    row3 = class_head_positions(manifest.parameters, [3])
    right[row3[:-1]] += 0.5
    right[row3[-1]] = 50.0  # class 3's bias: predicts class 3 for anything
    wrong[row3[-1]] = -50.0
    updates = [ClientUpdate("a", right, 10), ClientUpdate("b", wrong, 30)]
    ctx = RoundContext(round=2, task=1, task_classes=(3,), seen_classes=(0, 1, 2, 3))
    result = settled(rule.aggregate(torch.from_numpy(start), updates, ctx))
    weights = result.global_weights.numpy()
    by_accuracy = row3 if new_bias == "cswa" else row3[:-1]
    np.testing.assert_allclose(weights[by_accuracy], right[by_accuracy], rtol=1e-6)  # a(a) = 1, a(b) = 0
    others = np.setdiff1d(np.arange(manifest.num_parameters), by_accuracy)
    np.testing.assert_allclose(weights[others], (10 * right[others] + 30 * wrong[others]) / 40, rtol=1e-5)
    assert result.metrics["generator"]["generator_steps"] == 4
    x, y = decode_replay(result.broadcast["sdd/replay"], manifest.input_shape, 4)
    assert set(y.tolist()) == {3} and len(y) == 16  # one batch per epoch


@pytest.mark.parametrize("aggregation", ["fedavg", "cswa-literal"])
def test_under_central_dp_the_generator_learns_from_released_numbers_alone(export_artifacts, monkeypatch,
                                                                            aggregation):
    """Central DP, the first round of session 1, three devices sending statistics: the generator's one teacher is
    the mean of the clipped models released with the model's noise (under FedAvg the round's model itself, released
    once inside the rule; under CSWA a further mechanism, and the round's CSWA model is then released as a ball),
    and its one set of statistics the devices' vectors clipped to statistics_clip_norm, summed, noised with sd
    z x that norm and divided by the selected count; the round counts those further mechanisms at its rate."""
    from coordinator.aggregation import RoundAggregate
    from coordinator.containment import ContainedStrategy
    from coordinator.guard import UpdateBounds
    from coordinator.privacy import CentralPrivacy, PrivacySettings
    from coordinator.strategies import sdd
    from models.feature_stats import LAYERS, STATISTICS, encode_statistics

    manifest = load_manifest(export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",)))
    rule = SddCoordinator(aggregation=aggregation, generator_epochs=2, generator_iterations=2, warmup_epochs=1,
                          generator_batch_size=8, statistics_clip_norm=2.0, device="cpu", manifest=manifest)
    seen = {}

    def spy(teachers, statistics, *args, **kwargs):
        seen["teachers"] = [flatten_weights(t, manifest) for t in teachers]
        seen["statistics"] = statistics
        return train_generator(teachers, statistics, *args, **kwargs)

    monkeypatch.setattr(sdd, "train_generator", spy)
    rng = np.random.default_rng(0)
    g = rng.normal(0, 0.1, manifest.num_parameters).astype(np.float32)
    models = [g + rng.normal(0, 0.02, g.size).astype(np.float32) for _ in range(3)]  # each within C = 5
    vectors = []
    for k in range(3):
        layers = [LayerStatistics(layer, rng.uniform(0.1, 0.9 + k, size).astype(np.float32),
                                  rng.uniform(0.01, 0.5, size).astype(np.float32), 20)
                  for layer, size in (("input", 1), ("features", manifest.feature_dim))]
        vectors.append(np.concatenate([np.r_[s.mean, s.var] for s in layers]).astype(np.float64))
        models[k] = (models[k], {STATISTICS: encode_statistics(layers)})
    settings = PrivacySettings(mode="central", clip_norm=5.0, noise_multiplier=0.7, noise_seed=3)
    central = CentralPrivacy(settings, built_from=rule.built_from)
    ctx = RoundContext(round=4, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3))
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(rule, counters), UpdateBounds.only(), g, counters, 1 << 30, ctx=ctx,
                               privacy=central)
    for k, (weights, attachments) in enumerate(models):
        aggregate.add(ClientUpdate(f"d{k}", weights, 10, attachments=attachments))
    result = aggregate.close(selected=3, eligible=6)
    mean = np.mean([w for w, _ in models], axis=0, dtype=np.float64)
    model_noise = np.random.default_rng((3, 4)).normal(0.0, 0.7 * 5.0 / 3, g.size)
    rule_rng = np.random.default_rng((3, 4, 1))
    if aggregation == "fedavg":  # released once, in the rule: the teacher is the round's model
        np.testing.assert_allclose(result.global_weights.numpy(), mean + model_noise, atol=1e-5)
        np.testing.assert_allclose(seen["teachers"][0], result.global_weights.numpy(), atol=1e-6)
        assert aggregate.privacy_spent["further_rates"] == [0.5]  # the statistics
        assert aggregate.privacy_spent["calibration"] == "sum"
    else:  # the teacher: the mean with its own noise; the CSWA model released as a ball
        np.testing.assert_allclose(seen["teachers"][0], mean + rule_rng.normal(0.0, 0.7 * 5.0 / 3, g.size), atol=1e-5)
        assert aggregate.privacy_spent["further_rates"] == [0.5, 0.5]
        assert aggregate.privacy_spent["calibration"] == "ball"
    clipped = sum(v * min(1.0, 2.0 / np.linalg.norm(v)) for v in vectors)
    assert max(np.linalg.norm(v) for v in vectors) > 2.0  # the clip bites
    expected = (clipped + rule_rng.normal(0.0, 0.7 * 2.0, clipped.size)) / 3
    (statistics,) = seen["statistics"]
    got = np.concatenate([np.r_[statistics[layer].mean, statistics[layer].var] for layer in LAYERS])
    features = manifest.feature_dim
    np.testing.assert_allclose(got, np.r_[expected[:1], np.maximum(expected[1:2], 0), expected[2:2 + features],
                                          np.maximum(expected[2 + features:], 0)], atol=1e-5)
    _, labels = decode_replay(result.broadcast["sdd/replay"], manifest.input_shape, 4)  # a one-round session's
    assert set(labels.tolist()) == {2, 3}


# --- the generator's loss terms on a toy teacher ------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy(export_artifacts):
    """A fixed random MLP over 8x8 inputs with 4 classes, and statistics its data would never have."""
    manifest = load_manifest(export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",)))
    weights = np.random.default_rng(3).normal(0, 0.3, manifest.num_parameters).astype(np.float32)
    teacher = model_for(manifest, weights, CPU)
    stats = {"input": LayerStatistics("input", np.array([0.2], np.float32), np.array([0.01], np.float32), 10),
             "features": LayerStatistics("features", np.full(manifest.feature_dim, 0.5, np.float32),
                                         np.full(manifest.feature_dim, 0.1, np.float32), 10)}
    return manifest, teacher, stats


def _alone(term: str, **more) -> GeneratorSettings:
    weights = {name: 0.0 for name in ("lambda_ce", "lambda_entropy", "lambda_statistics", "lambda_adversarial")}
    weights[f"lambda_{term}"] = 1.0
    return GeneratorSettings(epochs=6, iterations=15, batch_size=32, warmup_epochs=0, **{**weights, **more})


def _first_and_last(synthetic, batch):
    return (synthetic.x[:batch], synthetic.y[:batch]), (synthetic.x[-batch:], synthetic.y[-batch:])


def _ensemble(teacher, x, classes):
    with torch.no_grad():
        return ensemble_logits([teacher(torch.from_numpy(x))[0][:, list(classes)]])


def test_the_ce_term_makes_samples_the_teacher_labels_as_asked(toy):
    manifest, teacher, _ = toy
    classes = (0, 1, 2, 3)
    out = train_generator([teacher], [None], classes, _alone("ce"), manifest, (0.0, 1.0), CPU, seed=0)
    (x0, y0), (x1, y1) = _first_and_last(out, 32)
    ce = [float(torch.nn.functional.cross_entropy(_ensemble(teacher, x, classes), torch.from_numpy(y)))
          for x, y in ((x0, y0), (x1, y1))]
    assert ce[1] < ce[0]


def test_the_entropy_term_raises_the_teachers_entropy(toy):
    manifest, teacher, _ = toy
    classes = (0, 1, 2, 3)
    out = train_generator([teacher], [None], classes, _alone("entropy"), manifest, (0.0, 1.0), CPU, seed=0)
    (x0, _), (x1, _) = _first_and_last(out, 32)
    entropy = [float(information_entropy(_ensemble(teacher, x, classes))) for x in (x0, x1)]
    assert entropy[1] > entropy[0]


def test_the_statistics_term_moves_the_batch_towards_the_devices_statistics(toy):
    manifest, teacher, stats = toy
    out = train_generator([teacher], [stats], (0, 1), _alone("statistics"), manifest, (0.0, 1.0), CPU, seed=0)
    (x0, _), (x1, _) = _first_and_last(out, 32)

    def distance(x):
        with torch.no_grad():
            features = teacher(torch.from_numpy(x))[1]
        return float(statistics_distance(torch.from_numpy(x), torch.tensor([0.2]), torch.tensor([0.01]))
                     + statistics_distance(features, torch.from_numpy(stats["features"].mean),
                                           torch.from_numpy(stats["features"].var)))

    assert distance(x1) < distance(x0)


@pytest.mark.parametrize("sign", ["paper", "target"])
def test_the_adversarial_term_drives_teacher_and_student_apart_where_its_sign_says(toy, sign):
    """With the student frozen (a rate of ~0) the term -omega KL(O || S) raises the teacher-student KL on the
    generated samples; the paper's sign (omega = 1 where they disagree) by pushing the disagreeing samples further
    apart, TARGET's (where they agree) by turning agreeing samples into disagreeing ones. The student is the
    teacher perturbed, agreeing with it on about half of the samples at first."""
    from models.sdd_generator import adversarial_mask

    manifest, teacher, _ = toy
    classes = (0, 1, 2, 3)
    weights = flatten_weights(teacher, manifest)
    noise = np.random.default_rng(5).normal(0, 0.8, weights.size).astype(np.float32)
    student = model_for(manifest, weights + noise, CPU)
    settings = _alone("adversarial", adversarial_sign=sign, student_lr=1e-12)
    out = train_generator([teacher], [None], classes, settings, manifest, (0.0, 1.0), CPU, seed=0, student=student)
    measured = []
    for x, _ in _first_and_last(out, 32):
        o = _ensemble(teacher, x, classes)
        with torch.no_grad():
            s = out.student(torch.from_numpy(x))[0][:, list(classes)]
        kl, mask = distillation_kl(o, s, settings.temperature), adversarial_mask(o, s, sign)
        measured.append((float(kl.mean()), float((mask * kl).mean()), float((o.argmax(1) == s.argmax(1)).float().mean())))
    (kl0, masked0, agree0), (kl1, masked1, agree1) = measured
    assert 0.2 < 1 - agree0 < 0.8 and kl1 > kl0
    if sign == "paper":
        assert masked1 > masked0
    else:
        assert agree1 < agree0


def test_a_warmup_that_outlasts_the_epochs_is_refused():
    with pytest.raises(ValueError, match="adversarial term would never run"):
        GeneratorSettings(epochs=20, warmup_epochs=20).check()
    GeneratorSettings(epochs=20, warmup_epochs=20, lambda_adversarial=0.0).check()  # without the term: fine
    with pytest.raises(ValueError, match="adversarial_sign must be one of"):
        GeneratorSettings(adversarial_sign="dense").check()


def test_the_generator_stops_at_its_deadline(toy):
    from coordinator.background import Deadline

    manifest, teacher, _ = toy
    out = train_generator([teacher], [None], (0, 1), GeneratorSettings(epochs=50, warmup_epochs=1), manifest,
                          (0.0, 1.0), CPU, seed=0, deadline=Deadline(0.0))
    assert out.log["generator_steps"] == 0 and len(out.y) == 0


# --- the replay set ------------------------------------------------------------------------------------------------

def test_the_replay_payload_round_trips_and_refuses_what_is_not_samples():
    rng = np.random.default_rng(0)
    x, y = rng.random((7, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 7)
    back_x, back_y = decode_replay(encode_replay(x, y), (1, 8, 8), 10)
    np.testing.assert_allclose(back_x, x, atol=1e-3)  # float16
    np.testing.assert_array_equal(back_y, y)
    for bad, shape, classes in ((encode_replay(x, y)[:-1], (1, 8, 8), 10), (encode_replay(x, y), (1, 40), 10),
                                (encode_replay(x, y), (1, 8, 8), 3), (b"\x00" * 5, (1, 8, 8), 10)):
        with pytest.raises(ValueError):
            decode_replay(bad, shape, classes)


def test_merged_replay_keeps_each_class_newest_samples():
    from coordinator.strategies.sdd import Synthetic

    held = (np.arange(6, dtype=np.float32).reshape(6, 1), np.array([0, 0, 0, 1, 1, 1]))
    new = Synthetic(np.array([[10.0], [11.0], [12.0]], np.float32), np.array([1, 2, 2]), {})
    x, y = merge_replay(held, new, per_class=2)
    assert sorted(zip(y.tolist(), x[:, 0].tolist())) == [(0, 1.0), (0, 2.0), (1, 5.0), (1, 10.0), (2, 11.0),
                                                         (2, 12.0)]


# --- a round finished off the loop ---------------------------------------------------------------------------------

class _Slow(Strategy):
    """A rule whose round finishes in a job that needs the loop to have run (it waits for `served`)."""

    name = "test-slow-round"

    def __init__(self, fail: bool = False, wait_s: float = 60.0) -> None:
        super().__init__("cpu")
        self.served, self.fail, self.wait_s = threading.Event(), fail, wait_s
        self.job: BackgroundJob[AggregateResult] = BackgroundJob("slow")

    def aggregate(self, global_weights, updates, ctx=RoundContext()):
        def work(deadline):
            if not self.served.wait(30):
                raise TimeoutError("the loop never ran")
            if self.fail:
                raise RuntimeError("the job fails")
            return AggregateResult(global_weights + 1)

        self.job.start(work, 30)
        return Pending(self.job, self.wait_s)


@pytest.mark.parametrize("fail", [False, True])
def test_a_pending_round_is_settled_while_the_loop_runs(fail):
    rule = _Slow(fail=fail)
    counters: Counter[str] = Counter()
    pumped = []

    def pump(seconds: float) -> None:  # the coordinator's loop: handles messages while the job runs
        pumped.append(seconds)
        rule.served.set()
        rule.job.wait(seconds)

    result = ContainedStrategy(rule, counters).aggregate(torch.zeros(3), [ClientUpdate("a", np.zeros(3, np.float32),
                                                                                       1)], RoundContext(), pump)
    assert pumped  # the loop ran while the round was pending
    if fail:
        assert result is None and counters[RULE_FAILED] == 1
    else:
        assert result is not None and result.global_weights.tolist() == [1.0, 1.0, 1.0]


def test_a_pending_round_that_outlasts_its_wait_is_lost_not_waited_for():
    rule = _Slow(wait_s=0.0)
    counters: Counter[str] = Counter()
    result = ContainedStrategy(rule, counters).aggregate(torch.zeros(3), [], RoundContext(), lambda s: None)
    assert result is None and counters[RULE_FAILED] == 1
    rule.served.set()
    rule.job.wait(30)


# --- the device half on every backend -----------------------------------------------------------------------------

def test_a_round_of_sdd_local_training_ends_at_the_same_weights_on_every_backend(export_artifacts, tmp_path):
    """Session 1 on one device: replay samples (relabelled by the old model) with SCE, the new head at 10x the
    rest's rate; the portable and ORT backends end where torch ends (SGD, relative to how far it moved), and the
    old classes' rows, at a rate of 0, do not move at all."""
    from edge_client.budget import Budget, DeviceBudget
    from edge_client.policies import make_policy
    from edge_client.policies.base import PolicyContext, RoundView, Samples, TrainingSet
    from edge_client.trainers.ort import OrtTrainer
    from edge_client.trainers.portable import PortableTrainer
    from edge_client.trainers.pytorch import TorchTrainer

    directory = export_artifacts("lenet", 10, (1, 8, 8), backends=("ort", "portable", "torch"))
    manifest = load_manifest(directory)
    trainers = {"torch": TorchTrainer(manifest, "sgd", 0.1), "portable": PortableTrainer(directory, "sgd", 0.1),
                "ort": OrtTrainer(directory, "sgd", 0.1)}
    start = trainers["portable"].get_weights()
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 1, 8, 8), dtype=np.float32), np.array([6, 7, 6, 7, 6, 7])
    replay = encode_replay(rng.random((40, 1, 8, 8), dtype=np.float32), np.repeat([0, 1, 2, 3], 10))
    ends = {}
    for name, trainer in trainers.items():
        trainer.set_weights(start)
        policy = make_policy("sdd", rest_rate=0.0, new_head_rate=1.0)
        policy.open(PolicyContext(tmp_path / name, directory, DeviceBudget(Budget(None, 1 << 20)), trainer))
        view = RoundView.of_samples(trainer, start, None, np.random.default_rng(1), batch_size=4,
                                    stored=Samples(x, y, np.ones(6, np.int64)))
        policy.receive(view, {"sdd/replay": replay})
        policy.fit(view, TrainingSet(x, y), epochs=2, proximal=None)
        ends[name] = trainer.get_weights()
        assert policy.metrics()["replay_held"] == 40
    moved = np.abs(ends["torch"] - start).max()
    assert moved > 0
    for name in ("portable", "ort"):
        assert np.abs(ends[name] - ends["torch"]).max() <= 1e-3 * moved, name
    frozen = np.ones(start.size, bool)
    frozen[class_head_positions(manifest.parameters, [6, 7])] = False
    for name, weights in ends.items():
        assert np.array_equal(weights[frozen], start[frozen]), name


def test_the_papers_finetune_trains_at_the_two_rates_without_replay(export_artifacts, tmp_path):
    """`replay = "none"` (the paper's Finetune+FL beside a FedAvg rule): session 1 at the two rates, the replay set
    left out even where one is held (the same weights as a device that holds none), and the old classes' rows,
    at a rate of 0, unmoved; the session's classes the round names but the device does not hold (class 8) train
    at the new head's rate too."""
    from edge_client.budget import Budget, DeviceBudget
    from edge_client.policies import make_policy
    from edge_client.policies.base import PolicyContext, RoundView, Samples, TrainingSet
    from edge_client.trainers.portable import PortableTrainer

    directory = export_artifacts("lenet", 10, (1, 8, 8), backends=("portable",))
    manifest = load_manifest(directory)
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 1, 8, 8), dtype=np.float32), np.array([6, 7, 6, 7, 6, 7])
    replay = encode_replay(rng.random((40, 1, 8, 8), dtype=np.float32), np.repeat([0, 1, 2, 3], 10))
    ends = {}
    for held in (True, False):
        trainer = PortableTrainer(directory, "sgd", 0.1)
        start = trainer.get_weights()
        policy = make_policy("sdd", replay="none", rest_rate=0.0, new_head_rate=1.0)
        policy.open(PolicyContext(tmp_path / str(held), directory, DeviceBudget(Budget(None, 1 << 20)), trainer))
        view = RoundView.of_samples(trainer, start, None, np.random.default_rng(1), batch_size=4,
                                    stored=Samples(x, y, np.ones(6, np.int64)))
        view = dataclasses.replace(view, known_classes=tuple(range(9)), task_classes=(6, 7, 8))
        if held:
            policy.receive(view, {"sdd/replay": replay})
        policy.fit(view, TrainingSet(x, y), epochs=2, proximal=None)
        ends[held] = trainer.get_weights()
    assert np.array_equal(ends[True], ends[False])
    moving = np.zeros(start.size, bool)
    moving[class_head_positions(manifest.parameters, [6, 7, 8])] = True
    assert np.array_equal(ends[True][~moving], start[~moving]) and not np.array_equal(ends[True], start)
    assert not np.array_equal(ends[True][class_head_positions(manifest.parameters, [8])],
                              start[class_head_positions(manifest.parameters, [8])])


def test_a_generator_that_made_no_finite_step_makes_no_samples(toy):
    """Statistics at the edge of float32 (they decode: finite, variances >= 0) make every step's loss non-finite:
    each is skipped, and the untrained generator's output (noise, whatever labels it was asked for) is not kept as
    the session's synthetic set, which would weight the classes' rows and join every device's replay."""
    manifest, teacher, _ = toy
    huge = {"input": LayerStatistics("input", np.array([3e38], np.float32), np.array([3e38], np.float32), 10),
            "features": LayerStatistics("features", np.full(manifest.feature_dim, -3e38, np.float32),
                                        np.full(manifest.feature_dim, 3e38, np.float32), 10)}
    settings = GeneratorSettings(epochs=3, iterations=5, batch_size=16, warmup_epochs=1)
    out = train_generator([teacher, teacher], [huge, None], (0, 1), settings, manifest, (0.0, 1.0), CPU, seed=0)
    assert out.log["generator_steps"] == 0 and out.log["generator_skipped_steps"] == 15
    assert len(out.y) == 0 and out.x.shape == (0, 1, 8, 8)


def test_only_statistics_an_honest_device_could_send_reach_the_generator(toy):
    """Inputs' means outside the data's range or variances beyond what the range allows, or features two orders of
    magnitude off the round's lower median, are not used; an honest spread (a device at twice another's scale)
    is."""
    manifest, _, stats = toy

    def scaled(features=1.0, input_mean=0.2, input_var=0.01):
        return {"input": LayerStatistics("input", np.array([input_mean], np.float32),
                                         np.array([input_var], np.float32), 10),
                "features": LayerStatistics("features", stats["features"].mean * features,
                                            stats["features"].var * features**2, 10)}

    sent = [scaled(), scaled(2.0), None, scaled(1e3), scaled(input_mean=3e38), scaled(input_var=0.3), scaled(0.5)]
    kept = plausible_statistics(sent, (0.0, 1.0), factor=100.0)
    assert [k is not None for k in kept] == [True, True, False, False, False, False, True]
    assert plausible_statistics([scaled(1e3), scaled()], (0.0, 1.0), 100.0)[0] is None  # two: the lower median


def test_the_sdd_rule_trains_its_generator_on_the_honest_devices_statistics_only(export_artifacts):
    """One device of three sends statistics of 3e38 (the fleet's `statistics-extreme`, firmware_sim/payload_attacks/
    sdd.py, made of an honest device's): the rule leaves them out (counted), and its generator steps."""
    from firmware_sim.payload_attacks import PAYLOAD_ATTACKS, PayloadContext
    from models.feature_stats import STATISTICS, decode_statistics, encode_statistics, layer_sizes

    artifacts = export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",))
    manifest = load_manifest(artifacts)
    rule = SddCoordinator(generator_epochs=2, generator_iterations=2, warmup_epochs=1, generator_batch_size=8,
                          device="cpu", manifest=manifest)
    start = np.random.default_rng(0).normal(0, 0.1, manifest.num_parameters).astype(np.float32)
    honest = [LayerStatistics("input", np.array([0.3], np.float32), np.array([0.05], np.float32), 10),
              LayerStatistics("features", np.full(manifest.feature_dim, 0.5, np.float32),
                              np.full(manifest.feature_dim, 0.1, np.float32), 10)]
    sent = {STATISTICS: encode_statistics(honest)}
    hostile = PAYLOAD_ATTACKS.get("statistics-extreme")().craft(sent, PayloadContext(None, manifest, artifacts,
                                                                                     np.array([3])))
    extreme = decode_statistics(hostile[STATISTICS], layer_sizes(manifest.input_shape, manifest.feature_dim))
    assert all((s.mean == np.float32(3e38)).all() and (s.var == np.float32(3e38)).all() for s in extreme.values())
    updates = [ClientUpdate(name, start.copy(), 10, attachments=attachments)
               for name, attachments in (("a", sent), ("b", sent), ("c", hostile))]
    for update in updates:
        rule.inspect(update)  # each decodes: the plausibility is the rule's, over the round
    ctx = RoundContext(round=2, task=1, task_classes=(3,), seen_classes=(0, 1, 2, 3))
    metrics = settled(rule.aggregate(torch.from_numpy(start), updates, ctx)).metrics["generator"]
    assert metrics["statistics_refused"] == 1 and metrics["generator_skipped_steps"] == 0
    assert metrics["generator_steps"] == 4


def test_the_replay_set_and_the_sessions_samples_survive_a_resume(export_artifacts, tmp_path):
    manifest = load_manifest(export_artifacts("mlp", 4, (1, 8, 8), backends=("torch",)))
    options = dict(generator_epochs=2, generator_iterations=2, warmup_epochs=1, generator_batch_size=8,
                   device="cpu", manifest=manifest)
    rule = SddCoordinator(**options)
    start = np.zeros(manifest.num_parameters, np.float32)
    ctx = RoundContext(round=2, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3))
    before = settled(rule.aggregate(torch.from_numpy(start), [ClientUpdate("a", start.copy(), 3)], ctx))
    rule.save(tmp_path)
    resumed = SddCoordinator(**options)
    resumed.load(tmp_path)
    assert resumed.replay is not None and resumed.session is not None and rule.replay is not None
    np.testing.assert_array_equal(resumed.replay[0], rule.replay[0])
    np.testing.assert_array_equal(resumed.session[2], rule.session[2])
    later = RoundContext(round=3, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3), round_in_task=2,
                         rounds_per_task=2)  # the session's next round: CSWA on the resumed X~, no generator
    after = resumed.aggregate(torch.from_numpy(start), [ClientUpdate("a", start.copy(), 3)], later)
    assert isinstance(after, AggregateResult) and after.broadcast == before.broadcast


@pytest.mark.parametrize("given", [None, [0.0, 1.0]])
def test_the_coordinator_gives_a_rule_that_makes_inputs_its_test_datas_range_unless_told(tmp_path, export_artifacts,
                                                                                         given):
    """A rule that makes inputs (SDD's generator, GLFC's reconstructions: `Strategy.makes_inputs`) makes them within
    `input_range`; left out, the coordinator's test data's range, not [0, 1] (MNIST-1D's signals span about
    [-4.6, 4.7], and a fleet's generator made them within [0, 1] unless the file said otherwise); a range given is
    kept."""
    from coordinator.config import CoordinatorConfig
    from coordinator.evaluation import input_range
    from coordinator.server import Coordinator
    from firmware_sim.scenarios import preset

    test_sets = preset("mnist1d-fewshot", n_clients=1).build()
    low, high = input_range(test_sets)
    x, _ = test_sets.task_test(0)
    assert low <= float(x.min()) < -1 and high >= float(x.max()) > 2  # every task's inputs, not [0, 1]
    config = CoordinatorConfig.from_dict({
        "fleet": "f", "out": "run", "artifacts": str(export_artifacts("cnn1d", 10, (1, 40))), "devices": ["d1"],
        "scenario": {"preset": "mnist1d-fewshot", "n_clients": 1},
        "strategy": {"name": "sdd", **({} if given is None else {"input_range": given})},
    }, base=tmp_path)
    rule = Coordinator(config, test_sets=test_sets).strategy.strategy
    assert isinstance(rule, SddCoordinator)
    assert rule.input_range == ((low, high) if given is None else (0.0, 1.0))
