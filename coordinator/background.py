"""Long work of a rule off the coordinator's loop: one job at a time on a worker thread, its result used when ready.

A rule's `aggregate` runs on the thread that handles every message; work that takes minutes (GLFC's proxy
reconstructs samples from gradients by L-BFGS) would stop registrations, heartbeats and updates for as long. So a
rule starts such work as a `BackgroundJob` and returns its round at once; a later round takes the result when it is
ready (`take`), or goes on without it. The job gets a deadline (`budget_s` from its start) and must stop itself by
then (threads cannot be killed: the work checks `Deadline.passed()` between iterations). Heavy torch work releases
the GIL, so the loop keeps its pace. A job that raises gives no result; the error is logged once, and the rule
goes on as if the job had not run. Running it as a separate process (the paper's proxy server, a machine of its
own) would take a subscription of its own to the rounds' attachments and a payload topic back: see
docs/methods/glfc.md.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from edgefil.thread_names import NamedThread

log = logging.getLogger("edgefil.coordinator")
T = TypeVar("T")


class Deadline:
    """When a job must have stopped: `passed()` says so, `left()` how many seconds remain."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class BackgroundJob(Generic[T]):
    """At most one running job of one kind (`name`, for the log); `start` refuses a second while one runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._result: T | None = None
        self._ready = False
        self._lock = threading.Lock()
        self.failures = 0

    def start(self, work: Callable[[Deadline], T], budget_s: float) -> bool:
        """Run `work(deadline)` on a worker thread; False (nothing started) while the previous job runs."""
        if self.running:
            return False
        with self._lock:
            self._result, self._ready = None, False
        deadline = Deadline(budget_s)

        def run() -> None:
            try:
                result = work(deadline)
            except Exception:
                self.failures += 1
                log.exception("the background job %s failed; its rule goes on without its result", self.name)
                return
            with self._lock:
                self._result, self._ready = result, True

        self._thread = NamedThread(target=run, name=f"job-{self.name}", daemon=True)
        self._thread.start()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self) -> T | None:
        """The finished job's result, once; None while it runs, after it failed, or when taken already."""
        with self._lock:
            if not self._ready:
                return None
            result, self._result, self._ready = self._result, None, False
            return result

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running job (the end of a run, a test); True when none runs afterwards."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running
