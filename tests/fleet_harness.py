"""A real fleet for end-to-end tests: a mosquitto with a password per device, a coordinator process and device
daemon processes (`python -m edgefil.cli ...`), each with its own config file, state folder and log."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mqtt_helpers import wait_online

from coordinator.broker import Bridge, Credentials, EmbeddedBroker, MosquittoBroker, Site, generate_password
from edgefil import wire
from edgefil.lifetime import stop_processes
from edgefil.settings import dump_toml, load_toml

ROOT = Path(__file__).resolve().parents[1]
# What a wait for a run's event allows: the wait returns when the event comes, and the ceiling only ends one for an
# event that never comes (a busy host makes start-up and rounds several times slower than a quiet one).
CEILING_S = 900
# The first round's wait for the whole roster (`wait_for_devices_s`) in a test whose roster holds a spare, an account
# no process stands behind: the honest devices have all said they are online before the coordinator starts
# (`Fleet.wait_online`), their retained statuses reach it with its subscription, and only the spare, which never
# comes, is waited for. It used to be 20 s of every such test.
SPARE_WAIT_S = 3.0


def default_signals() -> None:
    """`preexec_fn` of a child a test signals: Ctrl-C, SIGTERM and SIGHUP at their defaults, whatever the test run
    inherited. A suite started in the background (`nohup scripts/test &`) runs with SIGINT and SIGHUP ignored, and a
    child keeps an ignored signal across exec: Ctrl-C sent to it did nothing, and Python installs its own
    KeyboardInterrupt handler only where the signal is at its default."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(dump_toml(data))
    return path


