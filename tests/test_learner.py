"""The learner: task switches cache M - N_new old samples by policy, detection, budgets, restart."""
import numpy as np
import pytest
from open_files import open_files_under

from edge_client.budget import Budget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import make_policy
from edge_client.store import BudgetExceededError, ReplayStore
from edge_client.stream import Chunk, chunked
from edge_client.trainers.ort import OrtTrainer


def _task_data(classes, n, seed):
    rng = np.random.default_rng(seed)
    y = rng.choice(classes, n)
    x = (y[:, None, None, None] / 10 + 0.05 * rng.standard_normal((n, 1, 8, 8))).astype(np.float32)
    return x, y


@pytest.fixture
def make_learner(export_artifacts, tmp_path):
    def make(policy="random", max_samples=100, max_bytes=None, config=LearnerConfig(), name="store", **options):
        trainer = OrtTrainer(export_artifacts("lenet"), optimizer="adamw", lr=3e-3)
        store = ReplayStore(tmp_path / name, Budget(max_samples, max_bytes), sample_shape=(1, 8, 8))
        return Learner(trainer, store, make_policy(policy, **options), config, seed=0)

    return make


@pytest.mark.parametrize("policy", ["random", "class-balanced", "herding", "refed"])
def test_a_task_switch_caches_m_minus_n_new_old_samples(make_learner, policy):
    learner = make_learner(policy, max_samples=100, **({"pim_epochs": 1} if policy == "refed" else {}))
    learner.start_task(0, *_task_data([0, 1], 90, 0))
    assert len(learner.store) == 90
    learner.train()
    learner.start_task(1, *_task_data([2, 3], 70, 1))
    ids = learner.store.ids()
    tasks = learner.store.tasks(ids)
    assert (tasks == 1).sum() == 70
    assert (tasks == 0).sum() == 100 - 70  # the cache: M - N_new
    assert learner.state.seen_classes == [0, 1, 2, 3]


@pytest.mark.parametrize(("new_share", "first", "new", "old"), [
    (None, 100, 100, 0),        # Re-Fed's rule: the newest task keeps all it brings
    (0.3, 100, 30, 70),         # at most 30 % of M for it, the rest for the old data by the policy's ranking
    ("stream", 100, 50, 50),    # its share of everything seen: 100 of 200
    ("stream", 300, 25, 75),    # 100 of 400 seen
    (0.3, 20, 80, 20),          # what the old data cannot fill goes to the newest task
])
@pytest.mark.parametrize("policy", ["random", "refed"])
def test_the_budget_split_gives_the_newest_task_its_share_of_m(make_learner, policy, new_share, first, new, old):
    learner = make_learner(policy, max_samples=100, config=LearnerConfig(new_share=new_share),
                           **({"pim_epochs": 1} if policy == "refed" else {}))
    learner.start_task(0, *_task_data([0, 1], first, 0))
    learner.start_task(1, *_task_data([2, 3], 100, 1))
    tasks = learner.store.tasks()
    assert ((tasks == 1).sum(), (tasks == 0).sum()) == (new, old)
    learner.observe(Chunk(*_task_data([2, 3], 100, 2), task=1))  # a later chunk: the quota follows the stream
    tasks = learner.store.tasks()
    assert len(tasks) == 100
    if new_share == "stream":
        assert (tasks == 1).sum() == int(np.ceil(100 * 200 / (first + 200)))


def test_a_split_is_refused_in_one_line_where_it_cannot_apply():
    from edge_client.policies import check_policy
    from edgefil.settings import ConfigError, Where

    where = Where("device.toml").inner("policy")
    assert check_policy({"name": "refed", "new_share": 0.4}, where)["new_share"] == 0.4
    assert check_policy({"name": "reservoir", "new_share": "stream"}, where)["new_share"] == "stream"
    for table, message in [({"name": "random", "new_share": 1.5}, "number in \\(0, 1\\]"),
                           ({"name": "random", "new_share": "all"}, "number in"),
                           ({"name": "reservoir", "new_share": 0.5}, "admits the stream itself")]:
        with pytest.raises(ConfigError, match=rf"\[policy\] new_share.*{message}"):
            check_policy(table, where)


def test_new_data_larger_than_the_budget_is_subsampled(make_learner):
    learner = make_learner(max_samples=50)
    learner.start_task(0, *_task_data([0, 1], 40, 0))
    learner.start_task(1, *_task_data([2, 3], 80, 1))
    assert len(learner.store) == 50
    assert set(learner.store.tasks().tolist()) == {1}


