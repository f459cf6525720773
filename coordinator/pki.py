"""TLS material for a fleet's broker, and `edgefil credentials`: everything a deployment needs in one folder.

    edgefil credentials --fleet lab --devices dev-0,dev-1 --host broker.lan --out secrets/lab [--client-certs]
        [--observer-reads-learning] [--inbox-workers N] [--site a=dev-1@site-a.lan[:port]]

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

With `--site a=dev-0,dev-1@jetson-a.lan[:port]` (repeatable) those devices are served by site `a` (coordinator/
sites.py): their tables name the site's broker, the central broker's ACL gets the site's bridge account
(`site-a`), and `sites/a/` holds what the site runs:

    sites/a/mosquitto.conf, passwd, acl   the site's broker: TLS listener, its devices' passwords, the aggregator's
                                    account, the bridge to the central broker (as `site-a`; with --client-certs
                                    its certificate, sites/a/bridge.crt and .key)
    sites/a/server.crt, server.key  the site broker's certificate, for its host, signed by the fleet's CA
    sites/a/site.toml               `edgefil site`'s file: fleet, site, artifacts = "artifacts" (the fleet's
                                    exported model, copied beside it), and its [broker] table
    sites/a/bridge.toml             the site's account on the central broker (kept: a rerun keeps its password)
    sites/a/ca.crt                  the CA's certificate

mosquitto.conf names its files by absolute path: copy `sites/a/` to the site at the same path.

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
from dataclasses import dataclass
from pathlib import Path

from coordinator.broker import Bridge, Credentials, MosquittoBroker, Site, TlsFiles, generate_password
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


def make_server_cert(folder: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS, stem: str = "server"
                     ) -> TlsFiles:
    """A broker's key and certificate for `hosts` (kept when they exist), signed by the CA in `folder`: `stem`.crt
    and .key under it (a site's broker: sites/<name>/server)."""
    if not hosts:
        raise ValueError("the server certificate needs at least one host name or address")
    if not ((folder / f"{stem}.crt").exists() and (folder / f"{stem}.key").exists()):
        names = ",".join(_alt_name(h) for h in hosts)
        _sign(folder, stem, f"/CN={hosts[0]}",
              f"basicConstraints=CA:FALSE\nsubjectAltName={names}\nextendedKeyUsage=serverAuth\n", days)
    return TlsFiles(str(folder / "ca.crt"), str(folder / f"{stem}.crt"), str(folder / f"{stem}.key"))


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


@dataclass(frozen=True)
class SiteAddress:
    """`--site NAME=DEV,DEV@HOST[:PORT]`: a site, its devices, and where they reach its broker."""

    name: str
    devices: tuple[str, ...]
    host: str
    port: int = 8883

    @classmethod
    def parse(cls, text: str) -> SiteAddress:
        name, _, rest = text.partition("=")
        members, _, where = rest.rpartition("@")
        host, _, port = where.partition(":")
        devices = tuple(d.strip() for d in members.split(",") if d.strip())
        if not (name and devices and host) or (port and not port.isdigit()):
            raise ValueError(f"--site {text!r}: expected NAME=DEV,DEV@HOST[:PORT]")
        return cls(topics.check_name(name, "site name"), devices, host, int(port or 8883))


def write_fleet_credentials(out: Path, fleet: str, devices: Sequence[str], hosts: Sequence[str], port: int = 8883,
                            bind: str = "0.0.0.0", client_certs: bool = False, days: int = DEFAULT_DAYS,
                            observer_reads_learning: bool = False, inbox_workers: int = 0,
                            sites: Sequence[SiteAddress] = ()) -> list[MosquittoBroker]:
    """Everything the module docstring lists; the broker objects whose files were written (their `start()` runs
    mosquitto with them), the central one first, then each site's. `observer_reads_learning`: the observer reads
    updates, models and method payloads too, not only the protocol's metadata (`MosquittoBroker`). `inbox_workers`:
    the accounts of as many coordinator inbox workers (coordinator/inbox_workers.py), which connect with the
    coordinator's password and certificate. `sites`: devices served by a site's broker (module docstring)."""
    topics.check_name(fleet, "fleet")
    if OBSERVER in devices:
        raise ValueError(f"{OBSERVER!r} is the observer's account: choose another device id")
    at_sites = [device for site in sites for device in site.devices]
    if set(at_sites) - set(devices) or len(set(at_sites)) != len(at_sites):
        raise ValueError("--site: every site's devices must be among --devices, each at one site")
    out = out.resolve()
    (out / "devices").mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    make_ca(out, f"edgefil {fleet}", days)
    tls = make_server_cert(out, hosts, days)
    passwords = {d: _password_in(out / "devices" / f"{d}.toml") or generate_password() for d in devices}
    coordinator = Credentials("coordinator", _password_in(out / "coordinator.toml") or generate_password())
    observer = Credentials(OBSERVER, _password_in(out / "observer.toml") or generate_password())
    accounts = {site.name: Credentials(f"site-{site.name}", _password_in(out / "sites" / site.name / "bridge.toml")
                                       or generate_password()) for site in sites}
    broker = MosquittoBroker(out, fleet, passwords, coordinator, host=bind, port=port, tls=tls,
                             require_certificate=client_certs, observers={observer.username: observer.password},
                             observers_read_learning=observer_reads_learning, inbox_workers=inbox_workers,
                             sites=[Site(site.name, accounts[site.name]) for site in sites])
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
    served = {device: site for site in sites for device in site.devices}
    for device, password in passwords.items():
        cert = None
        if client_certs:
            make_client_cert(out, device, days)
            cert = (f"{device}.crt", f"{device}.key")
        site = served.get(device)
        _broker_table(out / "devices" / f"{device}.toml", hosts[0] if site is None else site.host,
                      port if site is None else site.port, device, password, "ca.crt", cert)
    shutil.copyfile(out / "ca.crt", out / "devices" / "ca.crt")
    return [broker, *(_write_site(out, fleet, site, accounts[site.name], passwords, hosts[0], port, bind,
                                  client_certs, days) for site in sites)]


def _write_site(out: Path, fleet: str, site: SiteAddress, account: Credentials, passwords: dict[str, str],
                central: str, central_port: int, bind: str, client_certs: bool, days: int) -> MosquittoBroker:
    """sites/<name>/: the site's broker, bridged to the central one, and its aggregator's file (module docstring)."""
    folder = out / "sites" / site.name
    folder.mkdir(parents=True, exist_ok=True)
    aggregator = Credentials("coordinator", _password_in(folder / "site.toml") or generate_password())
    tls = make_server_cert(out, [site.host], days, stem=f"sites/{site.name}/server")
    bridge_cert: tuple[Path, ...] = ()
    if client_certs:  # the bridge's own certificate, kept with the site's files
        bridge_cert = (folder / "bridge.crt", folder / "bridge.key")
        for signed, kept in zip(make_client_cert(out, account.username, days), bridge_cert):
            shutil.copyfile(signed, kept)
            _private(kept)
    broker = MosquittoBroker(folder, fleet, {d: passwords[d] for d in site.devices}, aggregator, host=bind,
                             port=site.port, tls=tls, require_certificate=client_certs,
                             bridge=Bridge(site.name, central, central_port, account, str(out / "ca.crt"),
                                           *(str(path) for path in bridge_cert)))
    broker.write_config()
    write_private(folder / "bridge.toml", dump_toml({"broker": {"username": account.username,
                                                                "password": account.password}}))
    cert = None
    if client_certs:
        made = make_client_cert(out, f"site-{site.name}-aggregator", days)
        for path in made:
            shutil.copyfile(path, folder / path.name)
            _private(folder / path.name)
        cert = (made[0].name, made[1].name)
    values: dict[str, str | int] = {"host": site.host, "port": site.port, "username": aggregator.username,
                                    "password": aggregator.password, "cafile": "ca.crt"}
    if cert is not None:
        values.update(certfile=cert[0], keyfile=cert[1])
    write_private(folder / "site.toml", dump_toml({"fleet": fleet, "site": site.name, "artifacts": "artifacts",
                                                   "broker": values}))
    shutil.copyfile(out / "ca.crt", folder / "ca.crt")
    return broker


def _run(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    sites = [SiteAddress.parse(text) for text in args.site]
    broker, *at_sites = write_fleet_credentials(Path(args.out), args.fleet, devices, args.host, args.port, args.bind,
                                                args.client_certs, args.days, args.observer_reads_learning,
                                                args.inbox_workers, sites)
    print(f"wrote TLS material, mosquitto's files and {len(devices)} device tables to {broker.workdir}\n"
          f"  broker:      mosquitto -c {broker.conf_path}\n"
          f"  coordinator: copy the [broker] table of coordinator.toml into its config (with ca.crt beside it)\n"
          f"  watching:    edgefil watch --config {broker.workdir / 'observer.toml'}\n"
          f"  devices:     copy devices/<id>.toml's [broker] table and ca.crt to each device")
    for site in at_sites:
        print(f"  site:        copy {site.workdir} to the site (the same path), then there: mosquitto -c "
              f"{site.conf_path}; edgefil site --config {site.workdir / 'site.toml'}")
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
    parser.add_argument("--site", action="append", default=[], metavar="NAME=DEV,DEV@HOST[:PORT]",
                        help="devices served by a site's broker at HOST (bridged to this one) and its aggregator "
                             "(`edgefil site`): their tables name the site's broker, and sites/NAME/ holds the "
                             "site's files (repeat for several sites)")
    parser.set_defaults(run=_run)
