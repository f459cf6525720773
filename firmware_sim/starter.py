"""`edgefil init`: the files of a first federation, commented, for a chosen preset.

    edgefil init lab --preset digits-class --devices pi-1,pi-2 [--host 127.0.0.1] [--port 8883]
    edgefil init lab --from my-images/ --tasks 2 --classes-per-task 2 --devices pi-1,pi-2

writes, into the folder (`lab/`):

    coordinator.toml        the coordinator: the roster, the rounds, test_data = "data/test", its [broker] account
    devices/<id>.toml       each device: its [broker] account, its [data] folder, the budget M, the replay policy
    fleet.toml              the same federation as a simulated fleet (`edgefil fleet run lab/fleet.toml`): a
                            rehearsal on this machine before the devices are real
    broker/                 mosquitto's files with TLS for `--host` (the CA, the broker's certificate, a password
                            per device, the ACL; edgefil credentials makes them), and observer.toml for
                            `edgefil watch`

and prints the commands that come next: `edgefil data split` (the devices' task files and the test sets, in the
preset's class order, or in the user's own data's with `--from`: firmware_sim/own_data.py; and the calibration
samples the coordinator's guard compares updates on: 10 a class, `ScenarioKind.calibration`), `edgefil export` (the
model), the broker, the coordinator and one client per device. Every relative path in edgefil's files is relative to
the file's own folder, so they move with the folder. mosquitto reads a relative path from the directory it was
started in, so `broker/mosquitto.conf` names its files (passwords, ACL, certificates, pid and log) by absolute path:
after moving the folder, put its new path in that file (`sed -i "s#/old/lab#/new/lab#g" lab/broker/mosquitto.conf`).
Writing into a folder that holds any of these files is refused: nothing is overwritten.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from coordinator.pki import write_fleet_credentials
from edgefil.durable import write_private
from edgefil.settings import load_toml
from edgefil.topics import check_name
from firmware_sim.scenarios import PRESETS, Scenario, ScenarioData, own_scenario, preset


@dataclass(frozen=True)
class StarterData:
    """Where a first federation's data come from: a preset's embedded data, or the user's own (`source`, cut into
    `tasks` of `classes_per_task` classes). One object, so that the files `edgefil init` writes and the `edgefil
    data split` it prints name the same data."""

    preset: str = "digits-class"
    source: str | None = None
    tasks: int | None = None
    classes_per_task: int | None = None

    def scenario(self, n_clients: int) -> Scenario:
        if self.source is not None:
            return own_scenario(self.source, self.tasks, self.classes_per_task, n_clients=n_clients)
        return preset(self.preset, n_clients=n_clients)

    def split_options(self) -> str:
        """`edgefil data split`'s options for these data."""
        if self.source is None:
            return f"--preset {self.preset}"
        return f"--from {self.source} --tasks {self.tasks} --classes-per-task {self.classes_per_task}"

    def fleet_scenario(self, calibration: int) -> str:
        """The fleet file's `scenario` table for these data (a rehearsal runs them as the devices will)."""
        if self.source is None:
            return f'{{preset = "{self.preset}", calibration = {calibration}}}'
        root = json.dumps(str(Path(self.source).resolve()))  # a TOML basic string, whatever the path holds
        return (f'{{dataset = "arrays", data_root = {root}, kind = "class", n_tasks = {self.tasks}, '
                f'classes_per_task = {self.classes_per_task}, calibration = {calibration}}}')


def model_for(data: ScenarioData) -> str:
    """The zoo's model for the scenario's inputs: a 1-D CNN for signals (C, L), LeNet for images (C, H, W)."""
    return "cnn1d" if len(data.input_shape) == 2 else "lenet"


def _broker_lines(table: dict[str, object], cafile: str) -> str:
    return "\n".join([
        "[broker]                          # edgefil init made this account (broker/ holds mosquitto's files)",
        f"host = \"{table['host']}\"",
        f"port = {table['port']}",
        f"username = \"{table['username']}\"",
        f"password = \"{table['password']}\"",
        f"cafile = \"{cafile}\"               # the fleet's CA: TLS to the broker",
    ])


