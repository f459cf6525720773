"""A fleet's worker process. Kept apart from firmware_sim/fleet.py so that a worker imports only the device side
(not the coordinator, which pulls in torch: about 285 MB of memory and 2 s of start-up per worker)."""
from __future__ import annotations

import faulthandler
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, NoReturn

from edgefil.durable import set_power_loss_safe
from edgefil.lifetime import die_with_parent
from edgefil.logs import error_line
from edgefil.prctl import prctl
from edgefil.thread_names import NamedThread

PARENT_POLL_S = 1.0
STOP_GRACE_S = 30.0  # how long a stopping worker waits for its devices, all of them together
# How long a worker may take to be gone once it starts to stop: its devices' grace, its network thread's (5 s) and
# the interpreter's own exit, with room to spare (ExitDeadline).
EXIT_DEADLINE_S = STOP_GRACE_S + 30.0
ALARM_AFTER_S = 10  # the kernel's SIGALRM ends the process this long after faulthandler should have
# Open files a worker needs per device: its MQTT socket, its replay store's SQLite database and journal, a state
# file being replaced (measured: 3.0 per device in a worker hosting 500, benchmarks/fleet_scale.py); the broker
# needs one per connection (mosquitto held 1008 at 1000 devices); a process needs BASE_DESCRIPTORS besides
# (imports, logs, pipes, the broker's listener and log).
DESCRIPTORS_PER_DEVICE = 4
DESCRIPTORS_PER_CONNECTION = 1
BASE_DESCRIPTORS = 256
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# The logger whose level the processes a fleet starts (its workers, its sites' aggregators) take from the fleet's own
# (`fleet_log_level`): edgefil's, which `edgefil --log-level` sets with its other packages' (edgefil/cli.py). A worker
# sets its whole log (the root logger) at that level, so its devices' `edge_client.*` loggers follow too.
RUNTIME_LOGGER = "edgefil"
# Connections one worker's network thread keeps alive (benchmarks/fleet_scale.py, 2 cores). Measured at 1500
# first: at 2500 a worker (5000 on 2) the thread fell behind under the GIL, the 10 s keepalives of the time lapsed
# and the broker dropped thousands of devices. Since, a crowded fleet's clients take a keepalive of 60 s and more
# (`crowded_keepalive`) and its heartbeats a budget (`fleet_heartbeat`), and a worker's devices hand the GIL over
# less: 2500 a worker (5000 on 2), 3334 (10,000 on 3) and 4000 (8000 on 2) ran clean (2026-12-06). A worker is a
# process of its own on the host's few cores: 1000 devices in 7 workers instead of 2 cost the devices' training
# 1.2-1.35x its CPU and the rest of the workers' work 1.15-1.45x; 10,000 devices in 3 workers instead of 7 took 11 %
# less memory, their rounds the same within the host's noise (docs/results.md).
DEVICES_PER_WORKER = 4000
# A worker builds its devices one after another and each connects as soon as it is built; a build is CPU work
# (about 8 ms) that holds the GIL, while a connection needs the worker's network thread to answer its broker. At
# 100,000 devices on 2 cores (24 workers of 4,166) the builds ran ahead of the connections: the network threads,
# starved, sent CONNECTs and pings late, the site brokers dropped 6,000 connections for silence and the devices
# retried, and the count online peaked at 24,854 and fell (docs/results.md). So a worker has at most
# CONNECTING_PER_WORKER devices built and not yet connected; the next build waits for one of them to connect.
CONNECTING_PER_WORKER = 16
# The fleet's shared parts (the coordinator, the brokers, the sites' aggregators) serve every device, and a
# device's connection, registration and round wait on them; a worker is one of many processes of devices. On a
# crowded host (`crowded`) the workers run this much nicer than the fleet, so that the kernel gives the shared
# parts the CPU first and the devices what is left: at 100,000 devices on 2 cores the 24 workers took both cores,
# and the coordinator heard registrations at a third of the rate the devices connected (docs/results.md). Below
# the crowd every part keeps the fleet's niceness.
WORKER_NICENESS = 10
ADVERSARY = "adversary"  # a device table's key, beside the device config, for a compromised device (adversary.py)
# What a worker tells its fleet of a device out of the run (it failed to start, or stopped on an error): the
# device's id and a line that says why (`serve_devices`).
DeviceFailed = Callable[[str, str], None]


