"""edgefil's fleet against Flower's simulation (Ray backend): the same work, side by side, alternated and repeated.

The work of one run, on both sides (`WORK`): the embedded digits' training split, all ten classes in one task (the
same data at every N), split over N clients by the preset's Dirichlet 1 split; `--rounds` rounds of one local epoch
of LeNet (models/zoo.py, the same initial weights, AdamW lr 3e-3, eps 1e-6, no weight decay, batches of 32, started
afresh each round: `[client] fresh_optimizer = true` on edgefil's side, a new optimiser per round on Flower's) on every
client that holds data, with the same loss (cross-entropy over all ten classes: edgefil's rounds tell its devices not
to mask the classes they have not seen, `[client] mask_seen_classes = false`), plain FedAvg over all of them (the
guard's bounds off: `coordinator.guard.OFF`), the global
model evaluated on the task's test set after each round. At 1000 and 3000 clients the split leaves some clients no
sample: edgefil's devices say so and are not selected, and Flower's side simulates only the clients that hold data,
the very shards edgefil's selected devices train on, so both train and aggregate the same clients (the table prints
them, with the samples each side's rounds aggregate and the accuracy each reaches).

- edgefil: `benchmarks/fleet_scale.py`'s instrumented fleet with the fleet's defaults (mosquitto, the workers it
  sizes itself: one per core up to 3000 devices on 2 cores, the portable backend, the devices' state parked on
  disk between rounds: `--between-rounds memory` keeps it in memory, a device's own default), random replay with M
  large enough to hold every share. The fleet exports its model's artifacts itself, inside the timed run, through the
  export cache (models/cache.py, `$EDGEFIL_CACHE` set per run): "cached", the cache filled once before the runs
  (every fleet run after a host's first), and, once per N, "cold", a cache without exports (a host's first run:
  the export itself). The cold cache keeps the digits split that the cache also holds (firmware_sim/datasets.py,
  made from scikit-learn's copy once per host, ~3 s of importing scikit-learn): Flower's side gets its shards made
  before its run too, so both sides start with their data made and only the export is cold. Flower builds its
  torch model in-process.
- Flower 1.40: `flwr.simulation.run_simulation` with the message API's FedAvg (`fraction_train = 1`, no
  client-side evaluation, the central evaluation as `evaluate_fn`, the samples of each round's replies counted by
  `train_metrics_aggr_fn`), one client per core at a time
  (`client_resources = {num_cpus = 1}`), torch at one thread in each. Its clients train on the very shards
  edgefil's devices train on (written to .npz files here). Flower pins protobuf 6 and more, which the project's
  environment must not take, so it runs in its own (`--flower-venv`, made on first use: flwr[simulation], torch
  and numpy from the package index).

Each side runs in a fresh process; this one samples the PSS of that process and all its descendants (the
coordinator, the workers and mosquitto; Flower's driver and every Ray process) twice a second. Printed per N, as
medians over `--repeats` (the two sides alternate which goes first):
  round s      the median round after the first: edgefil from the round's open to its close (aggregation,
               evaluation and checkpoint included), Flower from one central evaluation to the next
  start s      from the process start until round 1 is done: the imports, then the export (cold, or from the cache),
               the broker and the workers starting and every device registering (edgefil), or Ray and the
               simulation engine starting and its first ClientApps being built (Flower, which starts them when
               round 1 asks for them), then round 1
  MB/device    the peak PSS of the side's process tree over N (fixed costs included: it falls with N)
  anonymous    the peak of the tree's anonymous PSS: the memory its processes allocated, without the pages of the
               libraries they map, which the host's page cache moves (by up to 250 MB of a coordinator's here)
  marginal     what one more device costs: (peak PSS at N - peak PSS at the N before) / (N - the N before), the first
               N against a fleet of `--base` devices (one per core: below that, either side starts fewer
               processes, and the first N's marginal would count a process, not a device); none for a first N
               at or below the base fleet
  ratio        Flower / edgefil (above 1: edgefil is faster or smaller)
and, for edgefil, where its round goes in CPU (`fleet_scale.py`'s probe): its coordinator's, broker's and workers'
CPU seconds a round, the devices' training among the workers', its share, and the rest a device that trains.

    .venv/bin/python benchmarks/vs_flower.py [--devices 10,200,1000,3000] [--rounds 3] [--repeats 2] [--base CORES]
        [--flower-venv .venv-flower] [--json FILE]

The module's top level imports the standard library only: its Flower side runs under the other environment.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fleet_scale import holding_data, memory_of  # its top level imports the standard library only

ROOT = Path(__file__).resolve().parents[1]
FLOWER_PACKAGES = ["flwr[simulation]==1.40.0", "torch==2.14.1", "numpy"]
MODEL, SEED = "lenet", 0
LR, BATCH, EPOCHS = 3e-3, 32, 1
ADAMW_EPS, WEIGHT_DECAY = 1e-6, 0.0  # the devices' AdamW (edge_client/trainers): torch's defaults are 1e-8 and 0.01
REPLAY_M = 1400  # more than any share: every device trains on all of its data, as Flower's clients do
WORK = {"preset": "digits-class", "n_tasks": 1, "classes_per_task": 10}  # with "n_clients": N (module docstring)
CLIENT = {"mask_seen_classes": False, "fresh_optimizer": True}  # edgefil's rounds train as Flower's (module docstring)
RESULT = "VS_FLOWER_RESULT "
# The most one side's run may take: past it, the run is taken as hung, ended, and the benchmark fails saying so (a
# Flower runtime that crashed left its server waiting for replies forever, and this waited with it). Runs at 3000
# clients took under 3 minutes.
SIDE_CEILING_S = 1800
# edgefil's CPU seconds a round by process (fleet_scale's probe), and the devices' training among the workers'
CPU_PARTS = {"coordinator": "cpu_coordinator", "broker": "cpu_broker", "workers": "cpu_workers",
             "training": "dev_sum"}


# --- measuring a side from outside ----------------------------------------------------------------

def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_name(pid: int, root: int) -> str:
    """What a process of a side's tree is, for the memory breakdown: the side's own process ("main": edgefil's
    coordinator, Flower's driver and simulation engine), else its command name (a fleet worker is "python")."""
    if pid == root:
        return "main"
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class PeakMemory(threading.Thread):
    """The peak, over the samples, of the summed PSS of a process and its descendants, and what each kind of
    process held at that peak; and the peak of their anonymous PSS (`Pss_Anon`): the memory the processes
    allocated, without the pages of the files they map. Those, the libraries' above all, move with the state of
    the host's page cache, not with the work: torch's CUDA build maps its CUDA libraries on a host without a GPU
    too, and the pages of them that a process holds after its imports were 156-217 MB of edgefil's coordinator's
    PSS over a dozen runs, and 243 MB in one just after the page cache was dropped (docs/results.md, issue 57);
    both sides import torch."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak, self.peak_anon = pid, every_s, 0, 0
        self.parts: dict[str, int] = {}
        self.anon_parts: dict[str, int] = {}  # each kind's anonymous PSS at the PSS peak
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            parts: dict[str, int] = {}
            anon: dict[str, int] = {}
            for pid in descendants(self.pid):
                name = process_name(pid, self.pid)
                memory = memory_of(pid)
                parts[name] = parts.get(name, 0) + int(memory.get("Pss", 0))
                anon[name] = anon.get(name, 0) + int(memory.get("Pss_Anon", 0))
            self.peak_anon = max(self.peak_anon, sum(anon.values()))
            if sum(parts.values()) > self.peak:
                self.peak, self.parts, self.anon_parts = sum(parts.values()), parts, anon


def run_side(side: str, python: Path, n: int, args: argparse.Namespace, folder: Path, cache: Path) -> dict[str, Any]:
    command = [str(python), str(Path(__file__).resolve()), "--side", side, "--n", str(n),
               "--rounds", str(args.rounds), "--folder", str(folder), "--cache", str(cache), "--t0", repr(time.time())]
    if side == "edgefil" and args.between_rounds:
        command += ["--between-rounds", args.between_rounds]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = PeakMemory(proc.pid)
    memory.start()
    try:
        output, _ = proc.communicate(timeout=SIDE_CEILING_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += f"\n(ended: still running after {SIDE_CEILING_S} s)"
    memory.done.set()
    memory.join()
    lines = [line for line in output.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} N={n} failed ({proc.returncode}):\n{output[-3000:]}")
    return {**json.loads(lines[-1][len(RESULT):]), "peak_pss": memory.peak, "peak_parts": memory.parts,
            "peak_anon": memory.peak_anon, "peak_anon_parts": memory.anon_parts}


# --- the shared data (project environment) --------------------------------------------------------

def write_shards(n: int, folder: Path) -> None:
    """The training data of each of the N clients that holds any, as edgefil's device gets it (Flower's client i is
    the i-th of them), and the task's test set with how many clients hold data, as .npz files."""
    import numpy as np

    from edgefil.settings import Where
    from firmware_sim.client_shares import ClientSource
    from firmware_sim.scenarios import check_scenario

    scenario = {**WORK, "n_clients": n}
    data = check_scenario(scenario, Where("vs_flower")).build()
    folder.mkdir(parents=True, exist_ok=True)
    holding = holding_data(scenario)
    for i, k in enumerate(holding):
        x, y = ClientSource(scenario, k).task_data(0)
        np.savez(folder / f"client-{i}.npz", x=x, y=y)
    x, y = data.task_test(0)
    np.savez(folder / "test.npz", x=x, y=y, num_classes=data.num_classes, shape=np.array(data.input_shape),
             clients=len(holding))


