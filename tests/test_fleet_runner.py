"""`edgefil fleet run`: virtual devices hosted by worker processes against a broker and the coordinator, all
started from one fleet file; Ctrl-C, SIGTERM and SIGHUP stop everything, SIGKILL leaves no process behind, and
`--resume` finishes the run (taking back device disks a killed run left mounted)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from fleet_harness import CEILING_S, default_signals

from coordinator.broker import mosquitto_path
from edgefil.link import BrokerSettings
from firmware_sim import fleet as fleet_module
from firmware_sim.fleet_worker import (
    BASE_DESCRIPTORS,
    CROWDED_DEVICES_PER_CORE,
    CROWDED_KEEPALIVE_S,
    DESCRIPTORS_PER_DEVICE,
    DEVICES_PER_WORKER,
    HEARTBEATS_PER_CORE_S,
    KEEPALIVES_PER_CORE_S,
    MQTT_MAX_KEEPALIVE_S,
    RUNTIME_LOGGER,
    WORKER_NICENESS,
    crowded_keepalive,
    fleet_heartbeat,
    fleet_log_level,
    worker_count,
    worker_niceness,
)
from firmware_sim.report import run_summary

ROOT = Path(__file__).resolve().parents[1]

FLEET = """
name = "mini"
out = "run"
devices = 4
workers = 2
broker = "{broker}"
scenario = {{preset = "digits-class", n_tasks = 3}}
profiles = {{raspberry-pi-4-4gb = 2, jetson-orin-nano = 2}}
[policy]
name = "random"
[store]
max_samples = 120
[client]
epochs = 2
[coordinator]
rounds_per_task = 2
min_clients = 4
deadline_s = 30.0
"""


def rounds_done(out: Path) -> int:
    path = out / "results.json"
    return json.loads(path.read_text())["rounds_completed"] if path.exists() else 0


def fleet(path: Path, *extra: str) -> subprocess.Popen:
    log = open(path.parent / "fleet.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(path), *extra],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_signals)


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def born(pids: list[int]) -> dict[int, int | None]:
    """Each of `pids` with when it started: the two name one process, which a pid alone does not once the kernel
    has given the number to another (pid_max is 32768 on some hosts, and a suite starts thousands)."""
    return {pid: start_ticks(pid) for pid in pids}


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field); None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int, started: int | None) -> bool:
    """Whether the process that was `pid` when it started at `started` (`born`) still runs (a zombie does not)."""
    try:
        running = "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return running and start_ticks(pid) == started


def test_ctrl_c_stops_the_fleet_cleanly_and_resume_finishes_the_run(tmp_path):
    path = tmp_path / "fleet.toml"
    # 30 rounds: a round can be done in 50 ms, so the run must not end between round 2 and the signal's landing;
    # its processes are looked at (slow on a busy host) before round 2, the signal sent as soon as round 2 is seen
    path.write_text(FLEET.format(broker="embedded").replace("rounds_per_task = 2", "rounds_per_task = 10"))
    out, log = tmp_path / "run", tmp_path / "fleet.log"
    proc = fleet(path)
    wait_rounds(proc, out, 1, log)
    workers = born(children_of(proc.pid))
    assert len(workers) >= 2  # the worker processes
    wait_rounds(proc, out, 2, log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(CEILING_S) == 130
    deadline = time.monotonic() + CEILING_S  # no worker left behind (multiprocessing's helper exits just after)
    while any(alive(*worker) for worker in workers.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(*worker) for worker in workers.items())
    kept = json.loads((out / "results.json").read_text())

    assert fleet(path, "--resume").wait(CEILING_S) == 0, (tmp_path / "fleet.log").read_text()[-3000:]
    final = json.loads((out / "results.json").read_text())
    assert final["rounds_completed"] == 30
    assert [r["round"] for r in final["history"]] == list(range(1, 31))
    assert final["history"][: len(kept["history"])] == kept["history"]
    assert all(len(r["received"]) == 4 for r in final["history"])
    # emulated (profiles in the fleet file): every update reports its round's time on its device, and a store
    # byte budget that leaves its disk room; no device ever stored more than that
    assert all(m["device_seconds"] > 0 for r in final["history"] for m in r["metrics"].values())
    storage = run_summary(final)["storage"]
    assert len(storage) == 4 and all(s["within_budget"] for s in storage.values())
    assert {"summary.md", "accuracy_matrix.png", "accuracy_per_task.png", "storage_traffic.png"} <= {
        p.name for p in out.iterdir()}  # the run's report
    assert sorted(p.name for p in (out / "devices").iterdir()) == [f"dev-{i:03d}" for i in range(4)]
    for log in (out / "logs").glob("worker-*.log"):  # each worker read its devices' data from the fleet's shares
        assert "the scenario's shares in" in log.read_text() and "are not used" not in log.read_text(), log.name


def test_a_worker_that_dies_ends_the_run_in_one_line_and_it_resumes(tmp_path):
    """A worker killed mid-run (as the kernel kills one for memory) took its devices with it: the run ends, failed
    with a line that names the worker, rather than going on with half the fleet (or, at min_clients, waiting for the
    lost devices up to wall_limit_s), its devices recorded offline; its checkpoint stays and --resume finishes the
    run."""
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="embedded").replace("rounds_per_task = 2", "rounds_per_task = 10")
                    .replace("min_clients = 4", "min_clients = 1"))  # the 2 devices left could go on alone
    out, log = tmp_path / "run", tmp_path / "fleet.log"
    proc = fleet(path)
    wait_rounds(proc, out, 1, log)
    workers = [pid for pid in children_of(proc.pid)
               if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")]
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    assert proc.wait(CEILING_S) == 2, log.read_text()[-3000:]
    said = [line for line in log.read_text().splitlines() if line.startswith("edgefil fleet run:")]
    assert len(said) == 1 and "fleet worker" in said[0] and "exit code -9" in said[0], log.read_text()[-3000:]
    ended = json.loads((out / "results.json").read_text())
    assert ended["outcome"].startswith("failed: RunAborted: fleet worker") and ended["rounds_completed"] < 30
    # the dead worker's devices are offline in the record (the fleet told the coordinator: their last wills did
    # not always come, and the run's end waited the whole END_GRACE_S for them), the other worker's said goodbye
    assert {(d["state"], d["online"]) for d in ended["devices"]} == {("offline", False)}, ended["devices"]

    assert fleet(path, "--resume").wait(CEILING_S) == 0, log.read_text()[-3000:]
    final = json.loads((out / "results.json").read_text())
    assert final["outcome"] == "complete" and final["rounds_completed"] == 30


@pytest.mark.parametrize("quorum", ["reachable", "out of reach"])
def test_a_device_that_fails_to_start_is_out_of_the_run_and_not_waited_for(tmp_path, quorum):
    """One device of four cannot start in its worker (its state folder is a file: a damaged run folder, which the
    fleet cannot mount its emulated disk on either): its worker tells the fleet, and the coordinator, which would
    otherwise wait for the whole roster up to wall_limit_s (virtual time), logs why and goes on without it: the run
    completes with the device "failed" and the reason in results.json. Where the quorum needs every device, the run
    ends at once in one line that says why."""
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="embedded").replace("rounds_per_task = 2", "rounds_per_task = 1")
                    .replace("min_clients = 4", "min_clients = 3" if quorum == "reachable" else "min_clients = 4"))
    out, log = tmp_path / "run", tmp_path / "fleet.log"
    (out / "devices").mkdir(parents=True)
    (out / "devices" / "dev-003").write_text("not a folder")
    code = fleet(path).wait(CEILING_S)
    said = log.read_text()
    assert re.search(r"ERROR device dev-003 is out of the run: it failed to start: \w+", said), said[-3000:]
    ended = json.loads((out / "results.json").read_text())
    failed = {d["device"]: d for d in ended["devices"] if d["state"] == "failed"}
    assert list(failed) == ["dev-003"] and failed["dev-003"]["error"].startswith("it failed to start"), failed
    assert not failed["dev-003"]["online"]
    if quorum == "reachable":
        assert code == 0, said[-3000:]
        assert ended["outcome"] == "complete" and ended["rounds_completed"] == 3
        assert ended["counters"]["device-failed"] == 1
    else:
        assert code == 2, said[-3000:]
        line = [line for line in said.splitlines() if line.startswith("edgefil fleet run:")]
        assert len(line) == 1 and "quorum of 4 cannot be reached" in line[0] and "dev-003" in line[0], line
        assert ended["rounds_completed"] == 0


def wait_rounds(proc: subprocess.Popen, out: Path, rounds: int, log: Path) -> None:
    deadline = time.monotonic() + CEILING_S
    while rounds_done(out) < rounds:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)  # a round can be done in 50 ms: seen soon after


def survivors(spawned: dict[int, int | None]) -> list[str]:
    """What each process of `spawned` (`born`) still alive runs: a failure's message."""
    left = []
    for pid, started in spawned.items():
        try:
            if alive(pid, started):
                left.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200])
        except FileNotFoundError:
            pass
    return left