def worker_count(workers: int | None, devices: int, cores: int) -> int:
    """`workers` as set, else one per core, and more where the devices need them: a worker is one Python process
    (one GIL), so it does about one core of device work (at 1000 devices on 2 cores, 2 workers register every
    device in ~25 s, and more would only add each worker's own memory and the cores' switches between them), but one
    worker's network thread keeps at most `DEVICES_PER_WORKER` connections alive (benchmarks/fleet_scale.py), and
    the host's limit on a process's open files may allow fewer (`devices_per_worker`). Never more than the devices."""
    return min(workers if workers is not None else max(cores, math.ceil(devices / devices_per_worker())), devices)


def devices_per_worker() -> int:
    """The most devices a worker takes: DEVICES_PER_WORKER, or as many as the open files its devices need
    (DESCRIPTORS_PER_DEVICE each, BASE_DESCRIPTORS besides) fit under this host's hard limit, which a worker raises
    its own limit to (`ensure_descriptors`), where that is fewer."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return DEVICES_PER_WORKER
    return max(1, min(DEVICES_PER_WORKER, (hard - BASE_DESCRIPTORS) // DESCRIPTORS_PER_DEVICE))


# The MQTT keepalive of a fleet's clients, in seconds: the broker drops a connection it has heard nothing from for
# 1.5x this, and a client drops one whose broker has not answered its ping for as long. On a crowded host pings go
# out and are answered late: at 7000 devices on 2 cores (3500 a core) 12,222 device connections lapsed at the
# default of 10 s, none at 60 s; at 9000 the coordinator's own connection lapsed once. 5000 on 2 cores ran clean
# at 10 s on one host (benchmarks/fleet_scale.py), but on a host about 1.5x slower 3000 on 2 cores (1500 a core) lost
# 75 connections to their keepalive during round 1, twice in two runs, and the round its quorum (the devices were
# alive: their workers were busy; benchmarks/vs_flower.py, 2026-11-27). Past CROWDED_DEVICES_PER_CORE the fleet
# gives its devices and its coordinator the longer keepalive; the price is a dead device noticed after 90 s instead
# of 15 s.
# Past that, a keepalive is a ping a period for every connection (about 0.1 ms of the worker's CPU and as much of
# its broker's, measured), and a long keepalive is cheap in a fleet: its connections are on loopback or a cluster's
# network, where a worker that dies closes its sockets (the broker publishes the last wills at once, and the fleet
# ends the run: `Coordinator.abort`), so a keepalive only ever catches a connection left half open, which a
# fleet's network does not leave. So the pings of a crowded fleet, all of them together, keep within
# KEEPALIVES_PER_CORE_S a second per core, as its heartbeats do: 60 s up to 6000 devices on 2 cores, 1000 s at
# 100,000 (at 60 s, 100,000 devices pinged 1,667 times a second).
CROWDED_DEVICES_PER_CORE = 1000
CROWDED_KEEPALIVE_S = 60
KEEPALIVES_PER_CORE_S = 50.0
MQTT_MAX_KEEPALIVE_S = 65535  # the protocol's largest (a 16-bit field)
# A device's heartbeat (a status message every `heartbeat_s`, 5 s by default) costs its worker, the broker and the
# coordinator about 1 ms of CPU together. A fleet keeps its devices' heartbeats, all of them together, within
# HEARTBEATS_PER_CORE_S a second per core of its host: past that, every device beats less often than its default.
# A budget for the whole fleet, not a longer heartbeat for large ones: at 10,000 devices on 2 cores a 5 s heartbeat
# kept 1.73 cores busy and a round took 308 s (benchmarks/fleet_scale.py --per-device 3); a fixed 30 s past 2000
# devices still left them costing each round in proportion to the fleet's size times the round's length, which
# itself grows with the fleet. At 50 a second a core, 2 cores: 5 s up to 500 devices, 30 s at 3000, 100 s at
# 10,000. Nothing but the live view reads a heartbeat's age (a device that goes away says so: its last will), so
# the view's "last seen" is what ages.
HEARTBEATS_PER_CORE_S = 50.0
# A Python thread waiting for the GIL wakes every switch interval (5 ms by default) to ask for it. A broadcast
# wakes every device thread of a worker at once (1500 of them at 9000 devices on 6 workers), and their wake-ups
# then crowd out everything else on the host, the broker first. A longer interval in the workers thins them out.
WORKER_SWITCH_INTERVAL_S = 0.05
# glibc serves an allocation below its mmap threshold from a heap (an arena's), a larger one from memory mapped for it
# alone, faulted in page by page as it is first written and unmapped when freed. A worker's devices allocate and free
# model-sized buffers all round long (LeNet's 121 KiB: each received global model, the weights read back, the
# optimiser's moments, an upload): mapped at 64 KiB (this threshold until issue 57), a 1000-device fleet on the
# digits' LeNet took 2.7 million page faults in four rounds, 2.0-2.9 CPU s of its workers' kernel time a round; from
# the heap, 0.6 million (benchmarks/vs_flower.py's work; docs/results.md). glibc's own settings serve them from the
# heap too, but in an arena per thread (up to 8 a core) and with a threshold that rises as mapped blocks are freed,
# and each arena kept its own peak of freed buffers resident: +68 MB over the fixed 64 KiB at 1000 devices. One arena
# for the whole process (the devices' threads take turns at the GIL anyway) and the threshold fixed above a model's
# buffers: +7 to +28 MB, every thread reusing what another freed. A buffer of this size or more is still mapped
# alone.
WORKER_MMAP_THRESHOLD_BYTES = 8 << 20
WORKER_ARENAS = 1
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)
# Linux (6.16 on) gives a process with threads a futex hash of its own: the table of wait queues that every futex
# wait and wake (a lock, a condition, the GIL's hand-over) looks up, a wake walking the queue of its slot. The kernel
# sizes it at 4 slots per thread but counts at most as many threads as online CPUs: 16 slots on a 2-core host,
# whatever the threads. A worker's device threads each wait on futexes of their own, so at 1430 devices a worker
# (10,000 on 2 cores) about 90 waiters shared each slot, and `futex_wake` alone took 5.4-5.6 % of the host's CPU in
# a round (`benchmarks/fleet_scale.py --perf`; docs/results.md). A worker sizes its table for its threads instead, at
# the kernel's 4 a thread, up to a power of two: 64 bytes a slot, 256 to 512 a device.
FUTEX_SLOTS_PER_THREAD = 4
THREADS_BESIDE_DEVICES = 16  # a worker's own (main, network, turns, the stop's watcher), with room
PR_FUTEX_HASH, PR_FUTEX_HASH_SET_SLOTS = 78, 1  # linux/prctl.h


def crowded(devices: int, cores: int) -> bool:
    """Whether `devices` on `cores` crowd the host (CROWDED_DEVICES_PER_CORE)."""
    return devices > CROWDED_DEVICES_PER_CORE * max(cores, 1)


def worker_niceness(devices: int, cores: int) -> int:
    """How much nicer than the fleet its workers run: WORKER_NICENESS on a crowded host, else 0."""
    return WORKER_NICENESS if crowded(devices, cores) else 0


def crowded_keepalive(devices: int, cores: int) -> int | None:
    """The keepalive of a fleet's clients: None (their own default) unless the host is crowded, then at least
    CROWDED_KEEPALIVE_S and long enough that all their pings keep within KEEPALIVES_PER_CORE_S a second per core."""
    if not crowded(devices, cores):
        return None
    budget = math.ceil(devices / (KEEPALIVES_PER_CORE_S * max(cores, 1)))
    return min(max(CROWDED_KEEPALIVE_S, budget), MQTT_MAX_KEEPALIVE_S)


def fleet_heartbeat(devices: int, cores: int, default_s: float) -> float | None:
    """The heartbeat of a fleet's devices: None (their own, `default_s`) while their heartbeats at that keep within
    HEARTBEATS_PER_CORE_S a second per core, else the longer one that does."""
    interval = devices / (HEARTBEATS_PER_CORE_S * max(cores, 1))
    return interval if interval > default_s else None


def ensure_descriptors(devices: int, who: str, per_device: int = DESCRIPTORS_PER_DEVICE) -> None:
    """Raise this process's soft limit on open files to what `devices` need at `per_device` each (a broker
    started later inherits it), or refuse in one line naming the fix where the hard limit does not allow it. A
    common default of 1024 broke a worker near 200 devices, with errors deep in SQLite or paho. The limit is per
    process: a fleet's workers and its broker each need only their own share."""
    import resource

    needed = BASE_DESCRIPTORS + per_device * devices
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"{who} needs about {needed} open files for {devices} devices, but the hard limit is {hard}: raise it "
            f"(ulimit -Hn {needed}, or LimitNOFILE={needed} for a systemd service) or run fewer devices per host")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


