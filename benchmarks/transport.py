"""Transport overhead of one round (N devices, no training) against mosquitto's own clients moving the same bytes.

One real mosquitto (MosquittoBroker: loopback, a password per device, the fleet's ACL) serves both methods, timed
in the same run:

edgefil round: the coordinator side in this process (a Link with the coordinator's credentials on
`edgefil/<fleet>/dev/+/+`, an Inbox, an OpenRound) and N device processes, each a minimal echo device made only of
the protocol's pieces: a Link with its own credentials on its own topics, a wire.Reassembler for the weight chunks,
and on the round message (once it has the round's model) an update of the very same weights, encoded with
wire.encode_blob and published on its update topic as frames (as a device does). The clock runs from encoding the
global weights into chunks (as the coordinator's outbox does, as frames) and publishing them and the N round
messages, to the last of the N updates
reassembled, validated by the Inbox and accepted by the OpenRound. New weights every round.

mosquitto clients: downlink = one mosquitto_pub to N mosquitto_sub; then uplink = N concurrent mosquitto_pub to
one mosquitto_sub. The broker makes every client's id its username, so each client has its own account, with the
rights its side has in a fleet: the downlink sender is the coordinator's account (the coordinator's Link is
disconnected while the clients run), the uplink senders are device accounts writing their own update topics, the
receivers are observers (read-only). Every sender sends the model as the same number of equal-sized messages as edgefil's chunks:
one `mosquitto_pub -f <chunk file> --repeat <chunks> --repeat-delay 0.002` (mosquitto_pub has no way to send
several files in one connection; --repeat waits for each PUBACK, then the delay; with a delay under 2 ms its
loop polls with a zero timeout and spins a core, which on a small machine slows everything else). QoS 1 both
ways; the subscribers are started and have their SUBACK before the clock starts; the clock runs from the first
pub's start to the last sub's exit. The clients' start-up (process start, connect, authentication, one publish,
disconnect) is timed as 1 then N concurrent mosquitto_pub of a 1-byte message, and is shown subtracted as well.
(Not the whole procedure with 1-byte messages: a message that small reaches a mosquitto_sub about 40 ms late here,
a small-packet TCP delay that the ~1 MB messages do not hit, so it would overstate the start-up.)

A second table gives the CPU seconds each method spent per round, split by process (from /proc): on a machine
with few cores and many processes, wall time follows total CPU time.

    .venv/bin/python benchmarks/transport.py [--devices 20] [--params 100000,1000000,11000000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt

from edgefil import topics, wire
from edgefil.link import CONNECTED, BrokerSettings, Link, Message

FLEET = "bench"
MANIFEST = "transport-benchmark"
COORDINATOR = "coordinator"
STOP = "$stop"  # device worker inbox marker: the parent closed our stdin
REPEAT_DELAY_S = "0.002"  # the smallest --repeat-delay at which mosquitto_pub does not spin (see the docstring)
ROUND_TIMEOUT_S = 600.0
CLIENT_TIMEOUT_S = 300.0


# --- the device side (a worker process) ----------------------------------------------------------------------

def device_worker(device_id: str, host: str, port: int, max_parameters: int) -> None:
    """Echo device: on a round message whose model it holds, upload the same weights as its update."""
    password = sys.stdin.readline().rstrip("\n")
    link = Link(
        BrokerSettings(host, port, username=device_id, password=password), client_id=device_id,
        subscriptions=topics.device_subscriptions(FLEET, device_id),
    )

    def stop_on_eof() -> None:  # the parent closes our stdin to stop us (or dies, which closes it too)
        sys.stdin.read()
        link.inbox.put(Message(STOP, b""))

    threading.Thread(target=stop_on_eof, daemon=True).start()
    reassembler = wire.Reassembler(max_blob_bytes=4 * max_parameters, max_pending=4)
    models: OrderedDict[str, wire.Blob] = OrderedDict()
    waiting: wire.Message | None = None
    update_topic = topics.from_device(FLEET, device_id, "update")

    def echo(round_message: wire.Message) -> None:
        blob = models[round_message["model"]]
        weights = blob.weights(round_message["config"]["num_parameters"])
        for frame in wire.encode_blob(
            "update", wire.weights_bytes(weights), device=device_id, round=round_message["round"],
            task=round_message["task"], model=round_message["model"], num_samples=1, metrics={},
        ).frames:
            link.publish(update_topic, frame)

    try:
        link.start()
        while True:
            item = link.get(timeout=None)
            topic, payload = item.topic, item.payload
            if topic == STOP:
                break
            if topic == CONNECTED:
                link.publish(topics.from_device(FLEET, device_id, "register"), wire.encode(
                    "register", device=device_id, profile="echo", backend="none", manifest=MANIFEST,
                    software="benchmarks/transport.py",
                ))
                continue
            message = wire.decode(payload)
            if message["kind"] == "weights":
                blob = reassembler.add("coordinator", message)
                if blob is None:
                    continue
                models[blob.id] = blob
                while len(models) > 1:
                    models.popitem(last=False)
                if waiting is None or waiting["model"] not in models:
                    continue
                message, waiting = waiting, None
            if message["kind"] == "round":
                if message["model"] in models:
                    echo(message)
                else:
                    waiting = message  # its weights are still on their way
    except KeyboardInterrupt:
        pass
    finally:
        link.stop()


# --- process bookkeeping ------------------------------------------------------------------------------------

_children: list[subprocess.Popen] = []


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(args, **kwargs)
    _children.append(proc)
    return proc


def reap(proc: subprocess.Popen, timeout: float, what: str) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish in {timeout:.0f} s") from None
    if code != 0:
        raise RuntimeError(f"{what} exited with code {code}")
    _children.remove(proc)


def stop_children() -> None:
    """Workers first get EOF on stdin; anything still running is terminated, then killed."""
    for proc in _children:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + 5.0
    for proc in _children:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in _children:
        try:
            proc.wait(3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _children.clear()


# --- CPU accounting -------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass(frozen=True)
class Cpu:
    """CPU seconds spent by: this process (all threads), the device workers, the broker, reaped children."""

    this: float
    devices: float
    broker: float
    children: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.this - other.this, self.devices - other.devices, self.broker - other.broker,
                   self.children - other.children)


class CpuMeter:
    def __init__(self, broker_pid: int, worker_pids: list[int]) -> None:
        self.broker_pid = broker_pid
        self.worker_pids = worker_pids

    def __call__(self) -> Cpu:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return Cpu(time.process_time(), sum(process_cpu(pid) for pid in self.worker_pids),
                   process_cpu(self.broker_pid), children.ru_utime + children.ru_stime)


# --- the coordinator side ------------------------------------------------------------------------------------

class Coordinator:
    def __init__(self, address, password: str, devices: list[str], workers: list[subprocess.Popen]) -> None:
        self.devices = devices
        self.workers = workers
        self.settings = BrokerSettings(address.host, address.port, username=COORDINATOR, password=password)
        self.link = self.connect()
        self.number = 0

    def connect(self) -> Link:
        link = Link(self.settings, client_id=COORDINATOR, subscriptions=[f"{topics.prefix(FLEET)}/dev/+/+"])
        link.start()
        return link

    def pause(self) -> None:
        """Disconnect (the clients' run uses the coordinator's account); `resume` connects again."""
        self.stop()

    def resume(self) -> None:
        self.link = self.connect()

    def _next(self, timeout: float) -> tuple[str, bytes] | None:
        item = self.link.get(timeout=min(timeout, 1.0))
        if item is None:
            dead = [w.args[3] for w in self.workers if w.poll() is not None]
            if dead:
                raise RuntimeError(f"device workers exited: {', '.join(dead)}")
        return item

    def wait_registered(self, timeout: float = 120.0) -> None:
        from coordinator.inbox import Inbox, Registration

        inbox = Inbox(FLEET, set(self.devices), MANIFEST, 1)
        registered: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(registered) < len(self.devices):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(registered)} of {len(self.devices)} devices registered in {timeout:.0f} s")
            item = self._next(deadline - time.monotonic())
            if item is not None and item[0] != CONNECTED:
                event = inbox.accept(*item)
                if isinstance(event, Registration):
                    registered.add(event.device)

    def round(self, weights: np.ndarray, meter: CpuMeter) -> tuple[float, Cpu]:
        """One round without training: its seconds (see the module docstring for what the clock covers) and the
        CPU time spent meanwhile."""
        from coordinator.inbox import Inbox, Update
        from coordinator.rounds import OpenRound

        self.number += 1
        number, n = self.number, len(weights)
        inbox = Inbox(FLEET, set(self.devices), MANIFEST, n)
        counts: Counter[str] = Counter()
        received: dict[str, np.ndarray] = {}
        cpu = meter()
        started = time.perf_counter()
        encoded = wire.encode_blob("weights", wire.weights_bytes(weights), round=number, version=number - 1)
        model = encoded.id
        current = OpenRound.open(number, 0, model, list(self.devices), ROUND_TIMEOUT_S)
        for frame in encoded.frames:
            self.link.publish(topics.to_all(FLEET, "weights"), frame)
        for device in self.devices:
            self.link.publish(topics.to_device(FLEET, device, "round"), wire.encode(
                "round", round=number, task=0, model=model, version=number - 1, deadline_s=current.remaining_s(),
                config={"num_parameters": n},
            ))
        while not current.complete:
            if current.remaining_s() <= 0:
                raise RuntimeError(f"round {number}: no update from {', '.join(current.missing())}")
            item = self._next(current.remaining_s())
            if item is None or item[0] == CONNECTED:
                continue
            event = inbox.accept(*item)
            if isinstance(event, Update) and current.offer(event, counts) is None:
                received[event.device] = event.weights
        elapsed = time.perf_counter() - started
        cpu = meter() - cpu
        if counts or inbox.rejections:
            raise RuntimeError(f"round {number}: dropped {dict(counts)}, rejected {dict(inbox.rejections)}")
        for device, echoed in received.items():
            if not np.array_equal(echoed, weights):
                raise RuntimeError(f"round {number}: {device} sent back other weights")
        return elapsed, cpu

    def stop(self) -> None:
        self.link.wait_idle(2.0)
        self.link.stop()


# --- the baseline: mosquitto's own clients ---------------------------------------------------------------------

def uplink_topic(k: int | str) -> str:
    """Where uplink sender k writes: its account's own update topic ("+": all of them)."""
    if k == "+":
        return f"{topics.prefix(FLEET)}/{topics.FROM_DEVICE}/+/update"
    return topics.from_device(FLEET, uplink_account(int(k)), "update")


