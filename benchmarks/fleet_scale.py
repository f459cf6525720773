"""Fleet scale: host memory per virtual device and the coordinator's round overhead as the fleet grows.

For each fleet size N (default 10, 50, 200) this runs a whole fleet in this process through the library API
(`firmware_sim.fleet.Fleet`: broker, `--workers` worker processes hosting the N real `Device`s, the coordinator
here), on the embedded digits class-incremental scenario cut to one task (`n_tasks = 1`, two classes, the
~270 training samples split over the N clients), `--rounds` rounds, every device selected every round
(`fraction = 1`; `min_clients` = the devices that hold data: past ~270 devices some hold none, say so and are
not selected), random replay with M = `--replay-m`, one local epoch, the coordinator's guard without
Krum selection (`--guard defaults`: with it), no emulation (devices train at the host's speed). The total training data is the same at every N, so the devices' summed training
work per round stays about constant and what grows with N is overhead. With `--per-device K` the data grow with the
fleet instead: MNIST-1D (the cnn1d model) generated (once, then cached) for about K training samples a device, one task of all 10
classes, so (nearly) every device trains, as in a fleet whose every device collects data, and the round time per
device is the cost of one device's whole round.

Instrumentation lives here only: a `Fleet` subclass notes when the workers start and samples memory just before
the fleet stops, and a `Coordinator` subclass (swapped into `firmware_sim.fleet` for the run) times each round's
phases and every registration. Devices' own training times come from their `trained round` log lines and the
`device_seconds` they report (their training thread's CPU time).

Memory: PSS (/proc/<pid>/smaps_rollup, shared pages split between the processes sharing them) and RSS summed
over the worker processes, sampled once all N devices registered and again after the last round. Per device:
  total/N    the workers' PSS after the rounds divided by N (includes each worker's fixed cost: Python and its
             imports, so it is an upper bound that falls with N);
  net/N      (that PSS minus the PSS of as many idle worker processes, importing the same modules) / N;
  marginal   (PSS(N) - PSS(previous N)) / (N - previous N): the cost of one more device.
Round overhead: wall = coordinator opens the round (encodes and publishes the weights and N round messages)
until its close (aggregate, evaluate, checkpoint; the run's files are written once the next round is open)
returns. floor = the devices' training CPU time packed onto the host's cores: max(slowest device, sum of devices /
cores); overhead = wall - floor, everything that is not training (the coordinator, the broker, MQTT and the
devices' protocol work, scheduling). ratio is the median wall at N over the median wall at the first N (same
broker). Round time per device: the median wall over N at each N, with the wall each added device adds, whether
the first is flat within FLAT_WITHIN (1.2x) across the sizes, and the least-squares line wall = fixed + per device
x N over the sizes. With `--per-device` also the host's speed while each size ran (the devices' training CPU a
sample: the same work at every N) and the round time per device in those units (`per_device`). With `--passes K`
the sizes run K times, ascending then descending in turn, each pass's tables printed, then each size's round time
per device, the fleet's CPU per device and the training share in every pass and their medians, and the flatness of
the round time's medians (`across_passes`): a host whose speed drifts over the run weighs on every size alike.
CPU per round, by process, from /proc/<pid>/stat: the coordinator is this process (with `--broker embedded` the
amqtt broker runs here too, so its CPU counts as the coordinator's and its broker columns stay empty); the
devices' training as a share of the fleet's CPU (TRAINING_SHARE, 60 %, the target), and that share's
ceiling, were the devices' work besides training none at all (what the coordinator's and broker's work leave). "other
procs" is the host's busy CPU outside the fleet during the round (/proc/stat): on a shared machine, anything
above zero slowed the round. An idle window (`--idle-s`, after all devices registered, before round 1) measures
what an idle fleet costs: heartbeats, keepalives, MQTT threads. A run of at least LONG_RUN rounds also prints the
wall and the coordinator's CPU a round in its first and last rounds: what grows with the rounds.
Startup: from the first worker process start until the N-th registration reached the coordinator.
Profile (`--profile TOP`, needs yappi): every worker process and the coordinator's run yappi's CPU-clock profiler
over all their threads from round 2's open (round 1 also stores the task's data; round 1 where it is the only one)
to the last round's close (a worker starts and stops on a signal the
benchmark sends it); printed per side, the TOP functions by their own CPU time and the project's TOP functions by
their time with what they called, as microseconds per device-round, with calls per device-round. The profiler slows what it measures (several times
over, most where calls are many and short), so the timing and CPU tables of a profiled run do not stand for an
unprofiled one: profile in a run of its own.
Host profile (`--perf TOP`, needs perf and root): `perf record -a` over the last round, open to close, read back
per process (coordinator, broker, workers), per library and, in the kernel, per system call and function: the TOP
of each (benchmarks/host_profile.py). perf's sampling costs the host little (199 Hz a CPU); its tables are shares.

    .venv/bin/python benchmarks/fleet_scale.py [--devices 10,50,200] [--rounds 3] [--passes 1]
        [--workers N (default: the fleet's, one per core)] [--backend ort|portable|torch (default: the fleet's)]
        [--broker mosquitto,embedded] [--replay-m 50] [--between-rounds memory|disk (default: the fleet's)]
        [--per-device 0] [--idle-s 10] [--worker-log-level INFO] [--out DIR] [--keep] [--json FILE] [--profile TOP]
        [--perf TOP]

Keep this module's top level free of library imports: the workers are spawned processes, and spawn imports
the main module (this file) again in every one of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from host_profile import HostProfile  # its top level imports the standard library only

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
LONG_RUN = 9  # rounds from which a run's first and last rounds are compared (`over_rounds`)
# issue 57's targets: the devices' training at least this share of the fleet's CPU, and the round time per device
# flat within this factor across the sizes
TRAINING_SHARE = 0.6
FLAT_WITHIN = 1.2
MB = 1024 * 1024
PROFILE_ENV = "FLEET_SCALE_PROFILE"  # a folder: the spawned workers profile their rounds into it (`--profile`)


# --- /proc probes ---------------------------------------------------------------------------------

def memory_of(pid: int) -> dict[str, float]:
    """Rss, Pss, private and anonymous bytes (smaps_rollup), threads and open descriptors of one process."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
        status = Path(f"/proc/{pid}/status").read_text()
        out["threads"] = int(status.split("Threads:", 1)[1].split()[0])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, IndexError):
        pass
    return out