class ExitDeadline:
    """A stopping worker's last resort: from `arm()` on, the process has `seconds` to be gone. Past them
    faulthandler writes every thread's stack to the worker's log and ends the process, and where even that cannot
    run (late in the interpreter's exit, where faulthandler is already shut down) SIGALRM's default action ends it
    ALARM_AFTER_S later. The orderly stop is bounded at every step it takes itself, but not in what it waits on
    below Python: in CI a worker once outlived its SIGKILLed fleet by 15 minutes, stuck where 36 repeats here did
    not show."""

    def __init__(self, seconds: float, log_file: str) -> None:
        self.seconds = seconds
        self._log_file = log_file
        self._log: IO[str] | None = None  # open from arm() to the end: faulthandler writes to its descriptor

    def arm(self) -> None:
        """Start the count (once; later calls keep the first). Call from the main thread: SIGALRM's action is
        set there (host_devices)."""
        if self._log is not None:
            return
        self._log = open(self._log_file, "a")  # noqa: SIM115 (held until the process ends)
        faulthandler.dump_traceback_later(self.seconds, exit=True, file=self._log)
        if hasattr(signal, "alarm"):  # not on Windows, whose processes faulthandler alone ends
            signal.alarm(math.ceil(self.seconds) + ALARM_AFTER_S)