def test_the_cache_follows_the_policy_ranking(make_learner):
    """class-balanced keeps both old classes equally even when the old task was lopsided."""
    learner = make_learner("class-balanced", max_samples=60)
    x0, y0 = _task_data([0], 45, 0)
    x1, y1 = _task_data([1], 5, 1)
    learner.start_task(0, np.concatenate([x0, x1]), np.concatenate([y0, y1]))
    learner.start_task(1, *_task_data([2], 50, 2))
    old = learner.store.labels(learner.store.ids(task=0))
    assert sorted(old.tolist()) == [0] * 5 + [1] * 5


def test_unseen_labels_start_a_task_when_detection_is_on(make_learner):
    learner = make_learner(max_samples=100, config=LearnerConfig(detect_new_tasks=True))
    x, y = _task_data([0, 1], 60, 0)
    starts = [learner.observe(c) for c in chunked(x, y, task=None, size=20)]
    assert starts == [True, False, False] and learner.state.task == 0
    assert learner.observe(Chunk(*_task_data([5], 10, 1))) is True
    assert learner.state.task == 1
    assert learner.observe(Chunk(*_task_data([0, 5], 10, 2))) is False

    quiet = make_learner(max_samples=100, name="quiet")
    quiet.observe(Chunk(x, y))
    assert quiet.observe(Chunk(*_task_data([5], 10, 1))) is False  # detection off: same task


def test_later_chunks_of_a_task_never_overflow_the_budget(make_learner):
    learner = make_learner(max_samples=80)
    learner.start_task(0, *_task_data([0, 1], 60, 0))
    x, y = _task_data([2, 3], 120, 1)
    for chunk in chunked(x, y, task=1, size=25):
        learner.observe(chunk)
        assert len(learner.store) <= 80
    assert len(learner.store) == 80


def test_reservoir_streams_within_the_budget(make_learner):
    learner = make_learner("reservoir", max_samples=40)
    for t in range(4):
        x, y = _task_data([2 * t, 2 * t + 1], 30, t)
        for chunk in chunked(x, y, task=t, size=10):
            learner.observe(chunk)
            assert len(learner.store) <= 40
    assert len(learner.store) == 40
    assert len(set(learner.store.tasks().tolist())) > 1  # a uniform sample of everything seen


def test_a_byte_budget_tighter_than_m_drops_the_lowest_ranked_first(make_learner, tmp_path):
    # a byte budget under which 30 stored samples leave room for some, not all, of 30 more
    for max_bytes in range(64 * 1024, 4 << 20, 8192):
        try:
            probe = ReplayStore(tmp_path / f"probe-{max_bytes}", Budget(max_bytes=max_bytes), (1, 8, 8))
        except BudgetExceededError:  # below what an empty store needs
            continue
        with probe:
            if probe.room_for(30) < 30:
                continue
            probe.insert(*_task_data([0], 30, 9), task=0)
            room = probe.room_for(1000)
        if 5 <= room < 25:
            break
    learner = make_learner("class-balanced", max_samples=1000, max_bytes=max_bytes)
    learner.start_task(0, *_task_data([0, 1], 30, 0))
    learner.start_task(1, *_task_data([2, 3], 30, 1))
    assert learner.store.bytes_on_disk() <= max_bytes
    tasks = learner.store.tasks()
    assert (tasks == 1).sum() == 30  # the new task first; the cache takes what is left
    assert 0 < (tasks == 0).sum() < 30
    old_labels = learner.store.labels(learner.store.ids(task=0))
    assert abs(int((old_labels == 0).sum()) - int((old_labels == 1).sum())) <= 1  # a prefix of the ranking


def test_state_survives_a_restart(make_learner, tmp_path):
    learner = make_learner(max_samples=100)
    learner.start_task(0, *_task_data([0, 1], 60, 0))
    learner.train()
    learner.start_task(1, *_task_data([2], 30, 1))
    learner.state.round = 7
    learner.save(tmp_path / "state")
    weights, ids = learner.trainer.get_weights(), learner.store.ids()
    x_before, _ = learner.store.get(ids)
    learner.store.close()

    again = make_learner(max_samples=100)  # a fresh process would build exactly this
    assert again.restore(tmp_path / "state")
    assert np.array_equal(again.trainer.get_weights(), weights)
    assert (again.state.task, again.state.round, again.state.seen_classes) == (1, 7, [0, 1, 2])
    assert np.array_equal(again.store.ids(), ids)
    assert np.array_equal(again.store.get(ids)[0], x_before)
    again.start_task(2, *_task_data([3], 30, 2))  # and it carries on
    assert len(again.store) == 100


