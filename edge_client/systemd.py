"""A device daemon under systemd: the unit `edgefil client install` writes, and the notifications it sends.

    edgefil client install --config device.toml [--user edgefil] [--watchdog-s 600] [--root /]

writes `<root>/etc/edgefil/<device>.toml` (the device's file, made absolute, with state_dir in the unit's state
directory; mode 0600: it holds the device's broker password) and `<root>/etc/systemd/system/edgefil-<device>.service`:

- `Type=notify`: systemd counts the device started once it is connected to its broker (`READY=1`);
- `WatchdogSec`: the daemon says it is alive (`WATCHDOG=1`) with every heartbeat and after every round it trains,
  so a daemon stuck for longer is killed and started again. A round trains in the daemon's one thread, so the
  default (600 s) must exceed the longest round a device trains: a Raspberry Pi Zero on a large model can take
  minutes (`docs/deploy.md`);
- `Restart=always`: whatever ends the process (a crash, the watchdog, an out-of-memory kill) starts it again; its
  replay store and state survive in `StateDirectory=edgefil/<device>` (/var/lib/edgefil/<device>). But not a
  configuration error (`RestartPreventExitStatus=2`: the file, a model or data folder it names that is not there, a
  broker that refuses the account): the daemon says what in one line and exits with status 2, and starting it again
  every few seconds would change nothing;
- the installed file says `on_end = "wait"`: a daemon that exited when a run ends would be started again by
  systemd and see the same end;
- it runs as `--user` (a system user the install's next steps create) in a sandbox that `systemd-analyze security`
  scores 1.3 ("OK"; 8.6 "EXPOSED" without it): the file system read-only but for its state directory, no
  capabilities and no new privileges, private /tmp, /dev and users, kernel settings, logs, clock and hostname out of
  reach, sockets of the Internet and local families only, and system calls limited to `@system-service` less
  `@privileged` and `@resources` (refused with EPERM, not a kill: a library that tries to pin its threads goes on
  unpinned). Left open, each for a reason: the network (the broker), home directories read-only (a data folder may
  live there), `/proc`'s non-process files (thread pools read the CPU count there), and writable executable memory
  (`MemoryDenyWriteExecute` breaks JIT compilers and libffi's closures, which a user's model code may use). A device
  that needs more (a GPU's /dev nodes) takes a drop-in: `systemctl edit edgefil-<device>` with `PrivateDevices=no`.

The notifications go to `$NOTIFY_SOCKET` (a datagram socket systemd names) and do nothing without one, so the same
daemon runs in a terminal, a container or a fleet worker unchanged.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import stat
import sys
from pathlib import Path
from typing import Any

from edgefil.durable import write_private
from edgefil.settings import dump_toml, load_toml
from edgefil.topics import check_name

STATE_ROOT = Path("/var/lib/edgefil")


def notify(message: str) -> bool:
    """Send `message` (e.g. "READY=1", "WATCHDOG=1") to systemd; False when not run by systemd (or it fails)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True


def unit_text(device: str, fleet: str, config: Path, executable: str, user: str, watchdog_s: int) -> str:
    return f"""# edgefil device daemon: device {device} of fleet {fleet} (written by edgefil client install)
[Unit]
Description=edgefil device {device} (fleet {fleet})
Documentation=file://{config}
Wants=network-online.target
After=network-online.target
# a daemon that keeps failing is still started again, every RestartSec, for as long as it takes
StartLimitIntervalSec=0

[Service]
Type=notify
NotifyAccess=main
ExecStart={executable} client --config {config}
Restart=always
RestartSec=5
# a configuration error (edgefil's exit status 2: the file, what it points at, the broker refusing the account) is
# not started again every 5 s: the journal holds its one line; fix it, then systemctl restart
RestartPreventExitStatus=2
WatchdogSec={watchdog_s}
TimeoutStopSec=30
User={user}
Group={user}
StateDirectory=edgefil/{device}
StateDirectoryMode=0700
Environment=PYTHONUNBUFFERED=1
# the sandbox: what a trainer that reads files, writes its state directory and speaks to a broker needs, no more
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
PrivateDevices=yes
PrivateUsers=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM
UMask=0077

[Install]
WantedBy=multi-user.target
"""


def _absolute(value: Any, base: Path) -> Any:
    return str((base / value).resolve()) if isinstance(value, str) else value


