"""The device half's contract, for every method: hooks see one frozen view of the device; class quotas are the
learner's, around any policy's ranking, and never replace a policy's own hooks; every global model a device
receives reaches its policy; a policy can declare a task boundary where the stream announces none."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_client.budget import Budget, DeviceBudget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import POLICIES, ReplayPolicy, RoundView, Samples, group_ranking, make_policy, policy_names
from edge_client.policies.random_cache import RandomCache
from edge_client.store import ReplayStore
from edge_client.stream import Chunk
from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.manifest import OPTIONAL_GRAPHS, load_manifest

OPTIONS = {"refed": {"pim_epochs": 1, "importance": "last-layer"},
           "generator": {"init_steps": 2, "transfer_steps": 1, "precision": "int8", "keep_auxiliary": False},
           "fedcil": {"gan_steps": 2, "width": 8}}
TORCH_ONLY = ("dann",)
BUILT_IN = [name for name in policy_names() if POLICIES.get(name).__module__.startswith("edge_client.")]
HOOKS = ("rank", "admit", "task_boundary", "on_global_model", "requests", "receive", "training_set", "fit",
         "after_training", "release_bytes", "attachments")


@pytest.fixture(scope="module")
def artifacts(export_artifacts):
    # with the portable graphs: GLFC's perturbation runs the input gradient, which the ort backend takes from them
    lenet = export_artifacts("lenet", 10, (1, 8, 8), backends=("ort", "torch", "portable"))
    for name in BUILT_IN:  # what each method's devices open besides the model (a generator, an encoding network)
        POLICIES.get(name).export_artifacts(OPTIONS.get(name, {}), lenet)
    return lenet


def _learner(artifacts, folder, policy: ReplayPolicy, config: LearnerConfig, max_samples: int = 30) -> Learner:
    trainer = (TorchTrainer(load_manifest(artifacts), optimizer="sgd", lr=0.05) if policy.name in TORCH_ONLY
               else OrtTrainer(artifacts, optimizer="sgd", lr=0.05))
    store = ReplayStore.within(DeviceBudget(Budget(max_samples, None)), folder / "store", (1, 8, 8))
    learner = Learner(trainer, store, policy, config, seed=1)
    learner.open_policy(folder, artifacts)
    return learner


def _task(classes, n, seed):
    rng = np.random.default_rng(seed)
    y = np.repeat(np.asarray(classes), n // len(classes))
    x = (y[:, None, None, None] / 10 + 0.1 * rng.standard_normal((len(y), 1, 8, 8))).astype(np.float32)
    return x, y


def _spy(policy: ReplayPolicy, calls: list[tuple[str, object]]) -> None:
    """Record every hook the learner calls on this very object, with the view (or context) it was given."""
    for hook in HOOKS:
        own = getattr(policy, hook)

        def spied(*args, _hook=hook, _own=own, **kwargs):
            calls.append((_hook, next((a for a in args if isinstance(a, RoundView)), None)))
            return _own(*args, **kwargs)

        setattr(policy, hook, spied)


def _two_tasks(learner: Learner) -> None:
    weights = learner.trainer.get_weights()
    learner.global_model_arrived(weights)
    learner.start_task(0, *_task([0, 1, 2], 24, 0))  # 8 of each class
    learner.train()
    learner.finish_round()
    learner.global_model_arrived(learner.trainer.get_weights())
    learner.start_task(1, *_task([3, 4], 20, 1))  # 30 - 20 = 10 old samples stay
    learner.train()
    learner.finish_round()


@pytest.mark.parametrize("group_by", [None, "class"])
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_policy_keeps_its_own_hooks_with_and_without_class_quotas(artifacts, tmp_path, name, group_by):
    """The learner calls the policy's own hooks, each with a RoundView, whether or not it groups the ranking (its
    `after_training` where it acts after training); with class quotas, every old class keeps its share of the old
    samples the policy keeps."""
    policy = make_policy(name, **OPTIONS.get(name, {}))
    calls: list[tuple[str, object]] = []
    _spy(policy, calls)
    learner = _learner(artifacts, tmp_path, policy, LearnerConfig(batch_size=8, group_by=group_by))
    assert learner.policy is policy
    _two_tasks(learner)
    called = [hook for hook, _ in calls]
    assert called.count("fit") == 2 and called.count("training_set") == 2
    assert called.count("after_training") == (2 if policy.acts_after_training() else 0)
    assert called.count("on_global_model") == 2
    assert all(view is not None for _, view in calls)  # every hook got a RoundView
    old = learner.store.labels(learner.store.ids(0))
    if policy.keeps_old and group_by == "class" and name != "reservoir":  # reservoir admits by itself, unranked
        assert "rank" in called
        counts = np.bincount(old, minlength=3)[:3]
        assert counts.max() - counts.min() <= 1, counts
    learner.store.close()


@pytest.mark.parametrize("name", [name for name in BUILT_IN if name not in TORCH_ONLY])
def test_every_policy_trains_on_a_portable_set_of_only_the_graphs_it_declares(tmp_path, name):
    """A fleet exports the optional graphs its method declares and no others (`trainer_graphs`; a plain method's set
    lacks even the whole loss's gradient): every built-in method, with the options used here, trains two tasks on
    the portable backend from such a set, so none runs a graph it did not declare."""
    from edge_client.trainers.portable import PortableTrainer
    from models.export import export_registered

    policy = make_policy(name, **OPTIONS.get(name, {}))
    folder = tmp_path / "artifacts"
    export_registered("lenet", 10, folder, (1, 8, 8), seed=0, backends=("portable", "torch"),
                      graphs=policy.trainer_graphs(), cache=True)
    POLICIES.get(name).export_artifacts(OPTIONS.get(name, {}), folder)
    trainer = PortableTrainer(folder, optimizer="sgd", lr=0.05)
    assert trainer.graphs == policy.trainer_graphs()
    store = ReplayStore.within(DeviceBudget(Budget(30, None)), tmp_path / "store", (1, 8, 8))
    learner = Learner(trainer, store, policy, LearnerConfig(batch_size=8), seed=1)
    learner.open_policy(tmp_path, folder)
    _two_tasks(learner)
    store.close()


def test_grouping_is_a_quota_around_any_ranking_in_the_policys_own_order():
    """A ranking that knows no classes (by position, last first), under class quotas: the same quota per class,
    each class's samples in the ranking's order; under task quotas, the same per task."""
    y = np.array([0] * 8 + [1] * 2 + [2] * 6)
    task = np.array([0] * 10 + [1] * 6)
    order = np.arange(len(y))[::-1]
    kept = group_ranking(order, y, 6)
    assert sorted(np.bincount(y[kept], minlength=3).tolist()) == [2, 2, 2]
    assert set(kept[y[kept] == 0].tolist()) == {6, 7} and set(kept[y[kept] == 2].tolist()) == {14, 15}
    by_task = group_ranking(order, task, 4)
    assert np.bincount(task[by_task]).tolist() == [2, 2] and set(by_task.tolist()) == {8, 9, 14, 15}
    with pytest.raises(ValueError, match="group_by"):
        LearnerConfig(group_by="day")


def test_a_view_is_frozen_and_shows_the_device_as_it_is(artifacts, tmp_path):
    learner = _learner(artifacts, tmp_path, make_policy("random"), LearnerConfig(batch_size=8))
    learner.start_task(0, *_task([0, 1], 10, 0))
    learner.start_task(1, *_task([2, 3], 10, 1))
    view = learner.view()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.task = 5  # type: ignore[misc]
    assert view.task == 1 and view.n_stored() == len(learner.store) == 20 and view.n_seen == 20
    assert view.seen_before_task().tolist() == [0, 1]
    assert view.task_counts[[2, 3]].tolist() == [5, 5] and view.label_counts[:4].tolist() == [5, 5, 5, 5]
    assert view.class_mask is not None and np.flatnonzero(view.class_mask).tolist() == [0, 1, 2, 3]
    assert view.stored_tasks().tolist() == learner.store.tasks(learner.store.ids()).tolist()
    current = view.stored(1)
    assert isinstance(current, Samples) and set(current.y.tolist()) == {2, 3} and (current.task == 1).all()
    learner.store.close()


class LabelBoundary(ReplayPolicy):
    """A policy that declares a task boundary itself (a chunk with a label of 5 or more, while none was seen
    yet), and keeps the global models it was shown."""

    name = "test-boundary"

    def __init__(self) -> None:
        self.models_seen: list[np.ndarray] = []
        self.asked = 0

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return np.arange(min(keep, len(old)))

    def on_global_model(self, view: RoundView, weights: np.ndarray) -> None:
        self.models_seen.append(weights)

    def task_boundary(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> bool:
        self.asked += 1
        return bool((y >= 5).any()) and view.label_counts[5:].sum() == 0


def test_a_policy_declares_a_task_boundary_where_the_stream_announces_none(artifacts, tmp_path):
    policy = LabelBoundary()
    learner = _learner(artifacts, tmp_path, policy, LearnerConfig(batch_size=8), max_samples=100)
    assert learner.observe(Chunk(*_task([0, 1], 10, 0)))  # the first chunk starts task 0
    assert not learner.observe(Chunk(*_task([0, 1], 10, 1)))
    assert learner.observe(Chunk(*_task([5, 6], 10, 2))) and learner.state.task == 1
    assert policy.asked == 2
    learner.observe(Chunk(*_task([7], 10, 3), task=1))  # an announced task is never asked about
    assert policy.asked == 2
    learner.store.close()


def test_every_global_model_reaches_the_policy_and_becomes_the_views_latest(artifacts, tmp_path):
    policy = LabelBoundary()
    learner = _learner(artifacts, tmp_path, policy, LearnerConfig(batch_size=8))
    first, second = learner.trainer.get_weights(), learner.trainer.get_weights() + 1
    learner.global_model_arrived(first)
    assert learner.view().global_weights is first
    learner.global_model_arrived(second)
    assert [w is m for w, m in zip(policy.models_seen, (first, second))] == [True, True]
    assert learner.view().global_weights is second and learner.state.task == -1  # no data needed
    learner.store.close()


class NeedsInputGradients(LabelBoundary):
    """A policy that runs the input gradient (as GLFC's refinement does) when told to."""

    name = "test-input-gradients"

    def __init__(self, refine: bool) -> None:
        super().__init__()
        self.refine = refine

    def trainer_graphs(self) -> frozenset[str]:
        return frozenset({"input_gradient"}) if self.refine else frozenset()


def test_every_policy_declares_only_optional_graphs_and_a_learner_refuses_what_its_trainer_lacks(export_artifacts,
                                                                                                   tmp_path):
    """What a built-in policy declares, with its defaults and the options used here, are optional graphs; a
    policy that needs a graph its trainer lacks (ort artifacts without the portable graphs: no input gradient) is
    refused when the learner opens it, in one line, and the same policy not needing it opens."""
    for name in BUILT_IN:
        for options in ({}, OPTIONS.get(name, {})):
            assert make_policy(name, **options).trainer_graphs() <= OPTIONAL_GRAPHS
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))  # ort's own graphs only
    trainer = OrtTrainer(artifacts, optimizer="sgd", lr=0.05)
    assert "input_gradient" not in trainer.graphs
    for refine in (True, False):
        store = ReplayStore.within(DeviceBudget(Budget(30, None)), tmp_path / str(refine) / "store", (1, 8, 8))
        learner = Learner(trainer, store, NeedsInputGradients(refine), LearnerConfig(), seed=1)
        if refine:
            with pytest.raises(ValueError, match="test-input-gradients needs the optional trainer graphs "
                                                 "input_gradient .* ort backend's artifacts lack"):
                learner.open_policy(tmp_path, artifacts)
        else:
            learner.open_policy(tmp_path, artifacts)
        store.close()


