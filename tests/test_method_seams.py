"""A learning method plugs in without touching a generic file: a toy method, defined in this file, with a device
half (per-sample weighted loss, one attachment, one request) and a server half (checks the attachment, answers the
request, sends each device a payload with its next round), run by the real coordinator and two real device
daemons through a real mosquitto."""
from __future__ import annotations

import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from fleet_harness import SPARE_WAIT_S
from thread_fleet import ThreadFederation, run_federation

from coordinator.background import BackgroundJob, Deadline
from coordinator.broker import mosquitto_path
from coordinator.checkpoint import CheckpointPolicy
from coordinator.strategies.base import AggregateResult, ClientUpdate, RefusedUpdate, RoundContext
from coordinator.strategies.fedavg import FedAvg
from edge_client.policies import ReplayPolicy, RoundView, Samples, TrainingSet
from edge_client.trainers.base import LossInputs

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")


class ToyPolicy(ReplayPolicy):
    """Device half: class 0 counts twice in the loss; the update carries how many samples it trained on; each round
    it asks for a greeting; it remembers every payload it was given."""

    name = "toy-weighted"

    def __init__(self) -> None:
        self.received: list[dict[str, bytes]] = []
        self.trained_on: list[tuple[np.ndarray, np.ndarray]] = []  # (labels, sample weights) per round
        self.models_seen: list[np.ndarray] = []  # every global model the device received

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        return np.arange(min(keep, len(old)))

    def requests(self, view: RoundView, config: Mapping[str, Any]) -> list[str]:
        return ["toy/greeting"]

    def receive(self, view: RoundView, payloads: Mapping[str, bytes]) -> None:
        self.received.append(dict(payloads))

    def on_global_model(self, view: RoundView, weights: np.ndarray) -> None:
        self.models_seen.append(weights)

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        weights = np.where(y == 0, 2.0, 1.0).astype(np.float32)
        self.trained_on.append((y, weights))
        return TrainingSet(x, y, LossInputs(sample_weights=weights))

    def attachments(self, view: RoundView) -> dict[str, bytes]:
        return {"toy/trained": struct.pack("<I", view.n_stored())}


class ToyStrategy(FedAvg):
    """Server half: refuses an update without its attachment, greets whoever asks, and tells each device how many
    samples the whole round trained on, with its next round; it keeps the round contexts it was given."""

    name = "toy-echo"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: dict[str, int] = {}
        self.configured: list[RoundContext] = []
        self.aggregated: list[RoundContext] = []

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        self.configured.append(ctx)
        return super().configure(ctx, devices)

    def inspect(self, update: ClientUpdate) -> None:
        if "toy/trained" not in update.attachments:
            raise RefusedUpdate("attachments", "no toy/trained")

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        return {name: f"hello {device}".encode() for name in names if name == "toy/greeting"}

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = RoundContext()) -> AggregateResult:
        self.aggregated.append(ctx)
        result = super().aggregate(global_weights, updates, ctx)
        self.seen.update({u.device: struct.unpack("<I", u.attachments["toy/trained"])[0] for u in updates})
        total = struct.pack("<I", sum(self.seen.values()))
        result.payloads = {u.device: {"toy/round-total": total} for u in updates}
        return result


def test_a_toy_method_runs_through_a_real_broker_round_without_touching_generic_files(tmp_path, export_artifacts):
    federation = run_federation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)),
                                {"store": {"max_samples": 100}, "policy": {"name": "toy-weighted"}},
                                {"name": "toy-echo"})
    results, coordinator, devices = federation.results, federation.coordinator, federation.devices

    assert results["rounds_completed"] == 2 and results["counters"].get("attachments", 0) == 0
    strategy = coordinator.strategy.strategy  # the method's own object, inside its containment
    assert isinstance(strategy, ToyStrategy) and strategy.seen == {"dev-0": 40, "dev-1": 40}
    for device in devices:
        policy = device.learner.policy
        assert isinstance(policy, ToyPolicy)
        greetings = [p["toy/greeting"] for p in policy.received if "toy/greeting" in p]
        assert greetings == [f"hello {device.id}".encode()] * 2  # one answer per round
        totals = [p["toy/round-total"] for p in policy.received if "toy/round-total" in p]
        assert totals == [struct.pack("<I", 80)]  # round 1's result came with round 2
        assert len(policy.trained_on) == 2
        for labels, weights in policy.trained_on:
            assert len(labels) == 40 and (labels == 0).any() and (weights[labels == 0] == 2.0).all()