def run_fleet_file(folder: Path, text: str) -> dict[str, Any]:
    """`edgefil fleet run` of a fleet file (`text`, written into `folder`, its `out` relative to it) to its end: the
    run's results.json. The run must exit 0 (its log's tail is the failure's message)."""
    (folder / "fleet.toml").write_text(text)
    run = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(folder / "fleet.toml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=CEILING_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((folder / load_toml(folder / "fleet.toml")["out"] / "results.json").read_text())


@dataclass
class Fleet:
    root: Path
    artifacts: Path
    n_devices: int = 5
    fleet: str = "test"
    scenario: dict[str, Any] = field(default_factory=lambda: {"preset": "digits-class"})
    coordinator_options: dict[str, Any] = field(default_factory=dict)
    device_options: dict[str, Any] = field(default_factory=dict)
    keepalive: int = 2
    outsiders: tuple[str, ...] = ()  # broker accounts that are not on the coordinator's roster
    spares: tuple[str, ...] = ()  # on the roster and the broker, no process: a compromised device's account
    embedded: bool = False  # the pure-Python broker (anonymous, no ACL) instead of mosquitto
    per_device: dict[int, dict[str, Any]] = field(default_factory=dict)  # extra config sections by device index
    observer_reads_learning: bool = False  # the observer reads updates and models too (an operator's choice)
    # sites (coordinator/sites.py): name -> the indices of the devices at it, each site a mosquitto of its own
    # bridged to the central one and an aggregator process (`edgefil site`); the rest connect to the central broker
    sites: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.devices = [f"dev-{i}" for i in range(self.n_devices)]
        self.passwords = {d: generate_password() for d in (*self.devices, *self.outsiders, *self.spares)}
        self.coordinator_credentials = Credentials("coordinator", generate_password())
        self.observer_credentials = Credentials("observer", generate_password())  # reads, writes nothing
        self.site_accounts = {name: Credentials(f"site-{name}", generate_password()) for name in self.sites}
        self.aggregator_credentials = {name: Credentials("coordinator", generate_password()) for name in self.sites}
        self.broker = (
            EmbeddedBroker() if self.embedded
            else MosquittoBroker(self.root / "broker", self.fleet, self.passwords, self.coordinator_credentials,
                                 observers={"observer": self.observer_credentials.password},
                                 observers_read_learning=self.observer_reads_learning,
                                 inbox_workers=int(self.coordinator_options.get("inbox_workers", 0)),
                                 sites=[Site(name, self.site_accounts[name])
                                        for name in self.sites])
        )
        self.site_brokers: dict[str, MosquittoBroker] = {}
        self.scenario = {**self.scenario, "n_clients": self.n_devices}
        self.processes: dict[str, subprocess.Popen] = {}

    def at_site(self, name: str) -> tuple[str, ...]:
        return tuple(self.devices[k] for k in self.sites[name])

    def site_of(self, device: str) -> str | None:
        return next((name for name in self.sites if device in self.at_site(name)), None)

    # --- configs ----------------------------------------------------------------------------------

    def broker_section(self, username: str, password: str, site: str | None = None) -> dict[str, Any]:
        address = (self.broker if site is None else self.site_brokers[site]).address
        return {"host": address.host, "port": address.port, "username": username, "password": password,
                "keepalive": self.keepalive}

    def coordinator_config(self) -> Path:
        config = {
            "fleet": self.fleet, "out": str(self.root / "run"), "artifacts": str(self.artifacts),
            "devices": [*self.devices, *self.spares], "rounds_per_task": 2, "min_clients": 2, "deadline_s": 30.0,
            "wait_for_devices_s": 60.0, "scenario": self.scenario,
            "broker": self.broker_section("coordinator", self.coordinator_credentials.password),
            "strategy": {"name": "fedavg"}, "client": {"epochs": 2},
            **({"sites": [{"name": name, "devices": list(self.at_site(name))} for name in self.sites]}
               if self.sites else {}),
        }
        for key, value in self.coordinator_options.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
        return write_toml(self.root / "coordinator.toml", config)

    def device_config(self, index: int) -> Path:
        device = self.devices[index]
        config = {
            "device_id": device, "fleet": self.fleet, "artifacts": str(self.artifacts),
            "state_dir": str(self.root / "devices" / device), "heartbeat_s": 1.0,
            "on_end": "wait",  # the tests check the devices outlive what they put them through
            "broker": self.broker_section(device, self.passwords[device], self.site_of(device)),
            "trainer": {"backend": "ort", "optimizer": "adamw", "lr": 3e-3},
            "learner": {"epochs": 2, "batch_size": 32},
            "store": {"max_samples": 200},
            "policy": {"name": "refed", "pim_epochs": 2},
            "data": {"scenario": self.scenario, "client": index},
        }
        for key, value in {**self.device_options, **self.per_device.get(index, {})}.items():
            merge = isinstance(value, dict) and key in config and key not in ("policy", "data")  # replaced whole
            config[key] = {**config[key], **value} if merge else value
        return write_toml(self.root / f"{device}.toml", config)

    # --- processes --------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgefil.cli", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=default_signals,
        )
        log.close()
        self.processes[name] = proc
        return proc

    def site_config(self, name: str) -> Path:
        account = self.aggregator_credentials[name]
        return write_toml(self.root / f"site-{name}.toml", {
            "fleet": self.fleet, "site": name, "artifacts": str(self.artifacts),
            "broker": self.broker_section(account.username, account.password, name)})

    def start(self) -> None:
        self.broker.start()
        central = self.broker.address
        for name in self.sites:
            broker = self.site_brokers[name] = MosquittoBroker(
                self.root / f"broker-{name}", self.fleet, {d: self.passwords[d] for d in self.at_site(name)},
                self.aggregator_credentials[name], observers={"observer": self.observer_credentials.password},
                observers_read_learning=self.observer_reads_learning,
                bridge=Bridge(name, central.host, central.port, self.site_accounts[name]))
            broker.start()
            self.start_site(name)
        for i in range(self.n_devices):
            self.start_device(i)

    def start_site(self, name: str) -> subprocess.Popen:
        """A site's aggregator process (its broker runs from `start` to `stop`)."""
        return self._spawn(f"site-{name}", ["site", "--config", str(self.site_config(name))])

    def start_device(self, index: int) -> subprocess.Popen:
        return self._spawn(self.devices[index], ["client", "--config", str(self.device_config(index))])

    def start_coordinator(self, resume: bool = False) -> subprocess.Popen:
        args = ["coordinator", "--config", str(self.coordinator_config())] + (["--resume"] if resume else [])
        return self._spawn("coordinator", args)

    def wait_online(self, timeout: float = CEILING_S) -> None:
        """Until every device process started has said it is online: a coordinator started after this meets them
        all at its first subscription."""
        def exited() -> str | None:
            gone = [d for d in self.devices if d in self.processes and self.processes[d].poll() is not None]
            return f"{gone[0]} exited:\n{self.log_tail(gone[0])}" if gone else None

        wait_online(self.broker.address, Credentials("observer", self.observer_credentials.password), self.fleet,
                    [d for d in self.devices if d in self.processes], timeout, exited)

    def kill(self, name: str) -> None:
        proc = self.processes[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def wait_coordinator(self, timeout: float) -> int:
        proc = self.processes["coordinator"]
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"coordinator still running after {timeout} s:\n{self.log_tail('coordinator')}")

    def stop(self) -> None:
        stop_processes(self.processes.values(), grace_s=10)
        for broker in self.site_brokers.values():
            broker.stop()
        self.broker.stop()

    # --- results ----------------------------------------------------------------------------------

    def results(self) -> dict[str, Any]:
        return json.loads((self.root / "run" / "results.json").read_text())

    def rounds_done(self) -> int:
        path = self.root / "run" / "results.json"
        return json.loads(path.read_text())["rounds_completed"] if path.exists() else 0

    def wait_rounds(self, rounds: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.rounds_done() < rounds:
            if time.monotonic() > deadline or self.processes["coordinator"].poll() is not None:
                raise AssertionError(f"round {rounds} not reached:\n{self.log_tail('coordinator')}")
            time.sleep(0.1)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def fedavg_of_sent(sent: list[tuple[str, bytes]], number: int, size: int) -> tuple[list[str], np.ndarray]:
    """The devices whose updates of round `number` are among `sent` (messages an observer read off the brokers),
    and FedAvg of those updates computed here in one process, in float64 (what the round's model must be, to
    float32 rounding, where no bound changed an update)."""
    reassembler = wire.Reassembler(max_blob_bytes=1 << 24)
    updates = {}
    for topic, payload in sent:
        blob = reassembler.add(topic, wire.decode(payload))
        if blob is not None and blob.header["round"] == number:
            updates[blob.header["device"]] = (blob.weights(size).astype(np.float64), blob.header["num_samples"])
    total = sum(samples for _, samples in updates.values())
    return sorted(updates), sum(weights * samples for weights, samples in updates.values()) / total