def _portable_learner(export_artifacts, folder, between_rounds, optimizer="adamw", lr=3e-3):
    from edge_client.trainers.portable import PortableTrainer

    trainer = PortableTrainer(export_artifacts("lenet", backends=("portable",)), optimizer=optimizer, lr=lr)
    store = ReplayStore(folder / "store", Budget(100), sample_shape=(1, 8, 8))
    return Learner(trainer, store, make_policy("random"), LearnerConfig(between_rounds=between_rounds), seed=0)


def _kept_and_parked(export_artifacts, tmp_path, **trainer):
    """Two learners on the same task, one keeping its trainer's weights and state in memory between rounds, one
    parking them ("disk"), with a generator of their rounds: each trains, saves and goes idle, then the caller looks."""
    kept = _portable_learner(export_artifacts, tmp_path / "kept", "memory", **trainer)
    parked = _portable_learner(export_artifacts, tmp_path / "parked", "disk", **trainer)
    for learner in (kept, parked):
        learner.start_task(0, *_task_data([0, 1], 60, 0))

    def rounds(count):
        for round_ in range(count):
            for learner, name in ((kept, "kept"), (parked, "parked")):
                learner.train()
                learner.state.round = round_
                assert learner.save(tmp_path / name / "state")
                learner.idle()
            yield round_

    return kept, parked, rounds


def test_sgd_without_momentum_keeps_saves_and_parks_no_optimizer_state_and_trains_the_same(export_artifacts, tmp_path):
    """SGD without momentum carries nothing from step to step: a parking learner saves the weights alone (no
    optimiser file to write and read back each round) and takes the same steps as one that keeps everything in
    memory; a state saved with a velocity (momentum before) is taken and ignored."""
    from edge_client.state import load_state
    from edge_client.trainers.base import OptimizerState

    kept, parked, rounds = _kept_and_parked(export_artifacts, tmp_path, optimizer="sgd", lr=0.05)
    for _ in rounds(3):
        assert parked.trainer.optimizer_state() is None and parked.trainer._state == {}
        assert load_state(tmp_path / "parked" / "state").optimizer is None
        assert not list((tmp_path / "parked" / "state").glob("optimizer-*"))
        assert not parked.trainer._own_weights  # the weights are parked all the same
    np.testing.assert_array_equal(parked.trainer.get_weights(), kept.trainer.get_weights())
    size = parked.trainer.manifest.num_parameters
    parked.trainer.set_optimizer_state(OptimizerState(5, {"velocity": np.ones(size, np.float32)}))
    before = parked.trainer.get_weights()
    parked.train()  # the velocity given is not used: the same step as the learner that kept everything
    kept.train()
    assert not np.array_equal(parked.trainer.get_weights(), before)
    np.testing.assert_array_equal(parked.trainer.get_weights(), kept.trainer.get_weights())
    for learner in (kept, parked):
        learner.store.close()


def test_a_learner_that_parks_between_rounds_takes_the_same_steps_and_a_restart_resumes_its_optimizer(
        export_artifacts, tmp_path):
    """between_rounds = "disk": idle after each save, the trainer holds neither weights nor optimiser state of its own
    and the store no database open, takes them back from the saved state, and trains exactly as a learner that kept
    them (and its store's connection) in memory; a restarted learner gets the optimiser state back too (kept in
    memory, it would start afresh)."""
    kept, parked, rounds = _kept_and_parked(export_artifacts, tmp_path)
    for _ in rounds(3):
        assert not parked.trainer._own_weights and parked.trainer._state == {}  # parked: nothing of its own
        assert kept.trainer._own_weights and len(kept.trainer._state) == 2
        assert open_files_under(tmp_path / "parked" / "store") == []
        assert open_files_under(tmp_path / "kept" / "store")  # its database, open from round to round
    np.testing.assert_array_equal(parked.trainer.get_weights(), kept.trainer.get_weights())
    saved = parked.trainer.optimizer_state()
    np.testing.assert_array_equal(saved.buffers["exp_avg"], kept.trainer.optimizer_state().buffers["exp_avg"])
    parked.store.close()

    restarted = _portable_learner(export_artifacts, tmp_path / "parked", "disk")
    assert restarted.restore(tmp_path / "parked" / "state")
    restarted.idle()  # what it restored is what the save holds: parked again at once
    assert not restarted.trainer._own_weights and restarted.trainer._state == {}
    resumed = restarted.trainer.optimizer_state()
    assert resumed.steps == saved.steps > 0
    for name, buffer in saved.buffers.items():
        np.testing.assert_array_equal(resumed.buffers[name], buffer)
    restarted.train()
    restarted.idle()  # trained since the save: what it holds is not on disk, and stays
    assert restarted.trainer._own_weights and len(restarted.trainer._state) == 2


