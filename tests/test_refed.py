"""Re-Fed's PIM and importance, as the paper defines them, on all three trainer backends.

The PIM runs on the embedded digits' first four classes from a model trained briefly on them (AdamW, 3 epochs), the
state of a global model at a task switch, so the scores come from a model that has learned something.
"""
from __future__ import annotations

import numpy as np
import pytest

from edge_client.policies import RoundView, Samples, group_ranking, make_policy
from edge_client.policies.refed import ReFed, emphasis, pim_step, proximal_coefficient
from edge_client.trainers.base import Trainer
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.datasets import load_dataset
from models.manifest import load_manifest

BACKENDS = ("ort", "portable", "torch")


@pytest.fixture(scope="module")
def artifacts(export_artifacts):
    return export_artifacts("lenet", backends=BACKENDS)


@pytest.fixture(scope="module")
def old_samples() -> Samples:
    data = load_dataset("digits")
    keep = data.y_train < 4
    x, y = data.x_train[keep][:160], data.y_train[keep][:160]
    return Samples(x, y, np.zeros(len(y), dtype=np.int64))


@pytest.fixture(scope="module")
def global_weights(artifacts, old_samples) -> np.ndarray:
    trainer = OrtTrainer(artifacts, optimizer="adamw", lr=3e-3)
    trainer.fit(old_samples.x, old_samples.y, epochs=3, rng=np.random.default_rng(0))
    return trainer.get_weights()


def _trainer(backend: str, directory, optimizer: str = "adamw", lr: float = 1e-3) -> Trainer:
    if backend == "ort":
        return OrtTrainer(directory, optimizer=optimizer, lr=lr)
    if backend == "portable":
        return PortableTrainer(directory, optimizer=optimizer, lr=lr)
    return TorchTrainer(load_manifest(directory), optimizer, lr)


def _context(trainer: Trainer, global_weights: np.ndarray, seed: int = 3) -> RoundView:
    mask = np.zeros(10, dtype=np.float32)
    mask[:4] = 1.0
    return RoundView.of_samples(trainer, global_weights, mask, np.random.default_rng(seed), batch_size=32)


def test_the_pim_step_is_equation_3():
    v, g, w = (np.array(a, dtype=np.float32) for a in ([1.0, 2.0], [0.5, -1.0], [0.0, 1.0]))
    q = proximal_coefficient(0.2)
    assert q == pytest.approx(2.0) and proximal_coefficient(0.5) == pytest.approx(0.5)
    np.testing.assert_allclose(pim_step(v, g, w, 0.1, q), v - 0.1 * (g + 2.0 * (v - w)), rtol=1e-7)
    assert [emphasis(p, "early") for p in (1, 2, 4)] == [1.0, 0.5, 0.25]
    assert emphasis(3, "average") == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_lambda_moves_the_pim_monotonically(artifacts, old_samples, global_weights, backend):
    """Eq. 3: a larger lambda (a smaller q) lets the PIM drift further from the global model."""
    trainer = _trainer(backend, artifacts)
    trainer.set_weights(global_weights)
    drifts = []
    for lam in (0.05, 0.2, 0.5, 0.9):
        policy = ReFed(lam=lam, pim_epochs=4, pim_lr=0.05, importance="last-layer")
        policy.importance_scores(old_samples, _context(trainer, global_weights))
        assert policy.last_pim is not None and policy.last_pim.epochs == 4
        drifts.append(policy.last_pim.drift)
    assert all(a < b for a, b in zip(drifts, drifts[1:])), drifts
    assert drifts[-1] > 3 * drifts[0], drifts  # q goes from 9.5 to 0.056: the pull must matter


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pim_leaves_the_task_models_weights_and_optimizer_as_they_were(artifacts, old_samples, global_weights,
                                                                           backend):
    """Two trainers take the same AdamW steps; one runs a PIM between them. Its next step must be the other's,
    bit for bit: the PIM touched neither the weights nor the Adam moments nor the step count."""
    x, y = old_samples.x, old_samples.y
    with_pim, without = (_trainer(backend, artifacts) for _ in range(2))
    for trainer in (with_pim, without):
        trainer.set_weights(global_weights)
        trainer.fit(x[:64], y[:64], batch_size=32)
    before = with_pim.get_weights()
    ReFed(pim_epochs=2, pim_lr=0.05).importance_scores(old_samples, _context(with_pim, global_weights))
    assert np.array_equal(with_pim.get_weights(), before)
    for trainer in (with_pim, without):
        trainer.fit(x[64:128], y[64:128], batch_size=32)
    assert np.array_equal(with_pim.get_weights(), without.get_weights())


