"""The device daemon's configuration file (TOML), read into typed settings.

    device_id = "dev-0"
    fleet = "demo"
    artifacts = "artifacts/lenet"      # exported ORT training artifacts (manifest.json inside)
    state_dir = "state/dev-0"          # replay store + client state; survives restarts
    profile = "generic"                # informational: sent at registration
    heartbeat_s = 5.0

    [broker]   host, port, username (defaults to device_id), password, cafile, keepalive
    [trainer]  backend = "ort" | "torch", optimizer = "sgd" | "adamw", lr, threads
    [learner]  epochs, batch_size, mask_seen_classes
    [store]    max_samples (M), max_bytes
    [policy]   name = "refed" | "random" | ..., any other key goes to the policy (e.g. lam, pim_epochs)
    [data]     folder = "..."  (task-<t>.npz files with x, y)  or  scenario = {...} with client = k (simulation)
    [emulation]  simulation only: profile = "raspberry-pi-4-4gb" (or a path), host_gflops, real_time = false

Relative paths are taken relative to the file's folder. Unknown keys are errors: a typo must not pass silently.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from edgefil.link import BrokerSettings
from edgefil.topics import check_name


@dataclass(frozen=True)
class TrainerSettings:
    backend: str = "ort"
    optimizer: str = "adamw"
    lr: float = 1e-3
    threads: int = 1


@dataclass(frozen=True)
class LearnerSettings:
    epochs: int = 1
    batch_size: int = 32
    mask_seen_classes: bool = True


@dataclass(frozen=True)
class StoreSettings:
    max_samples: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class DeviceConfig:
    device_id: str
    fleet: str
    artifacts: Path
    state_dir: Path
    broker: BrokerSettings
    profile: str = "generic"
    heartbeat_s: float = 5.0
    trainer: TrainerSettings = TrainerSettings()
    learner: LearnerSettings = LearnerSettings()
    store: StoreSettings = StoreSettings()
    policy: Mapping[str, Any] = field(default_factory=lambda: {"name": "refed"})
    data: Mapping[str, Any] = field(default_factory=dict)
    emulation: Mapping[str, Any] = field(default_factory=dict)  # virtual devices only: profile, host_gflops, real_time

    @property
    def simulated(self) -> bool:
        """A virtual device's file (a scenario share or an emulated profile): the simulator builds its data
        source and surroundings (`firmware_sim.virtual_device`); the device runtime alone cannot run it."""
        return "scenario" in self.data or bool(self.emulation)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: Path = Path(".")) -> DeviceConfig:
        raw = dict(raw)
        device_id = check_name(raw.get("device_id", ""), "device_id")
        check_name(raw.get("fleet", ""), "fleet")
        broker = {"username": device_id, **raw.pop("broker", {})}
        sections = {
            "broker": _section(BrokerSettings, broker, "broker"),
            "trainer": _section(TrainerSettings, raw.pop("trainer", {}), "trainer"),
            "learner": _section(LearnerSettings, raw.pop("learner", {}), "learner"),
            "store": _section(StoreSettings, raw.pop("store", {}), "store"),
        }
        for key in ("artifacts", "state_dir"):
            if key not in raw:
                raise ValueError(f"device config needs {key!r}")
            raw[key] = (base / raw[key]).resolve()
        data = dict(raw.pop("data", {}))
        if "folder" in data:
            data["folder"] = str((base / data["folder"]).resolve())
        config = _section(cls, {**raw, **sections, "data": data}, "device config")
        if "name" not in config.policy:
            raise ValueError("[policy] needs a name")
        return config

    @classmethod
    def load(cls, path: str | Path) -> DeviceConfig:
        path = Path(path)
        with open(path, "rb") as handle:
            return cls.from_dict(tomllib.load(handle), base=path.parent)


def _section(cls: type, values: Mapping[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; known: {sorted(known)}")
    return cls(**values)
