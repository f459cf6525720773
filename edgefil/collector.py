"""Python's cyclic garbage collector over a long run: what is alive when a run starts is set aside from its scans.

A coordinator holds a few hundred thousand objects before its first round (torch's and numpy's modules, the data,
the model, the roster), a fleet worker as many for its devices (their MQTT clients, stores, trainers), and nearly
all of them live as long as the run. The collector's full collection scans every tracked object, and a run makes
one whenever the objects that outlived the younger generations grow by a quarter: measured at 1000 devices
(`benchmarks/fleet_scale.py`, 14 rounds, gc.callbacks), the coordinator's full collections took 80-115 ms each,
three in 14 rounds (6 % of its CPU), each worker's 70-90 ms, two in 14 rounds; what they found to free were the
rounds' own cycles, never the run's fixtures.

`long_run()` freezes (`gc.freeze`: every object alive now moves to a generation the collector never scans) when a
run starts, and unfreezes (`gc.unfreeze`) when the last run of the process ends, so a process that hosts one run
after another (a test session, a notebook) scans its old objects again once no run is left: garbage that was alive
at a freeze is collected then, not lost. Objects are still freed by their reference counts whenever they are let
go; only cycles among frozen objects wait for the unfreeze. Runs overlap freely (a fleet worker's devices, one per
thread, each starting once it is connected and freezing what the devices built before it hold): the last to
end unfreezes. A device's run is its message loop, entered once connected: a device that retries a broker that
is down freezes nothing until it gets through. `gc.freeze` and `gc.unfreeze` move whole lists: O(1), whatever
the objects.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class _Runs:
    """How many long runs this process has going: one per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def long_run(self) -> Iterator[None]:
        with self._lock:
            self.count += 1
            gc.freeze()
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1
                if not self.count:
                    gc.unfreeze()


_RUNS = _Runs()


def long_run() -> contextlib.AbstractContextManager[None]:
    """A run's span (module docstring): what is alive at its start is not scanned until the process's last run
    ends."""
    return _RUNS.long_run()


def runs() -> int:
    """How many long runs are going in this process."""
    return _RUNS.count
