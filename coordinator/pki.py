"""TLS material for a fleet's broker, and `edgefil credentials`: everything a deployment needs in one folder.

    edgefil credentials --fleet lab --devices dev-0,dev-1 --host broker.lan --out secrets/lab [--client-certs]
        [--observer-reads-learning]

writes, into `--out` (private files 0600):

    ca.crt, ca.key                  the fleet's own certificate authority (EC P-256)
    server.crt, server.key          the broker's certificate, naming every --host (DNS names and IP addresses)
    mosquitto.conf, passwd, acl     mosquitto's files: TLS listener, hashed passwords, the per-device ACL
                                    (coordinator/broker.py writes them, as for a simulated fleet)
    coordinator.toml                the coordinator's [broker] table (username, password, cafile; with
                                    --client-certs its certificate, devices/coordinator.crt and .key)
    observer.toml                   a read-only account on the fleet's protocol metadata (registrations, statuses,
                                    rounds, requests; with --observer-reads-learning the updates, models and
                                    method payloads too), with `fleet`: for `edgefil watch --config
                                    observer.toml` (with --client-certs its certificate too)
    devices/<id>.toml               each device's [broker] table; with --client-certs also devices/<id>.crt, .key
    devices/ca.crt                  a copy of the CA's certificate: devices/ holds all a device needs

Run it again with more devices to add them: what exists is kept (the CA, the server's key and certificate, every
password), so devices already deployed keep working. The certificates are made with the `openssl` command, which
every host that runs mosquitto has; keys are EC P-256, certificates last `--days` (825 by default: what clients
accept for a server certificate). A device needs its [broker] table in its config file and the files the table
names (relative paths are taken relative to the config file), so copy them side by side.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from coordinator.broker import Credentials, MosquittoBroker, TlsFiles, generate_password
from edgefil import topics
from edgefil.durable import write_private
from edgefil.settings import dump_toml, load_toml

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
DEFAULT_DAYS = 825
OBSERVER = "observer"  # the read-only account of `edgefil watch`


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is missing (Debian/Ubuntu: apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def _alt_name(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return f"IP:{host}"
    except ValueError:
        return f"DNS:{host}"


def make_ca(folder: Path, name: str, days: int = DEFAULT_DAYS) -> Path:
    """ca.crt and ca.key in `folder` (kept when they exist); the CA's certificate."""
    cert, key = folder / "ca.crt", folder / "ca.key"
    if not (cert.exists() and key.exists()):
        _openssl("req", "-x509", *EC, "-keyout", key.name, "-out", cert.name, "-days", str(days),
                 "-subj", f"/CN={name} CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
        _private(key)
    return cert


def _sign(folder: Path, stem: str, subject: str, extensions: str, days: int) -> None:
    """<stem>.key and <stem>.crt in `folder`, signed by the CA there."""
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        work = Path(scratch)
        (work / "ext").write_text(extensions)
        _openssl("req", *EC, "-keyout", str(folder / f"{stem}.key"), "-out", "req.csr", "-subj", subject, cwd=work)
        _openssl("x509", "-req", "-in", "req.csr", "-CA", str(folder / "ca.crt"), "-CAkey", str(folder / "ca.key"),
                 "-CAcreateserial", "-CAserial", "serial", "-out", str(folder / f"{stem}.crt"), "-days", str(days),
                 "-extfile", "ext", cwd=work)
    _private(folder / f"{stem}.key")


def make_server_cert(folder: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS) -> TlsFiles:
    """The broker's key and certificate for `hosts` (kept when they exist), signed by the CA in `folder`."""
    if not hosts:
        raise ValueError("the server certificate needs at least one host name or address")
    if not ((folder / "server.crt").exists() and (folder / "server.key").exists()):
        names = ",".join(_alt_name(h) for h in hosts)
        _sign(folder, "server", f"/CN={hosts[0]}",
              f"basicConstraints=CA:FALSE\nsubjectAltName={names}\nextendedKeyUsage=serverAuth\n", days)
    return TlsFiles(str(folder / "ca.crt"), str(folder / "server.crt"), str(folder / "server.key"))


def make_client_cert(folder: Path, name: str, days: int = DEFAULT_DAYS) -> tuple[Path, Path]:
    """A client certificate for `name` in folder/devices (kept when it exists), signed by the CA in `folder`."""
    devices = folder / "devices"
    devices.mkdir(exist_ok=True)
    if not ((devices / f"{name}.crt").exists() and (devices / f"{name}.key").exists()):
        _sign(folder, f"devices/{name}", f"/CN={name}",
              "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n", days)
    return devices / f"{name}.crt", devices / f"{name}.key"


def _password_in(table: Path) -> str | None:
    """The password an earlier run wrote into a [broker] table (kept, so deployed devices keep working)."""
    if not table.exists():
        return None
    return load_toml(table).get("broker", {}).get("password")


def _broker_table(path: Path, host: str, port: int, username: str, password: str, cafile: str | None,
                  client_cert: tuple[str, str] | None, fleet: str | None = None) -> None:
    """A private file with a [broker] table (and `fleet`, for an observer's file)."""
    values: dict[str, str | int] = {"host": host, "port": port, "username": username, "password": password}
    if cafile is not None:
        values["cafile"] = cafile
    if client_cert is not None:
        values.update(certfile=client_cert[0], keyfile=client_cert[1])
    write_private(path, dump_toml({**({"fleet": fleet} if fleet else {}), "broker": values}))


def write_fleet_credentials(out: Path, fleet: str, devices: Sequence[str], hosts: Sequence[str], port: int = 8883,
                            bind: str = "0.0.0.0", client_certs: bool = False, days: int = DEFAULT_DAYS,
                            observer_reads_learning: bool = False, inbox_workers: int = 0) -> MosquittoBroker:
    """Everything the module docstring lists; the broker object whose files were written (its `start()` runs
    mosquitto with them). `observer_reads_learning`: the observer reads updates, models and method payloads too,
    not only the protocol's metadata (`MosquittoBroker`). `inbox_workers`: the accounts of as many coordinator
    inbox workers (coordinator/inbox_workers.py), which connect with the coordinator's password and certificate."""
    topics.check_name(fleet, "fleet")
    if OBSERVER in devices:
        raise ValueError(f"{OBSERVER!r} is the observer's account: choose another device id")
    out = out.resolve()
    (out / "devices").mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    make_ca(out, f"edgefil {fleet}", days)
    tls = make_server_cert(out, hosts, days)
    passwords = {d: _password_in(out / "devices" / f"{d}.toml") or generate_password() for d in devices}
    coordinator = Credentials("coordinator", _password_in(out / "coordinator.toml") or generate_password())
    observer = Credentials(OBSERVER, _password_in(out / "observer.toml") or generate_password())
    broker = MosquittoBroker(out, fleet, passwords, coordinator, host=bind, port=port, tls=tls,
                             require_certificate=client_certs, observers={observer.username: observer.password},
                             observers_read_learning=observer_reads_learning, inbox_workers=inbox_workers)
    broker.write_config()
    coordinator_cert = None
    if client_certs:
        made = make_client_cert(out, coordinator.username, days)
        coordinator_cert = (f"devices/{made[0].name}", f"devices/{made[1].name}")
    _broker_table(out / "coordinator.toml", hosts[0], port, coordinator.username, coordinator.password,
                  "ca.crt", coordinator_cert)
    observer_cert = None
    if client_certs:
        made = make_client_cert(out, observer.username, days)
        observer_cert = (f"devices/{made[0].name}", f"devices/{made[1].name}")
    _broker_table(out / "observer.toml", hosts[0], port, observer.username, observer.password, "ca.crt",
                  observer_cert, fleet=fleet)
    for device, password in passwords.items():
        cert = None
        if client_certs:
            make_client_cert(out, device, days)
            cert = (f"{device}.crt", f"{device}.key")
        _broker_table(out / "devices" / f"{device}.toml", hosts[0], port, device, password, "ca.crt", cert)
    shutil.copyfile(out / "ca.crt", out / "devices" / "ca.crt")
    return broker


def _run(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    broker = write_fleet_credentials(Path(args.out), args.fleet, devices, args.host, args.port, args.bind,
                                     args.client_certs, args.days, args.observer_reads_learning, args.inbox_workers)
    print(f"wrote TLS material, mosquitto's files and {len(devices)} device tables to {broker.workdir}\n"
          f"  broker:      mosquitto -c {broker.conf_path}\n"
          f"  coordinator: copy the [broker] table of coordinator.toml into its config (with ca.crt beside it)\n"
          f"  watching:    edgefil watch --config {broker.workdir / 'observer.toml'}\n"
          f"  devices:     copy devices/<id>.toml's [broker] table and ca.crt to each device")
    return 0


def add_credentials_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil credentials` to the `edgefil` command's subparsers."""
    parser = commands.add_parser("credentials", help="make a fleet's CA, broker certificate, device passwords "
                                                     "(and client certificates) and mosquitto's files")
    parser.add_argument("--fleet", required=True, help="fleet name (the topic prefix)")
    parser.add_argument("--devices", required=True, help="device ids, comma-separated")
    parser.add_argument("--host", action="append", required=True,
                        help="a name or address devices use to reach the broker (repeat for several)")
    parser.add_argument("--out", required=True, help="folder to write (kept private: 0700)")
    parser.add_argument("--port", type=int, default=8883, help="the broker's TLS port")
    parser.add_argument("--bind", default="0.0.0.0", help="the address mosquitto listens on")
    parser.add_argument("--client-certs", action="store_true", help="also require a client certificate per device")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="how long certificates are valid")
    parser.add_argument("--observer-reads-learning", action="store_true",
                        help="let observer.toml's account read the devices' updates, the models and the methods' "
                             "payloads too (by default it reads the protocol's metadata only: whoever holds it could "
                             "otherwise reconstruct training samples from the updates); each run writes the ACL "
                             "anew, so the flag holds for the run that gives it")
    parser.add_argument("--inbox-workers", type=int, default=0,
                        help="broker accounts for as many coordinator inbox workers (the coordinator's inbox_workers): "
                             "they connect with the coordinator's password and certificate")
    parser.set_defaults(run=_run)