def _wait_for_stop(stop: Connection, stopping: Callable[[], None] = lambda: None) -> None:
    """Until the fleet says stop (closes its end of the pipe `stop`), SIGTERM arrives (from the fleet, or from the
    kernel when the fleet process dies: PR_SET_PDEATHSIG on Linux, even when it is killed by SIGKILL), or the parent
    is seen to have changed (every platform). A worker never outlives its fleet: `stopping()` is called as soon as
    any of these is seen, the signal included, so that an `ExitDeadline` counts from there even if this thread never
    gets out of its wait. The signal handler takes no lock: it sets a plain flag, which the wait below reads every
    PARENT_POLL_S, and calls `stopping`. Setting the fleet's multiprocessing Event (its word to stop before the
    pipe) from a handler that interrupted this thread's own wait on it deadlocks; so did a thread Event: SIGTERM
    comes twice when the fleet is killed (its own, and the kernel's), and the second handler, run inside the
    first's `Event.set`, waited for the lock the first held (a worker hung, its exit deadline never armed, 12
    minutes in the test of a killed fleet)."""
    # The fleet's pid as the spawn recorded it, not os.getppid() now: a fleet that died while this worker was still
    # starting (imports take seconds on a busy host) has already handed it to init, and a worker comparing against
    # that would wait forever (seen: two workers idle for 70 minutes after their fleet was killed at start-up).
    origin = mp.parent_process()
    parent = origin.pid if origin is not None and origin.pid is not None else os.getppid()
    signalled = False

    def on_sigterm(*_: object) -> None:
        nonlocal signalled
        signalled = True
        stopping()  # ExitDeadline.arm: once; a handler run inside another's arms nothing twice

    signal.signal(signal.SIGTERM, on_sigterm)
    die_with_parent()
    try:
        while not signalled:
            if os.getppid() != parent:
                logging.getLogger("edgefil.fleet").warning("the fleet process is gone: stopping the devices")
                return
            if stop.poll(PARENT_POLL_S):  # the fleet closed its end: told to stop
                return
    finally:
        stopping()


