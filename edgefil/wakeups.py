"""A link's inbox, and a bound on how many of a process's inbox readers a message wakes at once.

A fleet worker runs thousands of devices, each a thread that waits in its link's `get`. A message sent to every
device (a round's global weights, the fleet's broadcast) arrives on every connection at about the same moment, and a
plain queue wakes every reader at once: at 100,000 devices on 2 cores about 17,000 threads were runnable, each waiting
for its worker's GIL. Python's GIL waiters wake every switch interval to ask for it, so each worker's kernel time grew
with its runnable threads and the host spent itself in the scheduler: a round of 1000 devices did not finish in 40
minutes. Measured alone (a worker's 4000 threads each given one message and 1 ms of Python, six such processes on 2
cores): 577 s, 85 % of it in the kernel, for 24 s of work.

`ReaderGate` holds the readers a message has woken to `limit` a process: a reader that a message would wake while
`limit` others are awake waits, in order, for one of them to wait for its next message again. What is bounded is a
reader woken by a message; a reader that wakes at its own timeout, or was never asleep, is not held back (it then
takes a place it is handed, and gives it back when it waits again). A reader blocked elsewhere while it holds a place
(a device waiting for its turn at the CPU) keeps it, so `limit` stays well above what a process's readers wait on
each other for (edge_client/environment.py's turns: one at a time).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, TypeVar

Item = TypeVar("Item")

READERS_AWAKE = 32  # a fleet worker's bound (firmware_sim/fleet_worker.py): far above its one turn at a time


class ReaderGate:
    """At most `limit` of the readers of a process's gated inboxes woken by a message and not yet waiting again."""

    def __init__(self, limit: int = READERS_AWAKE) -> None:
        if limit < 1:
            raise ValueError(f"a reader gate lets at least 1 reader through, not {limit}")
        self.limit = limit
        self.awake = 0  # places held (read under the lock; exact only at rest)
        self._lock = threading.Lock()
        self._waiting: deque[Inbox] = deque()

    def _ask(self, inbox: Inbox) -> None:
        """`inbox`'s sleeping reader has a message: give it a place now, or queue it for the next one freed."""
        with self._lock:
            if self.awake >= self.limit:
                self._waiting.append(inbox)
                return
            self.awake += 1
        inbox._admit()

    def _give_back(self) -> None:
        """A reader waits again: its place goes to the first queued reader, or is free."""
        with self._lock:
            if not self._waiting:
                self.awake -= 1
                return
            inbox = self._waiting.popleft()
        inbox._admit()


class Inbox(Generic[Item]):
    """Items for one reader thread, in order; with a `gate`, the reader is woken by an item only while the gate
    has a place for it (module docstring). Any thread may `put`."""

    def __init__(self, gate: ReaderGate | None = None) -> None:
        self._gate = gate
        self._items: deque[Item] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._holds = False  # the reader holds one of the gate's places
        self._asked = False  # the gate was asked for a place for it (and has not given it yet)
        self._asleep = False  # the reader waits in get
        self._closed = False  # the reader is away (until its next get): a place given to it then goes on at once

    def qsize(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> None:
        with self._ready:
            self._items.append(item)
            if not self._asleep:
                return  # the reader finds it at its next get
            if self._gate is None or self._holds:
                self._ready.notify()
                return
            if self._asked:
                return
            self._asked = True
        self._gate._ask(self)  # outside the inbox's lock: the gate's lock is never taken inside it

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item; waits for one up to `timeout` seconds (None: without end) and returns None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            self._closed = False  # (back, if it was away)
            if self._items:
                return self._items.popleft()  # awake: reads on, keeping a place it holds
            self._asleep = True  # from here a put asks the gate for it
            give_back, self._holds = self._holds, False
        while True:
            if give_back:  # asleep: its place goes to the next reader a message has for the gate
                assert self._gate is not None
                self._gate._give_back()
            with self._ready:
                while not (self._items and (self._gate is None or self._holds)):
                    if self._holds:
                        break  # a place came for an item a timed-out wake already took
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return self._woken()  # its own timeout: not held back, whatever came
                    self._ready.wait(left)
                if self._items:
                    return self._woken()
                give_back, self._holds = True, False

    def _woken(self) -> Item | None:
        """(under the lock) Awake again: the next item, or None."""
        self._asleep = False
        return self._items.popleft() if self._items else None

    def close(self) -> None:
        """The reader goes away (its link stopped: a device that leaves, or goes offline for a while): the place it
        holds, and any it is given until its next `get`, go to the next reader."""
        with self._ready:
            self._closed = True
            give_back, self._holds = self._holds, False
        if give_back:
            assert self._gate is not None
            self._gate._give_back()

    def _admit(self) -> None:
        """The gate gives this reader a place: wake it (or, awake already, it keeps the place until it waits)."""
        with self._ready:
            self._asked = False
            if self._asleep or not self._closed:  # (a reader asleep in get is there, whoever closed its inbox)
                self._holds = True
                self._ready.notify()
                return
        assert self._gate is not None
        self._gate._give_back()
