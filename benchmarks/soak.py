"""Soak: a fleet of real processes through 100+ rounds of everything that goes wrong, and what it cost.

A mosquitto (generated files: passwords, the ACL), a coordinator process (`edgefil coordinator`) and `--devices`
device processes (`edgefil client`, ORT backend, Re-Fed, M = 200 samples and a byte budget) run the embedded
digits class-incremental scenario (5 tasks) for `--rounds` rounds, half the available devices selected per round,
quorum a quarter of the fleet, 5 local epochs, in the robust setting docs/security.md recommends where a device
may be hostile: `[guard] norm_bound = "reject"` and the coordinate-wise median (`--strategy` to change it).
Meanwhile:

- **device kills**: every `--kill-every-s` seconds a random honest device is frozen (SIGSTOP), its store is copied,
  and it is killed (SIGKILL); it is restarted 1-8 s later. At most 3 are down at once.
- **a broker restart** (SIGTERM, start again: retained messages are lost; everyone reconnects and re-announces)
  once 30% of the rounds are done;
- **a coordinator kill** (SIGKILL) once 60% are done, and `--resume`;
- **one hostile device** (a rostered account, its own paho client) that answers every round it is selected for
  with an attack, by turns: weights of 1e30, a claim of 10^9 samples, a boosted update (1000x), garbage bytes,
  and a flood of 50 re-registrations and 50 requests.

Printed at the end: rounds completed; **committed samples lost**: for every kill, the sample ids the store holds
when opened after the kill, against those of the copy taken while the device was frozen at the instant of the kill
(opened the same way: an interrupted transaction is rolled back), must be equal; every store passes its full
check (SQLite integrity, every sample's checksum) after every kill and at the end; **budget overruns**: a store
over M or its byte budget after a kill, at the end, or in any update's reported metrics; the coordinator's
resident memory after its first round and after its last, for the first process and the resumed one, and
every 10 rounds;
refusals and every other counter by reason; what the hostile device sent. A process kill does not lose the page
cache, so this shows the store and the protocol recover from any instant of a process's death; power loss is
the store's own tests' business (tests/test_store.py kills mid-transaction and checks the journal).

    .venv/bin/python benchmarks/soak.py [--devices 20] [--rounds 100] [--kill-every-s 6] [--seed 0] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.broker import Credentials, MosquittoBroker, generate_password, mosquitto_path  # noqa: E402
from edge_client.budget import Budget  # noqa: E402
from edge_client.store import ReplayStore  # noqa: E402
from edgefil import topics, wire  # noqa: E402
from edgefil.lifetime import stop_processes  # noqa: E402
from edgefil.link import CONNECTED, BrokerSettings, Link  # noqa: E402
from edgefil.settings import dump_toml  # noqa: E402
from models.manifest import load_manifest, manifest_digest  # noqa: E402

FLEET = "soak"
HOSTILE = "dev-x"
MAX_SAMPLES = 200
MAX_BYTES = 512 * 1024
TASKS = 5
MAX_DOWN = 3
WALL_LIMIT_S = 45 * 60


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return None


class Hostile(threading.Thread):
    """A compromised device: registers with the right model, and answers each round it is selected for with the
    next attack."""

    ATTACKS = ("huge", "inflated", "boosted", "garbage", "flood")

    def __init__(self, broker: BrokerSettings, artifacts: Path) -> None:
        super().__init__(daemon=True)
        self.n = load_manifest(artifacts).num_parameters
        self.manifest = manifest_digest(artifacts)
        self.link = Link(broker, HOSTILE, subscriptions=topics.device_subscriptions(FLEET, HOSTILE))
        self.sent: Counter[str] = Counter()
        self.stop = threading.Event()
        self.rng = np.random.default_rng(666)

    def _register(self) -> bytes:
        return wire.encode("register", device=HOSTILE, profile="attacker", backend="portable",
                           manifest=self.manifest, software="0")

    def _publish(self, kind: str, payload: bytes, retain: bool = False) -> None:
        self.link.publish(topics.from_device(FLEET, HOSTILE, kind), payload, retain=retain)

    def run(self) -> None:
        self.link.start(timeout=60)
        while not self.stop.is_set():
            item = self.link.get(timeout=0.5)
            if item is None:
                continue
            if item.topic == CONNECTED:
                self._publish("register", self._register(), retain=True)
                self._publish("status", wire.encode("status", device=HOSTILE, state="idle", round=0), retain=True)
                continue
            if item.topic != topics.to_device(FLEET, HOSTILE, "round"):
                continue
            try:
                message = wire.decode(item.payload)
            except wire.WireError:
                continue
            self._attack(message, self.ATTACKS[sum(self.sent.values()) % len(self.ATTACKS)])
        self.link.stop()

    def _attack(self, message: wire.Message, attack: str) -> None:
        self.sent[attack] += 1
        weights = self.rng.standard_normal(self.n).astype(np.float32)
        samples = 100
        if attack == "huge":
            weights = np.full(self.n, 1e30, np.float32)
        elif attack == "inflated":
            samples = 10 ** 9
        elif attack == "boosted":
            weights *= 1000
        elif attack == "garbage":
            for _ in range(20):
                self._publish("update", self.rng.bytes(int(self.rng.integers(1, 4096))))
            return
        elif attack == "flood":
            for _ in range(50):
                self._publish("register", self._register())
                self._publish("request", wire.encode("request", device=HOSTILE, round=message["round"],
                                                     names=["anything"]))
            return
        for chunk in wire.encode_blob("update", wire.weights_bytes(weights), device=HOSTILE,
                                      round=message["round"], task=message["task"], model=message["model"],
                                      num_samples=samples, metrics={}).chunks:
            self._publish("update", chunk)


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.rng = random.Random(args.seed)
        self.devices = [f"dev-{i:02d}" for i in range(args.devices)]
        self.passwords = {d: generate_password() for d in [*self.devices, HOSTILE]}
        self.coordinator_password = generate_password()
        self.broker = MosquittoBroker(out / "broker", FLEET, self.passwords,
                                      Credentials("coordinator", self.coordinator_password))
        self.procs: dict[str, subprocess.Popen] = {}
        self.down: dict[str, float] = {}  # device -> when to restart it
        self.kills = 0
        self.lost = 0
        self.phantom = 0
        self.integrity_failures: list[str] = []
        self.overruns: list[str] = []
        self.memory: list[dict[str, float | None]] = []  # per coordinator process: after its first and last round
        self.events: list[str] = []
        self.trajectory: dict[int, float] = {}  # round -> the coordinator's RSS (MB) when it was completed

    # --- files ------------------------------------------------------------------------------------

    def _broker(self, user: str, password: str) -> dict[str, Any]:
        address = self.broker.address
        return {"host": address.host, "port": address.port, "username": user, "password": password,
                "keepalive": 2}

    def write_configs(self, artifacts: Path) -> None:
        scenario = {"preset": "digits-class", "n_clients": len(self.devices), "n_tasks": TASKS}
        coordinator = {
            "fleet": FLEET, "out": str(self.out / "run"), "artifacts": str(artifacts),
            "devices": [*self.devices, HOSTILE], "rounds_per_task": self.args.rounds // TASKS,
            "fraction": 0.5, "min_clients": max(1, len(self.devices) // 4), "deadline_s": 30.0,
            "wait_for_devices_s": 90.0, "max_attempts": 5, "retry_backoff_s": 5.0, "seed": self.args.seed,
            "scenario": scenario, "broker": self._broker("coordinator", self.coordinator_password),
            "strategy": {"name": self.args.strategy}, "client": {"epochs": 5},
            "guard": {"norm_bound": self.args.norm_bound},
        }
        (self.out / "coordinator.toml").write_text(dump_toml(coordinator))
        for k, device in enumerate(self.devices):
            config = {
                "device_id": device, "fleet": FLEET, "artifacts": str(artifacts),
                "state_dir": str(self.out / "devices" / device), "heartbeat_s": 1.0,
                "broker": self._broker(device, self.passwords[device]),
                "trainer": {"backend": "ort", "optimizer": "adamw", "lr": 3e-3},
                "learner": {"epochs": 1, "batch_size": 32},
                "store": {"max_samples": MAX_SAMPLES, "max_bytes": MAX_BYTES},
                "policy": {"name": "refed", "pim_epochs": 1},
                "data": {"scenario": scenario, "client": k},
            }
            (self.out / f"{device}.toml").write_text(dump_toml(config))

    # --- processes --------------------------------------------------------------------------------

    def spawn(self, name: str, *args: str) -> None:
        log = open(self.out / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "edgefil.cli", *args], cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT)
        log.close()

    def start_device(self, device: str) -> None:
        self.spawn(device, "client", "--config", str(self.out / f"{device}.toml"))

    def start_coordinator(self, resume: bool) -> None:
        self.spawn("coordinator", "coordinator", "--config", str(self.out / "coordinator.toml"),
                   *(["--resume"] if resume else []))
        self.memory.append({"start": None, "end": None, "last_round": float(self.rounds())})

    def rounds(self) -> int:
        path = self.out / "run" / "results.json"
        try:
            return int(json.loads(path.read_text())["rounds_completed"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return 0

    # --- chaos ------------------------------------------------------------------------------------

    def _store_ids(self, directory: Path) -> set[int]:
        with ReplayStore(directory, Budget(MAX_SAMPLES, MAX_BYTES)) as store:
            store.check()
            if len(store) > MAX_SAMPLES or store.bytes_on_disk() > MAX_BYTES:
                self.overruns.append(f"{directory}: {len(store)} samples, {store.bytes_on_disk()} bytes")
            return {int(i) for i in store.ids()}

    def kill_device(self, device: str) -> None:
        proc = self.procs[device]
        store = self.out / "devices" / device / "store"
        frozen = self.out / "frozen" / device
        proc.send_signal(signal.SIGSTOP)
        shutil.rmtree(frozen, ignore_errors=True)
        if store.exists():
            shutil.copytree(store, frozen)
        proc.kill()
        proc.wait()
        self.kills += 1
        self.down[device] = time.monotonic() + self.rng.uniform(1.0, 8.0)
        if not store.exists():
            return
        try:
            before, after = self._store_ids(frozen), self._store_ids(store)
        except Exception as err:  # a store that does not open or check after a kill
            self.integrity_failures.append(f"{device}: {type(err).__name__}: {err}")
            return
        self.lost += len(before - after)
        self.phantom += len(after - before)

    def chaos(self, target: int) -> None:
        started = time.monotonic()
        next_kill = started + self.args.kill_every_s
        broker_restarted = coordinator_killed = False
        coordinator = self.procs["coordinator"]
        while coordinator.poll() is None and time.monotonic() - started < WALL_LIMIT_S:
            now, done = time.monotonic(), self.rounds()
            memory = self.memory[-1]
            if done > (memory["last_round"] or 0):  # a round of this process's own just completed
                memory["last_round"] = float(done)
                rss = rss_mb(coordinator.pid)
                if rss is not None:  # sampled at round boundaries only: not while the process starts or exits
                    memory["start"] = memory["start"] if memory["start"] is not None else rss
                    memory["end"] = rss
                    if done % 10 == 0:
                        self.trajectory[done] = rss
            for device, due in list(self.down.items()):
                if now >= due:
                    del self.down[device]
                    self.start_device(device)
            if now >= next_kill:
                next_kill = now + self.args.kill_every_s
                alive = [d for d in self.devices if d not in self.down]
                if len(self.down) < MAX_DOWN and alive:
                    self.kill_device(self.rng.choice(alive))
            if not broker_restarted and done >= 0.3 * target:
                broker_restarted = True
                self.events.append(f"broker restarted after round {done}")
                self.broker.restart()
            if not coordinator_killed and done >= 0.6 * target:
                coordinator_killed = True
                self.events.append(f"coordinator killed after round {done}, resumed")
                coordinator.kill()
                coordinator.wait()
                self.start_coordinator(resume=True)
                coordinator = self.procs["coordinator"]
            time.sleep(0.25)
        if coordinator.poll() is None:
            self.events.append(f"wall limit of {WALL_LIMIT_S} s reached: coordinator stopped")
            coordinator.terminate()
        coordinator.wait()

    def stop(self) -> None:
        stop_processes(self.procs.values(), grace_s=30)
        self.broker.stop()

    def final_checks(self, results: dict[str, Any]) -> None:
        for device in self.devices:
            store = self.out / "devices" / device / "store"
            if store.exists():
                try:
                    self._store_ids(store)
                except Exception as err:
                    self.integrity_failures.append(f"{device} at the end: {type(err).__name__}: {err}")
        for entry in results["history"]:
            for device, metrics in entry["metrics"].items():
                if device == HOSTILE:
                    continue
                if metrics.get("stored_samples", 0) > MAX_SAMPLES or metrics.get("stored_bytes", 0) > MAX_BYTES:
                    self.overruns.append(f"round {entry['round']} {device}: {metrics}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100, help="a multiple of 5 (the scenario's tasks)")
    parser.add_argument("--kill-every-s", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default="median", help="the aggregation rule ([strategy] name)")
    parser.add_argument("--norm-bound", default="reject", choices=("clip", "reject", "off"))
    parser.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    args = parser.parse_args()
    if mosquitto_path() is None:
        raise SystemExit("soak needs mosquitto (apt-get install mosquitto)")
    out = args.out or Path(tempfile.mkdtemp(prefix="edgefil-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    from models.export import export_registered  # host only

    artifacts = out / "artifacts"
    export_registered("lenet", 10, artifacts, (1, 8, 8), seed=args.seed, backends=("ort",))
    soak = Soak(args, out)
    soak.broker.start()
    hostile = None
    wall = time.monotonic()
    try:
        soak.write_configs(artifacts)
        for device in soak.devices:
            soak.start_device(device)
        hostile = Hostile(BrokerSettings(**soak._broker(HOSTILE, soak.passwords[HOSTILE])), artifacts)
        hostile.start()
        soak.start_coordinator(resume=False)
        soak.chaos(args.rounds)
    finally:
        if hostile is not None:
            hostile.stop.set()
            hostile.join(10)
        soak.stop()
    wall = time.monotonic() - wall
    results = json.loads((out / "run" / "results.json").read_text())
    soak.final_checks(results)
    counters = dict(sorted(results["counters"].items()))
    print(f"soak: {args.devices} devices + 1 hostile, {args.strategy} with norm_bound {args.norm_bound}, "
          f"{wall / 60:.1f} min, run folder {out}")
    print(f"  outcome                    {results['outcome']}")
    print(f"  rounds completed           {results['rounds_completed']} / {args.rounds}")
    print(f"  final accuracy             {results['final_accuracy']:.3f} (tasks {results['tasks_completed']})")
    print(f"  device kills (+ restarts)  {soak.kills}")
    for event in soak.events:
        print(f"  {event}")
    print(f"  committed samples lost     {soak.lost} (samples that appeared: {soak.phantom})")
    print(f"  store check failures       {len(soak.integrity_failures)} {soak.integrity_failures[:3]}")
    print(f"  budget overruns            {len(soak.overruns)} {soak.overruns[:3]}")
    for k, memory in enumerate(soak.memory):
        name = "coordinator" if k == 0 else f"coordinator (resumed {k})"
        print(f"  {name:26s} RSS after its first round {memory['start'] or 0:.0f} MB, after its last "
              f"{memory['end'] or 0:.0f} MB")
    print("  coordinator RSS by round     " + ", ".join(f"{r}: {mb:.0f}" for r, mb in sorted(soak.trajectory.items())))
    print(f"  hostile device sent        {dict(hostile.sent) if hostile else {}}")
    print(f"  device errors              {results.get('device_errors', {})}")
    print(f"  duplicate devices          {results.get('duplicate_devices', {})}")
    print("  refusals and counters by reason:")
    for reason, count in counters.items():
        print(f"    {reason:24s} {count}")
    ok = (soak.lost == 0 and not soak.integrity_failures and not soak.overruns
          and results["rounds_completed"] >= args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