def fleet_log_level() -> int:
    """The level a fleet's workers and sites' aggregators log at: the one this process (the fleet's) set on
    RUNTIME_LOGGER, so that `edgefil --log-level WARNING fleet run` (or a Python caller's
    `logging.getLogger("edgefil").setLevel`) reaches the devices' lines in the workers' logs too; INFO where nothing
    set it, as they logged before they followed the fleet. Every device logs an INFO line a round (`trained
    round`): at 10,000 devices 10,000 lines a round, and 3-4 % of the workers' CPU besides training
    (docs/results.md), which a long, large fleet may not want."""
    return logging.getLogger(RUNTIME_LOGGER).level or logging.INFO


def host_devices(configs: list[dict[str, Any]], stop: Connection, log_file: str, power_loss_safe: bool,
                 niceness: int = 0, log_level: int = logging.INFO, failures: Connection | None = None) -> None:
    """A worker process: `serve_devices` until the fleet says stop, SIGTERM arrives or the fleet process is gone,
    and then gone within EXIT_DEADLINE_S, whatever it is stuck on (ExitDeadline). Ctrl-C is the parent's to
    handle. Its log, `log_file`, at `log_level` (`fleet_log_level`); each device out of the run goes to the fleet
    down `failures` (`FailureSender`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is the parent's to handle
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # ExitDeadline's floor: the default action ends the process
    logging.basicConfig(filename=log_file, level=log_level, format=LOG_FORMAT)
    lean_log_records()
    deadline = ExitDeadline(EXIT_DEADLINE_S, log_file)
    still_stopping = serve_devices(configs, lambda: _wait_for_stop(stop, deadline.arm), power_loss_safe, niceness,
                                   failed=FailureSender(failures) if failures is not None else None)
    if still_stopping:
        end_now(still_stopping, len(configs))


class FailureSender:
    """A worker process's word to its fleet that one of its devices is out of the run (`DeviceFailed`): the device
    and the line that says why, down a pipe the fleet reads (`ProcessWorkers.watch`); one device thread at a time."""

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()

    def __call__(self, device: str, why: str) -> None:
        with self._lock:
            try:
                self._pipe.send((device, why))
            except OSError:  # the fleet is gone: the worker stops on its own (`_wait_for_stop`)
                pass


def end_now(still_stopping: int, devices: int) -> NoReturn:
    """End a worker whose devices outlived the stop's grace as a power cut would end them (each device's store is
    crash-safe: a resume finds what it had committed), without the interpreter's exit hooks. Those would run beside
    the devices' threads: at 100,000 devices (4,167 a worker, still logging their exits) the 24 workers printed 19
    tracebacks a stop, "Exception ignored in atexit callback ... dictionary changed size during iteration", from
    weakref.finalize's registry (torch's, which ONNX Runtime Training 1.19.2 imports with onnxruntime)."""
    logging.getLogger("edgefil.fleet").warning(
        "%d of %d devices still stopping after %.0f s: the worker ends now, as a power cut would end them",
        still_stopping, devices, STOP_GRACE_S)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def lean_log_records() -> None:
    """A worker's log records without what LOG_FORMAT never prints: the caller's file and line (a walk up the
    stack), the thread's and the process's names and ids (the logging HOWTO's "Optimization"). Every device of a
    worker logs a line a round; a line took a 200-device fleet's device threads 0.10 ms, 30 % more than without
    these (alone: 14 us against 10)."""
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def batch_scheduling() -> None:
    """The worker's threads scheduled as batch work (Linux's SCHED_BATCH, which the threads started after it inherit):
    a thread that wakes another does not give way to it at once. A worker's threads all need its GIL, and a thread
    woken by the one holding it (a device whose turn is done, a device handed a message) preempted that holder only to
    wait for the GIL it still held. On the Flower comparison's work at 200 devices, alternated with the default
    scheduling (8 pairs): rounds 0.73-0.99x as long, median 0.87x, the fleet's CPU 0.73-0.98x (docs/results.md,
    "A worker's threads scheduled as batch work"). The coordinator and the broker keep the default, and a wakeup of
    theirs may still preempt a worker. The threads already running are set too (a library's pool, started at its
    import). Where the platform has no such policy or refuses it, the default stays."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread, and those it starts
        threads = [0]
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as err:
            logging.getLogger("edgefil.fleet").info("batch scheduling refused (%s): the default stays", err)
            return