def test_a_round_that_starts_the_optimizer_afresh_saves_and_parks_none_of_it_and_trains_the_same(
        export_artifacts, tmp_path):
    """`fresh_optimizer` (the coordinator's [client] fresh_optimizer): each round's training starts AdamW afresh, so
    a parking learner saves the weights alone (no optimiser file written and read back each round), holds no
    optimiser state between rounds, kept in memory or parked, and both take the same steps; each round's steps count
    from the first, as a new optimiser's do."""
    from edge_client.state import load_state

    kept, parked, rounds = _kept_and_parked(export_artifacts, tmp_path)
    for learner in (kept, parked):
        learner.fresh_optimizer = True
    for _ in rounds(3):
        assert load_state(tmp_path / "parked" / "state").optimizer is None
        assert parked.trainer._state == {} and kept.trainer._state == {}
        assert parked.trainer._steps == kept.trainer._steps == 0
        assert not parked.trainer._own_weights  # the weights are parked all the same
    np.testing.assert_array_equal(parked.trainer.get_weights(), kept.trainer.get_weights())
    kept.train()
    assert kept.trainer._steps == 2  # one round's steps (60 samples in batches of 32), not three rounds' and more
    for learner in (kept, parked):
        learner.store.close()


def test_a_backend_that_keeps_its_optimizer_state_trains_on_when_asked_to_park(make_learner, tmp_path):
    """ORT Training hands out no optimiser state (the base contract's default): with between_rounds = "disk" its
    learner saves the weights alone, keeps everything in memory and trains on."""
    from edge_client.state import load_state

    learner = make_learner(config=LearnerConfig(between_rounds="disk"))
    learner.start_task(0, *_task_data([0, 1], 60, 0))
    learner.train()
    assert learner.save(tmp_path / "state")
    before = learner.trainer.get_weights()
    assert load_state(tmp_path / "state").optimizer is None
    learner.train()
    assert not np.array_equal(learner.trainer.get_weights(), before)


def test_between_rounds_is_refused_in_one_line_when_it_names_no_place():
    with pytest.raises(ValueError, match="unknown between_rounds 'ram'; choose one of memory, disk"):
        LearnerConfig(between_rounds="ram")


RESTART_SCRIPT = """
import hashlib, json, os, signal, sys
import numpy as np
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import make_policy
from edge_client.budget import Budget
from edge_client.store import ReplayStore
from edge_client.trainers.ort import OrtTrainer

artifacts, work, phase = sys.argv[1], sys.argv[2], sys.argv[3]
learner = Learner(
    OrtTrainer(artifacts, optimizer="adamw", lr=3e-3),
    ReplayStore(os.path.join(work, "store"), Budget(max_samples=80), sample_shape=(1, 8, 8)),
    make_policy("random"),
)
def report():
    x, y = learner.store.get(learner.store.ids())
    print(json.dumps({
        "weights": hashlib.sha256(learner.trainer.get_weights().tobytes()).hexdigest(),
        "store": hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest(),
        "task": learner.state.task, "round": learner.state.round, "seen": learner.state.seen_classes,
    }), flush=True)
if phase == "first":
    rng = np.random.default_rng(0)
    for task in (0, 1):
        y = rng.choice([2 * task, 2 * task + 1], 60)
        x = (y[:, None, None, None] / 10 + 0.05 * rng.standard_normal((60, 1, 8, 8))).astype(np.float32)
        learner.start_task(task, x, y)
        learner.train()
        learner.state.round += 1
        learner.save(os.path.join(work, "state"))
    report()
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown
else:
    assert learner.restore(os.path.join(work, "state"))
    report()
"""


