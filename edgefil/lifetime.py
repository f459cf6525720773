"""Child processes that do not outlive their parent: one place that asks Linux for it.

`die_with_parent()` sets PR_SET_PDEATHSIG: the kernel sends the calling process SIGTERM when the thread that
created it ends, which covers its parent process dying by SIGKILL, where no clean-up of the parent's runs. The
fleet's worker processes call it first thing; a broker gets it through `preexec_fn` (in the child, before exec),
and only when started from the main thread, since a helper thread that ends would take the child with it.
Elsewhere (macOS, Windows) it does nothing and says so; callers keep their own portable check of the parent.
"""
from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
    """Ask for SIGTERM when the creating thread ends; False where the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) == 0
    except (OSError, AttributeError):
        return False
