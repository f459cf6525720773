"""The device daemon's configuration file (TOML), read into typed settings by the one config checker
(`edgefil.settings`): an unknown key, a missing one or a wrong type is a one-line error naming file, table and key.

    device_id = "dev-0"
    fleet = "demo"
    artifacts = "artifacts/lenet"      # an exported artifact set (manifest.json inside)
    state_dir = "state/dev-0"          # replay store + client state; survives restarts
    profile = "generic"                # informational: sent at registration
    heartbeat_s = 5.0
    on_end = "exit"                    # when the coordinator says the run is over: exit, or "wait" for the next

    [broker]   host, port, username (defaults to device_id), password, cafile, keepalive
    [trainer]  backend = "auto" | "portable" | "ort" | "torch", optimizer = "sgd" | "adamw", lr, threads, momentum
    [learner]  epochs, batch_size, mask_seen_classes, detect_new_tasks, task_detectors
    [store]    max_samples (M), max_bytes
    [policy]   name = "refed" | "random" | ..., group_by = "class", new_share = "stream" | 0.5 (M's split between
               the newest task and the old ones; left out: Re-Fed's rule), and the policy's own options (e.g. lam)
    [data]     folder = "..."  (task-<t>.npz files with x, y)  or  scenario = {...} with client = k (simulation;
               shares = "...": every client's share, written by the device's fleet, read instead of a build)
    [emulation]  simulation only: profile = "raspberry-pi-4-4gb" (or a path), host_gflops, real_time, time_scale
    [privacy]  local differential privacy (edge_client/privacy.py): mode = "off" | "local", clip_norm = 1.0,
               noise_multiplier = 1.0, delta = 1e-5, epsilon_budget = 0.0 (none); require_secure_aggregation =
               false (true: the device answers a round without secure aggregation with an error, untrained)

Relative paths are taken relative to the file's folder. The same tables ([policy], [store], [trainer], [learner])
mean the same in a fleet file.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from edge_client.budget import Budget
from edge_client.policies import check_policy
from edge_client.privacy import LocalPrivacySettings
from edge_client.trainers.choice import TrainerSettings
from edgefil.link import BrokerSettings
from edgefil.settings import Where, build, load_toml
from edgefil.topics import check_name
from models.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class LearnerSettings:
    epochs: int = 1
    batch_size: int = 32
    mask_seen_classes: bool = True
    # The device decides where its own tasks start: a round's task only names the data to take, and the learner's
    # detectors (a label never seen, the policy's `task_boundary`) say whether that data starts a task.
    detect_new_tasks: bool = False
    # Which of them decide with detect_new_tasks: "both" (either one starts a task), "labels" (a label never seen),
    # "policy" (the policy's own detector alone, e.g. GLFC's entropy jump)
    task_detectors: Literal["both", "labels", "policy"] = "both"
    # Where the weights and the optimiser state are between rounds: "memory" (kept, and the replay store's database
    # connection with them; the optimiser state is not saved), or "disk" (saved with the state every round, let go
    # until the next with the connection: a fleet's default, for hosts of thousands of devices). The same steps
    # either way (edge_client/learner.py).
    between_rounds: Literal["memory", "disk"] = "memory"


@dataclass(frozen=True)
class StoreSettings:
    max_samples: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        Budget(self.max_samples, self.max_bytes)  # the budget's own rules (edge_client.budget), at load
        for name in ("max_samples", "max_bytes"):  # and a device's: a store that may keep nothing (a store's M can
            if getattr(self, name) == 0:           # be 0) leaves the device nothing to train on at its first round
                raise ValueError(f"{name} (the budget M) must be at least 1, or left out for no limit of that kind, "
                                 "not 0: a device whose store keeps nothing has nothing to train on")


@dataclass(frozen=True)
class DataSettings:
    """Where the device's data come from: a folder of task files, or (a virtual device) a scenario's share."""

    folder: Path | None = None
    scenario: Mapping[str, Any] | None = None
    client: int = 0
    # a virtual device's: every client's share of `scenario`, written by its fleet (firmware_sim/client_shares.py),
    # read instead of building the scenario where it serves it
    shares: Path | None = None

    def __post_init__(self) -> None:
        if (self.folder is None) == (self.scenario is None):
            raise ValueError("needs `folder` (a folder of task-<t>.npz files) or, for a simulated device, `scenario`")


@dataclass(frozen=True)
class EmulationSettings:
    """A virtual device's emulated profile (simulation only; firmware_sim applies it)."""

    profile: str
    host_gflops: float
    real_time: bool = False
    time_scale: float = 1.0
    availability_seed: int | None = None
    # the clock availability follows: "wall" (the wall clock since the device joined: it disconnects while
    # offline), or "fleet" (the fleet's virtual clock the rounds name: it sits out the rounds it is away for)
    availability_clock: Literal["wall", "fleet"] = "wall"
    # a round's compute time: "measured" (the host's CPU time, scaled to the profile) or "modelled" (the model's
    # training FLOPs at the profile's speed: the same on any host; firmware_sim/emulation.py)
    compute: Literal["measured", "modelled"] = "measured"


