"""A fleet too large to train whole each round: registration, heartbeats, one round of a share of it, a stop and a
resume, at N devices, with sites; what a device costs the host against a smaller fleet.

Each N runs `edgefil fleet run` of a fleet file (cnn1d on one MNIST-1D task of all 10 classes, generated for about 3
training samples a device, so every device holds data; the portable trainer, random replay M = 50, one epoch;
`--sites` sites, device k at site k mod sites, each a mosquitto bridged to the fleet's and an aggregator process;
`--workers` worker processes; `fraction` of the devices selected a round, at least one), 3 rounds: the run is
stopped with SIGINT once round 1 is checkpointed and resumed with `--resume` for the rest, as an operator would.
Sampled every `--sample-s` seconds: the PSS of every process of the run (/proc/<pid>/smaps_rollup: the workers,
the brokers, the aggregators, the coordinator) and the host's used memory (MemTotal - MemAvailable, which counts
the kernel's socket buffers too), both less what they were before the start. Printed per N: start to round 1's
open (the devices built, connected and registered, the first round waiting for the whole roster), round 1, the
resume to round 2's close (every device connecting and registering again), peak PSS and host memory per device,
and the ratios per device against the first N.

A host needs a file descriptor per device in its worker (`ulimit -n` over N / workers) and a thread per device
(`/proc/sys/kernel/pid_max` and `threads-max` over N plus the host's own); a local port per device and broker,
from the ephemeral range (28,232 ports by default) for each site's broker's address (clients connect without a
bind: edgefil/paho_buffers.py), so more than about 28,000 devices want sites (or a wider range).

    .venv/bin/python benchmarks/fleet_resume.py [--devices 10000,100000] [--sites 10] [--workers 10]
        [--fraction 0.01] [--sample-s 5] [--out runs/fleet-resume]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet_scale import memory_of  # noqa: E402  (their top levels import the standard library only)
from vs_flower import descendants  # noqa: E402

from edgefil.settings import dump_toml  # noqa: E402

MNIST1D_TRAINING_SHARE = 0.8 / 1.25  # as fleet_scale.py: the share of MNIST-1D's generated samples devices train on
PER_DEVICE = 3
ROUNDS = 3  # round 1, the stop, and the rest after the resume


def fleet_file(n: int, sites: int, workers: int, fraction: float) -> dict:
    return {
        "name": f"resume{n}", "out": "run", "devices": n, "workers": workers, "seed": 0, "broker": "mosquitto",
        "sites": sites, "model": "cnn1d",
        "scenario": {"preset": "mnist1d-class", "n_tasks": 1, "classes_per_task": 10, "n_clients": n,
                     "dataset_options": {"num_samples": math.ceil(n * PER_DEVICE / MNIST1D_TRAINING_SHARE)}},
        "policy": {"name": "random"}, "store": {"max_samples": 50}, "client": {"epochs": 1},
        "coordinator": {"rounds_per_task": ROUNDS, "fraction": fraction, "min_clients": 1, "max_attempts": 1,
                        "deadline_s": 3600.0, "wait_for_devices_s": 7200.0, "wall_limit_s": 7200.0,
                        "guard": {"krum_share": 0.0}},
    }


def host_used_bytes() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


# what a process of the run is, by its command line: the peaks are kept for each kind too
KINDS = (("worker", "spawn_main"), ("site aggregator", "edgefil.cli site"), ("broker", "mosquitto"),
         ("fleet and coordinator", "edgefil.cli fleet"))


def kind_of(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return "other"
    return next((kind for kind, mark in KINDS if mark in command), "other")


@dataclass
class Peaks:
    pss: int = 0
    host: int = 0
    kinds: dict[str, list[int]] = field(default_factory=dict)  # kind -> [peak PSS of all its processes, count]
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self, pid: int, every_s: float, host_before: int) -> None:
        while not self.stop.wait(every_s):
            by_kind: dict[str, list[int]] = {}
            for child in descendants(pid):  # the fleet process first
                entry = by_kind.setdefault(kind_of(child), [0, 0])
                entry[0] += int(memory_of(child).get("Pss", 0))
                entry[1] += 1
            self.pss = max(self.pss, sum(pss for pss, _ in by_kind.values()))
            self.host = max(self.host, host_used_bytes() - host_before)
            for kind, (pss, count) in by_kind.items():
                if pss > self.kinds.get(kind, [0, 0])[0]:
                    self.kinds[kind] = [pss, count]


def rounds_done(out: Path) -> int:
    """Rounds checkpointed (results.json is rewritten less often in a large fleet)."""
    return len(list((out / "checkpoint").glob("round-*")))


def phase(folder: Path, extra: list[str], log: Path, peaks: Peaks, every_s: float, host_before: int,
          stop_after_round: int | None) -> tuple[subprocess.Popen, dict[str, float]]:
    """One `edgefil fleet run` (with `extra` arguments) until it exits, or until `stop_after_round` is checkpointed
    (then SIGINT); the wall time of its start to round 1's open (from its log), and of its end."""
    started = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgefil.cli", "fleet", "run", str(folder / "fleet.toml"),
                                 *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=interruptible)
    sampler = threading.Thread(target=peaks.sample, args=(proc.pid, every_s, host_before), daemon=True)
    sampler.start()
    while proc.poll() is None:
        if stop_after_round is not None and rounds_done(folder / "run") >= stop_after_round:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            break
        time.sleep(0.2)
    return proc, {"wall_s": time.monotonic() - started}


