"""A fleet across machines: its workers as Ray actors placed over a cluster's nodes (`backend = "ray"`).

The devices run exactly as in a local fleet (`fleet_worker.serve_devices`: the real device daemon, one network
loop per worker carrying all its devices' MQTT connections); only where a worker runs changes. The fleet process
(the Ray driver) keeps the broker and the coordinator on its own node, the head node or a GPU node, and places
`workers` actors, a core each (a share of one where they outnumber the cores), spread over the nodes. Ray needs
the `ray` extra (`pip install 'edgefil[ray]'`) and edgefil installed on every node.

- **Where the broker listens.** On a cluster, on the address the driver's node has in it (remote devices connect
  there: mosquitto's passwords and ACL guard it, and the embedded broker, which has neither, is refused); with Ray
  started on this machine (no `address`), on loopback.
- **Files on a node.** Each device keeps its state under the fleet's `out/devices/<id>` on the node it runs on
  (its own disk, or a share every node mounts), each worker its log under `out/logs/`. The model's artifacts go to
  every worker with its devices and are written to `out/artifacts` on its node where they differ.
- **Emulated profiles** are scaled by the speed of the node a worker runs on: each worker measures its node
  (`limits.calibrate_host`) and mounts its devices' disks there.
- **A node that dies.** Its workers are started again on the nodes left (`[ray] max_restarts` times each, where a
  free core is); their devices reconnect and register, with the state their node's `out` still holds, and the
  coordinator's rounds go on without them meanwhile (deadlines, quorum, retries: coordinator/server.py).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefil.durable import write_atomically
from edgefil.logs import error_line
from edgefil.thread_names import NamedThread
from firmware_sim.fleet_worker import (
    LOG_FORMAT,
    STOP_GRACE_S,
    DeviceFailed,
    fleet_log_level,
    mount_disks,
    serve_devices,
)

log = logging.getLogger("edgefil.fleet")
LOOPBACK = "127.0.0.1"
WATCH_EVERY_S = 1.0  # how often `watch` asks Ray whether a worker ended (a wait that nothing else can wake)


@dataclass(frozen=True)
class RaySettings:
    """`[ray]` of a fleet file (used with `backend = "ray"`)."""

    address: str | None = None  # a running cluster: "auto", "host:port" or "ray://host:10001"; None: Ray here
    max_restarts: int = 5  # how often a worker whose node died is started again elsewhere (-1: always)

    def __post_init__(self) -> None:
        if self.max_restarts < -1:
            raise ValueError("max_restarts must be -1 (always) or at least 0")


class DeviceHost:
    """One worker as a Ray actor: hosts its share of the devices on the node Ray placed it on. Threaded (Ray's
    `max_concurrency`), so `stop` and `node` are answered while `host` runs."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._failed: list[tuple[str, str]] = []  # its devices out of the run, and why, until `failures` takes them
        self._failed_lock = threading.Lock()

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def host(self, configs: list[dict[str, Any]], artifacts: dict[str, bytes], log_file: str,
             power_loss_safe: bool, niceness: int = 0, log_level: int = logging.INFO) -> str:
        """Until `stop`: measure this node for the emulated devices, write the artifacts where this node lacks
        them, mount the emulated disks, serve the devices; the node's id at the end. Its log, `log_file`, at
        `log_level` (`fleet_log_level`)."""
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(log_level)
        if any("emulation" in raw for raw in configs):  # emulated device time scales with this node's speed
            from firmware_sim.limits import calibrate_host

            gflops = calibrate_host().gflops
            configs = [{**raw, "emulation": {**raw["emulation"], "host_gflops": gflops}} if "emulation" in raw
                       else raw for raw in configs]
        folder = Path(configs[0]["artifacts"])
        for name, data in artifacts.items():
            path = folder / name
            if not path.is_file() or path.read_bytes() != data:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(path, data)
        mounted = mount_disks(configs)
        try:
            serve_devices(configs, self._stop.wait, power_loss_safe, niceness, failed=self._out_of_the_run)
        finally:
            from firmware_sim import disk

            for path in mounted:
                disk.unmount(path)
            logging.getLogger().removeHandler(handler)
            handler.close()
        return self.node()

    def stop(self) -> None:
        self._stop.set()

    def failures(self) -> list[tuple[str, str]]:
        """The devices out of the run since the last call, each with why (`serve_devices`); taken, not copied, so
        that an actor started again after its node died tells only its own."""
        with self._failed_lock:
            taken, self._failed = self._failed, []
        return taken

    def _out_of_the_run(self, device: str, why: str) -> None:
        with self._failed_lock:
            self._failed.append((device, why))


