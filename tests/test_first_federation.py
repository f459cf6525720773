"""The README's first federation, run as it stands: init, data split, export, mosquitto, the coordinator and two
clients, against a real mosquitto; the accuracy matrix means something, the report is written, every process
exits. Then the same federation with the devices fed the digits in their natural class order (the mistake the
README once made itself): the coordinator says so in one line per device, and its guard refuses their updates
(claims of classes it cannot compare on its calibration samples)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.broker import free_port, mosquitto_path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the edgefil command of this environment


def readme_block() -> list[str]:
    """The commands of the README's first-federation block."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first federation"):]
    block = section[section.index("```bash\n") + len("```bash\n"):section.index("```", section.index("```bash\n") + 7)]
    return block.strip().splitlines()


def environment() -> dict[str, str]:
    mosquitto_dir = str(Path(mosquitto_path()).parent)
    return {**os.environ, "PATH": f"{BIN}:{mosquitto_dir}:{os.environ.get('PATH', '')}"}


def gone(pid_file: Path, timeout: float = 60.0) -> None:
    """Wait until mosquitto has exited: it deletes its pid file last (a ceiling for a stuck broker, not a measure
    of speed)."""
    deadline = time.monotonic() + timeout
    while pid_file.exists():
        assert time.monotonic() < deadline, f"{pid_file}: the broker did not exit"
        time.sleep(0.05)


def running(pattern: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_readmes_first_federation_runs_as_written_and_a_wrong_class_order_is_called_out(tmp_path):
    lines = readme_block()
    assert lines[0].startswith("edgefil init lab ")
    port = free_port("127.0.0.1")
    # the one change: a free port, where the README takes init's default (8883) on a machine of one's own
    script = "\n".join([f"{lines[0].split('#')[0].strip()} --port {port}", *lines[1:]])
    block = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = block.communicate(timeout=600)
    finally:  # a step that failed may leave its clients waiting for a broker that is gone: end the whole group
        try:
            os.killpg(block.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert block.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lab = tmp_path / "lab"
    results = json.loads((lab / "run" / "results.json").read_text())
    assert results["outcome"] == "complete"
    matrix = results["accuracy_matrix"]
    assert [len(row) for row in matrix] == [1, 2, 3, 4, 5]
    diagonal = [row[-1] for row in matrix]
    assert min(diagonal) > 0.5, diagonal  # each task learnt: chance is 0.5 within a task, 0.1 over ten classes
    assert results["final_accuracy"] > 0.3, matrix
    assert [d["profile"] for d in results["devices"]] == ["generic", "generic"]
    # the devices exited at the run's end, and the record says so (not "training", as when the last round closed)
    assert [(d["state"], d["online"]) for d in results["devices"]] == [("offline", False)] * 2, results["devices"]
    for written in ("summary.md", "accuracy_matrix.png", "metrics.csv", "live.json"):
        assert (lab / "run" / written).is_file(), written
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((lab / "run" / "tensorboard").glob("events.out.tfevents.*"))))
    events.Reload()  # TensorBoard's own reader: a scalar per round
    assert [s.step for s in events.Scalars("accuracy/average")] == list(range(1, 16))
    rows = (lab / "run" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 16 and rows[0].startswith("step,round,task,trained,accuracy_task_0")
    classes = json.loads((lab / "data" / "classes.json").read_text())
    assert [t["classes"] for t in classes["tasks"]] != [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # seeded order
    assert not running(str(lab)), "a process of the federation is still running"
    for private in ("coordinator.toml", "devices/pi-1.toml", "broker/observer.toml"):  # each holds a password
        assert (lab / private).stat().st_mode & 0o077 == 0, private
    from firmware_sim.fleet_config import FleetConfig

    rehearsal = FleetConfig.load(lab / "fleet.toml")  # init's simulated twin of the federation checks whole
    assert rehearsal.devices == 2 and rehearsal.check(str(lab / "fleet.toml")).n_tasks == 5

    # the same federation, the devices' files in the digits' natural class order: 0-1, 2-3, ...
    from firmware_sim.datasets import load_digits_dataset

    digits = load_digits_dataset()
    for k, device in enumerate(("pi-1", "pi-2")):
        folder = lab / "data" / "devices" / device
        for t in range(5):
            pick = np.flatnonzero(np.isin(digits.y_train, [2 * t, 2 * t + 1]))[k::2]
            np.savez(folder / f"task-{t}.npz", x=digits.x_train[pick], y=digits.y_train[pick])
    shutil.rmtree(lab / "state")
    config = (lab / "coordinator.toml").read_text()
    (lab / "coordinator.toml").write_text(config.replace('out = "run"', 'out = "natural"')
                                          .replace("rounds_per_task = 3", "rounds_per_task = 1"))
    env = environment()
    gone(lab / "broker" / "mosquitto.pid")  # the block's broker has let go of its port
    subprocess.run(["mosquitto", "-c", str(lab / "broker" / "mosquitto.conf"), "-d"], check=True, env=env)
    processes: list[subprocess.Popen] = []
    try:
        coordinator = subprocess.Popen([str(BIN / "edgefil"), "coordinator", "--config", str(lab / "coordinator.toml")],
                                       cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
        clients = [subprocess.Popen([str(BIN / "edgefil"), "client", "--config", str(lab / "devices" / f"{d}.toml")],
                                    cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for d in ("pi-1", "pi-2")]
        processes = [coordinator, *clients]
        log, _ = coordinator.communicate(timeout=300)
        # the guard cannot compare a claim of classes the run has not reached with its calibration samples, so it
        # refuses every update: the run ends saying no device trained, and why each update was refused
        assert coordinator.returncode == 2 and "had every update refused" in log, log[-3000:]
        assert [c.wait(timeout=60) for c in clients] == [0, 0]  # they exit when the run ends
    finally:
        for process in processes:  # whatever failed above: nothing of this run stays behind
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        subprocess.run(["kill", (lab / "broker" / "mosquitto.pid").read_text().strip()], check=False)
    warnings = [line for line in log.splitlines() if "not among tasks" in line]
    first = [w for w in warnings if re.search(r"pi-\d's data hold classes [\d, ]+, not among tasks 0\.\.0's", w)]
    assert len(first) == 2, log[-3000:]  # one line per device as its first task's update arrives
    assert (lab / "natural" / "summary.md").is_file()  # the coordinator writes the report at a run's end
    natural = json.loads((lab / "natural" / "results.json").read_text())
    assert natural["counters"]["class-mismatch"] == len(warnings) <= 2 * 5  # one per device and task at most
    refused = sum(natural["counters"].get(k, 0) for k in ("unreached-classes", "misplaced-classes",
                                                          "worse-on-own-classes"))
    assert refused == sum(len(entry["received"]) for entry in natural["history"]) > 0, natural["counters"]
