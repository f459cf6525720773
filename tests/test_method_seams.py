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

from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import FolderTestSets
from coordinator.server import Coordinator
from coordinator.strategies.base import AggregateResult, ClientUpdate, RefusedUpdate
from coordinator.strategies.fedavg import FedAvg
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.learner import Learner
from edge_client.policies import ReplayPolicy, Samples, SelectionContext, TrainingSet
from edge_client.trainers.base import LossInputs
from edgefil.link import BrokerSettings
from firmware_sim.datasets import load_dataset
from models.manifest import load_manifest

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "seams"
DEVICES = ("dev-0", "dev-1")


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
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    data = load_dataset("digits")
    tests = tmp_path / "tests"
    tests.mkdir()
    task = np.isin(data.y_test, [0, 1])
    np.savez(tests / "test-0.npz", x=data.x_test[task], y=data.y_test[task])
    passwords = {d: f"pw-{d}" for d in DEVICES}
    broker = MosquittoBroker(tmp_path / "broker", FLEET, passwords, Credentials("coordinator", "pw-c"))
    broker.start()
    devices: list[Device] = []
    threads = []
    try:
        for k, device_id in enumerate(DEVICES):
            folder = tmp_path / device_id / "incoming"
            folder.mkdir(parents=True)
            mine = np.flatnonzero(np.isin(data.y_train, [0, 1]))[k::2][:40]
            np.savez(folder / "task-0.npz", x=data.x_train[mine], y=data.y_train[mine])
            config = DeviceConfig.from_dict({
                "device_id": device_id, "fleet": FLEET, "artifacts": str(artifacts),
                "state_dir": str(tmp_path / device_id / "state"), "heartbeat_s": 0.5,
                "broker": {"port": broker.address.port, "password": passwords[device_id], "keepalive": 2},
                "store": {"max_samples": 100}, "policy": {"name": "toy-weighted"}, "data": {"folder": str(folder)},
            })
            ready = threading.Event()

            def run(config: DeviceConfig = config, ready: threading.Event = ready) -> None:
                devices.append(Device(config))  # a replay store belongs to the thread that opens it
                ready.set()
                devices[-1].run()

            threads.append(threading.Thread(target=run, daemon=True))
            threads[-1].start()
            assert ready.wait(60)
        coordinator = Coordinator(CoordinatorConfig(
            fleet=FLEET, out=tmp_path / "run", artifacts=artifacts, devices=DEVICES, rounds_per_task=2,
            min_clients=2, deadline_s=60.0, wait_for_devices_s=60.0, test_data=tests,
            broker=BrokerSettings(port=broker.address.port, username="coordinator", password="pw-c"),
            strategy={"name": "toy-echo"}, client={"epochs": 1},
        ), test_sets=FolderTestSets(tests, load_manifest(artifacts)))
        results = coordinator.run()
    finally:
        for device in devices:
            device.stop_requested.set()
        for thread in threads:
            thread.join(15)
        broker.stop()

    assert results["rounds_completed"] == 2 and results["counters"].get("attachments", 0) == 0
    strategy = coordinator.strategy
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