def ray_module() -> Any:
    """Ray, or a one-line error naming the extra that brings it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend = \"ray\" needs Ray: pip install 'edgefil[ray]'") from None
    return ray


def refuse_unreachable(address: str | None, timeout_s: float = 10.0) -> None:
    """A one-line ConnectionError when nothing listens at a `host:port` (or `ray://host:port`) address: Ray's
    own connect retries for minutes on end. "auto" and None are Ray's to resolve."""
    if address is None or address in ("auto", "local"):
        return
    try:
        answer(address, timeout_s)
    except OSError as err:
        raise ConnectionError(f"no Ray cluster answers at {address} ({err.strerror or err})") from None


def answer(address: str, timeout_s: float) -> None:
    """Connect to a Ray `host:port` (or `ray://host:port`) address and close again: OSError where nothing
    listens, ValueError for an address of another form."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"[ray] address must be auto, HOST:PORT or ray://HOST:PORT; got {address!r}")
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()


def here_address(timeout_s: float = 2.0) -> str | None:
    """What "Ray on this machine" (`address` left out) passes to `ray.init`: None, Ray's own choice (the cluster
    running on this machine, else a new one), or "local" (a new one) where Ray's file of the machine's cluster names
    one that does not answer: a Ray killed before it cleaned up leaves the file, and `ray.init` then waits minutes for
    the dead cluster instead of starting one (seen: a killed test's cluster; Flower's simulation crashed on it)."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    try:
        from ray._common.utils import get_ray_address_file  # Ray's own rule for where the file is (2.55)

        named = Path(get_ray_address_file(None)).read_text().strip()
    except (ImportError, OSError):
        return None
    try:
        answer(named, timeout_s)
    except (OSError, ValueError):
        log.warning("Ray's file of this machine's cluster names %s, where none answers (a Ray that did not stop "
                    "cleanly): starting a new one", named)
        return "local"
    return None


