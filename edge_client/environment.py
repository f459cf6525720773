"""What a device's surroundings impose on a round: whether training fits in memory, how long the compute and the
transfers take in the device's own time. A real device runs in `RealEnvironment` (nothing emulated: its clock is
the wall clock); a virtual device in a simulated fleet gets `firmware_sim.emulation.EmulatedEnvironment`, which
applies its profile's RAM, speed, link and availability.

Devices hosted together in one process (a fleet worker's) take turns at a round's CPU work (`turn`): trained all at
once, hundreds of device threads starve the process's network thread of the GIL, keepalives lapse and the broker
drops the connections; one at a time, the worker still keeps a core busy, as the GIL allows it no more anyway.
Their turns run on one thread the process keeps for them (`Turns`), not on each device's own: work that goes deep
into native code (an ONNX Runtime step) leaves its depth on the stack of the thread that ran it, touched pages
that stay for as long as the thread lives, and native libraries keep buffers per thread until it ends. On each
device's thread that cost about 110 KiB a device that had trained once (a LeNet step: 80 KiB of stack, 30 of
per-thread buffers; docs/results.md); on one thread it is paid once a process. A device alone (`turns` None)
works on its own thread, as before.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from edgefil.thread_names import NamedThread
from models.manifest import Manifest

T = TypeVar("T")


class Environment(Protocol):
    def check_training(self, manifest: Manifest, batch_size: int, optimizer: str) -> None:
        """Raise MemoryError when a training step would not fit (as an out-of-memory kill would end it)."""

    def compute(self, host_seconds: float, samples: int = 0) -> float:
        """Device seconds that a round's training takes on the device: `host_seconds` of this host's CPU work, over
        `samples` sample passes (an emulation that models compute from the model's FLOPs reads those instead)."""

    def transfer(self, nbytes: int, messages: int, upload: bool) -> float:
        """Device seconds to move `nbytes` in `messages` messages over the device's link."""

    def offline_for(self) -> float:
        """Wall seconds until the device is back online: 0 while it is online, inf when it never comes back."""

    def online_for(self) -> float:
        """Wall seconds the device stays online for sure (inf: for good): how long an idle device may sleep."""

    def away_at(self, clock_s: float | None) -> bool:
        """Whether the device is offline at `clock_s` on the fleet's clock (a simulated fleet in virtual time names
        each round's start on it: `config["clock_s"]`): it then stays connected but sits the round out. False
        without a fleet clock (the wall clock's availability is `offline_for`'s) and for a real device."""

    def turn(self, work: Callable[[], T]) -> T:
        """Run `work` (starting a task, training, the policy's after-training update) in the device's turn among
        the devices its process hosts; its result, or what it raised."""

    def cpu_time(self) -> float:
        """CPU seconds the calling device thread has worked, its turns included wherever they ran."""


class TurnsClosed(Exception):
    """The turns were closed (`Turns.close`: the process's devices are stopping): the work was not run."""


class Turns:
    """The turns of the devices one process hosts: each `run` waits for the ones before it, in order, and runs on
    the one thread this object keeps (started at the first turn; a daemon, so a process that ends does not wait
    for the queue). Why not each device's own thread: the module docstring."""

    def __init__(self, name: str = "device-turns") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Turn] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """No more turns: the one running finishes, those waiting and any asked for later raise `TurnsClosed` in
        their callers. A stopping fleet worker's devices queued hundreds of turns (a generator's training, seconds
        each), and each ran before its device could see the stop: the worker outlived the stop's grace."""
        self._closed = True

    def run(self, work: Callable[[], T]) -> T:
        """`work`'s result; what it raised is raised here, in the caller's thread (`TurnsClosed` where the turns
        were closed before it ran)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a device's turn asked for another turn: turns do not nest")
        if self._closed:
            raise TurnsClosed("the device's turns are closed: it is stopping")
        with self._started:
            if self._thread is None:
                self._thread = NamedThread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        turn = _Turn(work)
        self._jobs.put(turn)
        turn.done.acquire()  # released by the turns' thread once `work` has returned or raised
        if turn.error is not None:
            raise turn.error
        return turn.result  # type: ignore[return-value]  # (the turn carries `work`'s own T)

    def _serve(self) -> None:
        while True:
            turn = self._jobs.get()
            if self._closed:
                turn.error = TurnsClosed("the device's turns are closed: it is stopping")
                turn.done.release()
                continue
            try:
                turn.result = turn.work()
            except BaseException as err:  # the caller's to handle; this thread serves the next turn
                turn.error = err
            turn.done.release()


class _Turn:
    """One turn's work and its outcome, handed back through a lock the caller waits on: a handoff of 2 lock
    operations, where a `concurrent.futures.Future` took a condition, a waiter lock and their bookkeeping (a
    200-device fleet's device threads spent 0.08 ms a turn waiting for their turn's result, 0.015 alone)."""

    __slots__ = ("work", "done", "result", "error")

    def __init__(self, work: Callable[[], object]) -> None:
        self.work = work
        self.done = threading.Lock()
        self.done.acquire()
        self.result: object = None
        self.error: BaseException | None = None


class TakesTurns:
    """An environment's turns (both environments'): on the process's `Turns` when it hosts several devices, inline
    when alone; and the device's CPU time, its own thread's with its turns' added wherever they ran."""

    def __init__(self, turns: Turns | None = None) -> None:
        self._turns = turns
        self._elsewhere = 0.0  # CPU seconds this device's turns took on the turns' thread

    def turn(self, work: Callable[[], T]) -> T:
        if self._turns is None:
            return work()

        def timed() -> T:
            start = time.thread_time()
            try:
                return work()
            finally:  # read by the device's thread once `run` returns or raises: after this write
                self._elsewhere += time.thread_time() - start

        return self._turns.run(timed)

    def cpu_time(self) -> float:
        return time.thread_time() + self._elsewhere


class RealEnvironment(TakesTurns):
    """The device itself: no emulated limits; compute is what it measured, transfers are real (0 extra).
    `turns`: shared by devices hosted in one process (a simulated fleet's unemulated devices); None: alone."""

    def check_training(self, manifest: Manifest, batch_size: int, optimizer: str) -> None:
        return None

    def compute(self, host_seconds: float, samples: int = 0) -> float:
        return host_seconds

    def transfer(self, nbytes: int, messages: int, upload: bool) -> float:
        return 0.0

    def offline_for(self) -> float:
        return 0.0

    def online_for(self) -> float:
        return float("inf")

    def away_at(self, clock_s: float | None) -> bool:
        return False