def test_every_device_runs_the_policys_hook_for_every_global_model_selected_or_not(tmp_path, export_artifacts):
    """Three devices, one selected per round: the devices the round does not select still hand every global model
    to their policy (GLFC's task detection runs on every client in every round)."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"store": {"max_samples": 100}, "policy": {"name": "toy-weighted"}}
    with ThreadFederation(tmp_path, artifacts, device, n_devices=3) as federation:
        for running in federation.devices:
            assert running.link.wait_subscribed(60)  # connected before the first broadcast
        coordinator = federation.coordinator({"name": "toy-echo"}, rounds_per_task=3, min_clients=1, fraction=0.3)
        results = coordinator.run()
        devices = federation.devices
    assert results["rounds_completed"] == 3
    policies = [d.learner.policy for d in devices]
    assert all(isinstance(p, ToyPolicy) for p in policies)
    assert sum(len(p.trained_on) for p in policies) == 3  # one device trained each round
    for policy in policies:  # each round's global model reached every device, trained or not
        assert len(policy.models_seen) >= 3 and len(policy.models_seen) >= len(policy.trained_on)
    assert sum(len(p.models_seen) > len(p.trained_on) for p in policies) >= 2
    first = [p.models_seen[0] for p in policies]
    assert all(np.array_equal(first[0], m) for m in first)  # the same broadcast model, on every device


def test_a_rule_learns_the_round_it_configures_and_aggregates(tmp_path, export_artifacts):
    """The round context through a real run of two tasks of two rounds: the number, the task, the task's classes
    (digits: task t brings 2t and 2t + 1), the classes seen so far, and the round within the task."""
    federation = run_federation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)),
                                {"store": {"max_samples": 100}, "policy": {"name": "toy-weighted"}},
                                {"name": "toy-echo"}, tasks=2)
    strategy = federation.coordinator.strategy.strategy
    expected = [RoundContext(round=1, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=1,
                             rounds_per_task=2),
                RoundContext(round=2, task=0, task_classes=(0, 1), seen_classes=(0, 1), round_in_task=2,
                             rounds_per_task=2),
                RoundContext(round=3, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3), round_in_task=1,
                             rounds_per_task=2),
                RoundContext(round=4, task=1, task_classes=(2, 3), seen_classes=(0, 1, 2, 3), round_in_task=2,
                             rounds_per_task=2)]
    assert strategy.aggregated == expected
    assert sorted(set(strategy.configured), key=lambda c: c.round) == expected  # once per device and round
    assert len(strategy.configured) == 2 * 4
    assert [c.starts_task for c in expected] == [True, False, True, False]
    assert [c.ends_task for c in expected] == [False, True, False, True]


class OldModelPolicy(ToyPolicy):
    """Keeps what each round's broadcast said (the old model's task)."""

    name = "toy-old-model"

    def __init__(self) -> None:
        super().__init__()
        self.old_tasks: list[int] = []  # per round trained: the task of the old model it was given (-1: none)

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        given = [p["toy/old-task"] for p in self.received[-2:] if "toy/old-task" in p]
        self.old_tasks.append(struct.unpack("<i", given[-1])[0] if given else -1)
        return super().training_set(view, x, y)


class OldModelRule(ToyStrategy):
    """Broadcasts the global model at the end of each task, with its task: GLFC's best old model, in shape."""

    name = "toy-broadcast"

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = RoundContext()) -> AggregateResult:
        result = super().aggregate(global_weights, updates, ctx)
        if ctx.ends_task:
            result.broadcast = {"toy/old": result.global_weights.numpy().tobytes(),
                                "toy/old-task": struct.pack("<i", ctx.task)}
        return result