class RayWorkers:
    """The fleet's workers on a Ray cluster: joined (or Ray started here) when made, left by `stop`."""

    def __init__(self, settings: RaySettings, power_loss_safe: bool = False) -> None:
        """`power_loss_safe`: whether the devices' writes survive a power cut of their node (`serve_devices`)."""
        self.settings = settings
        self.power_loss_safe = power_loss_safe
        self._ray = ray = ray_module()
        self._joined = not ray.is_initialized()
        if self._joined:
            refuse_unreachable(settings.address)
            address = settings.address if settings.address is not None else here_address()
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=False)
        self._actors: list[Any] = []
        self._devices: list[list[str]] = []  # each worker's devices, in the order of `_actors`
        self._hosting: list[Any] = []
        self._stopping = threading.Event()

    @property
    def broker_host(self) -> str:
        """Where the broker listens: the driver node's address in the cluster, loopback when Ray runs here only."""
        if self.settings.address is None:
            return LOOPBACK
        here = self._ray.get_runtime_context().get_node_id()
        return str(next(n["NodeManagerAddress"] for n in self._ray.nodes() if n["NodeID"] == here))

    def cores(self) -> int:
        """The cores the workers run on: the cluster's."""
        return int(self._ray.cluster_resources().get("CPU", 1))

    def start(self, shares: list[list[dict[str, Any]]], artifacts: Path, logs: Path, niceness: int = 0) -> None:
        """An actor hosting each share of device configs, `niceness` nicer than it starts (`serve_devices`)."""
        files = {str(p.relative_to(artifacts)): p.read_bytes() for p in sorted(artifacts.rglob("*")) if p.is_file()}
        shipped = self._ray.put(files)
        # a core each; more workers than cores share them (as worker processes would), so none waits unplaced
        actor = self._ray.remote(
            num_cpus=min(1.0, self.cores() / len(shares)), max_concurrency=4,
            max_restarts=self.settings.max_restarts, max_task_retries=-1,
            scheduling_strategy="SPREAD",
        )(DeviceHost)
        for k, share in enumerate(shares):
            host = actor.remote()
            self._actors.append(host)
            self._devices.append([raw["device_id"] for raw in share])
            self._hosting.append(host.host.remote(share, shipped, str(logs / f"worker-{k}.log"),
                                                  self.power_loss_safe, niceness, fleet_log_level()))

    def placement(self, timeout: float = 60.0) -> list[str]:
        """The node id each worker runs on now, in worker order (waiting for the ones not placed yet)."""
        return [str(n) for n in self._ray.get([a.node.remote() for a in self._actors], timeout=timeout)]

    def here(self, timeout: float = 30.0) -> int:
        """How many of the workers run on this node (beside the coordinator): those placed within `timeout`."""
        ready, _ = self._ray.wait([a.node.remote() for a in self._actors], num_returns=len(self._actors),
                                  timeout=timeout)
        return [str(n) for n in self._ray.get(ready)].count(self._ray.get_runtime_context().get_node_id())

    def watch(self, gone: Callable[[str, list[str]], None], failed: DeviceFailed) -> None:
        """From a thread of its own until `stop`: call `failed` with each device a worker says is out of the run and
        why (`serve_devices`), and `gone` with a line and the worker's devices if a worker ends (its restarts spent,
        or failing). Ray's wait has no wake-up, so the thread asks every WATCH_EVERY_S."""
        hosting, actors = list(self._hosting), list(self._actors)
        asked: dict[int, Any] = {}  # each worker's `failures` call not answered yet: its answer is never dropped

        def tell_failures() -> None:
            for k, actor in enumerate(actors):
                if k not in asked:
                    asked[k] = actor.failures.remote()
            if not asked:
                return
            answered, _ = self._ray.wait(list(asked.values()), num_returns=len(asked), timeout=0)
            for k, ref in list(asked.items()):
                if ref not in answered:
                    continue
                del asked[k]
                try:
                    told = self._ray.get(ref)
                except Exception:  # a worker started again, or gone: the wait for its end says so
                    continue
                for device, why in told:
                    failed(device, why)

        def wait() -> None:
            ended: list[Any] = []
            while not ended and not self._stopping.is_set():
                ended, _ = self._ray.wait(hosting, num_returns=1, timeout=WATCH_EVERY_S)
                tell_failures()
            if self._stopping.is_set():
                return
            k = hosting.index(ended[0])
            try:
                self._ray.get(ended[0])
                why = "returned"
            except Exception as err:
                why = error_line(err)
            gone(f"fleet worker {k} ended ({why}) and its devices with it: its log, logs/worker-{k}.log, says more",
                 self._devices[k])

        NamedThread(target=wait, daemon=True, name="worker-watch").start()

    def stop(self) -> None:
        self._stopping.set()
        ray = self._ray
        for actor in self._actors:
            actor.stop.remote()
        ready, pending = ray.wait(self._hosting, num_returns=len(self._hosting), timeout=STOP_GRACE_S + 15)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as err:  # a worker lost for good (restarts spent) or failing: said, not raised
                log.warning("a fleet worker ended with %s", err)
        if pending:
            log.warning("%d fleet workers did not stop within %.0f s: killed", len(pending), STOP_GRACE_S + 15)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors, self._hosting = [], []
        if self._joined:
            ray.shutdown()