def resident_mb() -> float:
    """This process's resident memory, MB (/proc/self/statm: cheap enough for every round's close)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_sum(pids: list[int]) -> dict[str, float]:
    total: dict[str, float] = {}
    for pid in pids:
        for key, value in memory_of(pid).items():
            total[key] = total.get(key, 0) + value
    return total


def cpu_of(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0.0, 0.0
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def host_busy() -> float:
    """CPU seconds all the host's cores have been busy (not idle, not waiting for I/O) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK


def idle_worker(ready, stop, backend: str) -> None:  # noqa: ANN001 (spawned target)
    """A worker with no devices: the imports a fleet worker makes (firmware_sim.fleet_worker, to unpickle its
    target `host_devices`, then edge_client.device and the trainer of `backend`, which the first device loads)."""
    import importlib

    import firmware_sim.fleet_worker  # noqa: F401
    from edge_client.device import Device  # noqa: F401

    importlib.import_module({"ort": "edge_client.trainers.ort", "portable": "edge_client.trainers.portable",
                             "torch": "edge_client.trainers.pytorch"}[backend])

    ready.set()
    stop.wait()


def idle_workers_memory(count: int, backend: str) -> dict[str, float]:
    """Summed memory of `count` device-less workers alive together (so they share pages as the real ones do)."""
    context = mp.get_context("spawn")
    stop = context.Event()
    procs, readies = [], []
    for _ in range(count):
        ready = context.Event()
        proc = context.Process(target=idle_worker, args=(ready, stop, backend), daemon=True)
        proc.start()
        procs.append(proc)
        readies.append(ready)
    for ready in readies:
        ready.wait(120)
    time.sleep(0.5)
    memory = memory_sum([p.pid for p in procs])
    stop.set()
    for proc in procs:
        proc.join(10)
    return memory


def maps_library(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return False


class ForeignLogCounter(logging.Handler):
    """Counts (instead of printing) this process's log records from outside edgefil, e.g. the embedded broker's
    (amqtt, asyncio) tracebacks, by logger, message and exception."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        first = re.sub(r"\d+", "#", (record.getMessage().splitlines() or [""])[0])  # packet ids, ports, ...
        what = f"{record.name} {record.levelname}: {first[:80]}"
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            what += f" ({type(error).__name__}: {str(error)[:80]})"
        self.counts[what] = self.counts.get(what, 0) + 1

    def take(self) -> list[tuple[int, str]]:
        counts, self.counts = self.counts, {}
        return sorted(((n, what) for what, n in counts.items()), reverse=True)


FOREIGN = ForeignLogCounter()


# --- the profile (`--profile`) ------------------------------------------------------------------------

def profile_on_signals(folder: Path) -> None:
    """In a worker: start yappi (CPU clock, every thread) on SIGUSR1, and on SIGUSR2 stop it and save what it
    measured to `folder`/worker-<pid>.pstat. The handlers run on the worker's main thread, which only waits."""
    import signal

    import yappi

    def start(*_: object) -> None:
        yappi.set_clock_type("cpu")
        yappi.start(builtins=True, profile_threads=True)

    def stop(*_: object) -> None:
        yappi.stop()
        yappi.get_func_stats().save(str(folder / f"worker-{os.getpid()}.pstat"), type="pstat")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


@dataclass
class Profiler:
    """The rounds' profile of one fleet run: this process (the coordinator) and every worker, from the first profiled
    round's open to the last round's close."""

    folder: Path
    first_round: int  # the second, where there are two or more: round 1 also stores the task's data
    last_round: int
    workers: list[int] = field(default_factory=list)
    running: bool = False

    def start(self, workers: list[int]) -> None:
        import signal

        import yappi

        self.workers, self.running = list(workers), True
        for pid in self.workers:
            os.kill(pid, signal.SIGUSR1)
        yappi.set_clock_type("cpu")
        yappi.start(builtins=True, profile_threads=True)

    def stop(self) -> None:
        import signal

        import yappi

        if not self.running:
            return
        self.running = False
        yappi.stop()
        yappi.get_func_stats().save(str(self.folder / "coordinator.pstat"), type="pstat")
        yappi.clear_stats()
        for pid in self.workers:
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 120
        while (len(list(self.folder.glob("worker-*.pstat"))) < len(self.workers)
               and time.monotonic() < deadline):
            time.sleep(0.2)


def print_profile(folder: Path, device_rounds: int, top: int) -> None:
    """Per side (the workers summed, the coordinator), the `top` functions by own CPU time, per device-round."""
    import pstats

    for side, pattern in (("workers", "worker-*.pstat"), ("coordinator", "coordinator.pstat")):
        files = sorted(folder.glob(pattern))
        if not files:
            print(f"\nprofile, {side}: none saved")
            continue
        stats = pstats.Stats(str(files[0]))
        for file in files[1:]:
            stats.add(str(file))
        rows = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, calls, own, cumulative, callers)}
        total = sum(own for _, _, own, _, _ in rows.values())
        print(f"\nprofile, {side} ({len(files)} process{'es' if len(files) > 1 else ''}): {total:.1f} CPU-s "
              f"profiled over {device_rounds} device-rounds, {total / device_rounds * 1e6:.0f} us a device-round; "
              f"the top {top}, in us a device-round")
        ours = {key: row for key, row in rows.items() if key[0].startswith(str(ROOT) + "/")}
        for title, chosen, column in (("by own time", rows, 2), ("the project's own functions, by time with calls",
                                                                   ours, 3)):
            print(f"{title}:\n{'own':>8}{'with calls':>12}{'calls':>8}  function")
            for (file, line, name), (_, calls, own, cumulative, _) in sorted(
                    chosen.items(), key=lambda item: -item[1][column])[:top]:
                where = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", file).replace(str(ROOT) + "/", "")
                print(f"{own / device_rounds * 1e6:8.1f}{cumulative / device_rounds * 1e6:12.1f}"
                      f"{calls / device_rounds:8.2f}  {name} ({where}:{line})")


# --- one fleet run ----------------------------------------------------------------------------------

@dataclass
class Round:
    number: int
    selected: int
    opened: float = 0.0          # time.time() at _open's start
    sent: float = 0.0            # _open returned: weights and round messages handed to paho
    last_update: float = 0.0     # the last update accepted
    close_start: float = 0.0
    closed: float = 0.0
    evaluate_s: float = 0.0
    attempts: int = 1
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds spent during the round, by process
    coordinator_mb: float = 0.0  # this process's resident memory once the round closed