# --- edgefil's side (project environment) ---------------------------------------------------------

def edgefil_side(n: int, rounds: int, folder: Path, t0: float, cache: Path, between_rounds: str | None = None
                 ) -> dict[str, Any]:
    import logging

    os.environ["EDGEFIL_CACHE"] = str(cache)  # before the fleet's export reads it
    from fleet_scale import run_fleet, summarize

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # workers=None: the fleet's own sizing
    options = argparse.Namespace(workers=None, backend="portable", replay_m=REPLAY_M, deadline_s=600.0, wait_s=600.0,
                                 idle_s=0.0, rounds=rounds, per_device=0, profile=0, between_rounds=between_rounds)
    from coordinator.guard_settings import OFF

    # the fleet exports, through the cache; every device trains over all ten classes, and the round is plain FedAvg
    # over every update (every bound of the guard off), as on Flower's side
    run = run_fleet(n, options, folder / "edgefil", None, "mosquitto", work={**WORK, "n_clients": n},
                    client=CLIENT, guard=OFF)
    summary = summarize(run)
    first = run["probe"].rounds[min(run["probe"].rounds)]
    later = summary["rows"][1:] or summary["rows"]  # the rounds after the first (it also stores the task's data)
    cpu = {name: median([row[key] for row in later]) for name, key in CPU_PARTS.items()}
    return {"first_round_done_s": first.closed - t0, "round_s": summary["rounds"]["walls"],
            "registered_s": summary["startup"], "accuracy": summary["accuracy"],
            "completed": summary["completed"], "trained": median([row["received"] for row in summary["rows"]]),
            "samples": [row["samples"] for row in summary["rows"]], "cpu": cpu}


