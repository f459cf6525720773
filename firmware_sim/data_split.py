"""`edgefil data split`: a scenario's data as the files a real deployment reads, with their format recorded.

    edgefil data split --preset digits-class --devices pi-1,pi-2 --out lab/data
    edgefil data split --from my-data.npz --classes-per-task 2 --tasks 5 --devices pi-1,pi-2 --out lab/data
    edgefil data split --from my-images/ --classes-per-task 2 --tasks 2 --devices pi-1,pi-2 --out lab/data

writes, into `--out`:

    devices/<id>/task-<t>.npz   each device's share of task t (arrays x float32, y int64): its [data] folder
    test/test-<t>.npz           task t's test set: the coordinator's `test_data` folder
    test/calibration-<t>.npz    with `--calibration N`: N train samples of each of task t's classes that no device
                                gets, for the coordinator's guard (`[guard] reference`, coordinator/reference.py)
    classes.json                the class order (task t -> its classes), the input format (shape, dtype, range),
                                the number of classes and their names where the data name them (an image
                                folder's), the scenario that made it, and each device's label counts

The split is the scenario's (firmware_sim/scenarios.py), as a simulated fleet of these devices would run it: its
seeded class order, its Dirichlet split of each task's samples over the devices. A user's own data (`--from`: an
.npz, or a folder of .npy files, with `x` and `y` and optionally `x_test`, `y_test`; or a folder of images with a
subfolder per class) is a class-incremental scenario of the `arrays` dataset (firmware_sim/own_data.py). The
class order matters: the coordinator evaluates task t on test-<t>.npz, so devices fed another order learn the right
classes under the wrong tasks, and the coordinator warns when a device's labels are not among the tasks' so far.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.durable import npz_bytes, write_atomically
from edgefil.settings import ConfigError
from edgefil.topics import check_name
from firmware_sim.scenarios import PRESETS, ScenarioData, own_scenario, preset

CLASSES_FILE = "classes.json"


def split_scenario(data: ScenarioData, devices: list[str], out: Path) -> dict[str, Any]:
    """Write every device's task files, the test sets and classes.json; returns what classes.json holds."""
    if len(devices) != data.scenario.n_clients:
        raise ValueError(f"{len(devices)} devices for a scenario of {data.scenario.n_clients} clients")
    counts: dict[str, dict[str, list[int]]] = {}
    for folder in [out / "test", *(out / "devices" / d for d in devices)]:
        folder.mkdir(parents=True, exist_ok=True)
    for t, task in enumerate(data.tasks):
        x, y = data.task_test(t)
        write_atomically(out / "test" / f"test-{t}.npz", npz_bytes({"x": x.astype(np.float32),
                                                                     "y": y.astype(np.int64)}))
        if len(task.calibration_indices):
            x, y = task.calibration()
            write_atomically(out / "test" / f"calibration-{t}.npz", npz_bytes({"x": x.astype(np.float32),
                                                                                "y": y.astype(np.int64)}))
        for k, device in enumerate(devices):
            x, y = task.client_train(k)
            write_atomically(out / "devices" / device / f"task-{t}.npz",
                             npz_bytes({"x": x.astype(np.float32), "y": y.astype(np.int64)}))
            counts.setdefault(device, {})[f"task-{t}"] = np.bincount(y, minlength=data.num_classes).tolist()
    x_test = data.task_test(0)[0]
    names = data.tasks[0].data.class_names
    record = {
        "tasks": [{"task": t, "classes": list(data.task_classes(t))} for t in range(data.n_tasks)],
        "num_classes": data.num_classes,
        **({"class_names": list(names)} if names else {}),
        "input_shape": list(data.input_shape),
        "x": {"dtype": "float32", "min": float(x_test.min()), "max": float(x_test.max()),
              "layout": "one sample per row, channels first"},
        "y": {"dtype": "int64", "values": f"class ids 0..{data.num_classes - 1}"},
        "scenario": data.describe(),
        "devices": {d: {"folder": f"devices/{d}", "label_counts": c} for d, c in counts.items()},
    }
    write_atomically(out / CLASSES_FILE, json.dumps(record, indent=1).encode())
    return record


def _scenario(args: argparse.Namespace, devices: list[str]) -> ScenarioData:
    overrides: dict[str, Any] = {"n_clients": len(devices), "seed": args.seed, "calibration": args.calibration}
    if args.source is not None:
        return own_scenario(args.source, args.tasks, args.classes_per_task, **overrides).build()
    if args.tasks is not None:
        overrides["n_tasks"] = args.tasks
    if args.classes_per_task is not None:
        overrides["classes_per_task"] = args.classes_per_task
    return preset(args.preset, **overrides).build()


def _run_split(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        for device in devices:
            check_name(device, "device id")
        if len(set(devices)) != len(devices) or not devices:
            raise ValueError("--devices: give each device once (comma-separated ids)")
        data = _scenario(args, devices)
        record = split_scenario(data, devices, Path(args.out))
    except (ValueError, ConfigError, OSError) as err:
        print(f"edgefil data split: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print(f"wrote {data.n_tasks} tasks for {len(devices)} devices to {out} (inputs {tuple(data.input_shape)}, "
          f"{data.num_classes} classes):")
    for task in record["tasks"]:
        t = task["task"]
        sizes = ", ".join(f"{d} {sum(record['devices'][d]['label_counts'][f'task-{t}'])}" for d in devices)
        names = record.get("class_names")
        classes = ", ".join(f"{c} ({names[c]})" if names else str(c) for c in task["classes"])
        print(f"  task {t}: classes {classes}  ({sizes} samples)")
    print(f"  devices: [data] folder = \"{out / 'devices' / '<id>'}\"; coordinator: test_data = \"{out / 'test'}\"; "
          f"the class order: {out / CLASSES_FILE}")
    return 0


def add_data_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil data split` to the `edgefil` command's subparsers."""
    data = commands.add_parser("data", help="turn the embedded data or your own into per-device task files")
    sub = data.add_subparsers(dest="data_command", required=True)
    split = sub.add_parser("split", help="write each device's task-<t>.npz, the test sets and classes.json")
    split.add_argument("--preset", default="digits-class", choices=sorted(PRESETS),
                       help="the scenario (embedded data) to split (default digits-class)")
    split.add_argument("--from", dest="source", metavar="PATH",
                       help="your own data instead: an .npz (or a folder of .npy files) with x and y, or a "
                            "folder of images with a subfolder per class (firmware_sim/own_data.py)")
    split.add_argument("--devices", required=True, help="comma-separated device ids, one share each")
    split.add_argument("--out", required=True, help="folder to write (devices/, test/, classes.json)")
    split.add_argument("--tasks", type=int, help="number of tasks (default: the preset's)")
    split.add_argument("--classes-per-task", type=int, help="classes per task (default: the preset's)")
    split.add_argument("--seed", type=int, default=0, help="the class order's and the split's seed")
    split.add_argument("--calibration", type=int, default=0, metavar="N",
                       help="train samples of each class kept from every device for the coordinator's guard, "
                            "written as test/calibration-<t>.npz (default 0: none)")
    split.set_defaults(run=_run_split)
