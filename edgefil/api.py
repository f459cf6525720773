"""The Python API: a simulated fleet from a dict or a TOML file, run, its results as plain Python, resumed, compared.

    from edgefil import api

    base = {"name": "epochs", "devices": 4, "scenario": {"preset": "digits-class"}, "policy": {"name": "refed"}}
    runs = api.sweep(base, "client.epochs", [1, 5], out="runs/epochs")
    for epochs, run in runs.items():
        print(epochs, run.final_accuracy, run.accuracy_matrix)
    for row in api.compare(runs):
        print(row)

The same objects the command line uses, not a second implementation: `fleet` builds the `FleetConfig` that `edgefil
fleet run FILE` builds from its file, checked the same way (a typo is a ConfigError of one line that names the
table and the key); `run` runs it with `Fleet(config).run()` and reads back the `results.json` the run wrote; `load`
reads any finished run's folder, the command line's included; `rounds` are the rows of the run's metrics.csv.
`changes` name a key by its table's path, "client.epochs" or "coordinator.guard.norm_factor", so a sweep changes one
key of a file without copying it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefil.metrics import accuracy_matrix, average_incremental_accuracy
from edgefil.settings import ConfigError, load_toml

if TYPE_CHECKING:
    from firmware_sim.fleet_config import FleetConfig


@dataclass(frozen=True)
class Run:
    """A finished run: its folder and what its `results.json` holds."""

    folder: Path
    results: Mapping[str, Any]

    @property
    def outcome(self) -> str:
        """"complete", "stopped", or "failed: <reason>"."""
        return str(self.results["outcome"])

    @property
    def accuracy_matrix(self) -> list[list[float]]:
        """Row i: the accuracy on tasks 0..i after task i (ragged, as in results.json)."""
        return [list(row) for row in self.results["accuracy_matrix"]]

    @property
    def final_accuracy(self) -> float:
        """The average accuracy over every task after the last one."""
        return float(self.results["final_accuracy"])

    @property
    def average_incremental_accuracy(self) -> float:
        """The mean over tasks of the average accuracy after each task (edgefil.metrics)."""
        return average_incremental_accuracy(accuracy_matrix(self.results["accuracy_matrix"]))

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """A row per round, as the run's metrics.csv has them: round, task, the accuracy per task and on average,
        samples, updates, traffic and refusals."""
        from coordinator.run_logs import csv_rows

        return csv_rows(self.results["history"], len(self.results["accuracy_matrix"]))


def fleet(source: Mapping[str, Any] | str | Path, changes: Mapping[str, Any] | None = None,
          out: str | Path | None = None) -> FleetConfig:
    """The fleet of `source` (a fleet file's tables as a dict, or the file's path) with `changes` applied (a key by
    its table's path: {"client.epochs": 5}) and its runs in `out`; checked whole (`FleetConfig.check`), so a mistake
    is a ConfigError here, before anything runs."""
    config = _built(source, changes, out)
    config.check(str(source) if not isinstance(source, Mapping) else "fleet")
    return config


def _built(source: Mapping[str, Any] | str | Path, changes: Mapping[str, Any] | None,
           out: str | Path | None) -> FleetConfig:
    """`fleet`'s FleetConfig, its keys and types checked but not what they name (`Fleet.run` checks that first)."""
    from firmware_sim.fleet_config import FleetConfig

    if isinstance(source, Mapping):
        raw, base, file = _copy(source), Path("."), "fleet"
    else:
        raw, base, file = load_toml(source), Path(source).parent, str(source)
    for key, value in (changes or {}).items():
        _set(raw, key, value, file)
    if out is not None:
        raw["out"] = str(Path(out).resolve())
    return FleetConfig.from_dict(raw, base=base, file=file)


def run(source: FleetConfig | Mapping[str, Any] | str | Path, changes: Mapping[str, Any] | None = None,
        out: str | Path | None = None, resume: bool = False) -> Run:
    """Run the fleet (`fleet`'s arguments, or a FleetConfig) to its end and return what it wrote; `resume` goes on
    from the run's last checkpoint in its folder, as `edgefil fleet run --resume` does."""
    from firmware_sim.fleet import Fleet
    from firmware_sim.fleet_config import FleetConfig

    if isinstance(source, FleetConfig):
        if changes or out is not None:
            raise TypeError("changes and out apply to a fleet's tables or its file, not to a built FleetConfig")
        config = source
    else:
        config = _built(source, changes, out)  # Fleet.run checks it whole before anything starts
    Fleet(config).run(resume=resume, file="fleet" if isinstance(source, (Mapping, FleetConfig)) else str(source))
    return load(config.out)


def load(folder: str | Path) -> Run:
    """A finished run's folder (a fleet's `out`, the coordinator's `out`): its results.json read back."""
    from coordinator.run_logs import RESULTS_FILE

    path = Path(folder) / RESULTS_FILE
    try:
        return Run(Path(folder), json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (not a finished run's folder)") from None


def sweep(source: Mapping[str, Any] | str | Path, key: str, values: Sequence[Any], out: str | Path) -> dict[Any, Run]:
    """One run per value of `key` (a table's path, "client.epochs"), each in `out`/<key>=<value>, in order; every
    value's fleet is checked before the first runs."""
    configs = {value: fleet(source, {key: value}, Path(out) / f"{key}={value}") for value in values}
    return {value: run(config) for value, config in configs.items()}


def compare(runs: Mapping[Any, Run]) -> list[dict[str, Any]]:
    """A row per run, named by its key in `runs`: final accuracy, average incremental accuracy, rounds, outcome."""
    return [{"run": name, "final_accuracy": r.final_accuracy,
             "average_incremental_accuracy": r.average_incremental_accuracy,
             "rounds": len(r.results["history"]), "outcome": r.outcome} for name, r in runs.items()]


def _copy(table: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in table.items()}


def _set(raw: dict[str, Any], key: str, value: Any, file: str) -> None:
    """Set `key` ("client.epochs") in the nested tables of `raw`, making the tables it names where missing."""
    *tables, name = key.split(".")
    table = raw
    for part in tables:
        inner = table.setdefault(part, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"{file}: {key}: {part} is a value, not a table")
        table = inner
    table[name] = value
