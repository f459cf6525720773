"""The `edgefil` command. Each subcommand imports what it needs when it runs, so device-side commands never
pull in host-only packages (torch, onnx)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from edgefil.logs import LOG_LEVELS, configure_logging
from models.generator_kinds import GENERATOR_KINDS  # imports nothing: the CLI starts without numpy or torch

# What the host extras bring and the device install leaves out (pyproject.toml), and the extra to install.
HOST_ONLY = {name: "host" for name in ("torch", "torchvision", "onnx", "onnxscript", "sklearn", "matplotlib", "tqdm",
                                       "mnist1d", "threadpoolctl", "amqtt")} | {"ray": "host,ray"}


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a comma-separated shape such as 1,8,8, got {text!r}") from err


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"width\": 32}}', got {text!r}: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (keyword arguments), got {text!r}")
    return value


def _export(args: argparse.Namespace) -> int:
    from models.export import export_registered
    from models.zoo import REGISTRY

    if args.list:
        for name, spec in sorted(REGISTRY.items()):
            print(f"{name:16s} default input {spec.default_input_shape}  {spec.summary}")
        return 0
    if args.generator:
        return _export_generator(args)
    if not args.model or not args.classes or not args.out:
        raise SystemExit("edgefil export: --model, --classes and --out are required (or --list)")
    try:
        manifest = export_registered(
            args.model, args.classes, args.out, input_shape=args.input_shape, seed=args.seed, nominal=args.nominal,
            backends=args.backends, cache=not args.no_cache, model_args=args.model_args,
        )
    except ValueError as err:  # a model that cannot be built or exported: what is missing, in one line
        print(f"edgefil export: {err}", file=sys.stderr)
        return 2
    print(
        f"exported {manifest.model} ({manifest.num_parameters:,} parameters, input {manifest.input_shape}, "
        f"{manifest.num_classes} classes, IR {manifest.ir_version}) for the {', '.join(manifest.backends)} "
        f"backends to {args.out}"
    )
    return 0


def _export_generator(args: argparse.Namespace) -> int:
    """The per-class generator's artifacts (sampler graph; ORT training artifacts for the VAE)."""
    from models.generator_export import export_generator_artifacts
    from models.generators import default_spec, sampler_size

    if not args.input_shape or not args.out:
        raise SystemExit("edgefil export --generator: --input-shape and --out are required")
    spec = default_spec(args.generator, args.input_shape)
    export_generator_artifacts(spec, args.out, seed=args.seed)
    print(f"exported the {spec.kind} generator for inputs {spec.input_shape} ({sampler_size(spec):,} sampler values) "
          f"to {args.out}; devices find it at <model artifacts>/../generator-{spec.kind} unless [policy] artifacts "
          f"says otherwise")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from firmware_sim.demo import DemoSettings, run_demo

    run_demo(args.out, DemoSettings(devices=args.devices, tasks=args.tasks, rounds_per_task=args.rounds_per_task,
                                    epochs=args.epochs, budget=args.budget, seed=args.seed))
    return 0


def _client(args: argparse.Namespace) -> int:
    from edge_client.config import DeviceConfig
    from edge_client.device import Device, run_device
    from edgefil.link import ConnectionRefused

    if args.action == "install":
        return _client_install(args)
    config = DeviceConfig.load(args.config)
    if args.state_dir is not None:  # a container's writable volume, where the file's folder is mounted read-only
        config = dataclasses.replace(config, state_dir=Path(args.state_dir))
    config.check_paths(args.config)
    device: Device
    if config.simulated:  # a virtual device: the simulator builds its surroundings
        from firmware_sim.virtual_device import virtual_device

        device = virtual_device(config)
    else:
        device = Device(config)
    try:
        run_device(device)
    except ConnectionRefused as err:  # wrong credentials, a certificate that does not verify: retrying won't help
        print(f"edgefil client: {err}", file=sys.stderr)
        return 2
    return 0


