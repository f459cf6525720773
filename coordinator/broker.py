"""The MQTT broker the fleet talks through.

`MosquittoBroker` runs mosquitto with a config generated from the fleet: one loopback listener (optionally
TLS), a hashed password per device and an ACL that confines each device to its own topics of the protocol's
kinds (edgefil.topics), plus optional read-only observer accounts (a dashboard, a test's watcher) that read
the protocol's metadata and, where the operator says so, what carries learning:

    device -> coordinator   edgefil/<fleet>/dev/<device_id>/<kind>   device writes its own, coordinator reads
    coordinator -> device   edgefil/<fleet>/to/<device_id>/<kind>    device reads its own, coordinator writes
    coordinator -> all      edgefil/<fleet>/all/<kind>               devices read, coordinator writes

The ACL is written as one explicit block per user rather than `pattern` lines: a pattern applies to every user,
the coordinator included, and a per-user block grants nothing to a name that is not in the fleet. mosquitto
drops a publish the ACL denies without telling the client (an MQTT 3.1.1 QoS 1 publish is still acknowledged),
and disconnects a client that sends a packet over `max_packet_size`. `use_username_as_clientid` makes every
client's id its username, so a device that logs in with its own password and another's client id (the
coordinator's, another device's) gets its own id: it cannot disconnect the victim nor fire the victim's last
will. A second process with the same device's credentials does take over that device's session; the two then
push each other off, which the coordinator detects and reports (docs/security.md).

`EmbeddedBroker` is amqtt in a background thread, for machines without mosquitto: anonymous, no passwords, no
ACL, so it is for a trusted loopback only: it refuses another address unless told `allow_remote`, and warns when
it starts.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edgefil import topics
from edgefil.durable import write_private
from edgefil.lifetime import die_with_parent
from edgefil.thread_names import NamedThread

log = logging.getLogger("edgefil.broker")
_RUNNING = re.compile(rb"mosquitto version \S+ running")
_RELOADED = b"Reloading config."
_DROPPING = re.compile(rb"Outgoing messages are being dropped for client (\S+?)\.?$", re.MULTILINE)
# What mosquitto holds for one client beyond its in-flight window (`max_queued_messages`, one number for every
# client). The coordinator's queue takes the whole fleet's messages while it reads them, and a round brings each
# device's status, request and update chunks at nearly the same moment: 7000 devices overran a fixed 10,000.
# mosquitto acknowledges a publish to its sender before it queues it for the subscribers and drops what does not
# fit, so an overrun loses updates that every device believes delivered. The bound therefore grows with the roster:
# a round of one device's messages each (an update of up to ~120 MB in 1 MB chunks, and its control messages).
QUEUED_PER_DEVICE = 128
START_S, START_S_PER_DEVICE = 30.0, 0.01  # the ceiling of a wait for mosquitto to listen (`MosquittoBroker.start`)
MIN_QUEUED = 1000  # mosquitto's own default, for a roster of a few devices


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class TlsFiles:
    """Server side PEM files; clients verify the server with `cafile`."""

    cafile: str
    certfile: str
    keyfile: str


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    cafile: str | None = None  # set when the listener uses TLS


@dataclass(frozen=True)
class Site:
    """A site (issue 60's site aggregators): a broker of its own next to some of the fleet's devices, bridged to
    the central broker. On the central broker the site's bridge connects as `account`, which reads and writes the
    site's own topics (`edgefil/<fleet>/site/<name>/...`: its aggregator's, and its devices' relayed there,
    `topics.via_site`) and reads what the coordinator sends every device. Which devices are the site's the
    coordinator knows (its `[[sites]]`); the central broker need not serve them (they connect to the site's broker),
    so a fleet whose devices are all at sites has a central broker of a few accounts."""

    name: str
    account: Credentials


# what a site's bridge carries: its devices' protocol messages out (their updates stay at the site, where its
# aggregator folds them), the coordinator's messages to them and to every device in, the site's own topics both ways
BRIDGED_OUT = ("register", "status", "request")


def bridge_topics(fleet: str, site: str) -> list[str]:
    """mosquitto's `topic` lines of a site's bridge (pattern, direction, QoS, local prefix, remote prefix). Its
    devices' own topics cross under the site's prefix (`topics.via_site`): at the central broker the site's account
    then needs one ACL line whatever its size (mosquitto checks a message against its sender's lines one by one: with
    4 lines a device, a site of 1000 made the central broker's CPU a message grow with it), and the bridge
    subscribes to its own devices' messages only (one subscribed to `to/+/+` got every site's)."""
    p, name = topics.prefix(fleet), topics.check_name(site, "site")
    here = {direction: f"{p}/{direction}/" for direction in (topics.FROM_DEVICE, topics.TO_DEVICE)}
    there = {direction: f"{p}/{topics.SITE}/{name}/{direction}/" for direction in here}
    return ([f"+/{kind} out 1 {here[topics.FROM_DEVICE]} {there[topics.FROM_DEVICE]}" for kind in BRIDGED_OUT]
            + [f"+/+ in 1 {here[topics.TO_DEVICE]} {there[topics.TO_DEVICE]}", f"{p}/{topics.TO_ALL}/+ in 1"]
            + [f"{topics.site(fleet, name, kind)} out 1" for kind in topics.SITE_SENDS]
            + [f"{topics.site(fleet, name, kind)} in 1" for kind in topics.SITE_RECEIVES])


@dataclass(frozen=True)
class Bridge:
    """A site broker's connection to the central one: where it is and the site's account there."""

    site: str
    host: str
    port: int
    account: Credentials
    cafile: str | None = None  # the central broker's CA, where it listens with TLS
    certfile: str | None = None  # the site's client certificate and key, where the central broker requires one
    keyfile: str | None = None


def mosquitto_path() -> str | None:
    """The mosquitto binary; Debian puts it in /usr/sbin, which a non-root PATH often lacks."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if os.access("/usr/sbin/mosquitto", os.X_OK) else None


def _mosquitto_passwd_path() -> str:
    found = shutil.which("mosquitto_passwd")
    for candidate in (found, "/usr/bin/mosquitto_passwd", "/usr/sbin/mosquitto_passwd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("mosquitto_passwd not found (Debian/Ubuntu: apt-get install mosquitto)")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_password(user: str, password: str) -> str:
    # mosquitto_passwd reads `user:password` lines; an empty password or a line break would change the file.
    if not isinstance(password, str) or not password or any(c in password for c in ":\r\n\0"):
        raise ValueError(f"password of {user!r} must be non-empty without ':' or line breaks")
    return password


def generate_password(nbytes: int = 18) -> str:
    return secrets.token_urlsafe(nbytes)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def inbox_worker_account(coordinator: Credentials, index: int) -> Credentials:
    """The account of the coordinator's inbox worker `index`: its own name (the broker's client id), the
    coordinator's password."""
    return Credentials(topics.check_name(f"{coordinator.username}-inbox-{index}", "inbox worker"),
                       coordinator.password)


class MosquittoBroker:
    """A mosquitto process with a generated config: loopback listener, a password per device, per-device ACL,
    optional TLS."""

    def __init__(
        self,
        workdir: str | Path,
        fleet: str,
        devices: Mapping[str, str],
        coordinator: Credentials,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TlsFiles | None = None,
        max_packet_bytes: int = 2 * 1024 * 1024,
        persistence: bool = False,
        observers: Mapping[str, str] | None = None,
        observers_read_learning: bool = False,
        require_certificate: bool = False,
        queued_per_device: int = QUEUED_PER_DEVICE,
        inbox_workers: int = 0,
        sites: Sequence[Site] = (),
        bridge: Bridge | None = None,
        relayed_devices: int = 0,
    ) -> None:
        """`sites`: the sites bridged to this broker (their accounts); `bridge`: this broker is a site's, bridged to
        the central one; `relayed_devices`: the devices at sites that have no account here, whose messages still
        reach the coordinator through this broker (its queue is sized for them too)."""
        self.workdir = Path(workdir).resolve()
        self.prefix = topics.prefix(fleet)
        self.coordinator = Credentials(
            topics.check_name(coordinator.username, "coordinator username"),
            _check_password(coordinator.username, coordinator.password),
        )
        self._devices: dict[str, str] = {}
        for device_id, password in devices.items():
            self._check_device(device_id, password)
            self._devices[device_id] = password
        self._observers: dict[str, str] = {}
        for name, password in (observers or {}).items():
            self._check_device(name, password)
            if name in self._devices:
                raise ValueError(f"{name!r} is both a device and an observer")
            self._observers[name] = password
        self.observers_read_learning = observers_read_learning
        if max_packet_bytes < 1024:
            raise ValueError("max_packet_bytes below 1 KiB leaves no room for a CONNECT")
        self.host = host
        self.port = port or free_port(host)  # picked once, so restart() keeps it
        self.tls = tls
        self.max_packet_bytes = max_packet_bytes
        self.persistence = persistence
        if require_certificate and tls is None:
            raise ValueError("require_certificate needs a TLS listener (tls)")
        self.require_certificate = require_certificate
        if queued_per_device < 1:
            raise ValueError("queued_per_device must be at least 1")
        self.queued_per_device = queued_per_device
        if inbox_workers < 0:
            raise ValueError("inbox_workers must be at least 0")
        # the coordinator's inbox workers (coordinator/inbox_workers.py): an account each, since the broker makes a
        # client's id its username and two connections of one account push each other off; the coordinator's password
        self._workers = [inbox_worker_account(self.coordinator, k) for k in range(inbox_workers)]
        for worker in self._workers:
            if worker.username in self._devices or worker.username in self._observers:
                raise ValueError(f"{worker.username!r} is an inbox worker's account, not a device's or observer's")
        self.sites = tuple(sites)
        for site in self.sites:
            topics.check_name(site.name, "site")
            self._check_device(site.account.username, site.account.password)
            if site.account.username in self._devices or site.account.username in self._observers:
                raise ValueError(f"{site.account.username!r} is a site's account, not a device's or observer's")
        self.bridge = bridge
        if relayed_devices < 0:
            raise ValueError("relayed_devices must be at least 0")
        self.relayed_devices = relayed_devices
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None

    @property
    def max_queued_messages(self) -> int:
        """Sized to the roster and the devices its sites relay (QUEUED_PER_DEVICE: 10,000 devices at sites, whose
        registrations crossed the bridges at once, overran mosquitto's default 1000 of a central broker that held
        no device account); `add_device` grows it with the reload it sends."""
        return max(MIN_QUEUED, (len(self._devices) + self.relayed_devices) * self.queued_per_device)

    @property
    def conf_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(self.host, self.port, self.tls.cafile if self.tls else None)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _check_device(self, device_id: str, password: str) -> None:
        topics.check_name(device_id, "device id")
        if device_id == self.coordinator.username:
            raise ValueError(f"device id {device_id!r} is the coordinator's username")
        _check_password(device_id, password)

    def _acl(self) -> str:
        """Exactly the protocol's topics (edgefil.topics): a device writes its own kinds and reads its own
        and the broadcast ones, nothing under the fleet's prefix besides. Observers read the protocol's metadata
        (every kind but `topics.CARRY_LEARNING`: registrations, statuses, round messages, requests, notices, the
        end); what carries learning (updates, models, method payloads) only where `observers_read_learning` is
        set, an operator's explicit choice: whoever holds an observer's password then reads every device's
        updates, from which training samples can be reconstructed (docs/security.md, "Who reads what")."""
        p = self.prefix
        blocks = [f"user {self.coordinator.username}\ntopic readwrite {p}/#\n"]
        for site in self.sites:  # its bridge speaks for its devices, and for nobody else
            # mosquitto checks a message against its sender's lines one by one: the site's devices' topics are under
            # its prefix (`bridge_topics`), so a few lines whatever its size; the coordinator checks that a device
            # relayed there is the site's (coordinator/sites.py)
            lines = [f"user {site.account.username}"]
            lines += [f"topic read {p}/{topics.TO_ALL}/{kind}" for kind in topics.BROADCASTS]
            lines.append(f"topic readwrite {p}/{topics.SITE}/{site.name}/#")
            blocks.append("\n".join(lines) + "\n")
        for worker in self._workers:  # the devices' updates, and the chunks the workers pass each other
            blocks.append(f"user {worker.username}\ntopic read {p}/{topics.FROM_DEVICE}/+/update\n"
                          f"topic readwrite {p}/{topics.INBOX}/#\n")
        for device_id in sorted(self._devices):
            lines = [f"user {device_id}"]
            lines += [f"topic write {p}/{topics.FROM_DEVICE}/{device_id}/{kind}" for kind in topics.DEVICE_SENDS]
            lines += [f"topic read {p}/{topics.TO_DEVICE}/{device_id}/{kind}" for kind in topics.DEVICE_RECEIVES]
            lines += [f"topic read {p}/{topics.TO_ALL}/{kind}" for kind in topics.BROADCASTS]
            blocks.append("\n".join(lines) + "\n")
        if self.observers_read_learning:
            readable = [f"{p}/#"]
        else:
            readable = [f"{p}/{topics.FROM_DEVICE}/+/{kind}" for kind in topics.DEVICE_SENDS
                        if kind not in topics.CARRY_LEARNING]
            readable += [f"{p}/{topics.TO_DEVICE}/+/{kind}" for kind in topics.DEVICE_RECEIVES
                         if kind not in topics.CARRY_LEARNING]
            readable += [f"{p}/{topics.TO_ALL}/{kind}" for kind in topics.BROADCASTS
                         if kind not in topics.CARRY_LEARNING]
            if self.sites:  # the same of a site's devices, relayed under its prefix (topics.via_site)
                readable += [f"{p}/{topics.SITE}/+/{topics.FROM_DEVICE}/+/{kind}" for kind in BRIDGED_OUT]
                readable += [f"{p}/{topics.SITE}/+/{topics.TO_DEVICE}/+/{kind}" for kind in topics.DEVICE_RECEIVES
                             if kind not in topics.CARRY_LEARNING]
        for observer in sorted(self._observers):
            blocks.append("\n".join([f"user {observer}", *(f"topic read {t}" for t in readable)]) + "\n")
        return "\n".join(blocks)

    def _write_passwords(self, path: Path) -> None:
        """Hash with `mosquitto_passwd -U` in a private temporary file, so only the hashed file is ever at `path`."""
        users = {self.coordinator.username: self.coordinator.password, **self._devices, **self._observers,
                 **{worker.username: worker.password for worker in self._workers},
                 **{site.account.username: site.account.password for site in self.sites}}
        plain = path.with_name(path.name + ".plain")
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(f"{user}:{password}\n" for user, password in users.items())
            done = subprocess.run([_mosquitto_passwd_path(), "-U", str(plain)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"mosquitto_passwd -U failed: {done.stderr.strip() or done.stdout.strip()}")
            os.replace(plain, path)
        finally:
            plain.unlink(missing_ok=True)

    def _conf(self) -> str:
        w = self.workdir
        lines = [
            "per_listener_settings false",
            "allow_anonymous false",
            f"password_file {w / 'passwd'}",
            f"acl_file {w / 'acl'}",
            f"max_packet_size {self.max_packet_bytes}",
            f"max_queued_messages {self.max_queued_messages}",
            f"persistence {'true' if self.persistence else 'false'}",
        ]
        if self.persistence:
            lines.append(f"persistence_location {w}/")
        if os.geteuid() == 0:  # started as root, mosquitto switches to user `mosquitto`, who cannot read the workdir
            lines.append("user root")
        lines.append(f"pid_file {w / 'mosquitto.pid'}")  # `mosquitto -c ... -d`: what to kill to stop it
        lines.append(f"log_dest file {self.log_path}")
        lines += [f"log_type {kind}" for kind in ("error", "warning", "notice", "information")]
        lines.append(f"listener {self.port} {self.host}")
        # per listener, so after `listener` (before it, mosquitto opens a default listener on 1883 for it): the
        # client id is the username, so a client cannot take over another's session (nor fire its last will)
        lines.append("use_username_as_clientid true")
        if self.tls:
            lines += [
                f"cafile {Path(self.tls.cafile).resolve()}",
                f"certfile {Path(self.tls.certfile).resolve()}",
                f"keyfile {Path(self.tls.keyfile).resolve()}",
                "tls_version tlsv1.2",
            ]
            if self.require_certificate:  # a client certificate signed by the CA, and the password as well
                lines.append("require_certificate true")
        if self.bridge is not None:
            lines += self._bridge_lines(self.bridge)
        return "\n".join(lines) + "\n"

    def _bridge_lines(self, bridge: Bridge) -> list[str]:
        """mosquitto's bridge to the central broker (`bridge_topics` says what crosses): clean sessions, the site's
        account, QoS 1 both ways, no notification topics (the central ACL grants none)."""
        fleet = self.prefix.split("/", 1)[1]
        lines = [
            f"connection {bridge.account.username}",
            f"address {bridge.host}:{bridge.port}",
            f"remote_clientid {bridge.account.username}",
            f"remote_username {bridge.account.username}",
            f"remote_password {bridge.account.password}",
            "bridge_protocol_version mqttv311",
            "cleansession true",
            "notifications false",
            "try_private true",
            "restart_timeout 1 10",
        ]
        if bridge.cafile:
            lines.append(f"bridge_cafile {Path(bridge.cafile).resolve()}")
        if bridge.certfile and bridge.keyfile:
            lines += [f"bridge_certfile {Path(bridge.certfile).resolve()}",
                      f"bridge_keyfile {Path(bridge.keyfile).resolve()}"]
        lines += [f"topic {line}" for line in bridge_topics(fleet, bridge.site)]
        return lines

    def write_config(self) -> Path:
        """Write mosquitto.conf, the hashed passwd and the acl into the workdir; return the config's path."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_passwords(self.workdir / "passwd")
        write_private(self.workdir / "acl", self._acl())
        write_private(self.conf_path, self._conf())
        return self.conf_path

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _log_since(self, offset: int) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def _tail(self, lines: int = 20) -> str:
        parts = []
        for path in (self.workdir / "mosquitto.out", self.log_path):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts) or "(mosquitto wrote no log)"

    def dropping(self) -> list[str]:
        """The clients mosquitto has logged dropping messages to (their queue was full), once per episode: for
        the coordinator, updates and statuses the devices were told were delivered are lost."""
        return [name.decode(errors="replace") for name in _DROPPING.findall(self._log_since(0))]

    def start(self, timeout: float | None = None) -> None:
        """Spawn mosquitto and return once it logged that it runs and its port accepts TCP. `timeout`: a ceiling for
        an answer that never comes (None: START_S and START_S_PER_DEVICE a device: mosquitto reads its password
        and ACL files before it listens, which took over 10 s for 10,000 devices on a slow 2-core host)."""
        if self.running:
            raise RuntimeError("mosquitto is already running")
        if timeout is None:
            timeout = START_S + START_S_PER_DEVICE * len(self._devices)
        exe = mosquitto_path()
        if exe is None:
            raise RuntimeError("mosquitto not found (Debian/Ubuntu: apt-get install mosquitto)")
        conf = self.write_config()
        offset = self._log_size()
        self._out = open(self.workdir / "mosquitto.out", "ab")
        self._proc = subprocess.Popen(
            [exe, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT,
            # the kernel ties the child to the thread that forks it: only the main thread lives as long as we do
            preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
        )
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                self._release()
                raise RuntimeError(f"mosquitto exited with code {code} on start:\n{self._tail()}")
            # The log line tells our mosquitto from another process that may hold the port.
            if _RUNNING.search(self._log_since(offset)) and _accepts(self.host, self.port):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mosquitto not up on {self.host}:{self.port} after {timeout} s:\n{self._tail()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (mosquitto saves its persistence file), SIGKILL if it does not exit in `timeout`."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._release()

    def kill(self) -> None:
        """SIGKILL: a crash, nothing saved."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._release()

    def _release(self) -> None:
        self._proc = None
        if self._out is not None:
            self._out.close()
            self._out = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def add_device(self, device_id: str, password: str, timeout: float = 5.0) -> None:
        """Add (or re-key) a device. A running broker reloads on SIGHUP; this returns once mosquitto logged the
        reload, which it finishes before it reads from any client again, so the device can connect right away."""
        self._check_device(device_id, password)
        self._devices[device_id] = password
        if not self.running:
            return
        assert self._proc is not None
        offset = self._log_size()
        self.write_config()
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while _RELOADED not in self._log_since(offset):
            if not self.running or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not reload its config:\n{self._tail()}")
            time.sleep(0.01)

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_AMQTT_SHUTDOWN_S = 3.0
# amqtt logs every connection and every state-machine callback (via `transitions`) at INFO.
_CHATTY_LOGGERS = ("amqtt", "transitions")


class _SnapshotDict(dict[str, Any]):
    """amqtt 0.12.1 iterates its topic -> subscribers dict across awaits (publishing retained messages to a new
    session; deleting a closed session's subscriptions) while other sessions subscribe, and the iteration dies with
    "dictionary changed size during iteration", taking that client's connection handler with it (the client then
    waits out a keepalive). Iterating a snapshot of the keys is what those loops need."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(super().keys()))

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(super().keys())

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return list(super().items())

    def values(self) -> list[Any]:  # type: ignore[override]
        return list(super().values())


def _amqtt_config(host: str, port: int) -> dict:
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def _serve_amqtt(
    host: str, port: int, started: Callable[[asyncio.AbstractEventLoop, asyncio.Event], None]
) -> None:
    """Run amqtt until the event handed to `started` is set (or the task is cancelled, e.g. by Ctrl-C)."""
    from amqtt.broker import Broker

    for name in _CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    broker = Broker(_amqtt_config(host, port))
    broker._subscriptions = _SnapshotDict()
    await broker.start()
    stop = asyncio.Event()
    try:
        started(asyncio.get_running_loop(), stop)
        await stop.wait()
    finally:
        # amqtt 0.12.1 can wait forever for a connection it was still setting up when shutdown began.
        try:
            await asyncio.wait_for(broker.shutdown(), _AMQTT_SHUTDOWN_S)
        except asyncio.TimeoutError:
            pass


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


NO_AUTH_WARNING = ("the embedded MQTT broker (amqtt) has NO authentication and NO ACL: any client that reaches "
                   "{host}:{port} can read and write every topic. Use mosquitto for anything but a trusted host.")


def _check_embedded_bind(host: str, allow_remote: bool) -> None:
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"the embedded broker has no authentication: it listens on loopback only, not {host!r} "
                         f"(allow_remote / --allow-remote to bind it there anyway)")


class EmbeddedBroker:
    """Pure-Python broker (amqtt) for machines without mosquitto: anonymous, no ACL. Any client that reaches the
    port may read and write every topic, so it binds a loopback address unless `allow_remote` says otherwise,
    and says so when it starts: at WARNING where it listens beyond loopback, at INFO on loopback (a clean demo
    prints no warning for its own broker)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False) -> None:
        _check_embedded_bind(host, allow_remote)
        self.host = host
        self.port = port or free_port(host)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> BrokerAddress:
        return BrokerAddress(self.host, self.port)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._stop is not None

    def start(self, timeout: float = 10.0) -> None:
        """Run amqtt in a thread with its own event loop; return once amqtt has bound and is listening (no TCP
        probe: amqtt logs an error for every connection that closes without a CONNECT)."""
        if self._thread is not None:
            raise RuntimeError("the embedded broker is already running")
        ready = threading.Event()
        self._error = None

        def started(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
            self._loop, self._stop = loop, stop
            ready.set()

        def run() -> None:
            try:
                asyncio.run(_serve_amqtt(self.host, self.port, started))
            except BaseException as err:  # handed to start(); the thread has no one else to tell
                self._error = err
            finally:
                ready.set()

        self._thread = NamedThread(target=run, name=f"amqtt-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or self._stop is None:
            error = self._error
            self.stop()
            raise RuntimeError(f"amqtt did not start on {self.host}:{self.port}: {error!r}") from error
        # beyond loopback (allow_remote) anyone on the network reaches it: a warning. On loopback only this host's
        # processes do (the demo's own broker, a fleet's that the file asked for): said, not warned
        log.log(logging.INFO if is_loopback(self.host) else logging.WARNING,
                NO_AUTH_WARNING.format(host=self.host, port=self.port))

    def stop(self) -> None:
        """Shut amqtt down (its clients are disconnected) and join its thread; idempotent."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass
        self._thread.join(10.0)
        self._thread = self._loop = self._stop = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_embedded(host: str, port: int, allow_remote: bool = False) -> None:
    """Run the embedded broker in the foreground until Ctrl-C."""
    _check_embedded_bind(host, allow_remote)

    def started(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        print(f"edgefil broker: mqtt://{host}:{port} (embedded amqtt: anonymous, no ACL); Ctrl-C stops", flush=True)
        log.warning(NO_AUTH_WARNING.format(host=host, port=port))

    try:
        asyncio.run(_serve_amqtt(host, port, started))
    except KeyboardInterrupt:
        pass


def _run_broker(args: argparse.Namespace) -> int:
    try:
        serve_embedded(args.host, args.port, args.allow_remote)
    except ValueError as err:
        print(f"edgefil broker: {err}", file=sys.stderr)
        return 2
    return 0


def add_broker_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil broker` to the `edgefil` command's subparsers."""
    broker = commands.add_parser(
        "broker", help="run the embedded MQTT broker (amqtt; anonymous, no ACL: loopback or trusted hosts only)"
    )
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    broker.add_argument("--port", type=int, default=1883, help="port to listen on")
    broker.add_argument("--allow-remote", action="store_true",
                        help="listen on a non-loopback address although anyone who reaches it can use the broker")
    broker.set_defaults(run=_run_broker)