def worker_logs(out: Path, lines: int = 30) -> str:
    """The last `lines` of each worker's log: a failure's message."""
    return "\n".join(f"{p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                     for p in sorted((out / "logs").glob("worker-*.log")))


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = children_of(todo.pop())
        found += children
        todo += children
    return found


def test_sigterm_sighup_and_sigkill_leave_no_process_or_mount_and_the_run_resumes(tmp_path):
    path = tmp_path / "fleet.toml"
    # 20 rounds: each run is stopped in its second new round (a round can be done in 50 ms, so the looking at its
    # processes, slow on a busy host, is done after its first, and the signal sent as soon as the second is seen:
    # the rounds a run gets done before its signal lands do not grow with the host's load). With mosquitto, its
    # devices are at a site: the site's broker and aggregator go with the fleet too
    site = "sites = 1\n" if mosquitto_path() is not None else ""
    path.write_text(site + FLEET.format(broker="auto").replace("n_tasks = 3", "n_tasks = 4")
                    .replace("rounds_per_task = 2", "rounds_per_task = 5"))
    out, log = tmp_path / "run", tmp_path / "fleet.log"
    disks = [out / "devices" / f"dev-{i:03d}" for i in range(4)]
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        resumed = rounds_done(out)
        proc = fleet(path, *(["--resume"] if resumed else []))
        wait_rounds(proc, out, resumed + 1, log)  # a new round: its workers and broker are up
        spawned = born(descendants(proc.pid))  # workers, the broker, multiprocessing's helper
        assert len(spawned) >= 3
        mounted = [os.path.ismount(d) for d in disks]
        wait_rounds(proc, out, resumed + 2, log)
        proc.send_signal(sig)
        assert proc.wait(CEILING_S) == (-signal.SIGKILL if sig == signal.SIGKILL else 130), log.read_text()[-3000:]
        deadline = time.monotonic() + CEILING_S  # a worker notices its parent is gone within a second
        while any(alive(*child) for child in spawned.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(*child) for child in spawned.items()), (sig, survivors(spawned), worker_logs(out))
        if sig == signal.SIGKILL:
            assert [os.path.ismount(d) for d in disks] == mounted  # left mounted: the next run takes them back
        else:
            assert not any(os.path.ismount(d) for d in disks)

    assert fleet(path, "--resume").wait(CEILING_S) == 0, log.read_text()[-3000:]
    final = json.loads((out / "results.json").read_text())
    assert final["outcome"] == "complete" and final["rounds_completed"] == 20
    assert [r["round"] for r in final["history"]] == list(range(1, 21))
    assert not any(os.path.ismount(d) for d in disks)
    assert "stopped (SIGTERM)" in log.read_text() and "stopped (SIGHUP)" in log.read_text()


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_fleet_runs_over_tls(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="mosquitto").replace('broker = "mosquitto"', 'broker = "mosquitto"\ntls = true')
                    .replace("n_tasks = 3", "n_tasks = 1").replace("profiles = ", "# profiles = "))
    log = tmp_path / "fleet.log"
    assert fleet(path).wait(CEILING_S) == 0, log.read_text()[-3000:]
    final = json.loads((tmp_path / "run" / "results.json").read_text())
    assert final["outcome"] == "complete" and final["rounds_completed"] == 2
    assert all(len(r["received"]) == 4 for r in final["history"])
    # the devices exit at the run's end and say so before the record is written: not "idle" or "training" there
    assert {(d["state"], d["online"]) for d in final["devices"]} == {("offline", False)}, final["devices"]
    conf = (tmp_path / "run" / "broker" / "mosquitto.conf").read_text()
    assert "certfile" in conf and "tls_version" in conf  # the only listener is the TLS one


