"""The coordinator's configuration file (TOML), read into typed settings.

    fleet = "demo"
    out = "runs/demo"                   # run folder: checkpoint/, results.json
    artifacts = "artifacts/lenet"       # the model every device trains (its manifest must match theirs)
    devices = ["dev-0", "dev-1"]        # the roster: messages from any other id are rejected
    rounds_per_task = 3
    fraction = 1.0                      # r: share of the available devices selected each round
    min_clients = 2                     # quorum: a round aggregates only with at least this many updates
    deadline_s = 60.0                   # updates after this are logged and dropped
    wait_for_devices_s = 120.0          # how long a round waits for `min_clients` devices to be online
    max_attempts = 3                    # a round that misses its quorum is run again this many times at most
    retry_backoff_s = 5.0               # before attempt k+1, wait up to this x 2^(k-1) s (at most
                                        # wait_for_devices_s) for the devices that missed attempt k to be back
    seed = 0
    device = "auto"                     # aggregation and evaluation: auto | cpu | cuda
    virtual_time = false                # simulated fleets: deadlines apply to the devices' reported device time, and
                                        # the wall clock bounds only a hung run (`wall_limit_s`): a round waits
                                        # for every selected device, the first for the whole roster, so a busy host
                                        # drops no device (the same seed gives the same run on any host)
    wall_limit_s = 3600.0               # virtual time: the longest a round, or the first round's wait for the
                                        # roster, may take in wall time (a safeguard, not a deadline)
    train_tasks = 0                     # train only the first N tasks (1: the Fixed baseline); 0: every task
    max_held_mib = 4096                 # rules that need a whole round at once (median, trimmed-mean, pfedgrp):
                                        # the most update bytes a round holds (coordinator/aggregation.py)
    inbox_workers = 0                   # processes that take the devices' updates (a shared subscription),
                                        # bound and fold them apart, merged at each round's close
                                        # (coordinator/inbox_workers.py); 0: this process does it
    site_close_s = 60.0                 # the longest a round's close waits for a site's share
    last_rounds = 10                    # the final accuracy is also reported as the mean over the last task's
                                        # last rounds, as the papers report it (Re-Fed: 10)

    [asynchronous] rounds that do not wait for the slowest device (FedBuff, coordinator/buffered.py): mode = "off" |
                "buffered", buffer = 10 (K: the updates that move the model), max_staleness = 4, staleness_exponent
                = 0.5, concurrency = 0 (devices training at once, at most; 0: all), away_retry_s = 60.0 (virtual
                time). With rules that read an update's weights only; no secure aggregation, central DP, inbox
                workers or sites
    [broker]    host, port, username (default "coordinator"), password, cafile, keepalive
    [[sites]]   name = "a", devices = ["dev-0", ...]: devices at a site, served by its broker (bridged to the
                central one) and its aggregator (`edgefil site`), which takes their updates and hands each round
                one share (coordinator/sites.py)
    [scenario]  preset = "digits-class" and overrides, or every Scenario field: tasks and test sets
    [strategy]  name = "fedavg" | "fedprox" | "pfedgrp" | "median" | "trimmed-mean" | "centered-clip", and its
                options
    [guard]     bounds on one update (coordinator/guard.py; the defaults, measured in docs/security.md):
                norm_bound = "reject" | "clip" | "off", norm_factor = 3.0, max_samples = 0 (none), sample_factor =
                10.0, sample_rank = 0.0 (none), sample_bound = "reject" | "cap", free_rider_factor = 0.1, reference =
                "classes" | "off" (each update on its classes' calibration samples, coordinator/reference.py; none
                without calibration samples), reference_tolerance = 1.0, trust_margin = 0.05 (an update that lowers
                its mix's calibration loss by less than this many nats counts that share of its samples, in rounds
                whose typical update lowers it by as much; 0: off), trust_on = "gained" | "net" (that loss counted
                on the parts of the mix it lowered, or on the whole mix),
                reference_vouches = true (an update beyond a size bound that lowers that loss by the margin, beyond
                what random steps as long do, is kept at the bound, not refused), krum_share = 0.25 (Krum selection;
                0: off), krum_when = "without-reference" | "always" (Krum in rounds that have a calibration reference
                too), krum_compare = "classes" | "whole" (two updates compared without the head rows of the classes
                either claims), krum_radius = 2.0 (a refused update this near the kept ones is taken
                back; 0: none), krum_floor = 0.05 (... or this near, in the round's median distances),
                min_alignment = -0.9 (-1: off), direction_bound = "reject" | "project", min_progress = -0.95 (-1:
                off; the least cosine with the fleet's last global step), way_back = "clip" | "off" (no step back
                toward the first global model beyond the round's median plus way_back_slack = 0.25 times its median
                change length), row_factor = 1.25 (a class's head row at most this x its claimants' lower median; 0:
                off: influence.py), copy_factor = 0.01 (updates this near each other, in their changes' lengths,
                share one update's weight; 0: off), hold = 8 (the first updates of a round, bounded together)
    [limits]    per-device rates (coordinator/limits.py): registrations_per_minute = 6.0,
                requests_per_minute = 30.0, resends_per_round = 3
    [checkpoint] generations and refused models (coordinator/checkpoint.py): keep = 3, explode_factor = 10.0,
                collapse_drop = 0.5
    [client]    sent to devices in every round: epochs, lr, answer_wait_s, known_classes, mask_seen_classes,
                fresh_optimizer
                (each optional)
    [privacy]   central differential privacy (coordinator/privacy.py): mode = "off" | "central", clip_norm = 1.0,
                noise_multiplier = 1.0, delta = 1e-5, epsilon_budget = 0.0 (none; else the run ends before a
                round that would pass it), accountant = "rdp" | "pld", clipping = "fixed" | "adaptive"
                (clip_norm its start; target_quantile = 0.5, clip_learning_rate = 0.2, clipped_count_stddev =
                0.0: selected / 20), noise_seed (experiments only: the noise drawn from it, reproducible, and as
                easily taken back out). Every rule but pfedgrp (glfc and sdd noise what they send besides the model:
                docs/security.md)
    [secure_aggregation] the coordinator learns only the sum of a round's updates (coordinator/secagg.py): mode =
                "off" | "secagg+", degree = 0 (each device's neighbours; 0: 2 ceil(log2 n) + 2), threshold = 0.5 (the
                share of a device's neighbours that reconstruct its secrets, above it: a majority), clip_range = 4.0
                (each value of a device's weighted change, at most), max_weight = 10000 (the samples that weigh 1),
                stage_s = 60.0 (each stage's longest wait). With fedavg or fedprox only, no [guard] check (left out,
                the guard is off) and no central DP
    [host]      a task the host learns itself (coordinator/host_training.py): epochs = 20, lr = 0.05,
                momentum = 0.9, batch_size = 32, seed = 0

Relative paths are taken relative to the file's folder. Checked by the one config checker (`edgefil.settings`):
an unknown key, a missing one or a wrong type is a one-line error naming file, table and key. Everything but the
rule's own options is checked before torch is imported (this module and the settings it reads import none): a
typo in a key is refused in a fraction of a second.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.buffered import AsynchronousSettings
from coordinator.checkpoint import CheckpointPolicy
from coordinator.guard_settings import GuardSettings
from coordinator.host_training import HostTraining
from coordinator.limits import RateLimits
from coordinator.privacy import PrivacySettings
from coordinator.secagg import SecureAggregationSettings, config_refused, without_guard
from edgefil.link import BrokerSettings
from edgefil.metrics import LAST_ROUNDS
from edgefil.settings import Where, build, load_toml
from edgefil.topics import check_name


@dataclass(frozen=True)
class CoordinatorConfig:
    fleet: str
    out: Path
    artifacts: Path
    devices: tuple[str, ...]
    scenario: Mapping[str, Any] = field(default_factory=dict)  # simulation: the scenario whose test sets to use
    test_data: Path | None = None  # a deployment: the folder of test-<t>.npz files
    broker: BrokerSettings = BrokerSettings(username="coordinator")
    rounds_per_task: int = 3
    fraction: float = 1.0
    min_clients: int = 1
    deadline_s: float = 60.0
    wait_for_devices_s: float = 120.0
    max_attempts: int = 3
    retry_backoff_s: float = 5.0
    seed: int = 0
    device: str = "auto"
    virtual_time: bool = False
    wall_limit_s: float = 3600.0  # virtual time: a round's (and the first wait's) wall-clock safeguard
    train_tasks: int = 0  # train only the first N tasks, then evaluate the unchanged model (Fixed); 0: all
    max_held_mib: int = 4096  # a holding rule's update bytes per round, at most
    inbox_workers: int = 0  # processes that share the per-update work (coordinator/inbox_workers.py); 0: none
    sites: tuple[SiteDevices, ...] = ()  # devices served by a site's broker and aggregator (coordinator/sites.py)
    site_close_s: float = 60.0  # the longest a round's close waits for a site's share (virtual time: wall_limit_s)
    last_rounds: int = LAST_ROUNDS  # results.json's last-rounds mean covers the last task's last rounds, this many
    strategy: Mapping[str, Any] = field(default_factory=lambda: {"name": "fedavg"})
    guard: GuardSettings = GuardSettings()
    limits: RateLimits = RateLimits()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    client: Mapping[str, Any] = field(default_factory=dict)
    host: HostTraining = HostTraining()
    privacy: PrivacySettings = PrivacySettings()
    secure_aggregation: SecureAggregationSettings = SecureAggregationSettings()
    asynchronous: AsynchronousSettings = AsynchronousSettings()

    def __post_init__(self) -> None:
        check_name(self.fleet, "fleet")
        for device in self.devices:
            check_name(device, "device id")
        if not self.devices:
            raise ValueError("devices: the roster is empty")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if not 1 <= self.min_clients <= len(self.devices):
            raise ValueError(f"min_clients must be in [1, {len(self.devices)}], got {self.min_clients}")
        if self.rounds_per_task < 1 or self.max_attempts < 1 or self.deadline_s <= 0 or self.retry_backoff_s < 0:
            raise ValueError("rounds_per_task and max_attempts must be >= 1, deadline_s > 0 and retry_backoff_s >= 0")
        if self.max_held_mib < 1:
            raise ValueError(f"max_held_mib must be >= 1, got {self.max_held_mib}")
        if self.inbox_workers < 0:
            raise ValueError(f"inbox_workers must be >= 0, got {self.inbox_workers}")
        at_sites = [device for site in self.sites for device in site.devices]
        strangers = set(at_sites) - set(self.devices)
        if strangers:
            raise ValueError(f"sites: {', '.join(sorted(strangers)[:3])} not on the roster (devices)")
        if len(set(at_sites)) != len(at_sites) or len({site.name for site in self.sites}) != len(self.sites):
            raise ValueError("sites: a device at two sites, or two sites of one name")
        if self.site_close_s <= 0:
            raise ValueError(f"site_close_s must be > 0, got {self.site_close_s}")
        if self.last_rounds < 1:
            raise ValueError(f"last_rounds must be >= 1, got {self.last_rounds}")
        if "name" not in self.strategy:
            raise ValueError("[strategy] needs a name")
        refused = config_refused(self.secure_aggregation, self.guard.checks, self.privacy.central)
        if refused is not None:
            raise ValueError(f"[secure_aggregation] {refused}")
        if self.asynchronous.on and self.asynchronous.buffer > len(self.devices):
            raise ValueError(f"[asynchronous] buffer = {self.asynchronous.buffer} is more updates than the "
                             f"{len(self.devices)} devices can give one model")
        if not self.scenario and self.test_data is None:
            raise ValueError("the coordinator needs test data: test_data = \"folder\" (test-<t>.npz files, one per "
                             "task) or, in simulation, a scenario")

    def describe(self) -> dict[str, Any]:
        """What the run's record keeps of its settings, for the reports (no password, no paths)."""
        return {
            "rounds_per_task": self.rounds_per_task, "fraction": self.fraction, "min_clients": self.min_clients,
            "deadline_s": self.deadline_s, "train_tasks": self.train_tasks, "devices": len(self.devices),
            "last_rounds": self.last_rounds,
            "client": dict(self.client), "guard": dataclasses.asdict(self.guard),
            "privacy": dataclasses.asdict(self.privacy),
            "secure_aggregation": dataclasses.asdict(self.secure_aggregation),
            "asynchronous": dataclasses.asdict(self.asynchronous),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: Path = Path("."), file: str = "coordinator config"
                  ) -> CoordinatorConfig:
        """Checked by the one config checker (`edgefil.settings`): ConfigError naming file, table and key."""
        where = Where(file)
        raw = dict(raw)
        if isinstance(raw.get("broker", {}), Mapping):
            raw["broker"] = {"username": "coordinator", **raw.get("broker", {})}
        raw = without_guard(raw)
        config = build(cls, raw, where, base)
        client = build(RoundSettings, config.client, where.inner("client"))
        # the rule's options last: they are its constructor's, and the rules need torch (every check above runs
        # without it, so a typo elsewhere is refused at once)
        from coordinator.strategies import check_strategy

        check_strategy(config.strategy, where.inner("strategy"), config.privacy, config.secure_aggregation)
        return dataclasses.replace(config, client={k: v for k, v in vars(client).items() if v is not None})

    @classmethod
    def load(cls, path: str | Path) -> CoordinatorConfig:
        path = Path(path)
        return cls.from_dict(load_toml(path), base=path.parent, file=str(path))