def _client_install(args: argparse.Namespace) -> int:
    """`edgefil client install --config FILE`: the device's systemd unit and its file (edge_client/systemd.py)."""
    from edge_client.systemd import install

    try:
        unit, config = install(Path(args.config), Path(args.root), args.user, args.watchdog_s)
    except (ValueError, OSError) as err:
        print(f"edgefil client install: {err}", file=sys.stderr)
        return 2
    print(f"wrote {unit} and {config} (mode 0600)\nnext, as root:\n"
          f"  id {args.user} >/dev/null 2>&1 || useradd --system --home-dir /var/lib/edgefil --shell /usr/sbin/nologin "
          f"{args.user}\n  chown {args.user}: /etc/edgefil/{config.name}\n"
          f"  systemctl daemon-reload && systemctl enable --now {unit.name}\n"
          f"  journalctl -u {unit.name} -f     # its log")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """A stop signal as Ctrl-C; a second one does not cut the clean-up short."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM (systemd, `timeout`, `kill`) and SIGHUP (a closed terminal) stop a long command as Ctrl-C does:
    its clean-up runs and its results are written."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _installed(*modules: str) -> None:
    """ModuleNotFoundError for the first of `modules` this install lacks, found without importing any: a host
    command checks its file before its heavy imports, but on a device install the extra it lacks is said first."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _coordinator(args: argparse.Namespace) -> int:
    from coordinator.config import CoordinatorConfig

    _installed("torch")
    config = CoordinatorConfig.load(args.config)  # before the heavy imports: a typo is refused at once

    from coordinator.server import QuorumError, run_coordinator
    from edgefil.link import ConnectionRefused

    test_sets = None
    if config.scenario:  # simulation: the scenario's test sets (built by the simulator)
        from edgefil.settings import Where
        from firmware_sim.scenarios import check_scenario

        test_sets = check_scenario(config.scenario, Where(args.config).inner("scenario")).build()
    if args.dashboard is not None:
        from coordinator.dashboard import start_dashboard

        config.out.mkdir(parents=True, exist_ok=True)
        start_dashboard(config.out, args.dashboard)  # a daemon thread: it ends with the command
    try:
        with stop_signals():
            results = run_coordinator(config, resume=args.resume, device=args.device, test_sets=test_sets)
    except (QuorumError, FileExistsError, ConnectionRefused) as err:  # the broker refused its account, its TLS
        print(f"edgefil coordinator: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _write_report(config.out)
    print(f"final accuracy {results['final_accuracy']:.2%} after {results['rounds_completed']} rounds; "
          f"accuracy matrix: {results['accuracy_matrix']}; report: {config.out / 'summary.md'}")
    return 0


def _site(args: argparse.Namespace) -> int:
    from coordinator.site_aggregator import SiteConfig

    _installed("torch")
    config = SiteConfig.load(args.config)  # before the heavy imports: a typo is refused at once

    from coordinator.site_aggregator import SiteAggregator
    from edgefil.link import ConnectionRefused

    try:
        with stop_signals():
            SiteAggregator(config).run()
    except ConnectionRefused as err:
        print(f"edgefil site: {err}", file=sys.stderr)
        return 2
    return 0


def _write_report(out: Path) -> None:
    """The run's report beside its results, however the run ended (a fleet writes its own); one that cannot be
    written is said in one line and changes nothing else."""
    if not (out / "results.json").is_file():
        return
    from firmware_sim.report import write_report

    try:
        write_report(out)
    except (OSError, ValueError) as err:
        print(f"edgefil coordinator: the report was not written: {err}", file=sys.stderr)


def _fleet_run(args: argparse.Namespace) -> int:
    _installed("torch")
    from firmware_sim.fleet_config import FleetConfig

    FleetConfig.load(args.fleet_file).check_tables(str(args.fleet_file))  # before the heavy imports: a typo at once

    from coordinator.server import QuorumError, RunAborted
    from firmware_sim.fleet import run_fleet_file

    try:
        with stop_signals():
            results = run_fleet_file(args.fleet_file, resume=args.resume, address=args.address,
                                     dashboard=args.dashboard)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, QuorumError, RunAborted) as err:  # a Ray cluster that does not answer, a lost worker
        print(f"edgefil fleet run: {err}", file=sys.stderr)
        return 2
    print(f"final accuracy {results['final_accuracy']:.2%} after {results['rounds_completed']} rounds; "
          f"report: {results['report']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgefil", description=__doc__)
    from edgefil import __version__

    parser.add_argument("--version", action="version", version=f"edgefil {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="what edgefil logs: DEBUG, INFO (default), WARNING or ERROR; other libraries log "
                             "warnings and errors only, and everything at DEBUG")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a registered model for the devices' trainer backends")
    export.add_argument("--model", help="a zoo model's name (see --list), or your own as package.module:Name (an "
                                        "nn.Module mapping inputs to one feature vector each; models/zoo.py)")
    export.add_argument("--model-args", type=_json_object, default={}, metavar="JSON",
                        help="your own model's constructor arguments, a JSON object such as '{\"width\": 32}'")
    export.add_argument("--classes", type=int, help="total number of classes of the scenario (head size)")
    export.add_argument("--out", help="artifact directory to write")
    export.add_argument("--input-shape", type=_shape, help="input shape without batch, e.g. 1,28,28")
    export.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    export.add_argument("--nominal", action="store_true", help="ship a weight-less checkpoint")
    export.add_argument("--backends", type=lambda text: tuple(text.split(",")), default=None,
                        help="trainer backends to export for, comma-separated: portable, ort, torch (default: every "
                             "one this host can export)")
    export.add_argument("--list", action="store_true", help="list the registered models")
    export.add_argument("--no-cache", action="store_true",
                        help="export anew, even when the same export is kept in the cache (models/cache.py)")
    export.add_argument("--generator", choices=GENERATOR_KINDS,
                        help="export the per-class generator for --input-shape instead of a model")
    export.set_defaults(run=_export)

    demo = commands.add_parser(
        "demo", help="the main job: a fleet of virtual devices, Re-Fed vs random caching vs Fixed, compared"
    )
    demo.add_argument("--out", default="runs/demo", help="each demo writes a new folder run-<n> in here")
    demo.add_argument("--devices", type=int, default=10)
    demo.add_argument("--tasks", type=int, default=5, help="class-incremental digits tasks (2 classes each)")
    demo.add_argument("--rounds-per-task", type=int, default=4)
    demo.add_argument("--epochs", type=int, default=10, help="local epochs E per round")
    demo.add_argument("--budget", type=int, default=None,
                      help="the replay budget M, in samples per device (default: ~25%% of old data cached at the end)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    client = commands.add_parser("client", help="run one device: connect, register, train when selected, upload; "
                                                "`client install` writes its systemd unit")
    client.add_argument("action", nargs="?", choices=("run", "install"), default="run",
                        help="run the device (default), or install it as a systemd service")
    client.add_argument("--config", required=True, help="device config file (TOML, see edge_client/config.py)")
    client.add_argument("--state-dir", default=None,
                        help="run: keep the device's state and replay store here, not in the file's state_dir (a "
                             "container's writable volume: docs/deploy.md)")
    client.add_argument("--root", default="/", help="install: write under this root (default /)")
    client.add_argument("--user", default="edgefil", help="install: the system user the service runs as")
    client.add_argument("--watchdog-s", type=int, default=600,
                        help="install: systemd restarts a daemon silent this long (longer than its longest round)")
    client.set_defaults(run=_client)

    coordinator = commands.add_parser("coordinator", help="run the rounds of a federation over MQTT")
    coordinator.add_argument("--config", required=True, help="coordinator config file (TOML)")
    coordinator.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    coordinator.add_argument("--device", choices=("auto", "cpu", "cuda"),
                             help="where to aggregate (overrides the config)")
    coordinator.add_argument("--dashboard", metavar="[HOST:]PORT",
                             help="serve the run's live dashboard there (edgefil dashboard RUN_DIR does it apart)")
    coordinator.set_defaults(run=_coordinator)

    site = commands.add_parser("site", help="run a site's aggregator: its devices' updates taken at the site, one "
                                            "share a round to the coordinator (coordinator/site_aggregator.py)")
    site.add_argument("--config", required=True, help="site config file (TOML): fleet, site, artifacts, [broker]")
    site.set_defaults(run=_site)

    fleet = commands.add_parser("fleet", help="virtual devices, a broker and the coordinator on this machine")
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True)
    fleet_run = fleet_commands.add_parser("run", help="run a fleet file (see firmware_sim/fleet.py)")
    fleet_run.add_argument("fleet_file", help="fleet file (TOML)")
    fleet_run.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    fleet_run.add_argument("--address", help="run the workers on this Ray cluster (auto, HOST:PORT or "
                                             "ray://HOST:10001): backend = \"ray\" with [ray] address set")
    fleet_run.add_argument("--dashboard", metavar="[HOST:]PORT",
                           help="serve the run's live dashboard there while it runs (e.g. 8765)")
    fleet_run.set_defaults(run=_fleet_run)

    from coordinator.broker import add_broker_parser
    from coordinator.dashboard import add_dashboard_parser
    from coordinator.pki import add_credentials_parser
    from edgefil.watch import add_watch_parser
    from firmware_sim.data_split import add_data_parser
    from firmware_sim.report import add_report_parser
    from firmware_sim.starter import add_init_parser

    add_broker_parser(commands)
    add_credentials_parser(commands)
    add_dashboard_parser(commands)
    add_watch_parser(commands)
    add_init_parser(commands)
    add_data_parser(commands)
    add_report_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    from edgefil.durable import StateError
    from edgefil.settings import ConfigError

    try:
        return int(args.run(args))
    except (ConfigError, StateError) as err:  # a config file, or saved state, that cannot be used: one line
        print(f"edgefil {args.command}: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a host command on a device install: which extra brings it
        extra = HOST_ONLY.get((err.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"edgefil {args.command}: needs {err.name}, which a device install leaves out: install the "
              f"{extra} extra (in the edgefil checkout: pip install '.[{extra}]')", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