def coordinator_file(fleet: str, devices: list[str], broker: dict[str, object], rounds_per_task: int,
                     epochs: int) -> str:
    roster = ", ".join(f'"{d}"' for d in devices)
    return f"""# The coordinator of fleet "{fleet}" (every key: coordinator/config.py).
#   edgefil coordinator --config coordinator.toml [--dashboard 8765]
fleet = "{fleet}"
out = "run"                          # results.json, metrics.csv, tensorboard/, checkpoint/, live.json
artifacts = "artifacts"              # edgefil export ... --out artifacts (the devices hold the same files)
devices = [{roster}]
test_data = "data/test"              # test-<t>.npz from edgefil data split: task t's test set, in its class order
rounds_per_task = {rounds_per_task}
min_clients = {len(devices)}                      # a round aggregates with at least this many updates
deadline_s = 120                     # an update later than this is dropped
wait_for_devices_s = 300             # the first round waits this long for the whole roster

{_broker_lines(broker, "broker/ca.crt")}

[client]                             # sent to the devices with every round
epochs = {epochs}                           # E: local epochs per round
"""


def device_file(fleet: str, device: str, broker: dict[str, object], budget: int, policy: str) -> str:
    return f"""# Device "{device}" of fleet "{fleet}" (every key: edge_client/config.py).
#   edgefil client --config devices/{device}.toml
# On a real device, copy this file, ../artifacts, ../broker/ca.crt and its data folder, and fix the paths.
device_id = "{device}"
fleet = "{fleet}"
artifacts = "../artifacts"           # the model (its manifest must match the coordinator's)
state_dir = "../state/{device}"       # the replay store and the device's state: survives restarts
on_end = "exit"                      # when the run is over: exit, or "wait" for the next run

{_broker_lines(broker, "../broker/ca.crt")}

[store]
max_samples = {budget}                  # the budget M: replay samples kept on the device

[policy]
name = "{policy}"                      # refed, random, reservoir, herding, ... (edge_client/policies/)
# new_share = "stream"               # the newest task's share of M (left out: all it brings; or a number <= 1)

[learner]
mask_seen_classes = true             # softmax over the classes this device has seen (docs/results-history.md)

[data]
folder = "../data/devices/{device}"   # task-<t>.npz (x float32, y int64) from edgefil data split
"""


def fleet_file(fleet: str, data: StarterData, devices: list[str], budget: int, policy: str, rounds_per_task: int,
               epochs: int, model: str, calibration: int) -> str:
    return f"""# The same federation as a simulated fleet on this machine (every key: firmware_sim/fleet.py):
#   edgefil fleet run fleet.toml --dashboard 8765
name = "{fleet}-rehearsal"
out = "rehearsal"
devices = {len(devices)}
model = "{model}"
scenario = {data.fleet_scenario(calibration)}
# calibration: samples a class the coordinator keeps for its guard's trust reference (none on a device)

[policy]
name = "{policy}"

[store]
max_samples = {budget}

[client]
epochs = {epochs}

[coordinator]
rounds_per_task = {rounds_per_task}
min_clients = {len(devices)}
"""