def fill_cache(cache: Path, folder: Path) -> None:
    """Export the fleet's artifacts once into the export cache at `cache`, as a host's first fleet run does."""
    os.environ["EDGEFIL_CACHE"] = str(cache)
    from edge_client.policies import make_policy
    from edgefil.settings import Where
    from firmware_sim.scenarios import check_scenario
    from models.export import export_registered

    data = check_scenario({**WORK, "n_clients": 1}, Where("vs_flower")).build()
    # the set the fleet exports: the optional graphs its policy (fleet_scale's random replay) runs, no others
    export_registered(MODEL, data.num_classes, folder, data.input_shape, seed=SEED, backends=("portable", "torch"),
                      cache=True, graphs=make_policy("random").trainer_graphs())


def without_exports(cache: Path, copy: Path) -> None:
    """`copy` made anew as `cache` without its exported artifact sets: the data the host made (the digits split)
    kept, as Flower's side gets its shards made before its run."""
    from models.cache import ARTIFACTS

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(cache, copy, ignore=lambda folder, names: [ARTIFACTS] if Path(folder) == cache else [])


# --- Flower's side (its own environment) ----------------------------------------------------------

def flower_side(n: int, rounds: int, folder: Path, t0: float, cache: Path) -> dict[str, Any]:  # noqa: ARG001
    os.environ["VS_FLOWER_DATA"] = str(folder)
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    sys.path.insert(0, str(ROOT))
    from models.zoo import build_model

    test = np.load(folder / "test.npz")
    classes, shape = int(test["num_classes"]), tuple(int(s) for s in test["shape"])
    clients = int(test["clients"])  # those that hold data: client-0 .. client-(clients - 1)
    x_test, y_test = torch.from_numpy(test["x"]).float(), torch.from_numpy(test["y"]).long()

    def model() -> torch.nn.Module:
        return build_model(MODEL, classes, shape, seed=SEED)

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        shard = np.load(Path(os.environ["VS_FLOWER_DATA"]) / f"client-{context.node_config['partition-id']}.npz")
        x, y = torch.from_numpy(shard["x"]).float(), torch.from_numpy(shard["y"]).long()
        net = model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        net.train()
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, eps=ADAMW_EPS, weight_decay=WEIGHT_DECAY)
        for _ in range(EPOCHS):
            for batch in torch.randperm(len(x)).split(BATCH):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x[batch])[0], y[batch]).backward()
                optimizer.step()
        reply = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                            "metrics": MetricRecord({"num-examples": len(x)})})
        return Message(content=reply, reply_to=msg)

    evaluated: list[tuple[float, float]] = []  # (time, accuracy) at each central evaluation, round 0 first
    aggregated: list[int] = []  # the samples of each round's replies, which FedAvg weighs the round by

    def counted(records: list[RecordDict], weighted_by: str) -> MetricRecord:
        aggregated.append(sum(int(record["metrics"][weighted_by]) for record in records))
        return MetricRecord({weighted_by: aggregated[-1]})

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = model()
        net.load_state_dict(arrays.to_torch_state_dict())
        net.eval()
        with torch.no_grad():
            accuracy = float((net(x_test)[0].argmax(1) == y_test).float().mean())
        evaluated.append((time.time(), accuracy))
        return MetricRecord({"accuracy": accuracy})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                          min_available_nodes=clients, train_metrics_aggr_fn=counted)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model().state_dict()), num_rounds=rounds,
                       evaluate_fn=evaluate)

    cores = len(os.sched_getaffinity(0))
    # Ray of its own ("local"), as a user's simulation on a host without a cluster has: not one that Ray's file of the
    # current cluster names (a Ray process killed before it cleaned up leaves it behind, and Flower's runtime then
    # crashed on connecting to it and its server waited for replies forever), nor a user's cluster on this host
    run_simulation(server_app=server, client_app=client, num_supernodes=clients, backend_config={
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": cores, "address": "local"},
    })
    times = [t for t, _ in evaluated]
    return {"first_round_done_s": times[1] - t0, "round_s": [b - a for a, b in zip(times, times[1:])],
            "accuracy": evaluated[-1][1], "completed": len(times) - 1, "trained": clients, "samples": aggregated}