def interruptible() -> None:
    """SIGINT as a terminal's Ctrl-C sends it, in the fleet's process: a shell that starts this benchmark in the
    background has it ignored, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def opened_at(log: Path, after: float) -> float | None:
    """The wall time (epoch seconds) of the first round-open line logged after `after`."""
    for line in log.read_text(errors="replace").splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) edgefil.coordinator INFO round \d+ \(task", line)
        if match:
            at = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
            if at >= after:
                return at
    return None


def measure(n: int, args: argparse.Namespace) -> dict:
    folder = args.out / f"n{n}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fleet.toml").write_text(dump_toml(fleet_file(n, args.sites, args.workers, args.fraction)))
    log = folder / "fleet.log"
    log.unlink(missing_ok=True)
    host_before = host_used_bytes()
    peaks = Peaks()
    began = time.time()
    first, timing = phase(folder, [], log, peaks, args.sample_s, host_before, stop_after_round=1)
    first_open = opened_at(log, began)
    resumed = time.time()
    second, resume_timing = phase(folder, ["--resume"], log, peaks, args.sample_s, host_before, None)
    second_open = opened_at(log, resumed)
    peaks.stop.set()
    results = json.loads((folder / "run" / "results.json").read_text())
    history = results["history"]
    return {
        "n": n, "first_exit": first.returncode, "resume_exit": second.returncode, "outcome": results["outcome"],
        "start_s": None if first_open is None else first_open - began,
        "round_1_s": history[0]["ended_at"] - first_open if first_open else None,
        "selected": [len(entry["selected"]) for entry in history],
        "received": [len(entry["received"]) for entry in history],
        "resume_start_s": None if second_open is None else second_open - resumed,
        "resume_s": resume_timing["wall_s"], "pss_peak": peaks.pss, "host_peak": peaks.host,
        "pss_by_kind": peaks.kinds,
    }


def report(rows: list[dict]) -> str:
    lines = ["| N | outcome (exits) | start to round 1 s | round 1 s | resume to round 2's open s | whole resume s | "
             "selected / received | peak PSS GiB | MiB a device | host used GiB | MiB a device |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        def s(key: str) -> str:
            return "-" if row[key] is None else f"{row[key]:.1f}"
        lines.append(
            f"| {row['n']} | {row['outcome']} ({row['first_exit']}, {row['resume_exit']}) | {s('start_s')} | "
            f"{s('round_1_s')} | {s('resume_start_s')} | {row['resume_s']:.1f} | "
            f"{'/'.join(map(str, row['selected']))} ; {'/'.join(map(str, row['received']))} | "
            f"{row['pss_peak'] / 2**30:.2f} | {row['pss_peak'] / 2**20 / row['n']:.3f} | "
            f"{row['host_peak'] / 2**30:.2f} | {row['host_peak'] / 2**20 / row['n']:.3f} |")
    lines += ["", "Each kind of process at its own peak (PSS GiB, processes): "
              + " ; ".join(f"N={row['n']}: " + ", ".join(
                  f"{kind} {pss / 2**30:.2f} ({count})" for kind, (pss, count) in sorted(row["pss_by_kind"].items()))
                  for row in rows), ""]
    base = rows[0]
    for row in rows[1:]:
        per = {key: (row[key] / row["n"]) / (base[key] / base["n"]) for key in ("pss_peak", "host_peak")}
        times = {key: (row[key] / row["n"]) / (base[key] / base["n"]) for key in ("start_s", "resume_start_s")
                 if row[key] and base[key]}
        more = {key: (row[key] - base[key]) / 2**20 / (row["n"] - base["n"]) for key in ("pss_peak", "host_peak")}
        lines.append(f"- {row['n']} against {base['n']}, a device's: PSS {per['pss_peak']:.2f}x, host memory "
                     f"{per['host_peak']:.2f}x" + "".join(f", {key} {ratio:.2f}x" for key, ratio in times.items())
                     + f"; each device more (the fixed processes cancel): PSS {more['pss_peak']:.3f} MiB, host "
                     f"memory {more['host_peak']:.3f} MiB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="10000,100000")
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "fleet-resume")
    args = parser.parse_args()
    args.out = args.out.resolve()
    sizes = [int(v) for v in args.devices.split(",")]
    earlier = [args.out / f"n{n}" / "run" for n in sizes if (args.out / f"n{n}" / "run").exists()]
    if earlier:  # the fleet would refuse to start over it, and the resume would go on with the earlier run
        sys.exit(f"fleet_resume: {earlier[0]} holds an earlier run: remove it, or choose another --out")
    rows = []
    for n in sizes:
        rows.append(measure(n, args))
        print(json.dumps(rows[-1]), flush=True)
    print(report(rows))


if __name__ == "__main__":
    main()
