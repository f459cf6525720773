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

import os
import pwd
import shutil
import socket
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
    """Write the unit and the device's file under `root` (see the module docstring); returns both paths."""
    from edge_client.config import DeviceConfig

    config = DeviceConfig.load(config_path)  # checked whole first: a broken file is refused before anything
    check_name(user, "user")
    if watchdog_s < 10:
        raise ValueError(f"--watchdog-s must be at least 10, got {watchdog_s}")
    raw = load_toml(config_path)
    etc = root / "etc" / "edgefil"
    units = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True, exist_ok=True)
    units.mkdir(parents=True, exist_ok=True)
    installed = etc / f"{config.device_id}.toml"
    write_private(installed, dump_toml(installed_config(raw, config_path.resolve().parent, config.device_id)))
    try:
        pwd.getpwnam(user)
        shutil.chown(installed, user, user)  # the daemon reads it as its user
    except (KeyError, PermissionError):  # the user does not exist yet (the next steps make it), or not root
        pass
    executable = shutil.which("edgefil") or str(Path(sys.executable).parent / "edgefil")
    unit = units / f"edgefil-{config.device_id}.service"
    unit.write_text(unit_text(config.device_id, config.fleet, Path("/etc/edgefil") / installed.name,
                              str(Path(executable).resolve()), user, watchdog_s))
    return [unit, installed]