@dataclass(frozen=True)
class DeviceConfig:
    """The file's schema, table by table, and what the daemon reads."""

    device_id: str
    fleet: str
    artifacts: Path
    state_dir: Path
    broker: BrokerSettings = BrokerSettings()
    profile: str = "generic"
    heartbeat_s: float = 5.0
    trainer: TrainerSettings = TrainerSettings()
    learner: LearnerSettings = LearnerSettings()
    store: StoreSettings = StoreSettings()
    policy: Mapping[str, Any] = field(default_factory=lambda: {"name": "refed"})
    data: DataSettings | None = None
    emulation: EmulationSettings | None = None  # virtual devices only
    privacy: LocalPrivacySettings = LocalPrivacySettings()
    on_end: str = "exit"  # when the coordinator says the run is over: "exit", or "wait" for the next run

    def __post_init__(self) -> None:
        for key in ("device_id", "fleet"):
            check_name(getattr(self, key), key)
        if self.on_end not in ("exit", "wait"):
            raise ValueError(f"on_end must be \"exit\" or \"wait\", got {self.on_end!r}")

    @property
    def simulated(self) -> bool:
        """A virtual device's file (a scenario share or an emulated profile): the simulator builds its data
        source and surroundings (`firmware_sim.virtual_device`); the device runtime alone cannot run it."""
        return (self.data is not None and self.data.scenario is not None) or self.emulation is not None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: Path = Path("."), file: str = "device config") -> DeviceConfig:
        """Checked by the one config checker (`edgefil.settings`): ConfigError naming file, table and key."""
        where = Where(file)
        raw = dict(raw)
        device_id = raw.get("device_id", "")
        if isinstance(raw.get("broker", {}), Mapping) and isinstance(device_id, str):
            raw["broker"] = {"username": device_id, **raw.get("broker", {})}
        config = build(cls, raw, where, base)
        return replace(config, policy=check_policy(config.policy, where.inner("policy")))

    @classmethod
    def load(cls, path: str | Path) -> DeviceConfig:
        path = Path(path)
        return cls.from_dict(load_toml(path), base=path.parent, file=str(path))

    def check_paths(self, file: str = "device config") -> None:
        """What the file points at, before the daemon starts: the artifacts folder holds a model (`edgefil export`
        writes its manifest.json) and a data folder exists. A ConfigError naming the key and the path, rather than
        a traceback at start-up or at the first round. Not part of `load`: a file is checked on one machine (a
        unit installed, a fleet rehearsed) before its model and data are copied to the device."""
        where = Where(file)
        if not (self.artifacts / MANIFEST_NAME).is_file():
            raise where.error("artifacts", f"{self.artifacts} holds no model ({MANIFEST_NAME}): copy the exported "
                                           "artifacts there, or export them (edgefil export)")
        if self.data is not None and self.data.folder is not None and not self.data.folder.is_dir():
            raise where.inner("data").error("folder", f"{self.data.folder} is not a folder: copy the device's data "
                                                      "there (edgefil data split writes it)")
