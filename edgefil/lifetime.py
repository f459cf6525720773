"""Process lifetimes: child processes that do not outlive their parent, and writes a stop signal does not cut.

`die_with_parent()` sets PR_SET_PDEATHSIG: the kernel sends the calling process SIGTERM when the thread that
created it ends, which covers its parent process dying by SIGKILL, where no clean-up of the parent's runs. The
fleet's worker processes call it first thing; a broker gets it through `preexec_fn` (in the child, before exec),
and only when started from the main thread, since a helper thread that ends would take the child with it.
Elsewhere (macOS, Windows) it does nothing and says so; callers keep their own portable check of the parent.
`stop_processes` is the orderly end of a set of child processes: SIGTERM to all first, then SIGKILL to any that
outstays its grace. `uninterrupted()` holds the stop signals over a step that must be made whole (a round's
commit: its state and its checkpoint) and delivers the first one after it.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from edgefil.prctl import prctl

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent() -> bool:
    """Ask for SIGTERM when the creating thread ends; False where the platform cannot."""
    call = prctl()
    return call is not None and call(PR_SET_PDEATHSIG, int(signal.SIGTERM)) == 0


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


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while the block runs, then deliver the first that came to the handler in
    place before (KeyboardInterrupt, a clean-up's handler, or the default). Without it a stop that lands between a
    round's state change and its checkpoint leaves a results.json ahead of the checkpoint a resume starts from.
    Python runs signal handlers on the main thread only: elsewhere, and for a handler set from C, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in STOP_SIGNALS if signal.getsignal(sig) is not None}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])