@dataclass
class Probe:
    devices: int
    idle_s: float = 0.0                   # the idle window after all registered (0: none)
    idle_cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per second in that window
    heartbeat_s: float = 5.0              # the devices' heartbeat, as the fleet set it
    started: float = 0.0                  # Fleet.run called
    workers_started: float = 0.0          # first worker process started
    first_registered: float = 0.0
    all_registered: float = 0.0
    worker_pids: list[int] = field(default_factory=list)
    broker_pid: int | None = None
    rounds: dict[int, Round] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    broker_memory: dict[str, dict[str, float]] = field(default_factory=dict)
    profiler: Profiler | None = None
    host_profile: HostProfile | None = None  # `--perf`: the last round, recorded
    last_round: int = 0
    inbox: list[int] = field(default_factory=list)  # the coordinator's inbox workers' pids (`--inbox-workers`)
    aggregators: list[int] = field(default_factory=list)  # the sites' aggregators' pids (`--sites`) ...
    site_brokers: list[int] = field(default_factory=list)  # ... and their brokers'

    def snapshot(self, moment: str) -> None:
        self.memory[moment] = memory_sum(self.worker_pids)
        self.memory[moment]["libtorch"] = float(all(maps_library(p, "libtorch_cpu") for p in self.worker_pids))
        if self.broker_pid is not None:
            self.broker_memory[moment] = memory_of(self.broker_pid)

    def roles(self) -> dict[int, str]:
        """The fleet's processes by pid, named for the host profile."""
        return {os.getpid(): "coordinator", **{pid: "inbox/sites" for pid in [*self.inbox, *self.aggregators]},
                **{pid: "broker" for pid in [*([self.broker_pid] if self.broker_pid else []), *self.site_brokers]},
                **{pid: "workers" for pid in self.worker_pids}}

    def cpu(self) -> dict[str, float]:
        workers = [cpu_of(pid) for pid in self.worker_pids]
        inbox = sum(sum(cpu_of(pid)) for pid in [*self.inbox, *self.aggregators])
        return {
            # this process (the coordinator and its MQTT thread) and what takes its per-update work where the fleet
            # has them: its inbox workers' processes, the sites' aggregators
            "coordinator": time.process_time() + inbox,
            # the fleet's broker, and the sites' brokers where it has sites
            "broker": sum(sum(cpu_of(pid)) for pid in [*([self.broker_pid] if self.broker_pid else []),
                                                       *self.site_brokers]),
            "workers": sum(u + s for u, s in workers),
            "workers_sys": sum(s for _, s in workers),
            "host": host_busy(),
            # of the coordinator's and the broker's columns, the sites' share (counted in them above)
            "aggregators": sum(sum(cpu_of(pid)) for pid in self.aggregators),
            "site_brokers": sum(sum(cpu_of(pid)) for pid in self.site_brokers),
        }


def instrumented_classes(probe: Probe):  # noqa: ANN201
    from coordinator.server import Coordinator
    from firmware_sim.fleet import Fleet

    class MeasuredFleet(Fleet):
        def _start_broker(self, host: str = "127.0.0.1"):  # noqa: ANN202
            broker = super()._start_broker(host)
            proc = getattr(broker, "_proc", None)
            probe.broker_pid = proc.pid if proc is not None else None
            return broker

        def _start_workers(self, artifacts: Path) -> None:
            probe.workers_started = time.time()
            if self.heartbeat is not None:
                probe.heartbeat_s = self.heartbeat
            super()._start_workers(artifacts)
            probe.worker_pids = [w.pid for w in self.workers.processes]
            if self.sites is not None:
                probe.aggregators = [process.pid for process in self.sites.processes.values()]
                probe.site_brokers = [broker._proc.pid for broker in self.sites.brokers.values()
                                      if broker._proc is not None]

        def stop(self) -> None:
            if probe.worker_pids and "after" not in probe.memory:
                probe.snapshot("after")
            super().stop()

    class TimedCoordinator(Coordinator):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            evaluate = self.evaluator.accuracies

            def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
                start = time.perf_counter()
                result = evaluate(*a, **k)
                if self.state.round in probe.rounds:  # (not for a task evaluated without training)
                    probe.rounds[self.state.round].evaluate_s = time.perf_counter() - start
                return result

            self.evaluator.accuracies = timed
            probe.inbox = [pid for shares in self.shares for pid in shares.pids]

        def _on_registration(self, event) -> None:  # noqa: ANN001
            super()._on_registration(event)
            now = time.time()
            probe.first_registered = probe.first_registered or now
            if len(self.roster.registered) == probe.devices and not probe.all_registered:
                probe.all_registered = now
                probe.snapshot("registered")

        def _wait_for_devices(self) -> list[str]:
            first = self._first_round
            available = super()._wait_for_devices()
            if first and probe.idle_s > 0:  # keep handling messages (heartbeats), measure what idling costs
                before, started = probe.cpu(), time.monotonic()
                while (left := started + probe.idle_s - time.monotonic()) > 0:
                    self._pump(left)
                elapsed = time.monotonic() - started
                probe.idle_cpu = {k: (v - before[k]) / elapsed for k, v in probe.cpu().items()}
                available = self._available()
            return available

        def _open(self, number: int, task: int, selected: list[str], earlier):  # noqa: ANN001, ANN202
            if probe.profiler is not None and not probe.profiler.running and number == probe.profiler.first_round:
                probe.profiler.start(probe.worker_pids)
            if probe.host_profile is not None and not probe.host_profile.running and number == probe.last_round:
                probe.host_profile.start()
            previous = probe.rounds.get(number)
            current = probe.rounds[number] = Round(number, len(selected), opened=time.time(), cpu=probe.cpu())
            if previous is not None:
                current.attempts = previous.attempts + 1
            opened = super()._open(number, task, selected, earlier)
            current.sent = time.time()
            return opened

        def _on_update(self, update) -> None:  # noqa: ANN001
            super()._on_update(update)
            if self.open_round is not None and self.open_round.complete:
                probe.rounds[self.open_round.number].last_update = time.time()

        def _on_heard(self, heard) -> None:  # noqa: ANN001
            super()._on_heard(heard)
            if self.open_round is not None and self.open_round.complete:
                probe.rounds[self.open_round.number].last_update = time.time()

        def _close(self, collected, aggregate) -> None:  # noqa: ANN001
            current = probe.rounds[collected.number]
            current.close_start = time.time()
            super()._close(collected, aggregate)
            current.closed = time.time()
            current.cpu = {k: v - current.cpu[k] for k, v in probe.cpu().items()}
            current.coordinator_mb = resident_mb()
            if probe.profiler is not None and collected.number == probe.profiler.last_round:
                probe.profiler.stop()
            if probe.host_profile is not None and collected.number == probe.last_round:
                probe.host_profile.stop()

    return MeasuredFleet, TimedCoordinator