def test_a_policy_that_overrides_its_attachments_says_it_attaches_and_whether_local_dp_can_release_them():
    """Secure aggregation refuses a policy that attaches (`ReplayPolicy.attaches`), and local DP one whose attachments
    it cannot release (`releases_values`): every built-in policy that overrides `attachments` says it attaches at
    its defaults, and one that does not override it says it does not; one that says local DP can release them
    overrides `attached_values`, and one that attaches nothing gives none."""
    for name in BUILT_IN:
        policy = make_policy(name, **OPTIONS.get(name, {}))
        overrides = type(policy).attachments is not ReplayPolicy.attachments
        assert policy.attaches() == overrides, name
        if not policy.attaches():
            assert policy.releases_values() and policy.attached_values() is None, name
        elif policy.releases_values():
            assert type(policy).attached_values is not ReplayPolicy.attached_values, name


def test_a_policy_that_overrides_after_training_says_it_acts_and_the_learner_reads_its_samples_only_then(
        artifacts, tmp_path, monkeypatch):
    """Every built-in policy that overrides `after_training` says it acts after training at its defaults, and one
    that does not says it does not (a policy written before the question, overriding the hook, keeps it); the
    learner's `finish_round` reads the task's samples and calls the hook only for a policy that acts."""
    for name in BUILT_IN:
        policy = make_policy(name, **OPTIONS.get(name, {}))
        overrides = type(policy).after_training is not ReplayPolicy.after_training
        assert policy.acts_after_training() == overrides, name

    class OwnHook(RandomCache):  # a user's policy that overrides the hook and says nothing more
        def after_training(self, view, x, y):
            pass

    assert OwnHook().acts_after_training()
    rng = np.random.default_rng(0)
    for acts in (False, True):
        policy = make_policy("random")
        called: list[int] = []
        monkeypatch.setattr(policy, "acts_after_training", lambda _acts=acts: _acts)
        monkeypatch.setattr(policy, "after_training", lambda view, x, y, _called=called: _called.append(len(y)))
        learner = _learner(artifacts, tmp_path / str(acts), policy, LearnerConfig())
        learner.observe(Chunk(rng.random((6, 1, 8, 8), dtype=np.float32), np.array([0, 1] * 3), 0))
        learner.train()
        reads: list[str] = []
        for read in ("get", "samples", "ids"):
            monkeypatch.setattr(learner.store, read, lambda *a, _read=getattr(learner.store, read), _name=read,
                                _reads=reads: _reads.append(_name) or _read(*a))
        learner.finish_round()
        assert (bool(reads), called) == ((True, [6]) if acts else (False, [])), (acts, reads)
        learner.store.close()
