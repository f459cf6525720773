"""A fleet of virtual devices on one machine: the broker, the coordinator and N device daemons.

`edgefil fleet run FLEET.toml` exports the model, starts a broker (mosquitto with a password per device and the
ACL when it is installed, else the embedded one), starts worker processes that each host many virtual devices
(every device is the real `edge_client.device.Device`, on its own thread, with its own MQTT connection, state
folder and replay store), and runs the coordinator in this process; at the end it writes the run's report
(summary.md and plots, firmware_sim/report.py). Ctrl-C, SIGTERM (systemd, `timeout`, `kill`) and SIGHUP (a closed
terminal) stop everything the same way; the coordinator's checkpoint and every device's state stay, so `--resume`
continues the run. Workers never outlive the fleet, even one killed by SIGKILL (firmware_sim/fleet_worker.py),
and a device disk still mounted by a killed run is taken back by the next one (firmware_sim/disk.py).

The fleet file, its keys and how it is checked: firmware_sim/fleet_config.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from pathlib import Path
from typing import Any

from coordinator.broker import (
    Credentials,
    EmbeddedBroker,
    MosquittoBroker,
    generate_password,
    mosquitto_path,
)
from coordinator.config import CoordinatorConfig
from coordinator.dashboard import start_dashboard
from coordinator.pki import OBSERVER, make_ca, make_server_cert
from coordinator.preparation import Preparation
from coordinator.server import Coordinator
from edge_client.config import DeviceConfig, StoreSettings
from edge_client.policies import POLICIES, split_policy
from edge_client.privacy import LocalPrivacySettings
from edge_client.trainers.base import OPTIMIZER_BUFFERS
from edge_client.trainers.choice import artifact_backends, resolve_backend
from edgefil.durable import write_atomically, write_private
from edgefil.link import BrokerSettings
from edgefil.settings import Where, build, dump_toml
from edgefil.thread_names import NamedThread
from firmware_sim import disk
from firmware_sim.adversary import OMNISCIENT
from firmware_sim.client_shares import SHARES_FOLDER, write_shares
from firmware_sim.fleet_config import FleetConfig
from firmware_sim.fleet_ray import LOOPBACK, RayWorkers
from firmware_sim.fleet_worker import (
    ADVERSARY,
    DESCRIPTORS_PER_CONNECTION,
    STOP_GRACE_S,
    DeviceFailed,
    crowded_keepalive,
    ensure_descriptors,
    fleet_heartbeat,
    fleet_log_level,
    host_devices,
    mount_disks,
    worker_count,
    worker_niceness,
)
from firmware_sim.limits import calibrate_host
from firmware_sim.profiles import load_profile
from firmware_sim.report import FLEET_FILE, write_report
from firmware_sim.scenarios import ScenarioData
from firmware_sim.sites import SimulatedSites
from models.manifest import load_manifest

log = logging.getLogger("edgefil.fleet")
STATE_SLACK_BYTES = 64 * 1024


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def coordinator_threads(workers: int) -> Iterator[None]:
    """The coordinator's torch threads while a fleet runs: the cores its `workers` leave, at least one. The workers
    share the host with it, and OpenMP threads spin-wait on a busy host: one pFedGRP aggregation of 10 MNIST-1D
    devices took 58 s at torch's default 2 threads and 15 s at 1 while a fleet ran beside it (2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, usable_cores() - workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Fleet:
    """One run of a fleet: `run()` blocks until the coordinator finishes or Ctrl-C, and always cleans up."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.scenario = config.scenario_table()
        self.passwords = {d: generate_password() for d in config.device_ids}
        self.coordinator_password = generate_password()
        self.observer_password = generate_password()
        self.broker: MosquittoBroker | EmbeddedBroker | None = None
        self.workers: ProcessWorkers | RayWorkers | None = None
        self.keepalive: int | None = None  # the clients' MQTT keepalive (None: their default), for the workers' cores
        self.heartbeat: float | None = None  # the devices' heartbeat (None: their default), for the workers' cores
        self.learner: dict[str, Any] = dict(config.learner)  # the devices' [learner], the kind's defaults in (run)
        self.first_tasks: tuple[int | None, ...] = ()  # each device's first task with data (run; None: none has)
        members: dict[str, list[str]] = {}
        for index, device in enumerate(config.device_ids):
            site = config.site_of(index)
            if site is not None:
                members.setdefault(site, []).append(device)
        self.sites = SimulatedSites(config.out, config.name, {name: tuple(d) for name, d in members.items()},
                                    self.passwords) if members else None

    def run(self, resume: bool = False, file: str = "fleet config",
            progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """The whole run; `progress` gets each round's history entry as the coordinator completes it."""
        preparing = Preparation(self.config.out)  # what the dashboard shows until the first round
        data, artifacts = self.prepare(file, preparing)
        log.info("starting %d devices on %s, then the coordinator", self.config.devices,
                 "a Ray cluster" if self.config.backend == "ray" else "worker processes")
        try:
            # mosquitto inherits the limit: a connection per device at the busiest broker (the fleet's, or a site's)
            ensure_descriptors(self._busiest_broker(), "the fleet's broker", DESCRIPTORS_PER_CONNECTION)
            safe = self.config.power_loss_safe
            self.workers = RayWorkers(self.config.ray, safe) if self.config.backend == "ray" else ProcessWorkers(safe)
            self.keepalive = crowded_keepalive(self.config.devices, self.workers.cores())
            self.heartbeat = fleet_heartbeat(self.config.devices, self.workers.cores(), DeviceConfig.heartbeat_s)
            preparing.step("starting the broker")
            self.broker = self._start_broker(self.workers.broker_host)
            self._write_observer_file(self.broker)
            if self.sites is not None and isinstance(self.broker, MosquittoBroker):
                preparing.step("starting the sites' brokers and aggregators")
                self.sites.start(self.broker, artifacts, self.config.out / "logs", self.keepalive)
            preparing.step("starting a first device, then the workers and the coordinator")
            self._check_a_device_starts(artifacts, file)
            self._start_workers(artifacts)
            try:
                coordinator = Coordinator(self._coordinator_config(artifacts), resume=resume, test_sets=data,
                                          progress=progress)
            except ValueError as err:  # a rule's options the model does not take, a damaged checkpoint: one line
                raise Where(file).error(None, f"the coordinator cannot start: {err}") from None
            # a worker gone (killed for memory, crashed) took its devices: the run ends saying so, rather than
            # waiting for them up to wall_limit_s; a device that failed to start, or stopped on an error, is out of
            # the run, which goes on without it (Coordinator.device_failed)
            self.workers.watch(coordinator.abort, coordinator.device_failed)
            with coordinator_threads(self.workers.here()):
                results = coordinator.run()
        finally:
            self._report_dropped()
            self.stop()
        written = write_report(self.config.out, results)
        return {**results, "report": str(written[0])}

    def prepare(self, file: str, preparing: Preparation) -> tuple[ScenarioData, Path]:
        """Everything before a broker or a worker starts: the fleet file checked and its scenario built, the run
        folder, every client's share, the exported model, what each device's config needs (`device_config`)."""
        preparing.step("checking the fleet file and building the scenario")
        data = self.config.check(file)  # before anything starts
        self.first_tasks = tuple(data.client_first_task(k) for k in range(self.config.devices))
        if self.config.store is None:
            self.config = dataclasses.replace(self.config, store=StoreSettings(max_samples=data.binding_budget()))
        policy, _ = split_policy(self.config.policy)
        if "known_classes" not in self.config.client and (
                any(task.host_trained for task in data.tasks) or policy.head_classes == "fleet"):
            # the host's classes never reach a device: without them its mask would hide what the model knows; a
            # head over the fleet's classes needs them named (ReplayPolicy.head_classes)
            self.config = dataclasses.replace(self.config, client={**self.config.client, "known_classes": True})
        out = self.config.out
        for folder in ("devices", "logs"):
            (out / folder).mkdir(parents=True, exist_ok=True)
        write_atomically(out / FLEET_FILE, json.dumps(self.config.describe(), indent=1).encode())
        preparing.step("writing every client's share for the workers")
        write_shares(data, out / SHARES_FOLDER)  # again on a resume: the data a folder holds may have changed
        preparing.step("exporting the model")
        artifacts = self._export(data, preparing, file)
        self.learner = self.config.learner_options(data)
        if self.config.profiles:
            preparing.step("measuring this host's speed for the devices' profiles")
        self.host_gflops = calibrate_host().gflops if self.config.profiles else None
        return data, artifacts

    def stop(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self.sites is not None:
            self.sites.stop()
        if self.broker is not None:
            self.broker.stop()

    def _report_dropped(self) -> None:
        """mosquitto drops, without telling the sender, what a client's full queue cannot take: say so."""
        if not isinstance(self.broker, MosquittoBroker):
            return
        dropped = Counter(self.broker.dropping())
        if dropped.pop("coordinator", 0):
            log.error("mosquitto dropped messages to the coordinator (its queue of %d was full): devices' updates "
                      "and statuses were lost; see %s", self.broker.max_queued_messages, self.broker.log_path)
        if dropped:
            log.warning("mosquitto dropped messages to %d devices that did not read them (their queue of %d was "
                        "full)", len(dropped), self.broker.max_queued_messages)

    # --- parts ------------------------------------------------------------------------------------

    def _export(self, data: ScenarioData, preparing: Preparation, file: str) -> Path:
        """The model's artifacts, and whatever the policy needs beside them (its `export_artifacts`; what it cannot
        export for these inputs is refused in one line naming `file`'s [policy]); the exporter's steps are
        `preparing`'s."""
        from models.export import export_registered, exportable_backends  # host only

        artifacts = self.config.out / "artifacts"
        policy, _ = split_policy(self.config.policy)
        if not (artifacts / "manifest.json").is_file():
            artifacts.mkdir(parents=True, exist_ok=True)
            # Only what the devices run: the portable graphs take seconds each to export, the others a fraction;
            # of the optional graphs, those the policy runs with its options.
            backend = resolve_backend(self.config.trainer.backend, exportable_backends())
            graphs = policy.trainer_graphs()
            export_registered(self.config.model, data.num_classes, artifacts, data.input_shape,
                              seed=self.config.seed, backends=(*artifact_backends(backend, graphs), "torch"),
                              cache=True, graphs=graphs, model_args=self.config.model_args,
                              progress=preparing.step)
        options = dict(self.config.policy)
        try:
            POLICIES.get(options.pop("name")).export_artifacts(options, artifacts, seed=self.config.seed)
        except ValueError as err:  # a network of its own that the scenario's inputs do not fit
            raise Where(file).inner("policy").error(None, str(err)) from None
        return artifacts

    def _check_a_device_starts(self, artifacts: Path, file: str) -> None:
        """Build the first device as its worker would, in a folder of its own, before anything starts: what only
        opening shows (a method's file that can never fit M, a graph the backend lacks) is refused here in one line,
        not found by a coordinator that waits for devices that never come (in virtual time, up to wall_limit_s)."""
        from firmware_sim.virtual_device import virtual_device  # lazily, as fleet_worker: the device runtime

        raw = self.device_config(0, artifacts)
        raw.pop(ADVERSARY, None)
        with tempfile.TemporaryDirectory(prefix="edgefil-device-check-") as folder:
            raw["state_dir"] = folder
            try:
                device = virtual_device(DeviceConfig.from_dict(raw))
            except (ValueError, OSError, RuntimeError) as err:
                raise Where(file).error(None, f"a device cannot start with these tables: {err}") from None
            device.learner.store.close()

    def _start_broker(self, host: str = LOOPBACK) -> MosquittoBroker | EmbeddedBroker:
        """`host`: the address it listens on (the devices' and the coordinator's to connect to)."""
        use_mosquitto = self.config.broker == "mosquitto" or (
            self.config.broker == "auto" and mosquitto_path() is not None
        )
        if not use_mosquitto and self.config.tls:
            raise RuntimeError("tls = true needs mosquitto, which is not installed (apt-get install mosquitto)")
        if not use_mosquitto and self.config.broker == "auto":
            log.warning("mosquitto is not installed: falling back to the embedded broker, which has no "
                        "authentication and no ACL (install mosquitto for passwords, the ACL and TLS)")
        tls = None
        if self.config.tls:
            folder = self.config.out / "broker" / "tls"
            folder.mkdir(parents=True, exist_ok=True)
            make_ca(folder, f"edgefil {self.config.name}")
            tls = make_server_cert(folder, sorted({LOOPBACK, host}))
        broker: MosquittoBroker | EmbeddedBroker = (
            MosquittoBroker(self.config.out / "broker", self.config.name, self._served_here(),
                            Credentials("coordinator", self.coordinator_password), tls=tls, host=host,
                            observers={OBSERVER: self.observer_password},
                            observers_read_learning=self.config.observer_reads_learning,
                            inbox_workers=self.config.coordinator_options().get("inbox_workers", 0),
                            sites=self.sites.sites() if self.sites is not None else (),
                            relayed_devices=len(self.sites.site_of) if self.sites is not None else 0)
            if use_mosquitto else EmbeddedBroker(host=host)
        )
        broker.start()
        log.info("broker: %s on port %d", type(broker).__name__, broker.address.port)
        return broker

    def _served_here(self) -> dict[str, str]:
        """The devices' accounts the fleet's own broker serves: those at no site (a site's connect to its broker)."""
        if self.sites is None:
            return self.passwords
        return {d: password for d, password in self.passwords.items() if d not in self.sites.site_of}

    def _busiest_broker(self) -> int:
        """The most devices one broker of the fleet serves: the fleet's own (the devices at no site, and each site's
        bridge) or a site's."""
        if self.sites is None:
            return self.config.devices
        at_sites = [len(devices) for devices in self.sites.members.values()]
        return max(self.config.devices - sum(at_sites) + len(at_sites), *at_sites)

    def _write_observer_file(self, broker: MosquittoBroker | EmbeddedBroker) -> None:
        """broker/observer.toml: what `edgefil watch --config` needs to follow this fleet's traffic (private)."""
        settings = self._settings(OBSERVER, self.observer_password)
        if isinstance(broker, EmbeddedBroker):  # no accounts there
            settings = {k: v for k, v in settings.items() if k not in ("username", "password")}
        folder = self.config.out / "broker"
        folder.mkdir(parents=True, exist_ok=True)
        write_private(folder / "observer.toml", dump_toml({"fleet": self.config.name, "broker": settings}))

    def _settings(self, username: str, password: str) -> dict[str, Any]:
        if self.broker is None:
            raise RuntimeError("the broker is not started")
        address = self.broker.address
        tls = {"cafile": address.cafile} if address.cafile else {}
        keepalive = {} if self.keepalive is None else {"keepalive": self.keepalive}
        return {"host": address.host, "port": address.port, "username": username, "password": password, **tls,
                **keepalive}

    def device_config(self, index: int, artifacts: Path) -> dict[str, Any]:
        device = self.config.device_id(index)
        profile = self.config.device_profile(index)
        store = self.config.store_options()
        if profile is not None:  # the store's byte budget leaves the disk room for the device's state files
            room = load_profile(profile).disk_bytes - state_reserve_bytes(artifacts, self._saved_buffers())
            store["max_bytes"] = min(store.get("max_bytes", room), room)
        emulation = {} if profile is None else {"emulation": {
            "profile": profile, "host_gflops": self.host_gflops, "real_time": self.config.real_time,
            "time_scale": 1.0 if self.config.real_time else self.config.time_scale,
            "availability_clock": "wall" if self.config.real_time else "fleet", "compute": self.config.compute,
        }}
        attack = self.config.adversary.of(index, self.config.devices)
        honest = range(self.config.adversary.honest(self.config.devices))
        adversary = {} if attack is None else {ADVERSARY: {
            "attack": attack, "fleet_size": self.config.devices, "colluders": self.config.adversary.devices,
            "peers": [(str(self.config.out / "devices" / self.config.device_id(k)), first)
                      for k in honest if (first := self.first_tasks[k]) is not None],
            "wait_all": self.config.coordinator_options().get("fraction", 1.0) >= 1.0 and not self.config.profiles}}
        return {
            **emulation, **adversary, **({} if profile is None else {"profile": profile}),  # what it registers as
            "device_id": device, "fleet": self.config.name, "artifacts": str(artifacts),
            # each device exits when the run ends, saying so (offline), which the run's record then shows; the fleet
            # stops its workers after that
            "on_end": "exit",
            **({} if self.heartbeat is None else {"heartbeat_s": self.heartbeat}),
            "state_dir": str(self.config.out / "devices" / device),
            "broker": self._settings(device, self.passwords[device]) if self.sites is None or device not in
            self.sites.site_of else self.sites.settings(self.sites.site_of[device], device, self.passwords[device],
                                                        self.keepalive),
            "trainer": vars(self.config.trainer), "learner": self.learner, "store": store,
            "policy": dict(self.config.policy),
            **({"privacy": vars(self.config.privacy)} if self.config.privacy != LocalPrivacySettings() else {}),
            "data": {"scenario": self.scenario, "client": index, "shares": str(self.config.out / SHARES_FOLDER)},
        }

    def _saved_buffers(self) -> int:
        """The parameter-sized buffers a device saves: its weights, and its optimiser's state when it parks it."""
        on_disk = self.learner.get("between_rounds") == "disk"
        return 1 + (len(OPTIMIZER_BUFFERS[self.config.trainer.optimizer]) if on_disk else 0)

    def _start_workers(self, artifacts: Path) -> None:
        if self.workers is None:
            raise RuntimeError("no workers to start")
        configs = [self.device_config(i, artifacts) for i in range(self.config.devices)]
        count = worker_count(self.config.workers, self.config.devices, self.workers.cores())
        groups = [configs[k::count] for k in range(count)]
        if self.config.adversary.attack in OMNISCIENT:  # they wait for the honest updates: in a worker of their own
            honest = configs[:self.config.adversary.honest(self.config.devices)]
            groups = [group for group in (honest[k::count] for k in range(count)) if group]
            groups.append(configs[len(honest):])
        self.workers.start(groups, artifacts, self.config.out / "logs",
                           worker_niceness(self.config.devices, self.workers.cores()))

    def _coordinator_config(self, artifacts: Path) -> CoordinatorConfig:
        return CoordinatorConfig(
            fleet=self.config.name, out=self.config.out, artifacts=artifacts,
            devices=tuple(self.config.device_ids), scenario=self.scenario,
            broker=build(BrokerSettings, self._settings("coordinator", self.coordinator_password), Where("fleet")),
            seed=self.config.seed, strategy=dict(self.config.strategy), client=dict(self.config.client),
            virtual_time=not self.config.real_time,
            sites=self.sites.for_coordinator() if self.sites is not None else (),
            **self.config.coordinator_options(),
        )


EXIT_CODE_WAIT_S = 5.0  # how long `ProcessWorkers.watch` waits for an ended worker's exit code to be there


class ProcessWorkers:
    """The fleet's workers as processes on this machine (firmware_sim/fleet_worker.py): spawned by `start`, told
    to stop (and terminated past a grace period) by `stop`; the emulated devices' disks are mounted here first."""

    broker_host = LOOPBACK

    def __init__(self, power_loss_safe: bool = False) -> None:
        """`power_loss_safe`: whether the devices' writes survive a power cut of this machine (`serve_devices`)."""
        self.power_loss_safe = power_loss_safe
        # the word to stop: a pipe whose writing end `stop` closes, which every worker (and `watch`) sees as its end.
        # Not a multiprocessing Event: a worker killed while it waited on one (as the kernel kills for memory) left
        # its Condition counting a sleeper that never wakes, and the fleet's `set` waited for it forever
        self._stop_heard, self._stop_said = mp.get_context("spawn").Pipe(duplex=False)
        self.processes: list[mp.process.BaseProcess] = []
        self._devices: list[list[str]] = []  # each worker's devices, in the order of `processes`
        self._failures: list[Connection] = []  # each worker's word on its devices out of the run (`watch`)
        self._watching: threading.Thread | None = None
        self._mounted: list[Path] = []
        self._stopping = False

    def cores(self) -> int:
        """The cores the workers run on: those this process may run on."""
        return usable_cores()

    def start(self, shares: list[list[dict[str, Any]]], artifacts: Path, logs: Path, niceness: int = 0) -> None:
        """A worker process for each share of device configs, `niceness` nicer than this one (`serve_devices`)."""
        # what each worker checks at its start, checked here first: a worker refused there died with the line in its
        # log, and the coordinator waited for its devices until wall_limit_s
        ensure_descriptors(max(map(len, shares), default=0), "a fleet worker")
        self._mounted = mount_disks([raw for share in shares for raw in share])
        context = mp.get_context("spawn")
        for k, share in enumerate(shares):
            heard, said = context.Pipe(duplex=False)
            worker = context.Process(target=host_devices, daemon=True, args=(
                share, self._stop_heard, str(logs / f"worker-{k}.log"), self.power_loss_safe, niceness,
                fleet_log_level(), said))
            worker.start()
            said.close()  # the worker's end: once it is gone, its pipe reads as ended
            self.processes.append(worker)
            self._devices.append([raw["device_id"] for raw in share])
            self._failures.append(heard)

    def here(self) -> int:
        """How many of the workers run on this machine (beside the coordinator)."""
        return len(self.processes)

    def watch(self, gone: Callable[[str, list[str]], None], failed: DeviceFailed) -> None:
        """From a thread of its own until `stop`: call `failed` with each device a worker says is out of the run and
        why (`serve_devices`), and `gone` with a line and the worker's devices if a worker ends. Waits on the
        workers' pipes, the processes' sentinels and the word to stop (no polling)."""
        sentinels = {worker.sentinel: k for k, worker in enumerate(self.processes)}
        failures = list(self._failures)

        def wait() -> None:
            while True:
                ended = wait_for_ready([*failures, *sentinels, self._stop_heard])
                if self._stopping:
                    return
                for pipe in [p for p in failures if p in ended]:  # first: a device's word may precede its end
                    heard(pipe)
                dead = [sentinels[s] for s in ended if s in sentinels]
                if dead:
                    k = dead[0]
                    break
            self.processes[k].join(EXIT_CODE_WAIT_S)  # its sentinel may be ready a moment before its exit code
            gone(f"fleet worker {k} ended (exit code {self.processes[k].exitcode}) and its devices with it: "
                 f"its log, logs/worker-{k}.log, says why", self._devices[k])

        def heard(pipe: Connection) -> None:
            try:
                device, why = pipe.recv()
            except (EOFError, OSError):  # the worker ended: its sentinel says so
                failures.remove(pipe)
                return
            failed(device, why)

        self._watching = NamedThread(target=wait, daemon=True, name="worker-watch")
        self._watching.start()

    def stop(self) -> None:
        """Stop every worker, within STOP_GRACE_S for all of them together (then terminated)."""
        self._stopping = True
        self._stop_said.close()
        deadline = time.monotonic() + STOP_GRACE_S
        for k, worker in enumerate(self.processes):
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                log.warning("worker %d had not stopped within %.0f s: terminated (its devices' stores are crash-safe)",
                            k, STOP_GRACE_S)
                worker.terminate()
        if self._watching is not None:  # woken by the word to stop: done with the pipes before they close
            self._watching.join(EXIT_CODE_WAIT_S)
        while self._failures:
            self._failures.pop().close()
        while self._mounted:
            disk.unmount(self._mounted.pop())


def state_reserve_bytes(artifacts: Path, saved_buffers: int = 1) -> int:
    """Disk a device needs beside its store: two files of each of the `saved_buffers` parameter-sized buffers it
    saves (edgefil.durable's two slots: the weights, and the optimiser's state where it saves it) plus room for its
    two records and file-system blocks."""
    return 2 * saved_buffers * 4 * load_manifest(artifacts).num_parameters + STATE_SLACK_BYTES


def run_fleet_file(path: str | Path, resume: bool = False, address: str | None = None,
                   dashboard: str | None = None) -> dict[str, Any]:
    """`edgefil fleet run FLEET.toml [--resume] [--address A] [--dashboard [HOST:]PORT]`: the run's results, plus
    the path of its report; `address`: the workers go to that Ray cluster; `dashboard`: serve the run's dashboard
    there while it runs. The command line turns SIGTERM and SIGHUP into KeyboardInterrupt, so they stop it as
    Ctrl-C does (the clean-up runs, the run can be resumed)."""
    config = FleetConfig.load(path)
    if address is not None:
        config = dataclasses.replace(config, backend="ray", ray=dataclasses.replace(config.ray, address=address))
    fleet = Fleet(config)
    served = None
    if dashboard is not None:
        config.out.mkdir(parents=True, exist_ok=True)
        served = start_dashboard(config.out, dashboard)
    try:
        return fleet.run(resume=resume, file=str(path))
    except KeyboardInterrupt as stop:
        log.warning("stopped (%s); the run resumes with: edgefil fleet run %s --resume", stop or "Ctrl-C", path)
        raise
    finally:
        if served is not None:
            served.stop()
