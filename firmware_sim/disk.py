"""A virtual device's disk: its state folder on a file system of the profile's capacity (tmpfs), so every write
past it fails with ENOSPC exactly as on the device. Mounting needs root (containers and CI usually have it);
where it is refused the folder stays on the host's disk and the capacity is not enforced (the run says so).

tmpfs lives in memory, so `unmount` copies the folder's contents back onto the host's disk first and `mount`
copies them onto the new file system: a stopped fleet resumes with every device's store and state. A tmpfs left
mounted by a run that was killed (SIGKILL, a power cut of the host process) still holds the device's state:
`mount` finds it, takes its contents back to the host's disk and mounts afresh, so the next run or `--resume`
goes on where the killed one stopped instead of failing with "Device or resource busy".
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("edgefil.fleet")
PAGE = 4096


def mount(folder: Path, capacity_bytes: int) -> bool:
    """Put `folder` (and what it holds) on a tmpfs of `capacity_bytes`; False when mounting is not allowed."""
    if os.path.ismount(folder):  # left by a killed run
        log.warning("%s is still mounted from a run that did not stop cleanly: taking its contents back", folder)
        unmount(folder)
    folder.mkdir(parents=True, exist_ok=True)
    held = folder.with_name(folder.name + ".held")
    if any(folder.iterdir()):
        shutil.move(folder, held)
        folder.mkdir()
    size = max(PAGE, capacity_bytes // PAGE * PAGE)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("cannot mount a %d-byte disk for %s (%s): capacity not enforced", size, folder.name,
                    done.stderr.strip())
    if held.exists():
        shutil.copytree(held, folder, dirs_exist_ok=True)
        shutil.rmtree(held)
    return done.returncode == 0


def unmount(folder: Path) -> None:
    """Copy the folder's contents to the host's disk, unmount, and put them back in the plain folder. Where even
    a lazy unmount fails (someone else unmounted it first), the copy stays beside it as `<folder>.held` and the
    failure is logged: a fleet stopping after an error must not trade that error for this one."""
    held = folder.with_name(folder.name + ".held")
    shutil.copytree(folder, held, dirs_exist_ok=True)
    if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
        # still held open (a device that did not stop in time): detach it now, free it when released
        lazy = subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, text=True)
        if lazy.returncode != 0 and os.path.ismount(folder):
            log.warning("cannot unmount %s (%s): its contents are kept in %s", folder, lazy.stderr.strip(), held)
            return
    shutil.copytree(held, folder, dirs_exist_ok=True)
    shutil.rmtree(held)