def test_without_mosquitto_the_fleet_falls_back_to_the_embedded_broker_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fleet_module, "mosquitto_path", lambda: None)
    config = fleet_module.FleetConfig(name="mini", out=tmp_path, devices=2, scenario={"preset": "digits-class"})
    runner = fleet_module.Fleet(config)
    with caplog.at_level("WARNING"):
        broker = runner._start_broker()
    broker.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("falling back to the embedded broker, which has no authentication" in w for w in warnings), warnings
    tls = fleet_module.Fleet(fleet_module.FleetConfig(name="mini", out=tmp_path, devices=2, tls=True,
                                                      scenario={"preset": "digits-class"}))
    with pytest.raises(RuntimeError, match="tls = true needs mosquitto"):
        tls._start_broker()


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
@pytest.mark.parametrize("reads_learning", [False, True])
def test_the_fleet_files_observer_reads_what_carries_learning_only_when_it_says_so(tmp_path, reads_learning):
    config = fleet_module.FleetConfig(name="mini", out=tmp_path, devices=2, scenario={"preset": "digits-class"},
                                      broker="mosquitto", observer_reads_learning=reads_learning)
    broker = fleet_module.Fleet(config)._start_broker()
    try:
        acl = (tmp_path / "broker" / "acl").read_text()
    finally:
        broker.stop()
    observer = acl.split("user observer\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert ("topic read edgefil/mini/#" in observer) == reads_learning
    assert "topic read edgefil/mini/dev/+/status" in observer or reads_learning


def test_the_coordinator_takes_the_cores_the_workers_leave(monkeypatch):
    """OpenMP threads spin-wait on an oversubscribed host, so a fleet's coordinator runs on the cores its worker
    processes leave (at least one), and torch's own setting comes back afterwards."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for workers, threads in ((2, 6), (8, 1), (20, 1)):
        with fleet_module.coordinator_threads(workers):
            assert torch.get_num_threads() == threads
        assert torch.get_num_threads() == before


def test_a_worker_whose_fleet_died_while_it_started_stops(monkeypatch):
    """A fleet killed while its workers were still importing has handed them to init before they watch it: the
    worker compares against the fleet's pid as the spawn recorded it, so it stops at once instead of waiting for a
    stop that never comes."""
    import multiprocessing as mp
    import signal as signals
    import threading

    from firmware_sim import fleet_worker

    class Dead:
        pid = os.getppid() + 1_000_000  # not this process's parent: the fleet that spawned it is gone

    monkeypatch.setattr(fleet_worker.mp, "parent_process", lambda: Dead())
    monkeypatch.setattr(fleet_worker, "die_with_parent", lambda: None)
    handler = signals.getsignal(signals.SIGTERM)
    stop, said = mp.get_context("spawn").Pipe(duplex=False)
    backstop = threading.Timer(30, said.close)  # closed only if the worker missed its fleet's death and would hang
    backstop.start()
    try:
        fleet_worker._wait_for_stop(stop)
        assert not said.closed  # it returned on the dead fleet, not on the backstop's stop
    finally:
        backstop.cancel()
        signals.signal(signals.SIGTERM, handler)


def test_a_sigterm_inside_the_handler_of_another_does_not_hang_the_worker():
    """A killed fleet sends its workers SIGTERM twice (its own, and the kernel's for a dead parent). A second
    handler, run inside the first's `threading.Event.set`, waited for the lock the first held: a worker hung for
    12 minutes in the killed-fleet test. Here a SIGTERM lands at every line the first handler runs (a tracer sends
    them), and the wait returns, having called `stopping`."""
    script = """
import multiprocessing as mp, os, signal, sys, threading
from firmware_sim import fleet_worker

def handlers_in(frame):
    n = 0
    while frame is not None:
        n += frame.f_code.co_name == "on_sigterm"
        frame = frame.f_back
    return n

def tracer(frame, event, arg):
    def local(frame, event, arg):
        if event == "line" and handlers_in(frame) == 1:  # inside the first handler, at each of its lines
            os.kill(os.getpid(), signal.SIGTERM)
        return local
    return local

def first_signal():
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        threading.Event().wait(0.001)
    os.kill(os.getpid(), signal.SIGTERM)

calls = []
threading.Thread(target=first_signal, daemon=True).start()
sys.settrace(tracer)
stop, said = mp.get_context("spawn").Pipe(duplex=False)
fleet_worker._wait_for_stop(stop, lambda: calls.append(1))
sys.settrace(None)
print("stopping called", len(calls), "times")
"""
    try:  # a hung worker ignores the SIGTERM of an ordinary timeout: run's is a SIGKILL
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                              timeout=CEILING_S)
    except subprocess.TimeoutExpired:
        raise AssertionError("the worker hung in its SIGTERM handler") from None
    assert done.returncode == 0 and "stopping called" in done.stdout, done.stderr[-2000:]
    assert int(done.stdout.split()[-2]) >= 2  # the nested handlers ran too


def test_a_stopping_worker_stuck_past_its_deadline_writes_its_stacks_and_ends(tmp_path):
    """ExitDeadline: a worker that cannot finish its stop (here: its main thread waits on something that never
    comes) is ended once the deadline passes, with every thread's stack in its log to show where it was stuck."""
    log = tmp_path / "worker.log"
    script = f"""
import threading
from firmware_sim.fleet_worker import ExitDeadline
def stuck_in_the_stop():
    threading.Event().wait()
ExitDeadline(1.0, {str(log)!r}).arm()
stuck_in_the_stop()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=CEILING_S)
    assert done.returncode == 1, done.stderr
    text = log.read_text()
    assert text.startswith("Timeout (0:00:01)!") and "stuck_in_the_stop" in text


def test_a_worker_raises_its_open_files_limit_or_refuses_in_one_line():
    """A soft limit below what the devices need is raised (a broker started afterwards inherits it); a hard limit
    below it is refused with the fix named. In a child process: a lowered hard limit cannot be raised again."""
    script = """
import resource
from firmware_sim.fleet_worker import BASE_DESCRIPTORS, DESCRIPTORS_PER_DEVICE, ensure_descriptors
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
need = BASE_DESCRIPTORS + DESCRIPTORS_PER_DEVICE * 500
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, max(hard, need) if hard != resource.RLIM_INFINITY else hard))
ensure_descriptors(500, "a fleet worker")
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == need)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
try:
    ensure_descriptors(500, "a fleet worker")
