"""A simulated device's data: its client's share of a scenario, task by task (`ClientSource`).

A fleet builds its scenario once (`FleetConfig.check`) and writes every client's share of it to one folder of
arrays in its run folder (`write_shares`); each device's config names that folder (`[data] shares`), and a worker
process maps it (`np.load(mmap_mode="r")`: the pages are the kernel's, shared by every worker) and reads its
devices' rows from it. Without the folder a worker built the scenario itself: at 100,000 clients that was 15-25 s
of CPU and the whole dataset's memory in each of two dozen workers before any device started. A folder that is
missing, unreadable or written for another scenario is passed over with a line in the log, and the scenario is
built as before (a config copied to another machine, a run folder moved): a device's data never depend on it.

The layout: `scenario.json` (the scenario the shares are of, and the counts), `x.npy` and `y.npy` (every client's
train samples, task after task, client after client within a task) and `starts.npy` (n_tasks x n_clients + 1
positions: client k's samples of task t are rows starts[t n + k] up to starts[t n + k + 1]).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from firmware_sim import scenarios
from firmware_sim.scenarios import Scenario, ScenarioData, scenario_from_config

log = logging.getLogger("edgefil.fleet")
SHARES_FORMAT = 1
SHARES_FOLDER = "scenario-shares"  # in a fleet's run folder


def write_shares(data: ScenarioData, folder: Path) -> None:
    """Every client's train share of every task of `data`, into `folder` (replaced whole: written beside it, then
    renamed, so that no reader sees half of it)."""
    xs, ys, sizes = [], [], []
    for task in data.tasks:
        picked = (np.concatenate(task.client_train_indices) if task.client_train_indices
                  else np.empty(0, np.int64))
        xs.append(task.data.x_train[picked])
        ys.append(task.data.y_train[picked])
        sizes += [len(idx) for idx in task.client_train_indices]
    meta = {"format": SHARES_FORMAT, "scenario": data.scenario.to_dict(), "n_tasks": len(data.tasks),
            "n_clients": data.scenario.n_clients}
    folder.parent.mkdir(parents=True, exist_ok=True)
    written = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        np.save(written / "x.npy", np.concatenate(xs).astype(np.float32, copy=False))
        np.save(written / "y.npy", np.concatenate(ys).astype(np.int64, copy=False))
        np.save(written / "starts.npy", np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))
        (written / "scenario.json").write_text(json.dumps(meta))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(written, folder)
    except BaseException:
        shutil.rmtree(written, ignore_errors=True)
        raise


class MappedShares:
    """A shares folder mapped into this process: `client_train(t, k)` copies client k's rows of task t out."""

    def __init__(self, folder: Path, scenario: Scenario) -> None:
        """Raises ValueError when the folder is not the shares of `scenario` (OSError when it cannot be read)."""
        meta = json.loads((folder / "scenario.json").read_text())
        if meta.get("format") != SHARES_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {SHARES_FORMAT}")
        if Scenario.from_dict(meta["scenario"]) != scenario:
            raise ValueError("they are another scenario's")
        self.n_clients = int(meta["n_clients"])
        self.x = np.load(folder / "x.npy", mmap_mode="r")
        self.y = np.load(folder / "y.npy", mmap_mode="r")
        self.starts = np.load(folder / "starts.npy")
        if (len(self.starts) != int(meta["n_tasks"]) * self.n_clients + 1 or int(self.starts[-1]) != len(self.x)
                or len(self.x) != len(self.y)):
            raise ValueError("their arrays do not match their counts")

    def client_train(self, t: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        at = t * self.n_clients + k
        if not 0 <= at < len(self.starts) - 1:
            raise IndexError(f"no task {t} of client {k} in the shares")
        begin, end = int(self.starts[at]), int(self.starts[at + 1])
        return np.array(self.x[begin:end]), np.array(self.y[begin:end])


_mapped: dict[Path, MappedShares | None] = {}  # a process maps a folder once for all its devices (None: unusable)
_mapped_lock = threading.Lock()


def mapped_shares(folder: Path, scenario: Scenario) -> MappedShares | None:
    """`folder` mapped (once a process), or None, said once, where it cannot serve `scenario`."""
    with _mapped_lock:
        if folder not in _mapped:
            try:
                _mapped[folder] = MappedShares(folder, scenario)
                log.info("the devices' data: the scenario's shares in %s, mapped", folder)
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("the scenario's shares in %s are not used (%s: %s): building the scenario here",
                            folder, type(err).__name__, err)
                _mapped[folder] = None
        return _mapped[folder]


class ClientSource:
    """One client's share of a scenario, task by task: the data stream of a simulated device. Read from `shares`
    (a folder `write_shares` wrote) where it serves the scenario, else from the scenario built once a process."""

    def __init__(self, scenario: Scenario | Mapping[str, Any], client: int, shares: Path | None = None) -> None:
        if not isinstance(scenario, Scenario):
            scenario = scenario_from_config(scenario)
        if not 0 <= client < scenario.n_clients:
            raise ValueError(f"client {client} is not one of the scenario's {scenario.n_clients} clients")
        self.client = client
        mapped = None if shares is None else mapped_shares(Path(shares), scenario)
        self.data: ScenarioData | MappedShares = mapped if mapped is not None else scenarios.shared_build(scenario)

    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        return self.data.client_train(task, self.client)