def test_client_state_survives_a_killed_process(export_artifacts, tmp_path):
    import json
    import subprocess
    import sys

    def run(phase):
        return subprocess.run(
            [sys.executable, "-c", RESTART_SCRIPT, str(export_artifacts("lenet")), str(tmp_path), phase],
            capture_output=True, text=True, timeout=120,
        )

    first = run("first")
    assert first.returncode == -9, first.stderr
    second = run("second")
    assert second.returncode == 0, second.stderr
    before = json.loads(first.stdout.strip().splitlines()[-1])
    after = json.loads(second.stdout.strip().splitlines()[-1])
    assert after == before
    assert (after["task"], after["round"], after["seen"]) == (1, 2, [0, 1, 2, 3])


def test_the_classes_the_fleet_knows_join_the_seen_class_mask(make_learner):
    """A task the host learnt leaves a device none of its samples: the round's `known_classes` show its classes in
    the device's mask beside its own; a round message whose list is not class ids of the model is ignored."""
    from types import SimpleNamespace

    from edge_client.device import Device

    learner = make_learner()
    learner.start_task(1, *_task_data([6, 7], 20, 1))
    assert np.flatnonzero(learner.class_mask()).tolist() == [6, 7]
    learner.known_classes = (0, 1, 2, 3)
    assert np.flatnonzero(learner.class_mask()).tolist() == [0, 1, 2, 3, 6, 7]
    device = SimpleNamespace(trainer=learner.trainer, id="d")
    assert Device._known_classes(device, [0, 3]) == (0, 3)
    for bad in ([0, 10], [-1], ["1"], [True], "0,1", list(range(11)), None):
        assert Device._known_classes(device, bad) == ()


def test_the_round_can_turn_the_class_mask_on_or_off_whatever_the_device_says(make_learner):
    """The coordinator's [client] mask_seen_classes reaches every device with each round: true or false wins over
    the device's own [learner] setting, left out leaves it; anything else is ignored."""
    from types import SimpleNamespace

    from edge_client.device import Device

    for own in (True, False):
        learner = make_learner(config=LearnerConfig(mask_seen_classes=own), name=f"store-{own}")
        learner.start_task(0, *_task_data([2, 5], 20, 0))
        assert (learner.class_mask() is not None) == own
        learner.round_mask = not own
        assert (learner.class_mask() is not None) == (not own)
        learner.round_mask = None
        assert (learner.class_mask() is not None) == own
    device = SimpleNamespace(id="d")
    assert [Device._round_switch(device, {"mask_seen_classes": v}, "mask_seen_classes")
            for v in (True, False, None)] == [True, False, None]
    assert Device._round_switch(device, {}, "mask_seen_classes") is None
    for bad in (1, "false", [True]):
        assert Device._round_switch(device, {"mask_seen_classes": bad}, "mask_seen_classes") is None


def test_a_view_is_made_again_only_where_what_it_shows_changed_and_its_arrays_are_read_only(make_learner):
    """A device's round asks for a view at each policy hook: while nothing it shows changed, the learner hands the
    last one again; a new chunk, a new task, the fleet's classes, the round's mask or another global model each make
    a new one showing the change. Hooks share it, so its arrays cannot be written."""
    learner = make_learner()
    learner.start_task(0, *_task_data([0, 1], 20, 0))
    first = learner.view()
    assert learner.view() is first
    learner.train()  # training changes nothing a view shows
    assert learner.view() is first
    for name in ("class_mask", "label_counts", "task_counts"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(first, name)[0] = 5
    learner.observe(Chunk(*_task_data([0, 2], 10, 1), task=0))
    counted = learner.view()
    assert counted is not first and counted.n_seen == 30 and counted.label_counts[2] > 0 == first.label_counts[2]
    assert np.flatnonzero(counted.class_mask).tolist() == [0, 1, 2]
    learner.known_classes = (0, 1, 2, 3)
    known = learner.view()
    assert known is not counted and np.flatnonzero(known.class_mask).tolist() == [0, 1, 2, 3]
    learner.round_mask = False
    unmasked = learner.view()
    assert unmasked is not known and unmasked.class_mask is None
    weights = learner.trainer.get_weights()
    learner.global_model_arrived(weights)
    arrived = learner.view()
    assert arrived is not unmasked and arrived.global_weights is weights and learner.view() is arrived
    assert learner.view(global_weights=weights + 1).global_weights is not weights
    learner.start_task(1, *_task_data([4, 5], 10, 2))
    moved = learner.view()
    assert moved.task == 1 and moved.task_counts[[4, 5]].sum() == 10 and moved.task_counts[:4].sum() == 0
