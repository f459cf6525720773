"""Run a command under the parts of a systemd unit's sandbox that need no systemd: what a test of the unit
`edgefil client install` writes uses to show the device still trains inside it, on a host without systemd as init.

    python tests/unit_sandbox.py UNIT -- COMMAND...

Applied from the unit's own lines (so the check follows the unit, not a copy of it):
- `SystemCallFilter=` (allow-lists and `~` deny-lists, groups expanded by `systemd-analyze syscall-filter`), with
  `SystemCallErrorNumber=`'s errno for a refused call, as systemd does, through libseccomp;
- `RestrictAddressFamilies=`: socket(2) allowed only for the families named;
- `SystemCallArchitectures=native`: libseccomp's filter admits the native ABI only;
- `NoNewPrivileges=yes` and an empty `CapabilityBoundingSet=` (prctl; when run as root).
Not applied (they need systemd's mount and user namespaces): ProtectSystem/Home/Proc, PrivateTmp/Devices/Users,
the Protect*Kernel* and RestrictNamespaces/Realtime/SUIDSGID lines; `systemd-analyze security` scores those.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


class ArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def unit_values(unit: Path, key: str) -> list[str]:
    """Every value of `key=` in the unit's [Service] section, in order."""
    return [line.split("=", 1)[1].strip() for line in unit.read_text().splitlines()
            if line.startswith(f"{key}=")]


def expand(names: list[str], seen: set[str] | None = None) -> set[str]:
    """System call names of `names` (names and @groups, as `systemd-analyze syscall-filter` lists them)."""
    seen = set() if seen is None else seen
    calls: set[str] = set()
    for name in names:
        if not name.startswith("@"):
            calls.add(name)
            continue
        if name in seen:
            continue
        seen.add(name)
        listed = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True,
                                check=True).stdout.splitlines()[1:]
        members = [line.strip() for line in listed if line.strip() and not line.strip().startswith("#")]
        calls |= expand(members, seen)
    return calls


def allowed_calls(unit: Path) -> set[str]:
    """The unit's SystemCallFilter= lines folded in order: an allow-list starts the set, `~` lines take from it."""
    allowed: set[str] = set()
    for value in unit_values(unit, "SystemCallFilter"):
        if value.startswith("~"):
            allowed -= expand(value[1:].split())
        else:
            allowed |= expand(value.split())
    if not allowed:
        raise SystemExit(f"{unit} has no SystemCallFilter= allow-list")
    return allowed


def drop_capabilities(unit: Path) -> None:
    """NoNewPrivileges=yes, and CapabilityBoundingSet= (empty): every capability out of the bounding set."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if unit_values(unit, "CapabilityBoundingSet") == [""] and os.geteuid() == 0:
        cap = 0
        while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
            cap += 1


def load_filter(unit: Path) -> None:
    """The unit's system call filter and address families, through libseccomp, on this process and its children."""
    seccomp = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(ArgCmp)]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    refused = unit_values(unit, "SystemCallErrorNumber") or ["EPERM"]
    context = seccomp.seccomp_init(0x00050000 | getattr(errno, refused[-1]))  # SCMP_ACT_ERRNO(errno)
    families = [getattr(socket, name) for value in unit_values(unit, "RestrictAddressFamilies")
                for name in value.split()]
    calls = allowed_calls(unit)
    for name in sorted(calls - ({"socket"} if families else set())):
        number = seccomp.seccomp_syscall_resolve_name(name.encode())
        if number >= 0:  # a call this libseccomp does not know (a newer kernel's) is left out, as systemd does
            if seccomp.seccomp_rule_add_array(context, SCMP_ACT_ALLOW, number, 0, None) != 0:
                raise OSError(f"seccomp_rule_add {name}")
    if families and "socket" in calls:
        number = seccomp.seccomp_syscall_resolve_name(b"socket")
        for family in families:
            compare = ArgCmp(0, SCMP_CMP_EQ, int(family), 0)
            if seccomp.seccomp_rule_add_array(context, SCMP_ACT_ALLOW, number, 1, ctypes.byref(compare)) != 0:
                raise OSError(f"seccomp_rule_add socket({family})")
    if seccomp.seccomp_load(context) != 0:
        raise OSError("seccomp_load failed")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit("usage: unit_sandbox.py UNIT -- COMMAND...")
    drop_capabilities(Path(sys.argv[1]))
    load_filter(Path(sys.argv[1]))
    os.execv(sys.argv[3], sys.argv[3:])
