"""A small federation in one process for method tests: a real mosquitto, the real coordinator and real device
daemons, each device in a thread of its own, on class-incremental digits: task t holds classes 2t and 2t + 1,
split between the devices."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from mqtt_helpers import wait_online

from coordinator.broker import BrokerAddress, Credentials, MosquittoBroker
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import FolderTestSets
from coordinator.server import Coordinator
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.environment import Environment
from edgefil.link import BrokerSettings
from firmware_sim.datasets import load_dataset
from models.manifest import load_manifest

FLEET = "threads"


@dataclass
class Federation:
    results: dict[str, Any]
    coordinator: Coordinator
    devices: list[Device]


class ThreadFederation:
    """The broker and `n_devices` devices holding `samples` samples of each of `tasks` tasks (task t: digits
    `task_classes(t)`, 2t and 2t + 1 by default), running while the federation is entered; `device` adds sections
    to every device's config (policy, store, trainer). `spares`: ids on the roster and the broker with no device
    behind them (a compromised device's account: `passwords` has theirs); `environments`: a device's surroundings
    by its index (the host's own otherwise); `joins`: the task a device's data start at, by name (a device
    joining a later task: no file for the tasks before). `coordinator(...)` runs the coordinator once, to its
    end; again with `resume=True` to resume it."""

    def __init__(self, root: Path, artifacts: Path, device: Mapping[str, Any], tasks: int = 1, n_devices: int = 2,
                 samples: int = 40, spares: tuple[str, ...] = (),
                 environments: Mapping[int, Environment] | None = None, joins: Mapping[str, int] | None = None,
                 task_classes: Callable[[int], list[int]] = lambda t: [2 * t, 2 * t + 1]) -> None:
        self.root, self.artifacts, self.device, self.tasks = root, artifacts, device, tasks
        self.task_classes = task_classes
        self.environments = dict(environments or {})
        self.joins = dict(joins or {})
        self.names = [f"dev-{k}" for k in range(n_devices)]
        self.samples = samples
        self.roster = (*self.names, *spares)
        self.passwords = {d: f"pw-{d}" for d in self.roster}
        self.watcher = Credentials("observer", "pw-o")  # reads, writes nothing: `wait_online`'s
        self.broker = MosquittoBroker(root / "broker", FLEET, self.passwords, Credentials("coordinator", "pw-c"),
                                      observers={self.watcher.username: self.watcher.password})
        self.devices: list[Device] = []
        self._threads: list[threading.Thread] = []
        self.tests = root / "tests"

    @property
    def address(self) -> BrokerAddress:
        return self.broker.address

    def __enter__(self) -> ThreadFederation:
        data = load_dataset("digits")
        self.tests.mkdir(parents=True)
        for t in range(self.tasks):
            part = np.isin(data.y_test, self.task_classes(t))
            np.savez(self.tests / f"test-{t}.npz", x=data.x_test[part], y=data.y_test[part])
        self.broker.start()
        try:
            for k, name in enumerate(self.names):
                self._start_device(k, name, data)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_online(self, timeout: float = 60.0) -> None:
        """Until every device started has said it is online: a coordinator run after this meets them at its first
        subscription, so its first round's wait for the roster waits for the spares alone (SPARE_WAIT_S)."""
        wait_online(self.address, self.watcher, FLEET, [d.id for d in self.devices], timeout)

    def join(self, name: str) -> None:
        """Start a device of the roster that has none behind it yet (a spare): a device joining mid-run."""
        self._start_device(self.roster.index(name), name, load_dataset("digits"))

    def _start_device(self, k: int, name: str, data: Any) -> None:
        folder = self.root / name / "incoming"
        folder.mkdir(parents=True)
        for t in range(self.joins.get(name, 0), self.tasks):
            mine = np.flatnonzero(np.isin(data.y_train, self.task_classes(t)))[k::len(self.names)][:self.samples]
            np.savez(folder / f"task-{t}.npz", x=data.x_train[mine], y=data.y_train[mine])
        config = DeviceConfig.from_dict({
            "device_id": name, "fleet": FLEET, "artifacts": str(self.artifacts),
            "state_dir": str(self.root / name / "state"), "heartbeat_s": 0.5,
            "broker": {"port": self.address.port, "password": self.passwords[name], "keepalive": 2},
            "data": {"folder": str(folder)}, **self.device,
        })
        ready = threading.Event()

        def run() -> None:
            try:
                device = Device(config, environment=self.environments.get(k))
            finally:
                ready.set()
            self.devices.append(device)
            device.run()

        self._threads.append(threading.Thread(target=run, daemon=True))
        self._threads[-1].start()
        assert ready.wait(60) and len(self.devices) == k + 1, f"{name} did not start (its thread's error above)"

    def coordinator(self, strategy: Mapping[str, Any], rounds_per_task: int = 2, min_clients: int | None = None,
                    client: Mapping[str, Any] | None = None, resume: bool = False, deadline_s: float = 60.0,
                    wait_for_devices_s: float = 60.0, **options: Any) -> Coordinator:
        """A coordinator of this federation (every device of the roster waited for unless `min_clients` says
        less); `options`: more of the coordinator file's keys."""
        return Coordinator(CoordinatorConfig(
            fleet=FLEET, out=self.root / "run", artifacts=self.artifacts, devices=self.roster,
            rounds_per_task=rounds_per_task, min_clients=min_clients or len(self.roster), deadline_s=deadline_s,
            wait_for_devices_s=wait_for_devices_s, test_data=self.tests,
            broker=BrokerSettings(port=self.address.port, username="coordinator", password="pw-c"),
            strategy=dict(strategy), client=dict(client or {"epochs": 1}), **options,
        ), resume=resume, test_sets=FolderTestSets(self.tests, load_manifest(self.artifacts)))

    def devices_stopped(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until every device's thread has ended (after the federation's exit, which
        waits 15 s for each): whether they all have."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for running in self.devices:
            running.stop_requested.set()
        for thread in self._threads:
            thread.join(15)
        self.broker.stop()


def run_federation(
    root: Path, artifacts: Path, device: Mapping[str, Any], strategy: Mapping[str, Any], tasks: int = 1,
    rounds_per_task: int = 2, n_devices: int = 2, samples: int = 40, client: Mapping[str, Any] | None = None,
) -> Federation:
    """`tasks` tasks of `rounds_per_task` rounds over `n_devices` devices holding `samples` samples of each task;
    `device` adds sections to every device's config (policy, store, trainer), `strategy` is the coordinator's."""
    with ThreadFederation(root, artifacts, device, tasks, n_devices, samples) as federation:
        coordinator = federation.coordinator(strategy, rounds_per_task, client=client)
        results = coordinator.run()
    return Federation(results, coordinator, federation.devices)