def limit_torch_threads() -> None:
    """One torch intra-op thread per worker process (or `OMP_NUM_THREADS` where the user set it).

    A host runs several workers (and fleets) at once: torch's intra-op pool, one thread per core by default in
    every worker, would oversubscribe it many times over, and its OpenMP threads spin while they wait. Measured on a
    2-core host running two table1 fleets: 68 % of FedCIL's ACGAN time was spent inside libgomp, and the same ACGAN
    updates took 0.43 of the CPU on one thread (benchmarks/worker_threads.py). The environment variable only counts
    before torch is loaded; a worker
    spawned from a script that imported torch (multiprocessing's spawn re-imports the parent's main module, so
    every benchmark's workers) has already loaded it, so its pool is set directly. ORT sessions take their thread
    count from [trainer] threads."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            threads = 1
        torch.set_num_threads(threads)


def serve_devices(configs: list[dict[str, Any]], wait_for_stop: Callable[[], object], power_loss_safe: bool,
                  niceness: int = 0, failed: DeviceFailed | None = None) -> int:
    """Run the devices of `configs` (device config tables) until `wait_for_stop()` returns, then stop them: one
    thread per virtual device and one network thread that carries all their MQTT connections (edgefil.netloop). A
    worker process and a Ray actor (firmware_sim/fleet_ray.py) both host their devices with this. Their writes
    survive a power cut of the host only where `power_loss_safe` (`FleetConfig.power_loss_safe`; otherwise a
    killed worker: edgefil.durable). The process runs `niceness` nicer than it was started (`worker_niceness`), and
    builds a device only while fewer than CONNECTING_PER_WORKER of those built are not yet connected. A device that
    fails to start, or stops on an error before the stop, is logged here and told to `failed` with a line that says
    why: the coordinator learns of it from the fleet rather than waiting for a device that will not come. Returns
    how many devices were still stopping when the stop's grace (STOP_GRACE_S, for all together) ended."""
    set_power_loss_safe(power_loss_safe)
    if niceness and hasattr(os, "nice"):
        os.nice(niceness)  # (the kernel stops at 19)
    batch_scheduling()
    limit_torch_threads()
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
    set_worker_allocator()
    size_futex_hash(len(configs) + THREADS_BESIDE_DEVICES)
    ensure_descriptors(len(configs), "a fleet worker")
    from edge_client.config import DeviceConfig
    from edge_client.device import Device, run_until_stopped
    from edge_client.environment import Turns, TurnsClosed
    from edgefil.netloop import NetworkLoop
    from edgefil.wakeups import READERS_AWAKE, ReaderGate
    from firmware_sim.virtual_device import virtual_device

    devices: list[Device] = []
    lock = threading.Lock()
    # A message to every device (a round's global weights) wakes at most READERS_AWAKE of the worker's device threads
    # at once (edgefil/wakeups.py): all of them at once, each waiting for the GIL, kept a 100,000-device host in the
    # kernel for a whole round.
    network = NetworkLoop(name="fleet-worker-mqtt", readers=ReaderGate(READERS_AWAKE))
    # The devices take turns at CPU work: being built, starting a task, training, the policy's after-training
    # update, on the turns' one thread (edge_client/environment.py). Hundreds at once hold the GIL for seconds on
    # end and starve the network thread: keepalives lapse and the broker drops the connections (seen at 500
    # devices a worker).
    turns = Turns()
    connecting = threading.BoundedSemaphore(CONNECTING_PER_WORKER)

    def run(raw: dict[str, Any]) -> None:
        connecting.acquire()
        released = False

        def connected() -> None:  # the first connection, or the device's end: the next device may be built
            nonlocal released  # (called on this device's thread only)
            if not released:
                released = True
                connecting.release()

        try:
            raw = dict(raw)
            adversary = raw.pop(ADVERSARY, None)
            device = turns.run(lambda: virtual_device(DeviceConfig.from_dict(raw), network, turns, adversary,
                                                      stop_poll_s=None))  # woken by request_stop below
        except TurnsClosed:  # the stop came before it was built
            connected()
            return
        except Exception as err:
            connected()
            logging.getLogger("edgefil.fleet").exception("device %s failed to start", raw["device_id"])
            out_of_the_run(raw["device_id"], f"it failed to start: {error_line(err)}")
            return
        with lock:
            devices.append(device)
            if stopping.is_set():  # the stop came while it was being built: it stops before it runs (a fleet that
                device.request_stop()  # ended as its workers started waited out the whole grace for such devices)
        try:
            run_until_stopped(device, connected=connected)  # as a device waits for its broker, however long
        except Exception as err:  # refused by the broker, or failing: its own log line
            logging.getLogger("edgefil.fleet").error("device %s stopped: %s", raw["device_id"], err)
            out_of_the_run(raw["device_id"], f"it stopped: {error_line(err)}")
        finally:
            connected()

    def out_of_the_run(device: str, why: str) -> None:
        if failed is not None and not stopping.is_set():  # a device's error in the stop is the stop's
            failed(device, why)

    threads = [NamedThread(target=run, args=(raw,), daemon=True, name="device") for raw in configs]
    stopping = threading.Event()
    for thread in threads:
        thread.start()
    wait_for_stop()
    stopping.set()
    with lock:
        for device in devices:
            device.request_stop()
    turns.close()  # the turn running finishes; the devices waiting for theirs stop without them
    deadline = time.monotonic() + STOP_GRACE_S  # one grace period for all (a device mid-step finishes it first)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    network.stop()
    return sum(thread.is_alive() for thread in threads)