except RuntimeError as err:
    print(err)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[0] == "True"
    need = BASE_DESCRIPTORS + DESCRIPTORS_PER_DEVICE * 500
    assert lines[1].startswith(f"a fleet worker needs about {need} open files for 500 devices, but the hard limit "
                               f"is 1024")
    assert f"ulimit -Hn {need}" in lines[1] and len(lines) == 2


def test_a_fleet_whose_workers_would_pass_the_open_files_limit_is_refused_before_they_start(tmp_path):
    """300 devices in one worker under a hard limit of 1024 open files: the fleet ends at once with the worker's
    line naming the fix, not with a worker dead in its log and a coordinator waiting for its devices."""
    def limited() -> None:
        default_signals()
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="mosquitto").replace("devices = 4", "devices = 300").replace(
        "workers = 2", "workers = 1").replace("profiles = ", "# profiles = "))
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=CEILING_S, preexec_fn=limited)
    assert done.returncode != 0
    assert "a fleet worker needs about" in done.stderr and "ulimit -Hn" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run" / "logs" / "worker-0.log").exists()


def test_a_coordinator_that_cannot_start_ends_the_fleet_in_one_line(tmp_path):
    """What only the coordinator sees as it starts, after the workers (here a damaged checkpoint to resume from; a
    rule's option the model does not take, such as GLFC's Gamma named for images on a signal, is the same path):
    the fleet ends with one line naming the file and why, its workers stopped at once, not with a traceback."""
    from coordinator.checkpoint import generation_dir
    from coordinator.server import CHECKPOINT_DIR

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="mosquitto").replace("profiles = ", "# profiles = ").replace(
        "devices = 4", "devices = 1").replace("workers = 2", "workers = 1").replace("min_clients = 4", "min_clients = 1"))
    damaged = generation_dir(tmp_path / "run" / CHECKPOINT_DIR, 1)
    damaged.mkdir(parents=True)
    (damaged / "state.json").write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(path), "--resume"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=CEILING_S, preexec_fn=default_signals)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(f"edgefil fleet: {path}: the coordinator cannot start: "), \
        done.stderr[-2000:]
    assert "round-000001" in done.stderr.splitlines()[-1]
    # its worker stopped when told, the device it was building included (that one ran on, unstopped, until the
    # worker was terminated past the stop's grace)
    assert "terminated" not in done.stderr, done.stderr[-2000:]


