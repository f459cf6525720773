"""A small federation in one process for method tests: a real mosquitto, the real coordinator and real device
daemons, each device in a thread of its own (a replay store belongs to the thread that opens it), on class-
incremental digits: task t holds classes 2t and 2t + 1, split between the devices."""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.broker import Credentials, MosquittoBroker
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import FolderTestSets
from coordinator.server import Coordinator
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edgefil.link import BrokerSettings
from firmware_sim.datasets import load_dataset
from models.manifest import load_manifest

FLEET = "threads"


@dataclass
class Federation:
    results: dict[str, Any]
    coordinator: Coordinator
    devices: list[Device]


def run_federation(
    root: Path, artifacts: Path, device: Mapping[str, Any], strategy: Mapping[str, Any], tasks: int = 1,
    rounds_per_task: int = 2, n_devices: int = 2, samples: int = 40, client: Mapping[str, Any] | None = None,
) -> Federation:
    """`tasks` tasks of `rounds_per_task` rounds over `n_devices` devices holding `samples` samples of each task;
    `device` adds sections to every device's config (policy, store, trainer), `strategy` is the coordinator's."""
    data = load_dataset("digits")
    tests = root / "tests"
    tests.mkdir(parents=True)
    for t in range(tasks):
        part = np.isin(data.y_test, [2 * t, 2 * t + 1])
        np.savez(tests / f"test-{t}.npz", x=data.x_test[part], y=data.y_test[part])
    names = [f"dev-{k}" for k in range(n_devices)]
    passwords = {d: f"pw-{d}" for d in names}
    broker = MosquittoBroker(root / "broker", FLEET, passwords, Credentials("coordinator", "pw-c"))
    broker.start()
    devices: list[Device] = []
    threads = []
    try:
        for k, name in enumerate(names):
            folder = root / name / "incoming"
            folder.mkdir(parents=True)
            for t in range(tasks):
                mine = np.flatnonzero(np.isin(data.y_train, [2 * t, 2 * t + 1]))[k::n_devices][:samples]
                np.savez(folder / f"task-{t}.npz", x=data.x_train[mine], y=data.y_train[mine])
            config = DeviceConfig.from_dict({
                "device_id": name, "fleet": FLEET, "artifacts": str(artifacts),
                "state_dir": str(root / name / "state"), "heartbeat_s": 0.5,
                "broker": {"port": broker.address.port, "password": passwords[name], "keepalive": 2},
                "data": {"folder": str(folder)}, **device,
            })
            ready = threading.Event()

            def run(config: DeviceConfig = config, ready: threading.Event = ready) -> None:
                devices.append(Device(config))
                ready.set()
                devices[-1].run()

            threads.append(threading.Thread(target=run, daemon=True))
            threads[-1].start()
            assert ready.wait(60)
        coordinator = Coordinator(CoordinatorConfig(
            fleet=FLEET, out=root / "run", artifacts=artifacts, devices=tuple(names), rounds_per_task=rounds_per_task,
            min_clients=n_devices, deadline_s=60.0, wait_for_devices_s=60.0, test_data=tests,
            broker=BrokerSettings(port=broker.address.port, username="coordinator", password="pw-c"),
            strategy=dict(strategy), client=dict(client or {"epochs": 1}),
        ), test_sets=FolderTestSets(tests, load_manifest(artifacts)))
        results = coordinator.run()
    finally:
        for running in devices:
            running.stop_requested.set()
        for thread in threads:
            thread.join(15)
        broker.stop()
    return Federation(results, coordinator, devices)
