"""The fleet file (TOML), read into typed settings and checked: what `edgefil fleet run` runs
(firmware_sim/fleet.py). It imports nothing heavy (no torch, no dataset), so a typo is refused at once.

    name = "demo"                  # fleet (topic prefix) name
    out = "runs/demo"              # artifacts/, devices/<id>/, logs/, checkpoint/, results.json
    devices = 10
    workers = 2                    # processes hosting the virtual devices; left out: one per core (a worker is
                                   # one Python process, about one core of device work; more only add memory)
    model = "lenet"                # a zoo model (edgefil export --list), or your own: "package.module:Name"
    model_args = {}                # your own model's constructor arguments (models/zoo.py says what it is)
    seed = 0
    broker = "auto"                # auto | mosquitto | embedded (no authentication: auto falls back to it, at
                                   # WARNING, only where mosquitto is missing)
    tls = false                    # the broker's listener uses TLS (a CA and certificate made in out/broker/tls;
                                   # mosquitto only)
    observer_reads_learning = false  # broker/observer.toml's account (edgefil watch) reads updates, models and
                                   # method payloads too, not only the protocol's metadata (docs/security.md,
                                   # "Who reads what"; the embedded broker has no accounts: anyone reads all)
    scenario = {preset = "digits-class"}     # n_clients: the shares the data are split into (left out: `devices`);
                                   # device k holds share k, so more shares than devices leave some unused
    profiles = {raspberry-pi-4-4gb = 6, jetson-nano = 4}   # emulated devices by profile (counts sum to
                                   # `devices`); none: devices run unemulated at the host's speed
    real_time = false              # emulation: sleep to match device time, deadlines on the wall clock (else
                                   # virtual time: deadlines apply to the devices' reported device seconds, an
                                   # unemulated device's being its CPU seconds, and a round waits for every device
                                   # it selected however busy the host: coordinator/server.py)
    time_scale = 60.0              # availability schedules: profile seconds per second of the fleet's clock (in
                                   # virtual time a round starts at (round - 1) x deadline_s on it; 1 in real
                                   # time, on the wall clock)
    compute = "measured"           # emulation: a round's compute time measured (the host's CPU time, scaled to
                                   # the profile) or "modelled" (the model's FLOPs at the profile's speed: the same
                                   # run gives the same device times on any host; firmware_sim/emulation.py)
    backend = "processes"          # processes (workers on this machine) | ray (Ray actors over a cluster's
                                   # nodes, firmware_sim/fleet_ray.py; `--address` sets it with [ray] address)
    sites = 0                      # the devices split over this many sites (device k at site-<k mod sites>),
                                   # each a mosquitto of its own bridged to the fleet's and an aggregator process
                                   # (`edgefil site`, coordinator/sites.py); 0: every device at the fleet's broker
    [policy]       name = "refed", group_by, and the policy's options   (the device file's [policy])
    [store]        max_samples (M; left out: caching ~25 % of old data), max_bytes   (the device file's [store])
    [trainer]      backend ("portable"), optimizer, lr, threads           (the device file's [trainer])
    [privacy]      mode = "local", clip_norm, noise_multiplier, delta,   (the device file's [privacy]: local DP on
                   epsilon_budget, require_secure_aggregation            every device, edge_client/privacy.py)
    [learner]      batch_size, mask_seen_classes, detect_new_tasks       (the device file's [learner]; left out,
                                                                         mask_seen_classes is the scenario kind's
                                                                         measured default, `ScenarioKind.masks`)
    [client]       epochs (10), lr, answer_wait_s, known_classes,        (the coordinator file's [client]; a
                   mask_seen_classes, fresh_optimizer                    scenario whose host learns a task, or a
                                                                         policy whose head covers the fleet's
                                                                         classes, sets known_classes = true
                                                                         unless it is given)
    [strategy]     name = "fedavg", options                              (the coordinator file's [strategy])
    [coordinator]  rounds_per_task, fraction, min_clients, deadline_s, wait_for_devices_s, max_attempts,
                   train_tasks, device, [coordinator.privacy],           (the coordinator file's keys; with
                   [coordinator.secure_aggregation],                     secure aggregation and no [guard], the
                   [coordinator.asynchronous]                            guard is off; asynchronous rounds with
                                                                         compute = "modelled": the same run twice)
    [ray]          address (a running cluster; left out: Ray on this machine), max_restarts (5)
    [adversary]    attack = "sign-flip" (firmware_sim/adversary.py), devices = 1: the last devices are compromised,
                   to see what the coordinator's settings withstand (none by default)

Every table is checked by the one config checker (`edgefil.settings`) before anything starts: the file's own keys
when it is read; then, without heavy imports (`FleetConfig.check_tables`), the policy, the attack, the round and
learner settings, the coordinator's keys, the profiles and the scenario's table; then (`FleetConfig.check`) the
strategy's options and whether the model takes the scenario's inputs. Errors are one line naming file, table and
key.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig, RoundSettings
from coordinator.guard_settings import GuardSettings
from coordinator.privacy import PrivacySettings
from coordinator.secagg import SecureAggregationSettings, config_refused, without_guard
from edge_client.config import LearnerSettings, StoreSettings, TrainerSettings
from edge_client.policies import check_policy
from edge_client.privacy import LocalPrivacySettings
from edgefil.settings import Where, build, check_options, load_toml
from edgefil.topics import check_name
from firmware_sim.adversary import AdversarySettings
from firmware_sim.fleet_ray import RaySettings, ray_module
from firmware_sim.limits import COMPUTE_MODES
from firmware_sim.profiles import load_profile
from firmware_sim.scenarios import Scenario, ScenarioData, check_scenario

# CoordinatorConfig keys the fleet sets itself; its [coordinator] table may give the others
FLEET_SETS = ("fleet", "out", "artifacts", "devices", "scenario", "test_data", "broker", "seed", "strategy",
              "client", "virtual_time", "sites")  # [coordinator] sites: the fleet file's `sites` sets them


@dataclass(frozen=True)
class FleetConfig:
    name: str
    out: Path
    devices: int
    scenario: Mapping[str, Any]
    workers: int | None = None  # None: one per core the fleet may use (a cluster's cores with backend = "ray")
    model: str = "lenet"
    model_args: Mapping[str, Any] = field(default_factory=dict)  # a user's model's constructor arguments
    seed: int = 0
    broker: str = "auto"
    tls: bool = False
    observer_reads_learning: bool = False
    policy: Mapping[str, Any] = field(default_factory=lambda: {"name": "refed"})
    store: StoreSettings | None = None  # None: M binds (the scenario's `binding_budget`: a quarter of old data)
    # portable: a worker's devices share each graph's session (edge_client/trainers/portable.py), so a device
    # costs half the memory of an ORT Training one (1.4 against 2.7 MB at 1000 devices) and a worker builds one
    # session, not one per device; it also runs on any Python a fleet host has (benchmarks/fleet_scale.py)
    trainer: TrainerSettings = TrainerSettings(backend="portable", optimizer="adamw", lr=3e-3)
    privacy: LocalPrivacySettings = LocalPrivacySettings()  # the devices' local DP (off)
    client: Mapping[str, Any] = field(default_factory=lambda: {"epochs": 10})  # E: each task learnt in its rounds
    learner: Mapping[str, Any] = field(default_factory=dict)  # the devices' [learner]; see `learner_options`
    strategy: Mapping[str, Any] = field(default_factory=lambda: {"name": "fedavg"})
    coordinator: Mapping[str, Any] = field(default_factory=dict)
    profiles: Mapping[str, int] = field(default_factory=dict)
    real_time: bool = False
    time_scale: float = 60.0
    compute: str = "measured"  # emulation: "measured" | "modelled" (firmware_sim/emulation.py)
    backend: str = "processes"  # where the workers run: processes here, or Ray actors over a cluster
    ray: RaySettings = RaySettings()
    adversary: AdversarySettings = AdversarySettings()
    # Whether the devices' writes (their state every round, their replay stores) survive a power cut of the host,
    # or only a killed worker (false: edgefil.durable `power_loss_safe`; a device of its own keeps them)
    power_loss_safe: bool = False
    sites: int = 0  # the devices split over this many sites (coordinator/sites.py); 0: none

    def __post_init__(self) -> None:
        check_name(self.name, "name")  # it names the fleet's topics: refused here, before anything starts
        if self.devices < 1 or (self.workers is not None and self.workers < 1):
            raise ValueError("devices and workers must be at least 1")
        if self.profiles and sum(self.profiles.values()) != self.devices:
            raise ValueError(f"profile counts {dict(self.profiles)} add up to {sum(self.profiles.values())}, "
                             f"not to devices = {self.devices}")
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE_MODES)}; got {self.compute!r}")
        if self.broker not in ("auto", "mosquitto", "embedded"):
            raise ValueError(f"broker must be auto, mosquitto or embedded; got {self.broker!r}")
        if self.tls and self.broker == "embedded":
            raise ValueError("tls = true needs mosquitto: the embedded broker has no TLS")
        if self.backend not in ("processes", "ray"):
            raise ValueError(f"backend must be processes or ray; got {self.backend!r}")
        if self.adversary.devices >= self.devices:
            raise ValueError(f"[adversary] devices = {self.adversary.devices}: a fleet of {self.devices} needs "
                             "at least one honest device")
        if not 0 <= self.sites <= self.devices:
            raise ValueError(f"sites must be in [0, devices = {self.devices}], got {self.sites}")
        if self.sites and (self.broker == "embedded" or self.backend == "ray"):
            raise ValueError("sites need mosquitto (their brokers bridge to the fleet's) and backend = \"processes\"")
        if self.backend == "ray" and self.ray.address is not None and self.broker == "embedded":
            raise ValueError("backend = \"ray\" on a cluster needs mosquitto: the embedded broker has no "
                             "authentication, and remote devices reach it over the network")

    def site_of(self, index: int) -> str | None:
        """The site device `index` is at (None: the fleet's broker)."""
        return f"site-{index % self.sites}" if self.sites else None

    @classmethod
    def load(cls, path: str | Path) -> FleetConfig:
        """The file's keys and types checked (ConfigError); `check()` checks what the keys name."""
        path = Path(path)
        return cls.from_dict(load_toml(path), base=path.parent, file=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: Path = Path("."), file: str = "fleet config") -> FleetConfig:
        """A fleet file's tables as a dict, checked as `load` checks a file (relative paths from `base`); without
        `out`, the run goes to runs/<name>."""
        raw = dict(raw)
        if isinstance(raw.get("name"), str) and "out" not in raw:
            raw["out"] = f"runs/{raw['name']}"
        return build(cls, raw, Where(file), base=base)

    def check_tables(self, file: str = "fleet config") -> Scenario:
        """What the tables name, as far as it is known without the heavy imports (torch, the datasets): the
        policy, the attack, the round and learner settings, the coordinator's keys, the profiles and the scenario's
        table; ConfigError (one line: file, table, key) at the first problem. The command line runs it before it
        imports the fleet, so that a typo is refused at once. Returns the checked scenario, not yet built."""
        where = Where(file)
        if self.backend == "ray":
            try:
                ray_module()
            except RuntimeError as err:
                raise where.error("backend", str(err)) from None
        check_policy(self.policy, where.inner("policy"))
        try:
            self.adversary.check_policy(str(self.policy["name"]))
        except ValueError as err:
            raise where.inner("adversary").error("attack", str(err)) from None
        build(RoundSettings, self.client, where.inner("client"))
        build(LearnerSettings, self.learner, where.inner("learner"))
        self.coordinator_options(file)
        for name in self.profiles:
            try:
                load_profile(name)
            except (ValueError, OSError) as err:
                raise where.inner("profiles").error(name, str(err)) from None
        scenario = check_scenario(self.scenario_table(), where.inner("scenario"))
        if scenario.n_clients < self.devices:
            raise where.inner("scenario").error("n_clients", f"{scenario.n_clients} shares for {self.devices} devices: "
                                                             "each device needs a share of its own")
        return scenario

    def check(self, file: str = "fleet config") -> ScenarioData:
        """Everything the tables name, before a broker or a worker starts: `check_tables`, then the strategy's
        options (its constructor's: the rules import torch) and whether the model takes the scenario's inputs.
        ConfigError (one line: file, table, key) at the first problem; the built scenario (the devices' shares are
        built from the same table, the coordinator tests on it)."""
        from coordinator.strategies import check_strategy
        from models.zoo import model_fits

        where = Where(file)
        scenario = self.check_tables(file)
        options = self.coordinator_options(file)
        check_strategy(self.strategy, where.inner("strategy"), options.get("privacy"),
                       options.get("secure_aggregation"))
        try:
            data = scenario.build()
            model_fits(self.model, data.num_classes, data.input_shape, self.model_args)
        except (ValueError, OSError, RuntimeError) as err:
            raise where.error("model", f"{self.model!r} on scenario {scenario.dataset!r}: {err}") from None
        return data

    def coordinator_options(self, file: str = "fleet config") -> dict[str, Any]:
        """The [coordinator] table checked and converted (its [guard], [limits] and [checkpoint] as their settings
        classes), for the coordinator's config; ConfigError naming the key."""
        where = Where(file).inner("coordinator")
        options = check_options(CoordinatorConfig, without_guard(self.coordinator), where, skip=FLEET_SETS)
        secure = options.get("secure_aggregation", SecureAggregationSettings())
        refused = config_refused(secure, options.get("guard", GuardSettings()).checks,
                                 options.get("privacy", PrivacySettings()).central)
        if refused is not None:
            raise where.error("secure_aggregation", refused)
        return options

    def describe(self) -> dict[str, Any]:
        """What the devices and the coordinator of this fleet run, as JSON types: written to the run folder's
        `fleet.json`, where reports read each run's policy, budget M and rule."""
        return {
            "name": self.name, "devices": self.devices, "model": self.model, "model_args": dict(self.model_args),
            "seed": self.seed,
            "scenario": dict(self.scenario), "policy": dict(self.policy),
            "store": self.store_options(),
            "trainer": vars(self.trainer), "privacy": vars(self.privacy), "learner": dict(self.learner),
            "client": dict(self.client), "strategy": dict(self.strategy), "coordinator": dict(self.coordinator),
            "profiles": dict(self.profiles), "adversary": vars(self.adversary),
        }

    def learner_options(self, data: ScenarioData) -> dict[str, Any]:
        """The devices' [learner] as set; where it leaves `mask_seen_classes` out, the scenario kind's default
        (`ScenarioKind.masks`: measured per kind, docs/results-history.md "The class mask"); where it leaves
        `between_rounds` out, "disk": a worker hosts thousands of devices, and a device that keeps its weights and
        optimiser state in memory between rounds costs ~0.36 MB more (LeNet; benchmarks/device_memory.py)."""
        return {"mask_seen_classes": data.scenario.kind_class().masks(data.scenario), "between_rounds": "disk",
                **self.learner}

    def store_options(self) -> dict[str, Any]:
        """The devices' [store] as set, unset fields left out. `store` None means the scenario's binding budget,
        which only the built scenario knows: Fleet.run sets it before anything reads this."""
        if self.store is None:
            raise RuntimeError("the fleet's [store] is not resolved yet: Fleet.run sets it from the scenario")
        return {k: v for k, v in vars(self.store).items() if v is not None}

    def scenario_table(self) -> dict[str, Any]:
        """The scenario as the devices and the coordinator build it: split into `n_clients` shares (by default one
        a device); device k holds share k."""
        return {**self.scenario, "n_clients": self.scenario.get("n_clients", self.devices)}

    @property
    def device_ids(self) -> list[str]:
        return [self.device_id(i) for i in range(self.devices)]

    @staticmethod
    def device_id(index: int) -> str:
        return f"dev-{index:03d}"

    def device_profile(self, index: int) -> str | None:
        """Device `index`'s profile (None: not emulated): the profiles' counts laid out in order. One device's
        alone: each device's config is built on its own, and a list of all of them for each was quadratic in the
        fleet's size (tens of seconds before 10,000 devices could start)."""
        for name, count in self.profiles.items():
            if index < count:
                return name
            index -= count
        return None