def uplink_account(k: int) -> str:
    return f"c{k:03d}"


def downlink_account(k: int) -> str:
    return f"o{k:03d}"


UPLINK_READER = "oup"


@dataclass(frozen=True)
class Clients:
    """mosquitto_pub/sub with their options (host, port, user, password, QoS 1) in $XDG_CONFIG_HOME files, one
    per account, so no password is on any command line."""

    workdir: Path
    envs: dict[str, dict[str, str]]  # account -> the environment naming its options file
    pub: str
    sub: str

    @classmethod
    def configure(cls, workdir: Path, address, passwords: dict[str, str]) -> Clients:
        envs = {}
        for account, password in passwords.items():
            config = workdir / "clients" / account
            config.mkdir(parents=True)
            options = f"-h {address.host}\n-p {address.port}\n-u {account}\n-P {password}\n-q 1\n"
            for name in ("mosquitto_pub", "mosquitto_sub"):
                fd = os.open(config / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(options)
            envs[account] = {**os.environ, "XDG_CONFIG_HOME": str(config)}
        pub, sub = shutil.which("mosquitto_pub"), shutil.which("mosquitto_sub")
        if not pub or not sub:
            raise RuntimeError("mosquitto_pub/sub not found (Debian/Ubuntu: apt-get install mosquitto-clients)")
        return cls(workdir, envs, pub, sub)

    def subscribe(self, account: str, topic: str, count: int, name: str) -> subprocess.Popen:
        """A mosquitto_sub that exits after `count` messages, returned once the broker acknowledged its SUBSCRIBE.
        It prints each payload's length instead of the payload (-F %l); -d prints the SUBACK (line-buffered)."""
        log = self.workdir / f"{name}.out"
        with open(log, "wb") as out:
            proc = spawn(["stdbuf", "-oL", self.sub, "-d", "-t", topic, "-C", str(count), "-F", "%l"],
                         env=self.envs[account], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while b"received SUBACK" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto_sub got no SUBACK: {log.read_text(errors='replace')[-500:]}")
            time.sleep(0.002)
        return proc

    def publish(self, account: str, topic: str, message_file: Path, count: int) -> subprocess.Popen:
        repeat = ["--repeat", str(count), "--repeat-delay", REPEAT_DELAY_S] if count > 1 else []
        return spawn([self.pub, "-t", topic, "-f", str(message_file), *repeat], env=self.envs[account],
                     stdin=subprocess.DEVNULL)

    def startup(self, message_file: Path, senders: int) -> float:
        """The clients' fixed cost: 1 mosquitto_pub, then `senders` concurrent ones, of a 1-byte message to a topic
        nobody reads (process start, connect, authenticate, publish, PUBACK, disconnect), to the last exit."""
        started = time.perf_counter()
        reap(self.publish(COORDINATOR, f"{topics.prefix(FLEET)}/clients/startup", message_file, 1), CLIENT_TIMEOUT_S,
             "mosquitto_pub")
        for k, proc in enumerate([self.publish(uplink_account(k), uplink_topic(k), message_file, 1)
                                  for k in range(senders)]):
            reap(proc, CLIENT_TIMEOUT_S, f"mosquitto_pub {k}")
        return time.perf_counter() - started

    def round(self, message_file: Path, count: int, senders: int, meter: CpuMeter) -> tuple[float, Cpu]:
        """Downlink (1 pub -> `senders` subs) then uplink (`senders` pubs -> 1 sub), `count` messages per sender."""
        down = f"{topics.prefix(FLEET)}/clients/down"
        down_subs = [self.subscribe(downlink_account(k), down, count, f"down{k}") for k in range(senders)]
        up_sub = self.subscribe(UPLINK_READER, uplink_topic("+"), count * senders, "up")
        cpu = meter()
        started = time.perf_counter()
        down_pub = self.publish(COORDINATOR, down, message_file, count)
        for k, proc in enumerate(down_subs):
            reap(proc, CLIENT_TIMEOUT_S, f"downlink mosquitto_sub {k}")
        up_pubs = [self.publish(uplink_account(k), uplink_topic(k), message_file, count) for k in range(senders)]
        reap(up_sub, CLIENT_TIMEOUT_S, "uplink mosquitto_sub")
        elapsed = time.perf_counter() - started
        reap(down_pub, CLIENT_TIMEOUT_S, "downlink mosquitto_pub")
        for k, proc in enumerate(up_pubs):
            reap(proc, CLIENT_TIMEOUT_S, f"uplink mosquitto_pub {k}")
        return elapsed, meter() - cpu  # the pubs have exited by now: all their CPU is in `children`


# --- the run ------------------------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def mosquitto_version() -> str:
    done = subprocess.run(["mosquitto_pub", "--help"], capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines():
        if "version" in line:
            return line.split("version", 1)[1].split()[0]
    return "?"


def label(params: int) -> str:
    return f"{params / 1e6:g}M" if params >= 1_000_000 else f"{params / 1e3:g}K"


def quotient(numerator: float, denominator: float, spec: str) -> str:
    """numerator / a start-up-subtracted time, or '-' where the subtraction left nothing."""
    return format(numerator / denominator, spec) if denominator > 0 else "-".rjust(int(spec.split(".")[0]))


def spread(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def run(args: argparse.Namespace) -> None:
    from coordinator.broker import Credentials, MosquittoBroker, generate_password

    sizes = [int(p) for p in args.params.split(",")]
    devices = [f"d{k:03d}" for k in range(args.devices)]
    passwords = {d: generate_password() for d in devices}
    uplink = {uplink_account(k): generate_password() for k in range(args.devices)}
    readers = {name: generate_password() for name in [*map(downlink_account, range(args.devices)), UPLINK_READER]}
    coordinator_password = generate_password()
    rng = np.random.default_rng(0)
    workdir = Path(tempfile.mkdtemp(prefix="edgefil-transport-"))
    broker = coordinator = None
    try:
        broker = MosquittoBroker(
            workdir / "broker", FLEET, {**passwords, **uplink}, Credentials(COORDINATOR, coordinator_password),
            max_packet_bytes=max(2 * 1024 * 1024, wire.MAX_MESSAGE_BYTES + 64 * 1024), observers=readers,
        )
        broker.start()
        address = broker.address
        workers: list[subprocess.Popen] = []
        # The coordinator subscribes before any device starts: a device registers once, on connecting.
        coordinator = Coordinator(address, coordinator_password, devices, workers)
        for device in devices:
            worker = spawn([sys.executable, os.path.abspath(__file__), "--device-worker", device, address.host,
                            str(address.port), str(max(sizes))], stdin=subprocess.PIPE, text=True)
            worker.stdin.write(passwords[device] + "\n")
            worker.stdin.flush()
            workers.append(worker)
        coordinator.wait_registered()
        clients = Clients.configure(workdir, address, {COORDINATOR: coordinator_password, **uplink, **readers})
        # MosquittoBroker keeps its process private; its pid is only read here, for the CPU columns.
        meter = CpuMeter(broker._proc.pid, [w.pid for w in workers])
        tiny = workdir / "tiny.bin"
        tiny.write_bytes(b"\x00")
        coordinator.round(rng.standard_normal(sizes[0], dtype=np.float32), meter)  # warm-up, untimed
        coordinator.pause()
        clients.startup(tiny, args.devices)
        coordinator.resume()

        n = args.devices
        print(f"Transport overhead of one round: {n} devices, no training, vs mosquitto's own clients, same bytes")
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
              f"load average at start {os.getloadavg()[0]:.1f}; Python {platform.python_version()}, "
              f"paho-mqtt {paho.mqtt.__version__}, mosquitto {mosquitto_version()} on loopback "
              f"(passwords + ACL, QoS 1)")
        print(f"edgefil: coordinator Link + wire + Inbox + OpenRound in this process, {n} echo-device processes "
              f"(Link + wire.Reassembler, update = the received weights); clock: encode + publish the global "
              f"weight chunks and {n} round messages -> {n} updates reassembled, validated, accepted")
        print(f"mosquitto clients: 1 mosquitto_pub -> {n} mosquitto_sub, then {n} concurrent mosquitto_pub -> "
              f"1 mosquitto_sub; each sender sends the model as edgefil's number of chunks, equal-sized "
              f"(mosquitto_pub -f chunk --repeat <chunks> --repeat-delay {REPEAT_DELAY_S}: one PUBACK at a time, "
              f"then the delay); subs have their SUBACK before the clock; clock: first pub start -> last sub exit")
        print(f"start-up: 1 mosquitto_pub, then {n} concurrent ones, of a 1-byte message to a topic nobody reads "
              f"(process start, connect, authenticate, publish, PUBACK, disconnect), to the last exit; timed before "
              f"each clients run; '-start' columns subtract it (best from best, median from median). Not the whole "
              f"procedure with 1-byte messages: a message that small reaches a mosquitto_sub ~40 ms late here "
              f"(a small-packet TCP delay the ~1 MB messages do not hit). One untimed warm-up of both methods")
        print(f"MB/s = payload MB moved per round ({n} x model down + {n} x model up) / s; "
              f"ratio = edgefil best / clients best, median ratio = edgefil median / clients median; best and "
              f"median of {args.repeats} runs per size, the two methods alternating (which goes first changes "
              f"from run to run)")
        print()
        head = (f"{'params':>6s} {'model MB':>8s} {'msgs':>4s} {'moved MB':>8s} | "
                f"{'edgefil s':>9s} {'median':>7s} {'MB/s':>6s} | {'clients s':>9s} {'median':>7s} {'MB/s':>6s} | "
                f"{'start s':>7s} {'-start s':>8s} {'median':>7s} {'MB/s':>6s} | {'ratio':>5s} {'-start':>6s} "
                f"{'median ratio':>12s}")
        print(head)
        print("-" * len(head), flush=True)
        cpu_rows = []
        for params in sizes:
            model_bytes = 4 * params
            count = max(1, math.ceil(model_bytes / wire.CHUNK_BYTES))  # edgefil's chunks per blob
            moved = 2 * n * model_bytes
            message = workdir / f"message-{params}.bin"
            message_bytes = math.ceil(model_bytes / count)  # count equal messages carry the model's bytes
            message.write_bytes(rng.standard_normal(params, dtype=np.float32).tobytes()[:message_bytes])
            edgefil, startup, baseline = [], [], []
            for repeat in range(args.repeats):
                for method in ("edgefil", "clients") if repeat % 2 == 0 else ("clients", "edgefil"):
                    if method == "edgefil":
                        edgefil.append(coordinator.round(rng.standard_normal(params, dtype=np.float32), meter))
                        continue
                    coordinator.pause()
                    startup.append(clients.startup(tiny, n))
                    baseline.append(clients.round(message, count, n, meter))
                    coordinator.resume()
            e_best, e_median = spread([t for t, _ in edgefil])
            c_best, c_median = spread([t for t, _ in baseline])
            u_best, u_median = spread(startup)
            s_best, s_median = c_best - u_best, c_median - u_median
            mb = moved / 1e6
            print(f"{label(params):>6s} {model_bytes / 1e6:8.1f} {count:4d} {mb:8.0f} | "
                  f"{e_best:9.3f} {e_median:7.3f} {mb / e_best:6.0f} | "
                  f"{c_best:9.3f} {c_median:7.3f} {mb / c_best:6.0f} | "
                  f"{u_best:7.3f} {s_best:8.3f} {s_median:7.3f} {quotient(mb, s_best, '6.0f')} | "
                  f"{e_best / c_best:5.2f} {quotient(e_best, s_best, '6.2f')} {e_median / c_median:12.2f}",
                  flush=True)
            cpu_rows.append((params, [c for _, c in edgefil], [c for _, c in baseline]))

        print()
        print(f"CPU seconds per round, median of the runs (user + system, /proc; the machine has {os.cpu_count()} "
              f"cores, other load included in wall times but not here)")
        head = (f"{'params':>6s} | {'edgefil: coordinator':>20s} {'devices':>8s} {'broker':>7s} {'total':>7s} | "
                f"{'clients: pub+sub':>16s} {'broker':>7s} {'total':>7s} | {'ratio':>5s}")
        print(head)
        print("-" * len(head))
        for params, edgefil_cpu, clients_cpu in cpu_rows:
            def med(values):
                return statistics.median(values)
            e = [med([c.this for c in edgefil_cpu]), med([c.devices for c in edgefil_cpu]),
                 med([c.broker for c in edgefil_cpu]), med([c.this + c.devices + c.broker for c in edgefil_cpu])]
            c = [med([x.children for x in clients_cpu]), med([x.broker for x in clients_cpu]),
                 med([x.children + x.broker for x in clients_cpu])]
            print(f"{label(params):>6s} | {e[0]:20.2f} {e[1]:8.2f} {e[2]:7.2f} {e[3]:7.2f} | "
                  f"{c[0]:16.2f} {c[1]:7.2f} {c[2]:7.2f} | {e[3] / c[2]:5.2f}", flush=True)
    finally:
        if coordinator is not None:
            coordinator.stop()
        stop_children()
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--params", default="100000,1000000,11000000",
                        help="comma-separated float32 parameter counts (model sizes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-worker", nargs=4, metavar=("ID", "HOST", "PORT", "MAX_PARAMS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device_worker:
        device_id, host, port, max_parameters = args.device_worker
        device_worker(device_id, host, int(port), int(max_parameters))
        return

    def terminated(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        run(args)
    except KeyboardInterrupt:
        print("interrupted; processes stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