def test_a_worker_spawned_after_torch_was_loaded_still_runs_torch_on_one_thread():
    """A benchmark script imports torch before it spawns a fleet (spawn re-imports its main module in every
    worker), so OMP_NUM_THREADS set in the worker comes too late: the pool is set directly, to one thread, or to
    the user's OMP_NUM_THREADS."""
    script = """
import os, sys, torch
torch.set_num_threads(2)
os.environ.pop("OMP_NUM_THREADS", None)
if len(sys.argv) > 1:
    os.environ["OMP_NUM_THREADS"] = sys.argv[1]
from firmware_sim.fleet_worker import limit_torch_threads
limit_torch_threads()
print(torch.get_num_threads())
"""
    for argv, threads in (([], "1"), (["3"], "3"), (["x"], "1")):
        done = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [threads]


def test_workers_default_to_one_per_core_and_never_outnumber_the_devices(monkeypatch, tmp_path):
    """A worker is one Python process (one GIL), about one core of device work: left out of the fleet file,
    `workers` is the cores the fleet may use, or more where the devices outnumber what one worker's network thread
    keeps alive; a fleet file's own value is kept; either is capped at the devices."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="auto").replace("workers = 2\n", "").replace("devices = 4", "devices = 40")
                    .replace("profiles = {raspberry-pi-4-4gb = 2, jetson-orin-nano = 2}\n", ""))
    config = fleet_module.FleetConfig.load(path)
    cores = fleet_module.ProcessWorkers().cores()
    assert cores == 6

    def count(workers: int | None, devices: int) -> int:
        return worker_count(workers, devices, cores)

    assert config.workers is None and count(config.workers, config.devices) == 6
    assert count(3, config.devices) == 3
    assert count(None, 4) == 4
    # and more where one worker's network thread would carry more connections than it keeps alive
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, resource.RLIM_INFINITY))
    assert count(None, 20 * DEVICES_PER_WORKER) == 20
    # or where a worker's devices would need more open files than the host's hard limit allows one process
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, BASE_DESCRIPTORS + 1000 * DESCRIPTORS_PER_DEVICE))
    assert count(None, 20 * DEVICES_PER_WORKER) == 20 * DEVICES_PER_WORKER // 1000
    with pytest.raises(ValueError, match="at least 1"):
        dataclasses.replace(config, workers=0)


def test_clients_on_a_crowded_host_get_the_longer_keepalive():
    """Their network threads ping late on a crowded host; below the crowd, the devices keep their own default."""
    assert crowded_keepalive(CROWDED_DEVICES_PER_CORE * 2, 2) is None
    assert crowded_keepalive(CROWDED_DEVICES_PER_CORE * 2 + 1, 2) == CROWDED_KEEPALIVE_S
    assert crowded_keepalive(CROWDED_DEVICES_PER_CORE * 2 + 1, 3) is None
    assert CROWDED_KEEPALIVE_S > BrokerSettings.keepalive


def test_a_crowded_fleet_s_pings_keep_within_a_budget_per_core():
    """Past the crowded keepalive, a larger fleet pings less often: all its connections' pings together stay at
    KEEPALIVES_PER_CORE_S a second per core, never past what MQTT's 16-bit keepalive can say."""
    at_floor = int(KEEPALIVES_PER_CORE_S * 2 * CROWDED_KEEPALIVE_S)  # devices on 2 cores at the budget at 60 s
    assert crowded_keepalive(at_floor, 2) == CROWDED_KEEPALIVE_S
    for devices in (at_floor + 100, 100_000, 1_000_000):
        keepalive = crowded_keepalive(devices, 2)
        assert keepalive is not None and keepalive > CROWDED_KEEPALIVE_S
        assert devices / keepalive == pytest.approx(KEEPALIVES_PER_CORE_S * 2, rel=0.01)
    assert crowded_keepalive(100_000, 2) > crowded_keepalive(100_000, 4)
    assert crowded_keepalive(10**9, 2) == MQTT_MAX_KEEPALIVE_S