def set_worker_allocator() -> bool:
    """Set glibc's allocator in this process for a worker: WORKER_ARENAS arena(s), the mmap threshold fixed at
    WORKER_MMAP_THRESHOLD_BYTES (module comment); False where the C library is not glibc (it has no mallopt, or
    another allocator policy), which is left as it is, or where glibc refused either setting. Before the devices'
    threads start: a thread keeps the arena it took at its first allocation."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    arenas = mallopt(M_ARENA_MAX, WORKER_ARENAS)  # both asked for, whatever the other's answer
    threshold = mallopt(M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD_BYTES)
    return bool(arenas) and bool(threshold)


def size_futex_hash(threads: int) -> int | None:
    """Give this process a futex hash of FUTEX_SLOTS_PER_THREAD slots per thread for `threads` (a power of two, 16
    at least); the slots, or None where the system keeps no futex hash per process (Linux before 6.16, other
    systems), which is left as it is."""
    call = prctl()
    if call is None:
        return None
    slots = max(16, 1 << (FUTEX_SLOTS_PER_THREAD * max(threads, 1) - 1).bit_length())
    return slots if call(PR_FUTEX_HASH, PR_FUTEX_HASH_SET_SLOTS, slots, 0, 0) == 0 else None


def mount_disks(configs: list[dict[str, Any]]) -> list[Path]:
    """Each emulated device's state folder on a disk of its profile's capacity (firmware_sim/disk.py), on the
    machine this runs on: the folders mounted, for `disk.unmount` at the end. A folder that cannot be made (a file
    in its place) is said and passed over: its device cannot start either, and its worker tells the fleet so
    (`serve_devices`), which goes on without it."""
    from firmware_sim import disk
    from firmware_sim.profiles import load_profile

    mounted = []
    for raw in configs:
        emulation = raw.get("emulation")
        if emulation is not None:
            folder = Path(raw["state_dir"])
            try:
                if disk.mount(folder, load_profile(emulation["profile"]).disk_bytes):
                    mounted.append(folder)
            except OSError as err:
                logging.getLogger("edgefil.fleet").warning("no emulated disk for %s: %s", raw["device_id"],
                                                           error_line(err))
    return mounted
