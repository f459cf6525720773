"""A learning method plugs in without touching a generic file: a toy method, defined in this file, with a device
half (per-sample weighted loss, one attachment, one request) and a server half (checks the attachment, answers the
request, sends each device a payload with its next round), run by the real coordinator and two real device
daemons through a real mosquitto."""
from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from thread_fleet import run_federation

from coordinator.broker import mosquitto_path
from coordinator.strategies.base import AggregateResult, ClientUpdate, RefusedUpdate
from coordinator.strategies.fedavg import FedAvg
from edge_client.learner import Learner
from edge_client.policies import ReplayPolicy, Samples, SelectionContext, TrainingSet
from edge_client.trainers.base import LossInputs

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")


class ToyPolicy(ReplayPolicy):
    """Device half: class 0 counts twice in the loss; the update carries how many samples it trained on; each round
    it asks for a greeting; it remembers every payload it was given."""

    name = "toy-weighted"

    def __init__(self) -> None:
        self.received: list[dict[str, bytes]] = []
        self.trained_on: list[tuple[np.ndarray, np.ndarray]] = []  # (labels, sample weights) per round

    def rank(self, old: Samples, keep: int, ctx: SelectionContext) -> np.ndarray:
        return np.arange(min(keep, len(old)))

    def requests(self, learner: Learner, config: Mapping[str, Any]) -> list[str]:
        return ["toy/greeting"]

    def receive(self, learner: Learner, payloads: Mapping[str, bytes]) -> None:
        self.received.append(dict(payloads))

    def training_set(self, learner: Learner, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        weights = np.where(y == 0, 2.0, 1.0).astype(np.float32)
        self.trained_on.append((y, weights))
        return TrainingSet(x, y, LossInputs(sample_weights=weights))

    def attachments(self, learner: Learner) -> dict[str, bytes]:
        return {"toy/trained": struct.pack("<I", len(learner.store))}


class ToyStrategy(FedAvg):
    """Server half: refuses an update without its attachment, greets whoever asks, and tells each device how many
    samples the whole round trained on, with its next round."""

    name = "toy-echo"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: dict[str, int] = {}

    def inspect(self, update: ClientUpdate) -> None:
        if "toy/trained" not in update.attachments:
            raise RefusedUpdate("attachments", "no toy/trained")

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        return {name: f"hello {device}".encode() for name in names if name == "toy/greeting"}

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate]) -> AggregateResult:
        result = super().aggregate(global_weights, updates)
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