def test_a_crowded_fleet_s_workers_run_nicer_than_the_fleet(tmp_path):
    """On a crowded host the shared parts (coordinator, brokers, aggregators) get the CPU first: the workers run
    WORKER_NICENESS nicer than the fleet; below the crowd, at its niceness."""
    assert worker_niceness(CROWDED_DEVICES_PER_CORE * 2, 2) == 0
    assert worker_niceness(CROWDED_DEVICES_PER_CORE * 2 + 1, 2) == WORKER_NICENESS
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for niceness in (0, 3):
        workers = fleet_module.ProcessWorkers()
        workers.start([[]], tmp_path, tmp_path, niceness)
        try:
            pid = workers.processes[0].pid
            deadline = time.monotonic() + CEILING_S  # the worker nices itself once it has imported what it serves
            while os.getpriority(os.PRIO_PROCESS, pid) != ours + niceness or not (tmp_path / "worker-0.log").exists():
                assert time.monotonic() < deadline, f"the worker runs at {os.getpriority(os.PRIO_PROCESS, pid)}"
                time.sleep(0.05)
        finally:
            workers.stop()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this platform")
def test_a_worker_s_threads_are_scheduled_as_batch_work(tmp_path):
    """Every thread of a fleet worker runs under SCHED_BATCH (`batch_scheduling`): a thread it wakes does not preempt
    the one holding its GIL; the fleet's own process keeps its scheduling."""
    ours = os.sched_getscheduler(0)
    workers = fleet_module.ProcessWorkers()
    workers.start([[]], tmp_path, tmp_path, 0)
    try:
        pid = workers.processes[0].pid
        deadline = time.monotonic() + CEILING_S  # set once the worker has imported what it serves
        while os.sched_getscheduler(pid) != os.SCHED_BATCH or not (tmp_path / "worker-0.log").exists():
            assert time.monotonic() < deadline, f"the worker runs under policy {os.sched_getscheduler(pid)}"
            time.sleep(0.05)
        policies = {}
        for tid in (int(name) for name in os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
                policies[tid] = os.sched_getscheduler(tid)
        assert set(policies.values()) == {os.SCHED_BATCH}, policies
    finally:
        workers.stop()
    assert os.sched_getscheduler(0) == ours


def test_a_worker_s_log_lines_read_as_its_format_says_without_the_fields_it_never_prints(tmp_path):
    """A worker's records (`lean_log_records`, in a process of its own as a worker is) skip the caller's file and
    line and the thread's and process's names, which LOG_FORMAT never prints: the line is as before."""
    log_file = tmp_path / "worker.log"
    script = (
        "import logging\n"
        "from firmware_sim.fleet_worker import LOG_FORMAT, lean_log_records\n"
        f"logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO, format=LOG_FORMAT)\n"
        "lean_log_records()\n"
        "seen = []\n"
        "logging.getLogger('edgefil.fleet').addFilter(lambda record: seen.append(record) or True)\n"
        "logging.getLogger('edgefil.fleet').info('%s trained round %d', 'dev-7', 3)\n"
        "print([getattr(seen[0], name) for name in ('funcName', 'threadName', 'processName', 'process')])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CEILING_S,
                          cwd=ROOT, check=True)
    assert done.stdout.strip() == "['(unknown function)', None, None, None]"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} edgefil.fleet INFO dev-7 trained round 3\n",
                        log_file.read_text())