def ensure_flower_venv(path: Path) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        print(f"making {path} (Flower's environment): {' '.join(FLOWER_PACKAGES)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *FLOWER_PACKAGES], check=True)
    return python


# --- the comparison -------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="10,200,1000,3000", help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per run (the first is timed apart)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per N (alternating first)")
    parser.add_argument("--base", type=int, default=len(os.sched_getaffinity(0)),
                        help="the fleet size the first N's marginal is taken from (default: one device per core, the "
                             "smallest fleet that starts every process either side starts here: a worker or a Ray "
                             "actor per core)")
    parser.add_argument("--flower-venv", default=str(ROOT / ".venv-flower"))
    parser.add_argument("--json", default=None, help="also write every run's figures to this file")
    parser.add_argument("--between-rounds", choices=("memory", "disk"), default=None,
                        help="edgefil's devices' [learner] between_rounds (default: the fleet's, disk)")
    parser.add_argument("--side", choices=("edgefil", "flower"), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        extra = {"between_rounds": args.between_rounds} if args.side == "edgefil" else {}
        side = edgefil_side if args.side == "edgefil" else flower_side
        print(RESULT + json.dumps(side(args.n, args.rounds, Path(args.folder), args.t0, Path(args.cache), **extra)),
              flush=True)
        return

    flower_python = ensure_flower_venv(Path(args.flower_venv))
    if args.between_rounds:
        print(f"edgefil's devices keep their state between rounds in {args.between_rounds} (--between-rounds)")
    sizes = [int(n) for n in args.devices.split(",")]
    base = Path(tempfile.mkdtemp(prefix="vs-flower-"))
    pythons = {"edgefil": Path(sys.executable), "flower": flower_python}
    warm = base / "cache"
    runs: list[dict[str, Any]] = []
    finished = False
    try:
        fill_cache(warm, base / "artifacts")
        # the base fleet runs first for the first N's marginal, unless it is one of the N (then once, as that N)
        for n in ([args.base] if args.base and args.base not in sizes else []) + sizes:
            folder = base / f"n{n}"
            write_shards(n, folder)
            for repeat in range(args.repeats):
                order = ["edgefil", "flower"] if repeat % 2 == 0 else ["flower", "edgefil"]
                if repeat == 0 and n in sizes:  # a cold start at every N
                    order.append("edgefil-cold")
                for side in order:
                    shutil.rmtree(folder / "edgefil", ignore_errors=True)
                    cold = base / "cold-cache"
                    without_exports(warm, cold)
                    program = side.split("-")[0]
                    run = {"side": side, "n": n, "repeat": repeat,
                           **run_side(program, pythons[program], n, args, folder, cold if "cold" in side else warm)}
                    runs.append(run)
                    print(f"N={n} {side:12s} start {run['first_round_done_s']:6.1f} s  rounds "
                          f"{' '.join(f'{r:.2f}' for r in run['round_s'])} s  peak {run['peak_pss'] / 2**20:7.0f} MB"
                          f" (anonymous {run['peak_anon'] / 2**20:.0f})"
                          f"  accuracy {run['accuracy']:.3f}  clients training {run['trained']:.0f}  samples a round "
                          f"{' '.join(map(str, run['samples']))}", flush=True)
        finished = True
    finally:
        if finished:
            shutil.rmtree(base, ignore_errors=True)
        else:  # the failed side's run folder (its logs) is still there
            print(f"a run failed: its folders are kept in {base}", file=sys.stderr, flush=True)
    print_table(runs, sizes, args.base)
    print_parts(runs, sizes)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def print_table(runs: list[dict[str, Any]], sizes: list[int], base: int) -> None:
    def of(n: int, side: str, figure: str) -> float:
        mine = [r for r in runs if r["n"] == n and r["side"] == side]
        if figure == "round":
            return median([median(r["round_s"][1:]) for r in mine])
        if figure == "start":
            return median([r["first_round_done_s"] for r in mine])
        if figure == "samples":  # aggregated a round (the first included: every round aggregates the same)
            return median([s for r in mine for s in r["samples"]])
        if figure in ("trained", "accuracy"):
            return median([r[figure] for r in mine])
        if figure == "anon":
            return median([r["peak_anon"] / 2**20 for r in mine])  # MB
        return median([r["peak_pss"] / 2**20 for r in mine])  # MB

    print("\nround s: the median round after the first; start s: until round 1 is done (edgefil: export from the "
          "cache, and cold); MB: peak PSS of the side's processes; marginal: MB one more device costs (from the N "
          "before); ratio: Flower / edgefil; the work: clients training a round, samples aggregated a round, and the "
          "accuracy after the last round, each side")
    print("\n|    N | round s edgefil | Flower | ratio | start s edgefil cached | cold | Flower | ratio (cached) "
          "| ratio (cold) | MB/device edgefil | Flower | ratio | marginal MB/device edgefil | Flower | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    before = base if base and base < sizes[0] else None  # no marginal for an N at or below the base fleet
    for n in sizes:
        row = {side: (of(n, side, "round"), of(n, side, "start"), of(n, side, "peak")) for side in ("edgefil", "flower")}
        cold = of(n, "edgefil-cold", "start")
        (e_round, e_start, e_peak), (f_round, f_start, f_peak) = row["edgefil"], row["flower"]
        if before is not None:
            e_marginal = (e_peak - of(before, "edgefil", "peak")) / (n - before)
            f_marginal = (f_peak - of(before, "flower", "peak")) / (n - before)
            marginal = f"{e_marginal:.3f} | {f_marginal:.3f} | {f_marginal / e_marginal:.2f}"
        else:
            marginal = "- | - | -"
        print(f"| {n:4d} | {e_round:.2f} | {f_round:.2f} | {f_round / e_round:.2f} | {e_start:.1f} | {cold:.1f} "
              f"| {f_start:.1f} | {f_start / e_start:.2f} | {f_start / cold:.2f} | {e_peak / n:.2f} | {f_peak / n:.2f} | {f_peak / e_peak:.2f} "
              f"| {marginal} |")
        before = n
    print("\n|    N | clients training edgefil | Flower | samples a round edgefil | Flower | accuracy edgefil | Flower |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        work = {side: [of(n, side, f) for f in ("trained", "samples", "accuracy")] for side in ("edgefil", "flower")}
        (e_trained, e_samples, e_accuracy), (f_trained, f_samples, f_accuracy) = work["edgefil"], work["flower"]
        print(f"| {n:4d} | {e_trained:.0f} | {f_trained:.0f} | {e_samples:.0f} | {f_samples:.0f} | {e_accuracy:.3f} "
              f"| {f_accuracy:.3f} |")
    print("\nthe processes' own memory: the peak of their anonymous PSS, the pages of the files they map (the "
          "libraries') left out, which the host's page cache moves from run to run (PeakMemory)")
    print("\n|    N | anonymous MB edgefil | Flower | ratio | MB/device edgefil | Flower |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        e_anon, f_anon = of(n, "edgefil", "anon"), of(n, "flower", "anon")
        print(f"| {n:4d} | {e_anon:.0f} | {f_anon:.0f} | {f_anon / e_anon:.2f} | {e_anon / n:.2f} | {f_anon / n:.2f} |")
    print_cpu(runs, sizes)


def print_cpu(runs: list[dict[str, Any]], sizes: list[int]) -> None:
    """Where edgefil's round goes in CPU: its processes' CPU seconds a round (the median round after the first, the
    median run), the devices' training among the workers', its share of the whole, and what the rest costs a device
    that trains (the clients training a round)."""
    print("\nedgefil's CPU s a round (cached runs; the median round after the first): training = the devices' "
          "training threads, within the workers'; besides = (the whole - training) / the clients training, ms")
    print("\n|    N | coordinator | broker | workers | devices' training | training share | besides ms a device |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        mine = [r["cpu"] for r in runs if r["n"] == n and r["side"] == "edgefil" and "cpu" in r]
        if not mine:
            continue
        part = {name: median([cpu[name] for cpu in mine]) for name in CPU_PARTS}
        whole = part["coordinator"] + part["broker"] + part["workers"]
        clients = median([r["trained"] for r in runs if r["n"] == n and r["side"] == "edgefil"])
        print(f"| {n:4d} | {part['coordinator']:.2f} | {part['broker']:.2f} | {part['workers']:.2f} "
              f"| {part['training']:.2f} | {part['training'] / whole:.1%} "
              f"| {(whole - part['training']) / clients * 1e3:.1f} |")


def print_parts(runs: list[dict[str, Any]], sizes: list[int]) -> None:
    """Each side's peak PSS by kind of process (MB; the run at the median peak, the first repeat on a tie)."""
    print("\npeak PSS by process (MB), at the peak, and (in brackets) its anonymous part; main = edgefil's "
          "coordinator or Flower's driver and engine")
    for side in ("edgefil", "flower"):
        for n in sizes:
            mine = sorted((r for r in runs if r["n"] == n and r["side"] == side), key=lambda r: r["peak_pss"])
            if mine:
                run = mine[(len(mine) - 1) // 2]
                parts, anon = run["peak_parts"], run["peak_anon_parts"]
                print(f"{side:8s} N={n:5d} " + "  ".join(
                    f"{name} {size / 2**20:.0f} ({anon.get(name, 0) / 2**20:.0f})"
                    for name, size in sorted(parts.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