def test_late_emphasis_is_the_early_ranking_reversed(artifacts, old_samples, global_weights):
    """Supplement E.3: late emphasis sorts by the early-emphasis importance, reversed."""
    trainer = _trainer("ort", artifacts)
    rankings = {}
    for weighting in ("early", "late"):
        policy = ReFed(pim_epochs=3, pim_lr=0.05, weighting=weighting, importance="last-layer")
        rankings[weighting] = policy.rank(old_samples, len(old_samples), _context(trainer, global_weights))
    assert np.array_equal(rankings["late"], rankings["early"][::-1])
    assert not np.array_equal(rankings["late"][:40], rankings["early"][:40])


def test_importance_is_the_emphasised_sum_of_the_pims_norms(artifacts, old_samples, global_weights):
    """Recompute I(x) by hand with the trainer's gradients and Eq. 3 steps over the same batches."""
    from edge_client.trainers.base import iterate_batches

    trainer = _trainer("ort", artifacts)
    policy = ReFed(lam=0.25, pim_epochs=3, pim_lr=0.05, weighting="early", importance="exact")
    ctx = _context(trainer, global_weights, seed=5)
    scores = policy.importance_scores(old_samples, ctx)

    rng, q, v = np.random.default_rng(5), proximal_coefficient(0.25), global_weights.copy()
    expected = np.zeros(len(old_samples))
    for p in (1, 2, 3):
        for idx in iterate_batches(len(old_samples), 32, rng):
            trainer.set_weights(v)
            v = pim_step(v, trainer.gradient(old_samples.x[idx], old_samples.y[idx], ctx.class_mask)[1],
                         global_weights, 0.05, q)
        trainer.set_weights(v)
        expected += trainer.per_sample_grad_norms(old_samples.x, old_samples.y, "exact", ctx.class_mask) / p
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


def test_a_flat_loss_ends_the_pim_early(artifacts, old_samples, global_weights):
    trainer = _trainer("ort", artifacts)
    full = ReFed(pim_epochs=12, pim_lr=0.01, importance="last-layer")
    full.importance_scores(old_samples, _context(trainer, global_weights))
    assert full.last_pim is not None and full.last_pim.epochs == 12
    early = ReFed(pim_epochs=12, pim_lr=0.01, pim_tolerance=0.5, importance="last-layer")
    early.importance_scores(old_samples, _context(trainer, global_weights))
    assert early.last_pim is not None and early.last_pim.epochs < 12
    losses = early.last_pim.losses
    assert losses[-2] - losses[-1] < 0.5 * losses[-2]  # it stopped because the last epoch gained too little
    assert early.metrics() == {"pim_epochs": float(early.last_pim.epochs), "pim_drift": early.last_pim.drift,
                               "pim_diverged": 0.0}
    assert early.metrics() == {}  # reported once


@pytest.mark.parametrize("options", [{"pim_lr": 0.0}, {"pim_tolerance": -1.0}, {"pim_epochs": 0}, {"lam": 1.0},
                                     {"weighting": "middle"}])
def test_bad_pim_options_are_refused(options):
    with pytest.raises(ValueError):
        make_policy("refed", **options)


