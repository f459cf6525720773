"""A device daemon run as its own process (another Python, another architecture) against a real mosquitto and an
in-process coordinator: what the Python 3.12 and the aarch64 device tests share."""
from __future__ import annotations

import logging
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.broker import Credentials, MosquittoBroker
from coordinator.config import CoordinatorConfig
from coordinator.evaluation import FolderTestSets
from coordinator.server import Coordinator
from edgefil.link import BrokerSettings
from models.manifest import load_manifest

FLEET, DEVICE = "external", "pi-0"


def run_rounds(device_python: list[str], artifacts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
               rounds: int, samples: int, deadline_s: float) -> tuple[dict[str, Any], str]:
    """`rounds` FedAvg rounds of one device that `device_python` (an interpreter command) runs with
    `edgefil client`, trained with backend = "auto" on `samples` digits; returns the coordinator's results and the
    device's output."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.images / 16.0).astype(np.float32)[:, None], digits.target.astype(np.int64)
    incoming, tests = tmp_path / "incoming", tmp_path / "tests"
    incoming.mkdir()
    tests.mkdir()
    np.savez(incoming / "task-0.npz", x=x[:samples], y=y[:samples])
    np.savez(tests / "test-0.npz", x=x[1500:], y=y[1500:])
    broker = MosquittoBroker(tmp_path / "broker", FLEET, {DEVICE: "pw-d"}, Credentials("coordinator", "pw-c"))
    broker.start()
    config = tmp_path / "device.toml"
    config.write_text(textwrap.dedent(f"""
        device_id = "{DEVICE}"
        fleet = "{FLEET}"
        artifacts = "{artifacts}"
        state_dir = "{tmp_path / 'state'}"
        heartbeat_s = 0.5
        [broker]
        port = {broker.address.port}
        password = "pw-d"
        keepalive = 5
        [trainer]
        backend = "auto"
        optimizer = "adamw"
        lr = 0.003
        [store]
        max_samples = 100
        [policy]
        name = "refed"
        [data]
        folder = "{incoming}"
    """))
    command = [*device_python, "-c", "import sys; from edgefil.cli import main; sys.exit(main())",
               "client", "--config", str(config)]
    device = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="edgefil.coordinator"):
            coordinator = Coordinator(CoordinatorConfig(
                fleet=FLEET, out=tmp_path / "run", artifacts=artifacts, devices=(DEVICE,), rounds_per_task=rounds,
                min_clients=1, deadline_s=deadline_s, wait_for_devices_s=deadline_s, test_data=tests,
                broker=BrokerSettings(port=broker.address.port, username="coordinator", password="pw-c"),
                strategy={"name": "fedavg"}, client={"epochs": 2},
            ), test_sets=FolderTestSets(tests, load_manifest(artifacts)))
            results = coordinator.run()
    finally:
        device.terminate()
        output = device.communicate(timeout=60)[0]
        broker.stop()
    return results, output