def test_a_broadcast_payload_is_sent_once_to_every_device_and_kept_by_version(tmp_path, export_artifacts):
    """Three tasks of two rounds: the rule broadcasts an old model at the end of each task. Every device assembles
    each broadcast once (not once per round) and hands the current one to its policy in every round of the next
    task; a device that joins mid-run gets the current one with its first round."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"store": {"max_samples": 100}, "policy": {"name": "toy-old-model"}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=3, spares=("dev-2",)) as federation:
        for running in federation.devices:
            assert running.link.wait_subscribed(60)
        federation.wait_online()
        coordinator = federation.coordinator({"name": "toy-broadcast"}, rounds_per_task=2, min_clients=2,
                                             wait_for_devices_s=SPARE_WAIT_S,  # then on without the spare
                                             checkpoint=CheckpointPolicy(collapse_drop=0.0))  # every round's model

        def progress(entry: dict) -> None:
            if entry["round"] == 3:  # after the first old model went out
                federation.join("dev-2")

        coordinator.progress = progress
        results = coordinator.run()
        devices = {d.id: d for d in federation.devices}
    assert results["rounds_completed"] == 6
    for name in ("dev-0", "dev-1"):  # online from the start: every round, and each broadcast once
        policy = devices[name].learner.policy
        assert isinstance(policy, OldModelPolicy)
        assert policy.old_tasks == [-1, -1, 0, 0, 1, 1]
        assert devices[name].broadcasts_received == 3
    late = devices["dev-2"]
    trained = [h["round"] for h in results["history"] if "dev-2" in h["received"]]
    assert trained and min(trained) >= 4
    assert late.learner.policy.old_tasks == [0 if r <= 4 else 1 for r in trained]
    # each broadcast once: the current one with its first round (the first old model when that is round 4), then
    # every later one as the fleet gets it
    assert late.broadcasts_received == (3 if min(trained) == 4 else 2)


class SlowWorkRule(FedAvg):
    """Starts long work at round 1 (blocked until the test releases it) and uses its result when ready."""

    name = "toy-slow-work"
    release = threading.Event()

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.job: BackgroundJob[str] = BackgroundJob("toy-proxy")
        self.used: list[tuple[int, str | None]] = []

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = RoundContext()) -> AggregateResult:
        if ctx.round == 1:
            def work(deadline: Deadline) -> str:
                while not self.release.wait(0.05):
                    if deadline.passed():
                        return "out of time"
                return "reconstructed"

            assert self.job.start(work, budget_s=300.0) and not self.job.start(work, budget_s=1.0)
        if ctx.round == 3:
            self.job.wait(60)  # a rule that needs the result by now waits for it here
        self.used.append((ctx.round, self.job.take()))
        return super().aggregate(global_weights, updates, ctx)


def test_long_work_of_a_rule_does_not_stop_the_rounds(tmp_path, export_artifacts):
    """While a rule's background job runs, the coordinator keeps taking the devices' messages: round 2 completes
    with the job still running, and round 3 uses its result."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    running_at: dict[int, bool] = {}
    with ThreadFederation(tmp_path, artifacts, {"store": {"max_samples": 100}, "policy": {"name": "random"}}) as fed:
        coordinator = fed.coordinator({"name": "toy-slow-work"}, rounds_per_task=3)
        rule = coordinator.strategy.strategy
        assert isinstance(rule, SlowWorkRule)

        def progress(entry: dict) -> None:
            running_at[entry["round"]] = rule.job.running
            if entry["round"] == 2:
                SlowWorkRule.release.set()

        coordinator.progress = progress
        results = coordinator.run()
    assert results["rounds_completed"] == 3
    assert running_at[1] and running_at[2]  # two rounds went by while the job ran
    assert rule.used == [(1, None), (2, None), (3, "reconstructed")]


@pytest.mark.parametrize("detect", [False, True])
def test_a_device_that_detects_its_own_tasks_starts_one_only_where_its_data_is_new(tmp_path, export_artifacts,
                                                                                    detect):
    """Two scheduled tasks over the same two digits: announced, the second starts a task on every device; with
    `[learner] detect_new_tasks`, the data bring no label the device has not seen, so it stays in its first task,
    and the coordinator still takes its updates for the second (they answer the round's task)."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"store": {"max_samples": 100}, "policy": {"name": "random"}, "learner": {"detect_new_tasks": detect}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2, task_classes=lambda t: [0, 1]) as federation:
        results = federation.coordinator({"name": "fedavg"}, rounds_per_task=1).run()
        devices = federation.devices
    assert results["rounds_completed"] == 2 and results["counters"].get("wrong-task", 0) == 0
    assert [h["received"] for h in results["history"]] == [["dev-0", "dev-1"]] * 2
    for running in devices:
        assert running.learner.state.data_task == 1
        assert running.learner.state.task == (0 if detect else 1)


def test_a_resumed_coordinator_keeps_the_rules_broadcast(tmp_path, export_artifacts):
    """The broadcast is part of the checkpoint: a coordinator resumed from it sends the same blob, by the same id."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"store": {"max_samples": 100}, "policy": {"name": "toy-old-model"}}
    options = {"checkpoint": CheckpointPolicy(collapse_drop=0.0)}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2) as federation:
        finished = federation.coordinator({"name": "toy-broadcast"}, rounds_per_task=1, **options)
        finished.run()
        resumed = federation.coordinator({"name": "toy-broadcast"}, rounds_per_task=1, resume=True, **options)
    assert finished.outbox.broadcast.id is not None and set(finished.outbox.broadcast.payloads) == {"toy/old", "toy/old-task"}
    assert resumed.outbox.broadcast.id == finished.outbox.broadcast.id and resumed.outbox.broadcast.payloads == finished.outbox.broadcast.payloads