def write_starter(folder: Path, fleet: str, source: StarterData, data: ScenarioData, devices: list[str], host: str,
                  port: int, policy: str = "refed", rounds_per_task: int = 3, epochs: int = 10) -> list[Path]:
    """Write the files the module docstring lists for `source`'s data, built (`data`); returns them.
    FileExistsError when one is there already."""
    check_name(fleet, "fleet")
    for device in devices:
        check_name(device, "device id")
    budget = data.binding_budget()
    targets = [folder / "coordinator.toml", folder / "fleet.toml", *(folder / "devices" / f"{d}.toml"
                                                                     for d in devices)]
    present = [p for p in [*targets, folder / "broker"] if p.exists()]
    if present:
        raise FileExistsError(f"{present[0]} exists: edgefil init writes into a new folder (nothing is overwritten)")
    (folder / "devices").mkdir(parents=True)
    write_fleet_credentials(folder / "broker", fleet, devices, [host], port=port, bind=host)
    coordinator = load_toml(folder / "broker" / "coordinator.toml")["broker"]
    # private: each holds a broker password
    write_private(folder / "coordinator.toml", coordinator_file(fleet, devices, coordinator, rounds_per_task, epochs))
    for device in devices:
        account = load_toml(folder / "broker" / "devices" / f"{device}.toml")["broker"]
        write_private(folder / "devices" / f"{device}.toml", device_file(fleet, device, account, budget, policy))
    (folder / "fleet.toml").write_text(fleet_file(fleet, source, devices, budget, policy, rounds_per_task,
                                                  epochs, model_for(data), calibration_of(data)))
    return targets


def calibration_of(data: ScenarioData) -> int:
    """The calibration samples a class the first federation keeps (`ScenarioKind.calibration`)."""
    return data.scenario.kind_class().calibration(data.scenario)


def next_steps(folder: Path, source: StarterData, data: ScenarioData, devices: list[str]) -> str:
    shape = ",".join(map(str, data.input_shape))
    clients = "\n".join(f"  edgefil client --config {folder}/devices/{d}.toml" for d in devices)
    calibration = calibration_of(data)
    kept = f" --calibration {calibration}" if calibration else ""
    return (f"next:\n"
            f"  edgefil data split {source.split_options()} --devices {','.join(devices)}{kept} --out {folder}/data\n"
            f"  edgefil export --model {model_for(data)} --classes {data.num_classes} --input-shape {shape} "
            f"--out {folder}/artifacts\n"
            f"  mosquitto -c {folder}/broker/mosquitto.conf -d\n"
            f"  edgefil coordinator --config {folder}/coordinator.toml --dashboard 8765\n{clients}\n"
            f"  edgefil watch --config {folder}/broker/observer.toml     # the traffic, decoded\n"
            f"  edgefil report {folder}/run")


def _run_init(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    folder = Path(args.folder)
    try:
        if not devices or len(set(devices)) != len(devices):
            raise ValueError("--devices: give each device once (comma-separated ids)")
        source = StarterData(args.preset, args.source, args.tasks, args.classes_per_task)
        data = source.scenario(len(devices)).build()  # once: a folder of images is read whole
        written = write_starter(folder, args.fleet or folder.resolve().name, source, data, devices, args.host,
                                args.port, args.policy)
    except (ValueError, FileExistsError) as err:
        print(f"edgefil init: {err}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(str(p) for p in written)} and the broker's files in {folder / 'broker'}")
    print(next_steps(folder, source, data, devices))
    return 0


def add_init_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil init FOLDER --devices a,b [--preset P]` to the `edgefil` command's subparsers."""
    init = commands.add_parser("init", help="write the commented files of a first federation into a new folder")
    init.add_argument("folder", help="the folder to make (its name is the fleet's unless --fleet)")
    init.add_argument("--devices", required=True, help="comma-separated device ids")
    init.add_argument("--preset", default="digits-class", choices=sorted(PRESETS),
                      help="the scenario whose data the devices get (edgefil data split)")
    init.add_argument("--from", dest="source", metavar="PATH",
                      help="your own data instead (as edgefil data split --from: arrays, or a folder of images "
                           "with a subfolder per class); needs --tasks and --classes-per-task")
    init.add_argument("--tasks", type=int, help="with --from: number of tasks")
    init.add_argument("--classes-per-task", type=int, help="with --from: classes per task")
    init.add_argument("--fleet", help="the fleet's name (default: the folder's)")
    init.add_argument("--host", default="127.0.0.1", help="the broker's address, as the devices reach it")
    init.add_argument("--port", type=int, default=8883, help="the broker's TLS port")
    init.add_argument("--policy", default="refed", help="the devices' replay policy")
    init.set_defaults(run=_run_init)