def test_a_fleet_s_workers_and_sites_log_at_the_level_the_command_was_given(tmp_path):
    """`edgefil --log-level WARNING fleet run` reaches the workers' and the sites' aggregators' logs: no device's
    INFO line (a `trained round` a device and round), no site's, while the devices train through their sites; a
    fleet process that sets no level leaves them at INFO."""
    runtime = logging.getLogger(RUNTIME_LOGGER)
    kept = runtime.level  # (a test before may have run the CLI in this process, which sets it)
    try:
        runtime.setLevel(logging.NOTSET)
        assert fleet_log_level() == logging.INFO  # nothing set: INFO, as before
        runtime.setLevel(logging.ERROR)
        assert fleet_log_level() == logging.ERROR
    finally:
        runtime.setLevel(kept)
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="mosquitto").replace("devices = 4", "devices = 2\nsites = 2")
                    .replace("min_clients = 4", "min_clients = 2").replace("rounds_per_task = 2", "rounds_per_task = 1")
                    .replace("n_tasks = 3", "n_tasks = 1").replace("profiles = ", "# profiles = "))
    with open(tmp_path / "fleet.log", "ab") as log:
        done = subprocess.run([sys.executable, "-m", "edgefil.cli", "--log-level", "WARNING", "fleet", "run", str(path)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=CEILING_S)
    assert done.returncode == 0, (tmp_path / "fleet.log").read_text()[-3000:]
    final = json.loads((tmp_path / "run" / "results.json").read_text())
    assert final["rounds_completed"] == 1 and len(final["history"][0]["received"]) == 2  # both devices trained
    logs = sorted((tmp_path / "run" / "logs").glob("worker-*.log")) + sorted((tmp_path / "run" / "logs").glob("site-*"))
    assert len(logs) == 4
    for log_file in logs:
        assert " INFO " not in log_file.read_text(), f"{log_file.name}: {log_file.read_text()[-2000:]}"


def test_a_fleet_s_heartbeats_keep_within_a_budget_per_core(tmp_path):
    """Heartbeats cost the worker, the broker and the coordinator CPU for each device: a fleet whose devices would
    beat more than HEARTBEATS_PER_CORE_S a second per core at their default gets a longer heartbeat that keeps them
    at the budget (longer the larger the fleet); below it they keep the device's own."""
    from edge_client.config import DeviceConfig, StoreSettings

    default = DeviceConfig.heartbeat_s
    within = int(HEARTBEATS_PER_CORE_S * 2 * default)  # devices on 2 cores that beat at the budget at their default
    assert fleet_heartbeat(within, 2, default) is None
    for devices in (within + 1, 3000, 10_000):
        beat = fleet_heartbeat(devices, 2, default)
        assert beat is not None and beat > default
        assert devices / beat == pytest.approx(HEARTBEATS_PER_CORE_S * 2)  # the whole fleet, at the budget
    assert fleet_heartbeat(10_000, 4, default) == pytest.approx(fleet_heartbeat(10_000, 2, default) / 2)
    fleet = fleet_module.Fleet(fleet_module.FleetConfig(name="mini", out=tmp_path, devices=2,
                                                        scenario={"preset": "digits-class"},
                                                        store=StoreSettings(max_samples=10)))
    fleet.broker = types.SimpleNamespace(address=types.SimpleNamespace(host="127.0.0.1", port=1, cafile=None))
    fleet.passwords = {device: "pw" for device in fleet.config.device_ids}
    assert "heartbeat_s" not in fleet.device_config(0, tmp_path)
    fleet.heartbeat = fleet_heartbeat(10_000, 2, default)
    assert DeviceConfig.from_dict({**fleet.device_config(0, tmp_path), "data": None}).heartbeat_s == \
        fleet.heartbeat


def test_each_device_s_profile_and_id_follow_the_fleet_s_layout(tmp_path):
    """Device k's id and profile, as its config is built (one device at a time, not from lists of the whole
    fleet): the profiles' counts laid out in the order the fleet file gives them."""
    base = {"name": "mini", "out": tmp_path, "scenario": {"preset": "digits-class"}}
    mixed = fleet_module.FleetConfig(devices=5, profiles={"raspberry-pi-zero-2w": 2, "jetson-nano": 3}, **base)
    assert [mixed.device_profile(k) for k in range(5)] == ["raspberry-pi-zero-2w"] * 2 + ["jetson-nano"] * 3
    assert [mixed.device_id(k) for k in range(5)] == mixed.device_ids == [f"dev-{k:03d}" for k in range(5)]
    plain = fleet_module.FleetConfig(devices=3, **base)
    assert [plain.device_profile(k) for k in range(3)] == [None] * 3


def test_a_ray_fleet_is_checked_before_anything_starts(tmp_path):
    """`backend` and `[ray]` refused in one line: an unknown backend, a cluster behind the embedded broker (no
    authentication, reached over the network), a typo in `[ray]`."""
    from firmware_sim.fleet_ray import RaySettings

    base = {"name": "mini", "out": tmp_path, "devices": 2, "scenario": {"preset": "digits-class"}}
    with pytest.raises(ValueError, match="backend must be processes or ray"):
        fleet_module.FleetConfig(**base, backend="slurm")
    with pytest.raises(ValueError, match="on a cluster needs mosquitto"):
        fleet_module.FleetConfig(**base, backend="ray", broker="embedded", ray=RaySettings(address="auto"))
    fleet_module.FleetConfig(**base, backend="ray", broker="embedded")  # Ray on this machine: loopback is fine
    with pytest.raises(ValueError, match="max_restarts"):
        RaySettings(max_restarts=-2)
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="auto") + '[ray]\nadress = "auto"\n')
    with pytest.raises(ValueError, match=r"\[ray\].*adress"):
        fleet_module.FleetConfig.load(path)


def test_the_fleet_files_learner_table_reaches_the_devices_with_the_kinds_mask_default(tmp_path):
    """[learner] is the devices' table: what it sets wins, `mask_seen_classes` left out is the scenario kind's
    measured default, `between_rounds` left out is "disk" (a fleet host's devices park between rounds), and a typo
    is refused in one line before anything starts."""
    from edgefil.settings import ConfigError, Where
    from firmware_sim.scenarios import check_scenario

    def config(scenario: dict, learner: dict) -> fleet_module.FleetConfig:
        return fleet_module.FleetConfig(name="mini", out=tmp_path, devices=2, scenario=scenario, learner=learner)

    for preset in ("digits-class", "digits-domain"):
        data = check_scenario({"preset": preset, "n_clients": 2}, Where("t")).build()
        default = data.scenario.kind_class().masks(data.scenario)
        assert config({"preset": preset}, {}).learner_options(data) == {"mask_seen_classes": default,
                                                                         "between_rounds": "disk"}
        chosen = config({"preset": preset}, {"mask_seen_classes": not default, "batch_size": 16,
                                             "between_rounds": "memory"})
        assert chosen.learner_options(data) == {"mask_seen_classes": not default, "batch_size": 16,
                                                "between_rounds": "memory"}
    with pytest.raises(ConfigError, match=r"\[learner\].*mask_seen_class"):
        config({"preset": "digits-class"}, {"mask_seen_class": False}).check()
    with pytest.raises(ConfigError, match=r"\[learner\].*between_rounds"):
        config({"preset": "digits-class"}, {"between_rounds": "ram"}).check()


