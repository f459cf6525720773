"""Linux's prctl(2), looked up in one place: a child process's death signal (edgefil/lifetime.py), threads' names
(edgefil/thread_names.py), a fleet worker's futex hash (firmware_sim/fleet_worker.py). Each caller keeps its own
option and says what it does where there is no prctl."""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any


@functools.cache
def prctl() -> Any:
    """The C library's prctl, looked up once a process (a fleet worker names thousands of threads); None off Linux
    or where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