@pytest.mark.parametrize(("lam", "pim_lr"), [(0.05, 0.22), (0.5, 4.0), (0.2, 1.0)])
def test_a_pim_whose_proximal_step_diverges_is_refused_in_one_line_when_configured(lam, pim_lr):
    """pim_lr * q(lam) >= 2 makes Eq. 3's distance to the global model grow at every step: refused where the
    [policy] table is checked, in one line that says the bound; just under it is taken."""
    from edge_client.policies import check_policy
    from edgefil.settings import ConfigError, Where

    q = proximal_coefficient(lam)
    assert pim_lr * q >= 2
    with pytest.raises(ConfigError, match=r"\[policy\].*pim_lr .* diverges.*must stay below 2") as refused:
        check_policy({"name": "refed", "lam": lam, "pim_lr": pim_lr}, Where("device.toml").inner("policy"))
    assert "\n" not in str(refused.value)
    assert make_policy("refed", lam=lam, pim_lr=0.99 * 2 / q).pim_lr == pytest.approx(0.99 * 2 / q)


def test_a_pim_that_diverges_anyway_keeps_its_finite_epochs_and_says_so(artifacts, old_samples, global_weights,
                                                                        caplog):
    """A step the proximal bound allows can still diverge on a steep loss (a huge pim_lr with a weak pull): the
    run stops at the first epoch that is not finite, ranks on the epochs before it (or on the global model's
    scores), and reports it."""
    trainer = _trainer("ort", artifacts)
    trainer.set_weights(global_weights)
    policy = ReFed(lam=0.999, pim_epochs=6, pim_lr=1e3, importance="last-layer")
    with caplog.at_level("WARNING"):
        order = policy.rank(old_samples, 40, _context(trainer, global_weights))
    assert policy.last_pim is not None and policy.last_pim.diverged and policy.last_pim.epochs < 6
    assert len(order) == 40 and len(set(order.tolist())) == 40 and order.max() < len(old_samples)
    reported = policy.metrics()
    assert reported["pim_diverged"] == 1.0 and np.isfinite(reported["pim_drift"])  # the last finite point's
    assert any("PIM diverged" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(trainer.get_weights(), global_weights)  # the task model as it was


def test_with_two_heads_the_pim_moves_only_its_auxiliary_head(artifacts, old_samples, global_weights, monkeypatch):
    """The supplement's structure: the PIM is a second fully-connected head on the shared layers, so every model
    the PIM scores or steps from keeps the global model's shared layers; its head moves."""
    from models.manifest import class_head_positions

    trainer = _trainer("ort", artifacts)
    trainer.set_weights(global_weights)
    head = class_head_positions(trainer.manifest.parameters, np.arange(trainer.manifest.num_classes))
    shared = np.setdiff1d(np.arange(len(global_weights)), head)
    seen: list[np.ndarray] = []
    original = trainer.set_weights

    def spy(weights: np.ndarray) -> None:
        seen.append(np.array(weights, copy=True))
        original(weights)

    monkeypatch.setattr(trainer, "set_weights", spy)
    policy = ReFed(pim_epochs=3, pim_lr=0.5, heads="two", importance="exact")
    policy.importance_scores(old_samples, _context(trainer, global_weights))
    assert policy.last_pim is not None and policy.last_pim.drift > 0
    assert all(np.array_equal(w[shared], global_weights[shared]) for w in seen)
    assert any(not np.array_equal(w[head], global_weights[head]) for w in seen)
    with pytest.raises(ValueError, match="heads must be one of"):
        ReFed(heads="three")


def test_class_quotas_keep_every_seen_class_when_the_budget_allows_one_each(artifacts, old_samples,
                                                                            global_weights):
    """Re-Fed's ranking under `group_by = "class"`: with as many slots as classes, one sample of every class."""
    trainer = _trainer("ort", artifacts)
    policy = make_policy("refed", pim_epochs=2, pim_lr=0.05, importance="last-layer")
    for keep in (4, 5, 9):  # as the learner groups any ranking (LearnerConfig.group_by)
        order = policy.rank(old_samples, len(old_samples), _context(trainer, global_weights))
        ranking = group_ranking(order, old_samples.y, keep)
        assert len(ranking) == keep
        assert set(old_samples.y[ranking].tolist()) == {0, 1, 2, 3}