def test_a_worker_keeps_model_sized_buffers_in_one_heap_and_maps_only_larger_ones():
    """Past `set_worker_allocator`, a model-sized buffer (LeNet's weights, 121 KiB) that another thread than the main
    one allocates comes from the process's one heap, not an arena of that thread's own as with glibc's own settings
    (where each arena kept its own peak of freed buffers); and a buffer of twice WORKER_MMAP_THRESHOLD_BYTES lies
    outside the heap (mapped alone, unmapped when freed) even after a larger mapped block was freed, which raises
    glibc's own threshold so that such a buffer comes from the heap. Each in a child process: the allocator's
    settings are the process's."""
    script = """
import ctypes, sys, threading
from firmware_sim.fleet_worker import WORKER_MMAP_THRESHOLD_BYTES, set_worker_allocator

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
fixed = sys.argv[1] == "fixed" and set_worker_allocator()
threaded = []
thread = threading.Thread(target=lambda: threaded.append(libc.malloc(121 << 10)))
thread.start()
thread.join()
libc.free(libc.malloc(30 << 20))  # a mapped block freed: glibc's own threshold rises to 30 MiB
block = libc.malloc(WORKER_MMAP_THRESHOLD_BYTES * 2)
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
start, end = (int(a, 16) for a in heap[0].split("-"))
print(fixed, start <= threaded[0] < end, start <= block < end)
"""
    outputs = []
    for mode in ("glibc", "fixed"):
        done = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.split())
    assert outputs == [["False", "False", "True"], ["True", "True", "False"]]


def test_a_worker_sizes_its_futex_hash_for_its_threads_and_keeps_it_as_threads_start():
    """`size_futex_hash` gives the process FUTEX_SLOTS_PER_THREAD slots a thread, up to a power of two, where the
    kernel sizes the table of a process with threads by its CPUs (16 slots on 2 cores, however many threads); the
    size holds as the devices' threads start. In a child process: the table is the process's. Skipped where the
    kernel keeps no futex hash per process (before Linux 6.16)."""
    script = """
import ctypes, threading
from firmware_sim.fleet_worker import size_futex_hash

def slots():
    return ctypes.CDLL(None).prctl(78, 2, 0, 0, 0)  # PR_FUTEX_HASH, PR_FUTEX_HASH_GET_SLOTS

sized = size_futex_hash(1500)
release = threading.Event()
threads = [threading.Thread(target=release.wait) for _ in range(300)]
for thread in threads:
    thread.start()
print(sized, slots())
release.set()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    sized, slots = done.stdout.split()
    if sized == "None":
        pytest.skip("this kernel keeps no futex hash per process (Linux before 6.16)")
    assert int(sized) == int(slots) == 8192  # 4 x 1500 = 6000 slots, up to a power of two


def test_a_method_whose_files_can_never_fit_m_is_refused_in_one_line_before_any_worker_starts(tmp_path):
    """FedCIL's ACGAN at width 64 (570 KB) cannot be replaced within half of a 300 KB M: the fleet builds its first
    device before the workers start and says so in one line, where a coordinator in virtual time would wait for
    devices that never come."""
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="auto").replace('name = "random"', 'name = "fedcil"\nwidth = 64')
                    .replace("max_samples = 120", "max_samples = 120\nmax_bytes = 300000")
                    .replace("profiles = ", "# profiles = "))
    process = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(path)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=CEILING_S)
    assert process.returncode == 2
    last = process.stderr.strip().splitlines()[-1]
    assert "a device cannot start with these tables: policy fedcil: replacing its ACGAN" in last, process.stderr
    assert not (tmp_path / "run" / "results.json").exists() and not list((tmp_path / "run" / "logs").glob("worker-*"))


def test_a_fleet_worker_s_devices_write_for_a_power_cut_only_where_the_fleet_file_asks(monkeypatch, tmp_path):
    """Left out of the fleet file, `power_loss_safe` is false: a worker's devices write without syncs (a killed
    worker loses nothing they committed; the host's power cut is not emulated); `power_loss_safe = true` keeps
    them. The workers are given the fleet's choice, and a worker applies it before its devices start."""
    from edgefil import durable
    from firmware_sim import fleet_worker

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(broker="auto"))
    assert fleet_module.FleetConfig.load(path).power_loss_safe is False
    path.write_text("power_loss_safe = true\n" + FLEET.format(broker="auto"))
    assert fleet_module.FleetConfig.load(path).power_loss_safe is True
    assert fleet_module.ProcessWorkers(True).power_loss_safe and not fleet_module.ProcessWorkers().power_loss_safe
    monkeypatch.setattr(durable, "_power_loss_safe", True)  # restored after the test, as are the process-wide
    monkeypatch.setattr(sys, "setswitchinterval", lambda _: None)  # settings a worker makes
    monkeypatch.setattr(fleet_worker, "set_worker_allocator", lambda: True)
    monkeypatch.setattr(fleet_worker, "size_futex_hash", lambda _: None)
    monkeypatch.setattr(fleet_worker, "limit_torch_threads", lambda: None)
    seen = []
    for safe in (False, True):
        fleet_worker.serve_devices([], lambda: seen.append(durable.power_loss_safe()), safe)
    assert seen == [False, True]