@dataclass(frozen=True)
class RoundSettings:
    """`[client]`: what every round message tells the devices (left out: the device's own setting)."""

    epochs: int | None = None
    lr: float | None = None
    answer_wait_s: float | None = None  # how long a device waits for the answer to its request
    # true: every round tells the devices the classes of tasks 0..t as the coordinator knows them, which the
    # devices' seen-class masks then show beside their own (a task the host learnt left them none of its samples)
    known_classes: bool | None = None
    # true or false: every device masks (or does not mask) the classes it has not seen, whatever its own [learner]
    # says; left out, each device's own setting (docs/results-history.md, "The class mask", says where the mask helps)
    mask_seen_classes: bool | None = None
    # true: each round's local training starts the devices' optimiser afresh (its state zero, its step count 0),
    # as Flower's clients and most FedAvg implementations train; left out or false: a device keeps its optimiser's
    # state from round to round (docs/architecture.md)
    fresh_optimizer: bool | None = None


@dataclass(frozen=True)
class SiteDevices:
    """`[[sites]]` of the coordinator file: a site's name and the devices that connect to its broker."""

    name: str
    devices: tuple[str, ...]

    def __post_init__(self) -> None:
        check_name(self.name, "site name")
        if not self.devices:
            raise ValueError(f"site {self.name}: no devices")


@dataclass(frozen=True)
class SiteConfig:
    """A site aggregator's file (coordinator/site_aggregator.py): the fleet, the site's name in the coordinator's
    `[[sites]]`, the fleet's model, and the site's broker with its coordinator account."""

    fleet: str
    site: str
    artifacts: Path
    broker: BrokerSettings = BrokerSettings(username="coordinator")

    def __post_init__(self) -> None:
        check_name(self.fleet, "fleet")
        check_name(self.site, "site")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: Path = Path("."), file: str = "site config") -> SiteConfig:
        raw = dict(raw)
        raw["broker"] = {"username": "coordinator", **raw.get("broker", {})}
        return build(cls, raw, Where(file), base)

    @classmethod
    def load(cls, path: str | Path) -> SiteConfig:
        path = Path(path)
        return cls.from_dict(load_toml(path), base=path.parent, file=str(path))
