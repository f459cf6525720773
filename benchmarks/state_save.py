"""A device's state save, as every device of a fleet makes it each round, with and without power-loss safety.

A fleet device saves its state after each round it trains (`Learner.save`: the record, its weights and, with
`between_rounds = "disk"`, the fleet's default, its optimiser state; `edgefil/durable.py`). A device's own process
makes each save survive a power cut of its machine (fsync of each file and of the folder); a fleet's worker makes
it survive a killed worker only (`edgefil.durable.set_power_loss_safe(False)`, `FleetConfig.power_loss_safe`).
The state is saved in two slots written in place (`save_state`, `durable.save_slotted`); the baseline is the form
devices used before, each buffer a new file named by its sha256 and state.json replaced by rename, the old files
removed (`durable.save_record`, still the coordinator's for its write-once generations).

This saves the state of `--devices` devices (each its own folder, as a fleet's) `--rounds` times each of the four
ways (the two forms, with and without power-loss safety), after two untimed saves each (a running device's
folder holds its files), alternated in one process, and prints CPU and wall time per save (best of the repeats) and ratios;
and, for the slots, a read-back of the weights and optimiser state with the record the save returned (what a parked
trainer takes back at the device's next round).

    .venv/bin/python benchmarks/state_save.py [--model cnn1d] [--devices 200] [--rounds 3] [--repeats 3]
        [--dir DIR] (default: the system temp directory; on a tmpfs there is nothing to sync)
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_client.state import ClientState, load_state, save_state
from edgefil import durable
from models.zoo import REGISTRY, build_model

FORMS: dict[str, Callable[[Path, ClientState], None]] = {"slots": save_state, "replace": durable.save_record}


def saves(root: Path, devices: int, rounds: int, state: ClientState, save: Callable[[Path, ClientState], None]
          ) -> tuple[float, float]:
    """CPU and wall seconds per save of `devices` x `rounds` saves under `root` (after two untimed saves per device:
    a running device's folder, both slots made), each round's weights new."""
    for _ in range(2):
        for d in range(devices):
            save(root / f"device-{d}", state)
    cpu, wall = time.process_time(), time.perf_counter()
    for r in range(rounds):
        for d in range(devices):
            assert state.weights is not None and state.optimizer is not None
            state.weights[0] = state.optimizer[0] = r * devices + d + 1  # another file each time, as a round's is
            save(root / f"device-{d}", state)
    count = devices * rounds
    return (time.process_time() - cpu) / count, (time.perf_counter() - wall) / count


def read_backs(root: Path, devices: int, rounds: int, state: ClientState) -> tuple[float, float]:
    """CPU and wall seconds per read-back of a slotted save's weights and optimiser state, with the record the save
    returned (`load_state(saved=...)`: what a device's parked trainer takes back at its next round), `devices` x
    `rounds` of them, each after an untimed save."""
    cpu = wall = 0.0
    for r in range(rounds):
        for d in range(devices):
            assert state.weights is not None
            state.weights[0] = r * devices + d + 1
            record = save_state(root / f"device-{d}", state)
            cpu_at, wall_at = time.process_time(), time.perf_counter()
            load_state(root / f"device-{d}", saved=record)
            cpu, wall = cpu + time.process_time() - cpu_at, wall + time.perf_counter() - wall_at
    return cpu / (devices * rounds), wall / (devices * rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn1d", choices=sorted(REGISTRY))
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    size = sum(p.numel() for p in build_model(args.model, 10).parameters())  # its default input, 10 classes
    rng = np.random.default_rng(0)
    state = ClientState(task=0, round=1, seen_classes=list(range(10)), label_counts=[3] * 10, model="m" * 16,
                        metrics={f"metric_{k}": 0.5 for k in range(12)},
                        weights=rng.standard_normal(size).astype(np.float32),
                        optimizer=rng.standard_normal(2 * size).astype(np.float32), optimizer_buffers=["m", "v"])
    best: dict[tuple[str, bool], tuple[float, float]] = {}
    for _ in range(args.repeats):
        for form, save in FORMS.items():
            for safe in (True, False):  # alternated: the host's load falls on every way alike
                root = Path(tempfile.mkdtemp(prefix="state-save-", dir=args.dir))
                try:
                    durable.set_power_loss_safe(safe)
                    cpu, wall = saves(root, args.devices, args.rounds, state, save)
                    if form == "slots":
                        read_cpu, read_wall = read_backs(root, args.devices, args.rounds, state)
                        old = best.get(("read back", safe), (read_cpu, read_wall))
                        best["read back", safe] = (min(read_cpu, old[0]), min(read_wall, old[1]))
                finally:
                    shutil.rmtree(root)
                old = best.get((form, safe), (cpu, wall))
                best[form, safe] = (min(cpu, old[0]), min(wall, old[1]))
    print(f"state save of a {args.model} device ({size} parameters, weights and AdamW state: "
          f"{3 * size * 4 / 1024:.0f} KiB), {args.devices} devices x {args.rounds} rounds, best of {args.repeats}")
    print(f"{'writes survive':>22s} {'CPU ms, replace':>15s} {'slots':>6s} {'ratio':>6s} "
          f"{'wall ms, replace':>16s} {'slots':>6s} {'ratio':>6s}")
    for safe, label in ((True, "a power cut (device)"), (False, "a killed process")):
        (rc, rw), (sc, sw) = best["replace", safe], best["slots", safe]
        print(f"{label:>22s} {rc * 1e3:15.3f} {sc * 1e3:6.3f} {rc / sc:5.2f}x {rw * 1e3:16.3f} {sw * 1e3:6.3f} "
              f"{rw / sw:5.2f}x")
    for form in FORMS:
        print(f"{form}: power cut / killed process: CPU {best[form, True][0] / best[form, False][0]:.2f}x, "
              f"wall {best[form, True][1] / best[form, False][1]:.2f}x")
    for safe, label in ((True, "a power cut"), (False, "a killed process")):
        cpu, wall = best["read back", safe]
        print(f"slots, read back (a parked trainer's next round), writes surviving {label}: CPU {cpu * 1e3:.3f} ms, "
              f"wall {wall * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
