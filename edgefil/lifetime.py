"""Child processes that do not outlive their parent: one place that asks Linux for it.

`die_with_parent()` sets PR_SET_PDEATHSIG: the kernel sends the calling process SIGTERM when the thread that
created it ends, which covers its parent process dying by SIGKILL, where no clean-up of the parent's runs. The
fleet's worker processes call it first thing; a broker gets it through `preexec_fn` (in the child, before exec),
and only when started from the main thread, since a helper thread that ends would take the child with it.
Elsewhere (macOS, Windows) it does nothing and says so; callers keep their own portable check of the parent.
`stop_processes` is the orderly end of a set of child processes: SIGTERM to all first, then SIGKILL to any that
outstays its grace.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
    """Ask for SIGTERM when the creating thread ends; False where the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) == 0
    except (OSError, AttributeError):
        return False


def stop_processes(processes: Iterable[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM every process still running (all at once, so they stop in parallel), then wait up to `grace_s`
    for each and SIGKILL the ones still there."""
    processes = list(processes)
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    for proc in processes:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
