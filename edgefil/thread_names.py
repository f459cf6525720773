"""Threads the operating system knows by their names, so that `top -H`, `ps -L`, /proc and perf tell a process's
threads apart: a fleet worker's network thread, its devices' turns and the devices' own threads, a coordinator's
network thread and background jobs. Python names a thread for itself only (until 3.14, which passes the name on;
this project runs on 3.10-3.13), and the system shows every thread of a process as the process ("python"), so a
profile of a 10,000-device round could split its CPU by process but not by thread (docs/results.md, issue 57).

Linux keeps 15 bytes of a thread's name: a longer one is cut. Elsewhere a thread keeps the system's name for it.
A process's main thread is never renamed here: its name is the process's own, which `ps`, `pgrep` and `pkill` match.
"""
from __future__ import annotations

import threading

from edgefil.prctl import prctl

PR_SET_NAME = 15  # linux/prctl.h
OS_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN, less its terminating NUL


def name_this_thread(name: str) -> bool:
    """Give the calling thread `name` (its first OS_NAME_BYTES bytes) where the system shows it; False where the
    platform has no such call or it refused, or the calling thread is the main thread (the process's name)."""
    if threading.current_thread() is threading.main_thread():
        return False
    call = prctl()
    return call is not None and call(PR_SET_NAME, name.encode()[:OS_NAME_BYTES], 0, 0, 0) == 0


class NamedThread(threading.Thread):
    """A thread that takes its Python name (`name=`) as its name in the operating system too, as it starts."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()