def unreadable(path: Path, user: str) -> str | None:
    """Why `user` could not read `path` (a folder: list it; a file: read it; every folder above it: enter it), or
    None. A user that does not exist yet (the install's next steps make it) is taken as a new system user: owner of
    nothing, in no group. A Raspberry Pi's home folder is 0700: a lab copied there is out of the service's reach, and
    its daemon would say only that the folder holds no model. File modes only: an ACL that lets it in is not read."""
    try:
        entry = pwd.getpwnam(user)
        uid: int | None = entry.pw_uid
        groups = {entry.pw_gid, *(g.gr_gid for g in grp.getgrall() if user in g.gr_mem)}
    except KeyError:
        uid, groups = None, set()
    if uid == 0:
        return None

    def refused(at: Path, bits: int) -> str | None:
        status = at.stat()
        shift = 6 if status.st_uid == uid else 3 if status.st_gid in groups else 0
        if (status.st_mode >> shift) & bits == bits:
            return None
        try:
            owner = pwd.getpwuid(status.st_uid).pw_name
        except KeyError:
            owner = str(status.st_uid)
        return f"{at} is {stat.filemode(status.st_mode)}, {owner}'s"

    path = path.resolve()
    for folder in reversed(path.parents):  # from / down: each must let it in
        if (why := refused(folder, 1)) is not None:
            return why
    return refused(path, 5 if path.is_dir() else 4)


def installed_config(raw: dict[str, Any], base: Path, device: str) -> dict[str, Any]:
    """The device's file for its unit: every path absolute (the unit runs from /), state_dir in its state
    directory."""
    out = dict(raw)
    out["artifacts"] = _absolute(raw["artifacts"], base)
    out["state_dir"] = str(STATE_ROOT / device)
    out["on_end"] = "wait"  # a service that exited at the run's end would be restarted into the same end, forever
    for table, key in (("data", "folder"), ("broker", "cafile"), ("broker", "certfile"), ("broker", "keyfile")):
        if isinstance(raw.get(table), dict) and key in raw[table]:
            out[table] = {**out[table], key: _absolute(raw[table][key], base)}
    return out


def install(config_path: Path, root: Path, user: str = "edgefil", watchdog_s: int = 600) -> list[Path]:
    """Write the unit and the device's file under `root` (see the module docstring); returns both paths. What the
    file names that the service user could not read is refused first (`unreadable`)."""
    from edge_client.config import DeviceConfig

    config = DeviceConfig.load(config_path)  # checked whole first: a broken file is refused before anything
    check_name(user, "user")
    if watchdog_s < 10:
        raise ValueError(f"--watchdog-s must be at least 10, got {watchdog_s}")
    named = [("artifacts", config.artifacts)]
    if config.artifacts.is_dir():
        named += [("artifacts", path) for path in sorted(config.artifacts.iterdir())]
    if config.data is not None and config.data.folder is not None:
        named.append(("[data] folder", config.data.folder))
    named += [(f"[broker] {key}", path) for key in ("cafile", "certfile", "keyfile")
              if (path := getattr(config.broker, key)) is not None]
    for key, path in named:
        why = unreadable(Path(path), user) if Path(path).exists() else None  # copied later: not checked
        if why is not None:
            raise ValueError(f"{key}: the service user {user} cannot read {path}: {why}; put the files where it "
                             "can, e.g. /srv/edgefil (docs/deploy.md, step 3)")
    raw = load_toml(config_path)
    etc = root / "etc" / "edgefil"
    units = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True, exist_ok=True)
    units.mkdir(parents=True, exist_ok=True)
    installed = etc / f"{config.device_id}.toml"
    write_private(installed, dump_toml(installed_config(raw, config_path.resolve().parent, config.device_id)))
    try:  # the daemon reads it as its user, in that user's own group, whatever its name (nobody's is nogroup)
        entry = pwd.getpwnam(user)
        os.chown(installed, entry.pw_uid, entry.pw_gid)
    except (KeyError, PermissionError):  # the user does not exist yet (the next steps make it), or not root
        pass
    executable = shutil.which("edgefil") or str(Path(sys.executable).parent / "edgefil")
    unit = units / f"edgefil-{config.device_id}.service"
    unit.write_text(unit_text(config.device_id, config.fleet, Path("/etc/edgefil") / installed.name,
                              str(Path(executable).resolve()), user, watchdog_s))
    return [unit, installed]