def trained_times(logs: Path) -> dict[int, list[float]]:
    """Round number -> the times the devices logged `trained round` (worker logs, local-time asctime)."""
    out: dict[int, list[float]] = {}
    for path in logs.glob("worker-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if " trained round " not in line:
                continue
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            number = int(line.split(" trained round ", 1)[1].split()[0])
            out.setdefault(number, []).append(stamp)
    return out


def log_problems(logs: Path) -> list[tuple[int, str]]:
    """The worker logs' warnings and errors, grouped by message shape (ids and numbers blanked): (count, first)."""
    groups: dict[str, list] = {}
    for path in sorted(logs.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if " WARNING " in line or " ERROR " in line or line.startswith("Traceback"):
                message = line[24:]
                shape = re.sub(r"dev-\d+", "dev-N", re.sub(r"\d+(\.\d+)?", "#", message))
                groups.setdefault(shape, [0, f"{path.name}: {message}"])[0] += 1
    return sorted(((count, first) for count, first in groups.values()), reverse=True)


SCENARIO = {"preset": "digits-class", "n_tasks": 1}
# MNIST-1D's split: 0.8 of the generated samples train, and a client keeps 1 / 1.25 of its share for training
# (client_test_fraction 0.25): the share of the generated samples that devices train on.
MNIST1D_TRAINING_SHARE = 0.8 / 1.25


def scenario(n: int, per_device: int) -> dict:
    """The fleet's scenario at N devices: one digits task (~270 training samples, the same at every N) or, with
    `per_device` > 0, one MNIST-1D task (cnn1d) of all 10 classes generated with about `per_device` training samples a
    device, so the training work grows with N as the devices do."""
    if per_device <= 0:
        return {**SCENARIO, "n_clients": n}
    samples = math.ceil(n * per_device / MNIST1D_TRAINING_SHARE)
    return {"preset": "mnist1d-class", "n_tasks": 1, "classes_per_task": 10, "n_clients": n,
            "dataset_options": {"num_samples": samples}}


def holding_data(work: dict) -> list[int]:
    """The devices the scenario `work` gives training data (the digits task past ~270 devices, or a device the
    Dirichlet split leaves empty, gives some none: they say so and are not selected, so they cannot count toward a
    round's quorum)."""
    from edgefil.settings import Where
    from firmware_sim.scenarios import check_scenario

    data = check_scenario(work, Where("fleet_scale")).build()
    return [k for k in range(work["n_clients"]) if len(data.tasks[0].client_train(k)[1]) > 0]


# `--guard`: the coordinator's [guard] by name
GUARDS: dict[str, dict[str, float]] = {"no-krum": {"krum_share": 0.0}, "defaults": {}}


def run_fleet(n: int, args: argparse.Namespace, out: Path, artifacts: Path | None, broker: str,
              work: dict | None = None, client: dict | None = None, guard: dict | None = None,
              coordinator: dict | None = None) -> dict:
    """A fleet of `n` devices on `work` (default: this benchmark's scenario), with `client` added to what every
    round tells the devices, `guard` for the coordinator's [guard] (default: the defaults without Krum
    selection), and `coordinator`: more of the coordinator's tables (its [secure_aggregation])."""
    import firmware_sim.fleet as fleet_module
    from edge_client.config import StoreSettings
    from firmware_sim.fleet_config import FleetConfig

    work = work or scenario(n, args.per_device)
    probe = Probe(devices=n, idle_s=args.idle_s, last_round=args.rounds)
    if getattr(args, "perf", 0):
        probe.host_profile = HostProfile(out / "perf")
    if args.profile:
        probe.profiler = Profiler(out / "profile", min(2, args.rounds), args.rounds)
    MeasuredFleet, TimedCoordinator = instrumented_classes(probe)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if probe.profiler is not None:
        probe.profiler.folder.mkdir()
        os.environ[PROFILE_ENV] = str(probe.profiler.folder)  # the workers, spawned from here, take it
    if artifacts is not None:  # the model does not depend on N: export once, copy
        shutil.copytree(artifacts, out / "artifacts")
    config = FleetConfig(
        name=f"scale{n}", out=out, devices=n, workers=args.workers, broker=broker, seed=0,
        model="cnn1d" if args.per_device > 0 else "lenet",
        trainer=dataclasses.replace(FleetConfig.trainer, backend=args.backend),
        scenario=work,
        policy={"name": "random"}, store=StoreSettings(max_samples=args.replay_m),
        client={"epochs": 1, **(client or {})},
        learner={"between_rounds": args.between_rounds} if getattr(args, "between_rounds", None) else {},
        coordinator={
            "rounds_per_task": args.rounds, "fraction": 1.0, "min_clients": len(holding_data(work)),
            "deadline_s": args.deadline_s, "wait_for_devices_s": args.wait_s, "max_attempts": 1,
            "guard": GUARDS["no-krum"] if guard is None else guard, **(coordinator or {}),
            **({"inbox_workers": args.inbox_workers} if getattr(args, "inbox_workers", 0) else {}),
        },
        sites=getattr(args, "sites", 0),
    )
    original = fleet_module.Coordinator
    fleet_module.Coordinator = TimedCoordinator
    probe.started = time.time()
    try:
        results = MeasuredFleet(config).run()
    finally:
        fleet_module.Coordinator = original
        os.environ.pop(PROFILE_ENV, None)
        if probe.profiler is not None:
            probe.profiler.stop()  # a run that ended before its last round: what was measured
        if probe.host_profile is not None:
            probe.host_profile.stop()
    trained = trained_times(out / "logs")
    return {"n": n, "broker": broker, "probe": probe, "results": results, "trained": trained,
            "problems": log_problems(out / "logs"), "foreign": FOREIGN.take(), "cores": os.cpu_count() or 1}


# --- summary ------------------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(run: dict) -> dict:
    probe: Probe = run["probe"]
    n, cores = run["n"], run["cores"]
    history = {h["round"]: h for h in run["results"]["history"]}
    rows = []
    for number, r in sorted(probe.rounds.items()):
        h = history.get(number)
        if h is None or not r.closed:
            continue
        device_cpu = [m.get("device_seconds", 0.0) for m in h["metrics"].values()]
        trained = run["trained"].get(number, [])
        floor = max(max(device_cpu, default=0.0), sum(device_cpu) / min(cores, n))
        wall = r.closed - r.opened
        rows.append({
            "wall": wall, "open": r.sent - r.opened, "collect": r.last_update - r.sent,
            "close": r.closed - r.close_start, "aggregate": h["aggregate_s"], "evaluate": r.evaluate_s,
            "first_trained": (min(trained) - r.sent) if trained else float("nan"),
            "last_trained": (max(trained) - r.sent) if trained else float("nan"),
            "upload": (r.last_update - max(trained)) if trained else float("nan"),
            "dev_sum": sum(device_cpu), "dev_max": max(device_cpu, default=0.0), "floor": floor,
            "overhead": wall - floor, "received": len(h["received"]), "attempts": r.attempts, "selected": r.selected,
            "samples": h.get("samples", 0),  # the samples the round's aggregate counts
            # busy CPU of the host's other processes (other users of the machine) during the round
            "other": r.cpu["host"] - r.cpu["coordinator"] - r.cpu["broker"] - r.cpu["workers"],
            **{f"cpu_{k}": v for k, v in r.cpu.items()},
            "coordinator_mb": r.coordinator_mb,
        })
    keys = rows[0].keys() if rows else []
    med = {k: median([row[k] for row in rows]) for k in keys}
    med["rounds"] = len(rows)
    med["walls"] = [row["wall"] for row in rows]
    after, registered = probe.memory.get("after", {}), probe.memory.get("registered", {})
    return {
        "n": n, "broker": run["broker"], "rounds": med, "rows": rows, "workers": len(probe.worker_pids),
        "startup": (probe.all_registered - probe.workers_started) if probe.all_registered else float("nan"),
        "first_registered": (probe.first_registered - probe.workers_started) if probe.first_registered else float("nan"),
        "registered": registered, "after": after, "idle_cpu": probe.idle_cpu, "heartbeat_s": probe.heartbeat_s,
        "broker_after": probe.broker_memory.get("after", {}), "problems": run["problems"],
        "foreign": run["foreign"],
        "completed": run["results"]["rounds_completed"], "accuracy": run["results"]["final_accuracy"],
    }


def fmt(value: float, spec: str) -> str:
    """format(value, spec), or a right-aligned "-" of the same width for NaN."""
    width = int(re.match(r"\d*", spec).group() or 0)
    return "-".rjust(width) if value != value else format(value, spec)


def print_tables(summaries: list[dict], idle: dict[str, float], args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    workers = args.workers or "the fleet's own number of"
    work = (f"MNIST-1D (cnn1d), 1 task of 10 classes, ~{args.per_device} training samples a device" if args.per_device > 0
            else "digits-class (LeNet) with 1 task (~270 training samples at every N)")
    print(f"\nfleet scale: {workers} worker processes, {cores} cores, {args.backend} backend, {work}, "
          f"{args.rounds} rounds, fraction 1.0, random replay M={args.replay_m}, 1 local epoch, the workers' log at "
          f"{args.worker_log_level}")
    print(f"an idle worker (its imports, no device), of {args.idle_workers} alive together: PSS "
          f"{idle.get('Pss', 0) / MB:.0f} MB, RSS {idle.get('Rss', 0) / MB:.0f} MB, anonymous "
          f"{idle.get('Anonymous', 0) / MB:.0f} MB")
    mapped = [f"{s['broker']} N={s['n']}" for s in summaries if s["after"].get("libtorch")]
    if mapped:
        print(f"workers map libtorch_cpu (a worker should not import torch): {', '.join(mapped)}")

    print("\nstartup and host memory (worker processes summed; MB = MiB)")
    print(f"{'broker':>9s} {'N':>5s} {'workers':>7s} {'first reg s':>11s} {'all reg s':>9s} {'PSS reg':>8s} {'PSS after':>9s} "
          f"{'RSS after':>9s} {'anon after':>10s} {'total/N':>8s} {'net/N':>6s} {'marginal':>8s} "
          f"{'threads':>7s} {'fds':>5s} {'broker RSS':>10s}")
    previous: dict[str, dict] = {}
    for s in summaries:
        after, reg = s["after"], s["registered"]
        pss = after.get("Pss", float("nan"))
        prev = previous.get(s["broker"])
        marginal = ((pss - prev["after"].get("Pss", float("nan"))) / (s["n"] - prev["n"]) / MB
                    if prev is not None else float("nan"))
        print(f"{s['broker']:>9s} {s['n']:5d} {s['workers']:7d} {fmt(s['first_registered'], '11.1f')} {fmt(s['startup'], '9.1f')} "
              f"{fmt(reg.get('Pss', float('nan')) / MB, '8.0f')} {fmt(pss / MB, '9.0f')} "
              f"{fmt(after.get('Rss', float('nan')) / MB, '9.0f')} {fmt(after.get('Anonymous', float('nan')) / MB, '10.0f')} "
              f"{fmt(pss / s['n'] / MB, '8.2f')} {fmt((pss - idle.get('Pss', 0) * s['workers']) / s['n'] / MB, '6.2f')} "
              f"{fmt(marginal, '8.2f')} {after.get('threads', 0):7.0f} {after.get('fds', 0):5.0f} "
              f"{fmt(s['broker_after'].get('Rss', float('nan')) / MB, '10.1f')}")
        previous[s["broker"]] = s

    print("\nround timing (seconds, median over rounds; open = encode+publish weights and N round messages, "
          "close = aggregate+evaluate+checkpoint)")
    print(f"{'broker':>9s} {'N':>4s} {'rounds':>6s} {'wall':>6s} {'ratio':>6s} {'open':>6s} {'1st trained':>11s} "
          f"{'last trained':>12s} {'upload':>6s} {'close':>6s} {'aggregate':>9s} {'evaluate':>8s} {'dev CPU sum':>11s} "
          f"{'dev max':>7s} {'floor':>6s} {'overhead':>8s} {'overhead/N ms':>13s}")
    base: dict[str, float] = {}
    for s in summaries:
        r = s["rounds"]
        if not r.get("rounds"):
            print(f"{s['broker']:>9s} {s['n']:4d}  no round completed ({s['completed']})")
            continue
        base.setdefault(s["broker"], r["wall"])
        print(f"{s['broker']:>9s} {s['n']:4d} {r['rounds']:6d} {r['wall']:6.2f} {r['wall'] / base[s['broker']]:6.2f} "
              f"{r['open']:6.3f} {fmt(r['first_trained'], '11.2f')} {fmt(r['last_trained'], '12.2f')} "
              f"{fmt(r['upload'], '6.3f')} {r['close']:6.3f} {r['aggregate']:9.4f} {r['evaluate']:8.4f} "
              f"{r['dev_sum']:11.3f} {r['dev_max']:7.3f} {r['floor']:6.3f} {r['overhead']:8.2f} "
              f"{r['overhead'] / s['n'] * 1e3:13.1f}")

    per_device(summaries, same_work=args.per_device > 0)

    print("\nCPU seconds per round (median), by process: the coordinator process, the broker, all workers (of "
          "which kernel); dev train = the devices' training threads; workers-dev = the devices' other work; "
          "per device = (coordinator + broker + workers-dev) / N; train share = dev train / (coordinator + broker "
          f"+ workers), the target at least {TRAINING_SHARE:.0%}; ceiling = the share were the devices' other work none "
          "at all, dev train / (coordinator + broker + dev train): what the coordinator's and the broker's work "
          "per update leave reachable; other procs = the host's busy CPU outside this fleet (other users of the "
          "machine: it slows the rounds)")
    print(f"{'broker':>9s} {'N':>4s} {'coordinator':>11s} {'broker':>7s} {'workers':>7s} {'w. sys':>6s} "
          f"{'dev train':>9s} {'workers-dev':>11s} {'per device ms':>13s} {'train share':>11s} {'ceiling':>7s} "
          f"{'other procs':>11s}  "
          f"{'walls s':s}")
    for s in summaries:
        r = s["rounds"]
        if not r.get("rounds"):
            continue
        other = r["cpu_workers"] - r["dev_sum"]
        share = training_share(r)
        served = r["cpu_coordinator"] + r["cpu_broker"] + r["dev_sum"]
        ceiling = r["dev_sum"] / served if served > 0 else float("nan")
        print(f"{s['broker']:>9s} {s['n']:4d} {r['cpu_coordinator']:11.2f} {r['cpu_broker']:7.2f} "
              f"{r['cpu_workers']:7.2f} {r['cpu_workers_sys']:6.2f} {r['dev_sum']:9.2f} {other:11.2f} "
              f"{(r['cpu_coordinator'] + r['cpu_broker'] + other) / s['n'] * 1e3:13.1f} {share:11.1%} "
              f"{ceiling:7.1%} {r['other']:11.2f}  "
              f"{' '.join(f'{w:.2f}' for w in r['walls'])}")
    over_rounds(summaries)
    at_sites = [s for s in summaries if s["rounds"].get("cpu_aggregators", 0.0) > 0]
    if at_sites:
        print("\nof which the sites (median CPU s a round): their aggregators (in the coordinator column) and their "
              "brokers (in the broker column); what is left for the coordinator's process and the fleet's broker")
        print(f"{'broker':>9s} {'N':>4s} {'aggregators':>11s} {'site brokers':>12s} {'coordinator':>11s} "
              f"{'fleet broker':>12s}")
        for s in at_sites:
            r = s["rounds"]
            print(f"{s['broker']:>9s} {s['n']:4d} {r['cpu_aggregators']:11.2f} {r['cpu_site_brokers']:12.2f} "
                  f"{r['cpu_coordinator'] - r['cpu_aggregators']:11.2f} {r['cpu_broker'] - r['cpu_site_brokers']:12.2f}")
    idle = [s for s in summaries if s["idle_cpu"]]
    if idle:
        print(f"\nidle fleet (all registered, no round open, {args.idle_s:.0f} s; heartbeat s: every device's, as "
              f"the fleet set it): CPU cores busy")
        print(f"{'broker':>9s} {'N':>4s} {'heartbeat s':>11s} {'coordinator':>11s} {'broker':>7s} {'workers':>7s} "
              f"{'w. sys':>6s} {'per device %':>12s} {'other procs':>11s}")
        for s in idle:
            c = s["idle_cpu"]
            total = c["coordinator"] + c["broker"] + c["workers"]
            print(f"{s['broker']:>9s} {s['n']:4d} {s['heartbeat_s']:11.1f} {c['coordinator']:11.3f} {c['broker']:7.3f} "
                  f"{c['workers']:7.3f} {c['workers_sys']:6.3f} {total / s['n'] * 100:12.3f} {c['host'] - total:11.3f}")
    for s in summaries:
        if s["completed"] < args.rounds:
            print(f"\n{s['broker']} N={s['n']}: only {s['completed']} of {args.rounds} rounds completed")
        if s["problems"]:
            total = sum(count for count, _ in s["problems"])
            print(f"\n{s['broker']} N={s['n']}: {total} warnings/errors in the worker logs, by kind (count, first):")
            for count, first in s["problems"][:5]:
                print(f"  {count:6d}  {first[:160]}")
        if s["foreign"]:
            total = sum(count for count, _ in s["foreign"])
            print(f"\n{s['broker']} N={s['n']}: {total} warnings/errors logged in this process outside edgefil "
                  f"(the embedded broker runs here), by kind:")
            for count, what in s["foreign"][:5]:
                print(f"  {count:6d}  {what[:200]}")


def training_share(r: dict) -> float:
    """The devices' training as a share of the fleet's CPU in a round (`r`: a summary's median round)."""
    fleet = r["cpu_coordinator"] + r["cpu_broker"] + r["cpu_workers"]
    return r["dev_sum"] / fleet if fleet > 0 else float("nan")


def per_device(summaries: list[dict], same_work: bool = False) -> None:
    """Round time per device at each N, the round time each added device adds, and whether the first is flat
    within FLAT_WITHIN; then the least-squares line wall = fixed + per_device x N over the sizes, which separates what
    grows with N from what does not (the selected devices' own rounds, once their number stops growing with N).

    With `same_work` (`--per-device`: every device trains on as many samples at every N), the devices' training CPU
    a sample is the same work at every size, so it gauges the host's speed while each size ran: the sizes run one
    after another, and a host shared with other machines (a virtual machine's neighbours, invisible to "other
    procs") may slow down between them (seen: a 1000-device round 1.2 s, then 2.0 s minutes later, its training 1.4x
    slower a sample). Printed with the round time per device in those units (wall a device over training CPU a
    sample), whose spread is what N changes with the host's speed taken out: a reading beside the wall's, never
    instead of it."""
    for broker in dict.fromkeys(s["broker"] for s in summaries):
        done = [s for s in summaries if s["broker"] == broker and s["rounds"].get("rounds")]
        if not done:
            continue
        print(f"\nround time per device, {broker} (median wall / N; added = the wall's growth over the previous N's "
              f"/ the devices added; selected = the devices in the round, those that hold data)")
        print(f"{'N':>6s} {'selected':>8s} {'wall s':>7s} {'ms per device':>13s} {'added ms per added device':>25s}")
        previous = None
        for s in done:
            r = s["rounds"]
            added = ((r["wall"] - previous["rounds"]["wall"]) / (s["n"] - previous["n"]) * 1e3
                     if previous is not None else float("nan"))
            print(f"{s['n']:6d} {r['selected']:8.0f} {r['wall']:7.2f} {r['wall'] / s['n'] * 1e3:13.2f} "
                  f"{fmt(added, '25.2f')}")
            previous = s
        if len(done) < 2:
            continue
        each = [s["rounds"]["wall"] / s["n"] for s in done]
        spread = max(each) / min(each)
        sizes = [float(s["n"]) for s in done]
        walls = [s["rounds"]["wall"] for s in done]
        slope, fixed = statistics.linear_regression(sizes, walls)
        print(f"per device {min(each) * 1e3:.2f}-{max(each) * 1e3:.2f} ms: {spread:.2f}x "
              f"({'within' if spread <= FLAT_WITHIN else 'outside'} {FLAT_WITHIN}x); least squares over the sizes: wall = "
              f"{fixed:.2f} s + {slope * 1e3:.2f} ms x N")
        if same_work and all(s["rounds"]["samples"] > 0 and s["rounds"]["dev_sum"] > 0 for s in done):
            sample = [s["rounds"]["dev_sum"] / s["rounds"]["samples"] for s in done]
            units = [wall / cost for wall, cost in zip(each, sample)]
            print(f"the host's speed: the devices' training CPU a sample {min(sample) * 1e6:.0f}-"
                  f"{max(sample) * 1e6:.0f} us over the sizes ({max(sample) / min(sample):.2f}x); the round time per "
                  f"device in those units {min(units):.2f}-{max(units):.2f} ({max(units) / min(units):.2f}x, "
                  f"{'within' if max(units) / min(units) <= FLAT_WITHIN else 'outside'} {FLAT_WITHIN}x)")


def across_passes(summaries: list[dict]) -> None:
    """With `--passes`: each size's round time per device, the fleet's CPU per device and the training share in
    every pass, their medians, and whether the medians' round time per device is flat within FLAT_WITHIN. The sizes
    run one after another, and on a shared host whose speed drifts (a virtual machine's neighbours) the one that ran
    in a slow spell reads slow (seen: 1000 devices at 1.53 and 1.75 ms a device, 10,000 at 1.44 and 1.28, in turn
    minutes apart); in alternating order every size meets the drift alike, and the medians compare the sizes, not
    the spells."""
    print("\nacross the passes (the sizes in alternating order): round time per device (median wall / N), the "
          "fleet's CPU per device (coordinator, broker and workers over N) and the training share of that CPU, each "
          "pass, then the median")
    print(f"{'broker':>9s} {'N':>6s} {'ms per device, each pass':>29s} {'median':>7s} "
          f"{'CPU ms per device, each pass':>29s} {'median':>7s} {'train share, each pass':>34s} {'median':>7s}")
    for broker in dict.fromkeys(s["broker"] for s in summaries):
        each_size = {}
        for n in sorted({s["n"] for s in summaries if s["broker"] == broker}):
            done = sorted((s for s in summaries if s["broker"] == broker and s["n"] == n and s["rounds"].get("rounds")),
                          key=lambda s: s["pass"])
            if not done:
                continue
            per_device_ms = [s["rounds"]["wall"] / n * 1e3 for s in done]
            cpu_ms = [(s["rounds"]["cpu_coordinator"] + s["rounds"]["cpu_broker"] + s["rounds"]["cpu_workers"]) / n
                      * 1e3 for s in done]
            shares = [training_share(s["rounds"]) for s in done]
            each_size[n] = median(per_device_ms)
            print(f"{broker:>9s} {n:6d} {' '.join(f'{v:.2f}' for v in per_device_ms):>29s} {each_size[n]:7.2f} "
                  f"{' '.join(f'{v:.2f}' for v in cpu_ms):>29s} {median(cpu_ms):7.2f} "
                  f"{' '.join(f'{v:.1%}' for v in shares):>34s} {median(shares):7.1%}")
        if len(each_size) > 1:
            spread = max(each_size.values()) / min(each_size.values())
            print(f"{broker}: per device (medians over the passes) {min(each_size.values()):.2f}-"
                  f"{max(each_size.values()):.2f} ms: {spread:.2f}x "
                  f"({'within' if spread <= FLAT_WITHIN else 'outside'} {FLAT_WITHIN}x)")


def over_rounds(summaries: list[dict]) -> None:
    """A run of at least LONG_RUN rounds: the wall and the coordinator's CPU a round in the first and the last quarter
    of its rounds after the first (which creates the devices' files), medians: what grows with the rounds (a
    record rewritten whole each round does: coordinator/run_logs.py); and the coordinator's resident memory at
    their closes, with what a round added to it between the two quarters (a history kept whole in memory did:
    coordinator/checkpoint.py `HistoryFile`)."""
    long = [s for s in summaries if len(s["rows"]) >= LONG_RUN]
    if not long:
        return
    print("\nover the rounds (medians of the first and the last quarter of the rounds after the first; last / first)")
    print(f"{'broker':>9s} {'N':>5s} {'rounds':>6s} {'wall first':>10s} {'last':>6s} {'ratio':>6s} "
          f"{'coordinator CPU first':>21s} {'last':>6s} {'ratio':>6s} {'coordinator MB first':>20s} {'last':>6s} "
          f"{'MB a round':>10s}")
    for s in long:
        rows = s["rows"][1:]
        quarter = max(1, len(rows) // 4)
        first, last = rows[:quarter], rows[-quarter:]
        walls = [median([row["wall"] for row in part]) for part in (first, last)]
        cpu = [median([row["cpu_coordinator"] for row in part]) for part in (first, last)]
        mb = [median([row["coordinator_mb"] for row in part]) for part in (first, last)]
        apart = max(len(rows) - quarter, 1)  # rounds between the quarters' middles
        print(f"{s['broker']:>9s} {s['n']:5d} {len(s['rows']):6d} {walls[0]:10.3f} {walls[1]:6.3f} "
              f"{walls[1] / walls[0]:6.2f} {cpu[0]:21.3f} {cpu[1]:6.3f} {cpu[1] / cpu[0]:6.2f} {mb[0]:20.0f} "
              f"{mb[1]:6.0f} {(mb[1] - mb[0]) / apart:10.3f}")


def measure(n: int, broker: str, args: argparse.Namespace, out: Path, artifacts: Path | None) -> dict | None:
    """A fleet of `n` devices through `broker` in the folder `out`: its summary, with its profiles printed where
    asked; None where the fleet failed (said: the other sizes go on)."""
    t0 = time.perf_counter()
    try:
        run = run_fleet(n, args, out, artifacts, broker, guard=GUARDS[args.guard])
    except Exception as err:
        print(f"{broker} N={n}: the fleet failed: {type(err).__name__}: {err}", flush=True)
        return None
    summary = summarize(run)
    print(f"{broker} N={n}: {summary['completed']} rounds in {time.perf_counter() - t0:.0f} s "
          f"(all registered after {summary['startup']:.1f} s, final accuracy {summary['accuracy']:.3f})", flush=True)
    if args.profile:
        device_rounds = sum(len(h["received"]) for h in run["results"]["history"] if h["round"] >= min(2, args.rounds))
        print(f"\nprofile of {broker} N={n}'s rounds (profiled: its times are not an unprofiled run's)")
        print_profile(out / "profile", max(device_rounds, 1), args.profile)
    if args.perf and run["probe"].host_profile is not None:
        print(f"\nthe last round of {broker} N={n}, recorded with perf")
        run["probe"].host_profile.print_tables(run["probe"].roles(), args.perf)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="10,50,200", help="comma-separated fleet sizes (ascending)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fleet (one task)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the sizes this many times, ascending then descending in turn, and print each "
                             "size's median over the passes (`across_passes`)")
    parser.add_argument("--sites", type=int, default=0,
                        help="the devices split over this many sites (their brokers bridged to the fleet's, an "
                             "aggregator each: coordinator/sites.py); the aggregators' CPU is counted with the "
                             "coordinator's, the sites' brokers' with the broker's")
    parser.add_argument("--inbox-workers", type=int, default=0,
                        help="the coordinator's inbox workers (its per-update work in that many processes, counted "
                             "in its CPU column); 0: none")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes hosting the devices (default: the fleet's: one per core, more where "
                             "the devices need them)")
    parser.add_argument("--backend", default=None, help="the devices' trainer backend (default: the fleet's)")
    parser.add_argument("--broker", default="mosquitto,embedded",
                        help="mosquitto, embedded, or both comma-separated (default: both)")
    parser.add_argument("--replay-m", type=int, default=50, help="replay store size M")
    parser.add_argument("--guard", choices=sorted(GUARDS), default="no-krum",
                        help="the coordinator's [guard]: its defaults without Krum selection (FedAvg over every "
                             "update, as Flower's side does; the default), or its defaults (a fleet file's without "
                             "[guard]: Krum selection where there are no calibration samples, as here)")
    parser.add_argument("--between-rounds", choices=("memory", "disk"), default=None,
                        help="the devices' [learner] between_rounds (default: the fleet's, disk)")
    parser.add_argument("--per-device", type=int, default=0,
                        help="0: one digits task, the same ~270 samples at every N (default); K > 0: MNIST-1D "
                             "generated for about K training samples a device, every device training")
    parser.add_argument("--worker-log-level", choices=("INFO", "WARNING", "ERROR"), default="INFO",
                        help="the workers' log level, as `edgefil --log-level` gives it (fleet_worker.fleet_log_level;"
                             " default INFO), set on edgefil's logger here (which prints WARNING and up). Above INFO "
                             "the devices log no `trained round` line, and the round's phases after its start "
                             "(first and last trained, the upload) are not measured")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="round deadline")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long round 1 waits for all devices")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="after all devices registered, idle this long (devices heartbeat) and measure CPU")
    parser.add_argument("--out", default=None, help="run folders (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("--json", default=None, help="also write the summaries to this file")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="profile the rounds (yappi) and print the TOP functions of each side; slows the run")
    parser.add_argument("--perf", type=int, default=0, metavar="TOP",
                        help="record the last round with perf (the whole host) and print the TOP processes, "
                             "libraries, system calls and kernel functions")
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    if args.perf and (why := HostProfile.available()) is not None:
        parser.error(f"--perf: {why}")
    if args.profile:
        try:
            import yappi  # noqa: F401
        except ImportError:
            parser.error("--profile needs yappi: .venv/bin/pip install yappi")
    sizes = sorted(int(n) for n in args.devices.split(","))
    brokers = [b.strip() for b in args.broker.split(",")]

    # edgefil's own warnings (a round closed at its deadline, ...) print; any other logger's are counted
    printed = logging.StreamHandler(sys.stderr)
    printed.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    printed.addFilter(lambda record: record.name.startswith("edgefil"))
    FOREIGN.addFilter(lambda record: not record.name.startswith("edgefil"))
    logging.basicConfig(level=logging.WARNING, handlers=[printed, FOREIGN])
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" (as the CLI does)
    if args.worker_log_level != "INFO":  # (INFO: left unset, the workers' default; this process prints WARNING up)
        from firmware_sim.fleet_worker import RUNTIME_LOGGER

        logging.getLogger(RUNTIME_LOGGER).setLevel(args.worker_log_level)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    started = time.perf_counter()
    from firmware_sim.fleet import usable_cores
    from firmware_sim.fleet_config import FleetConfig
    from firmware_sim.fleet_worker import worker_count

    counts = [worker_count(args.workers, n, usable_cores()) for n in sizes]  # None: the fleet's own sizing
    args.idle_workers = max(counts)
    args.backend = args.backend or FleetConfig.trainer.backend
    idle = {k: v / args.idle_workers for k, v in idle_workers_memory(args.idle_workers, args.backend).items()}
    summaries, artifacts = [], None
    try:
        for number in range(1, args.passes + 1):
            for broker in brokers:
                for n in sizes if number % 2 else sizes[::-1]:  # alternating: a drifting host weighs on each alike
                    out = base / (f"{broker}-{n}" if args.passes == 1 else f"{broker}-{n}-pass{number}")
                    summary = measure(n, broker, args, out, artifacts)
                    if summary is not None:
                        summary["pass"] = number
                        summaries.append(summary)
                        artifacts = artifacts or out / "artifacts"
        for number in range(1, args.passes + 1):
            if args.passes > 1:
                print(f"\n===== pass {number} of {args.passes} =====")
            print_tables(sorted((s for s in summaries if s["pass"] == number),
                                key=lambda s: (brokers.index(s["broker"]), s["n"])), idle, args)
        if args.passes > 1:
            across_passes(summaries)
        print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(
                [{k: v for k, v in s.items()} for s in summaries], indent=1, default=float))
    finally:
        if not args.keep and not args.out:
            shutil.rmtree(base, ignore_errors=True)
        elif args.keep or args.out:
            print(f"run folders kept in {base}")


if __name__ == "__mp_main__" and os.environ.get(PROFILE_ENV):  # this module, imported again in a spawned worker
    profile_on_signals(Path(os.environ[PROFILE_ENV]))

if __name__ == "__main__":
    main()
