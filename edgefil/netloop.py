"""One thread that carries the traffic of many MQTT connections, through paho's external-loop API.

Why: paho's `loop_start` gives every connection a thread of its own and a socket pair to wake it. A fleet worker
hosting hundreds of devices then runs hundreds of network threads fighting for one GIL: keepalives starve, the
broker drops the connections, and the devices all reconnect at once. A `NetworkLoop` selects over the sockets of
all its connections and calls paho's `loop_read`, `loop_write` and `loop_misc` on one thread; each connection is
still its own authenticated MQTT client. A fleet worker shares one loop among its devices; a standalone device
or the coordinator has a loop of its own (one thread, as before, and no socket pair).

Connecting is the loop's job: the first attempt is made at once, and every further one (the broker was not
reachable, refused the TCP connection, gave no CONNACK within `CONNACK_TIMEOUT_S`, or the connection was lost
later) after a "full jitter" exponential backoff, a uniform wait in [0, min(`BACKOFF_CAP_S`, `BACKOFF_BASE_S` x
2^(k-1))) after the k-th failure in a row: a thousand devices that lost the broker together do not come back
together. The loop keeps trying until the connection is closed; how long to wait for the first connection is the
owner's choice (edgefil.link). A TCP connect (and a TLS handshake) blocks the loop for up to the client's
`connect_timeout` (`TCP_CONNECT_TIMEOUT_S` for a link's): a fleet's broker is on the same host or network, where
that is a fraction of a millisecond.

Thread safety: paho calls the socket callbacks on whatever thread changed a socket's state (a device thread that
publishes asks for write interest); they only post a command and wake the loop, which alone touches the selector.
The callbacks say when to look, not what to select for: the loop selects a socket for writing exactly while paho
has packets queued on it (`want_write`), looked at on each callback and after each write. paho's own flag
(`_registered_write`) is checked and set without a lock, so a publish from a device thread racing the end of a
write on this one could leave a packet queued with no write interest, its callback swallowed or followed by the
write's "done": it then waited for the next packet of that client (a ping, up to a keepalive away). At 100,000
devices five registrations waited so (keepalive 1000 s), and rounds at 10,000 took 30-40 s instead of 5.

Writing: asked to write, the loop writes at once, and selects the socket for writing only where the socket took
less than what was queued. A publish used to cost the loop a selection for writing, a pass through `select` to
learn the socket could take it, and the selection undone: two `epoll_ctl` calls and a wake-up for a packet the
socket took whole. The loop's own posts (paho's callbacks inside its reads and writes: a PUBACK queued, a write
done) wake nobody: the loop applies its commands before it waits again. Before, each woke the loop through its
socket pair, a `send` and a `recv` of its own. (A 1000-device fleet's round: 8 `sendto`, 10 `epoll_ctl` and 12
`futex` calls fewer a device, of about 400 system calls; benchmarks/fleet_scale.py under `perf stat`.)
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt

from edgefil.thread_names import NamedThread
from edgefil.wakeups import ReaderGate

log = logging.getLogger("edgefil.link")

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 8.0
CONNACK_TIMEOUT_S = 10.0  # an attempt whose CONNACK has not come by then is abandoned (a broker overwhelmed)
CLOSE_GRACE_S = 2.0  # how long a closing connection may take to send its DISCONNECT before its socket is shut
TCP_CONNECT_TIMEOUT_S = 5.0
TICK_S = 0.5  # CONNACK timeouts and closing deadlines are looked at this often
# A connection's keepalive (paho's loop_misc: a PINGREQ when one is due, the socket closed when its answer is late)
# is looked at KEEPALIVE_CHECKS times a keepalive period (and at least every tick where that is shorter): a PINGREQ
# goes out at most 1/KEEPALIVE_CHECKS of the period late, well inside the broker's 1.5x. Every connection at every
# tick was 2.75 us a connection (paho's locks and clock), 4 ms a second of a worker's 1500 connections, paid under
# its GIL for as long as a round lasts (benchmarks/fleet_scale.py). And a tick looks only at the connections one of
# whose deadlines (keepalive, CONNACK, close) is due (`_plan_housekeeping`), not at every connection, most of which
# have none due: half the ticks' CPU at 500 to 33,334 connections, 588 -> 330 us a second at a 10,000-device fleet
# worker's 3334 (benchmarks/netloop_ticks.py), and a cost that follows what is due, not how many are held.
KEEPALIVE_CHECKS = 5


def backoff_delay(failures: int, rng: random.Random) -> float:
    """The wait before the next attempt after `failures` failed ones in a row: none before the first attempt, then
    full jitter, uniform in [0, min(cap, base x 2^(failures-1)))."""
    if failures <= 0:
        return 0.0
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (failures - 1)))


@dataclass(eq=False)
class _Connection:
    client: mqtt.Client
    name: str  # for the log
    failures: int = 0  # failed attempts in a row (reset by a CONNACK)
    sock: Any = None  # the socket the loop has registered, None between attempts
    attempt_at: float | None = None  # when the open attempt started, until its CONNACK
    close_by: float | None = None  # closing: the deadline for its DISCONNECT to go out
    keepalive_at: float = 0.0  # when its keepalive is next looked at (loop_misc)
    housekeep_at: float = math.inf  # when the loop looks at its deadlines next (`_housekeep`; inf: not planned)
    writing: bool = False  # its socket is selected for writing
    closed: threading.Event = field(default_factory=threading.Event)


class NetworkLoop:
    """The network thread of any number of paho clients (see the module docstring). `open` a client after its
    `connect_async` (which only records host, port and keepalive); `close` it to disconnect and stop retrying."""

    def __init__(self, name: str = "edgefil-mqtt", seed: int | None = None, readers: ReaderGate | None = None) -> None:
        """`readers`: the bound on how many of its links' readers a message wakes at once (edgefil/wakeups.py), for a
        process whose links each have a thread of their own that waits for messages (a fleet worker's devices)."""
        self.readers = readers
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._commands: deque[tuple[str, mqtt.Client | None, Any]] = deque()
        self._connections: dict[mqtt.Client, _Connection] = {}  # the loop thread's alone
        self._due: list[tuple[float, int, _Connection]] = []  # (when, tie-break, connection): attempts to make
        self._housekeeping: list[tuple[float, int, _Connection]] = []  # likewise: deadlines to look at
        self._order = itertools.count()
        self._rng = random.Random(seed)
        self._next_tick = 0.0  # the next housekeeping pass
        self._thread = NamedThread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the owner's side (any thread but the loop's, unless said) --------------------------------

    def open(self, client: mqtt.Client, name: str) -> None:
        """Connect `client` (`name` in the log) and keep it connected (reconnecting with backoff) until `close`."""
        client.on_socket_close = self._socket_closed
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._done_writing
        self._post("open", client, name)

    def close(self, client: mqtt.Client, wait_s: float | None = CLOSE_GRACE_S + 1.0) -> None:
        """Disconnect `client` (a DISCONNECT when connected) and make no further attempt. Waits up to `wait_s` for
        its socket to be closed; None returns at once (the only form the loop's own thread, i.e. a paho
        callback, may use)."""
        done = threading.Event()
        self._post("close", client, done)
        if wait_s is not None:
            done.wait(wait_s)

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread, shutting every socket still open (close connections first for a clean DISCONNECT)."""
        self._post("stop", None)
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # --- paho's socket callbacks (whatever thread changed the socket) -----------------------------

    def _socket_closed(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._post("closed", client, sock)

    def _want_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._post("write", client, sock)

    def _done_writing(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._post("read", client, sock)

    def _post(self, kind: str, client: mqtt.Client | None, arg: Any = None) -> None:
        self._commands.append((kind, client, arg))
        if threading.current_thread() is self._thread:  # the loop's own: applied before it waits again (`_turn`)
            return
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # already awake (its buffer is full), or the loop has ended
            pass

    # --- the loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        self._next_tick = time.monotonic()
        try:
            while True:
                try:
                    if not self._turn():
                        return
                except Exception:  # the loop carries every connection of the process: it must not end on one bug
                    log.exception("MQTT network loop: unexpected error; carrying on")
        finally:
            for conn in list(self._connections.values()):
                self._forget(conn)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self) -> bool:
        """One pass: wait for sockets (or the next due attempt or tick), service them, apply the posted commands,
        housekeep on a tick, make the attempts that are due. False once asked to stop."""
        due = self._due[0][0] if self._due else self._next_tick
        wait = 0.0 if self._commands else max(0.0, min(self._next_tick, due) - time.monotonic())
        for key, events in self._selector.select(wait):
            if key.data is None:
                self._drain_wake()
            else:
                self._service(key.data, events)
        if not self._apply_commands():
            return False
        now = time.monotonic()
        if now >= self._next_tick:
            self._housekeep_due(now)
            self._next_tick = now + TICK_S
            if not self._apply_commands():  # the sockets housekeeping closed are unregistered before a new
                return False  # socket may take their descriptor numbers
        while self._due and self._due[0][0] <= now:
            self._attempt(heapq.heappop(self._due)[2], now)
        return True

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _service(self, conn: _Connection, events: int) -> None:
        client = conn.client
        try:
            if events & selectors.EVENT_READ:
                client.loop_read()
            if events & selectors.EVENT_WRITE and conn.sock is not None:
                client.loop_write()
                self._select_writes(conn)
        except Exception:  # a callback's error or a broken socket: one connection's problem, not the loop's
            log.exception("MQTT client %s: network error; reconnecting", conn.name)
            self._lose_socket(conn)
        if conn.attempt_at is not None and client.is_connected():
            conn.attempt_at = None
            conn.failures = 0

    def _apply_commands(self) -> bool:
        """Apply what other threads (and paho callbacks) posted, in order; False once asked to stop."""
        while self._commands:
            kind, client, arg = self._commands.popleft()
            if kind == "stop":
                return False
            conn = self._connections.get(client) if client is not None else None
            if kind == "open" and client is not None:
                if conn is None:
                    conn = self._connections[client] = _Connection(client, arg)
                conn.close_by = None
                conn.closed.clear()
                if conn.sock is None:
                    self._schedule(conn)
            elif conn is None:
                if kind == "close":
                    arg.set()  # never opened, or already gone
            elif kind == "close":
                conn.closed = arg
                self._begin_close(conn)
            elif kind == "write" and conn.sock is arg and not conn.writing:
                self._service(conn, selectors.EVENT_WRITE)  # written now; selected for writing only if it must wait
            elif kind in ("write", "read") and conn.sock is arg:
                self._select_writes(conn)
            elif kind == "closed" and conn.sock is not None and conn.sock is arg:
                self._unregister(conn)
                self._after_socket(conn)
        return True

    def _select_writes(self, conn: _Connection) -> None:
        """Select the connection's socket for writing while paho has packets queued on it, and only then (the
        module docstring: paho's write callbacks race)."""
        if conn.sock is None or conn.client.want_write() == conn.writing:
            return
        conn.writing = not conn.writing
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
        try:
            self._selector.modify(conn.sock, mask, conn)
        except (KeyError, ValueError, OSError):  # closed meanwhile: its "closed" follows
            pass

    def _begin_close(self, conn: _Connection) -> None:
        conn.close_by = time.monotonic() + CLOSE_GRACE_S
        self._plan_housekeeping(conn)
        if conn.sock is None:
            self._forget(conn)
        else:
            conn.client.disconnect()  # queues a DISCONNECT: paho shuts the socket once it has gone out

    def _after_socket(self, conn: _Connection) -> None:
        """The connection's socket is gone: done if it was closing, else the next attempt after a backoff."""
        if conn.close_by is not None:
            self._forget(conn)
        else:
            self._retry(conn)

    def _retry(self, conn: _Connection) -> None:
        conn.failures += 1
        conn.attempt_at = None
        self._schedule(conn)

    def _schedule(self, conn: _Connection) -> None:
        when = time.monotonic() + backoff_delay(conn.failures, self._rng)
        heapq.heappush(self._due, (when, next(self._order), conn))

    def _attempt(self, conn: _Connection, now: float) -> None:
        if self._connections.get(conn.client) is not conn or conn.close_by is not None or conn.sock is not None:
            return  # closed or reconnected meanwhile
        conn.attempt_at = now
        try:
            conn.client.reconnect()  # paho closes any old socket first; its "closed" is for a socket not ours
        except (OSError, ValueError) as err:  # unreachable, refused, TLS, a bad host
            log.debug("MQTT client %s: connect failed (%s); retrying", conn.name, err)
            self._retry(conn)
            return
        sock = conn.client.socket()
        if sock is None:  # paho closed it at once (a callback's doing): a failed attempt
            self._retry(conn)
            return
        conn.writing = conn.client.want_write()
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
        stale = self._selector.get_map().get(sock.fileno())
        if stale is not None:  # a socket closed without its "closed" applied yet held this descriptor number
            self._unregister(stale.data)
            self._after_socket(stale.data)
        conn.sock = sock
        self._selector.register(sock, mask, conn)
        self._plan_housekeeping(conn)

    def _plan_housekeeping(self, conn: _Connection) -> None:
        """Plan the next look at the connection's deadlines (its keepalive, its CONNACK's, its DISCONNECT's), where
        it has a socket and that is sooner than the look planned."""
        if conn.sock is None:
            return
        when = min(conn.keepalive_at, math.inf if conn.close_by is None else conn.close_by,
                   math.inf if conn.attempt_at is None else conn.attempt_at + CONNACK_TIMEOUT_S)
        if when < conn.housekeep_at:
            conn.housekeep_at = when
            heapq.heappush(self._housekeeping, (when, next(self._order), conn))

    def _housekeep_due(self, now: float) -> None:
        """A tick: look at the connections whose planned look is due (an entry a later plan replaced is passed
        over), and plan each one's next."""
        planned = self._housekeeping
        while planned and planned[0][0] <= now:
            when, _, conn = heapq.heappop(planned)
            if when != conn.housekeep_at or self._connections.get(conn.client) is not conn:
                continue
            conn.housekeep_at = math.inf
            self._housekeep(conn, now)
            self._plan_housekeeping(conn)

    def _housekeep(self, conn: _Connection, now: float) -> None:
        if conn.sock is None:
            return
        if conn.close_by is not None and now >= conn.close_by:  # its DISCONNECT never went out
            self._lose_socket(conn)
            return
        if conn.attempt_at is not None and now - conn.attempt_at >= CONNACK_TIMEOUT_S:
            log.info("MQTT client %s: no CONNACK in %.0f s; retrying", conn.name, CONNACK_TIMEOUT_S)
            self._lose_socket(conn)
            return
        if now < conn.keepalive_at:
            return
        conn.keepalive_at = now + conn.client.keepalive / KEEPALIVE_CHECKS
        try:
            conn.client.loop_misc()  # keepalive: a PINGREQ when due, the socket closed when its answer is late
        except Exception:
            log.exception("MQTT client %s: keepalive failed; reconnecting", conn.name)
            self._lose_socket(conn)

    def _lose_socket(self, conn: _Connection) -> None:
        """Give up the connection's socket: unregister it and shut it down (paho closes it at its next attempt or
        sees it dead), then carry on as after any lost socket."""
        if conn.sock is None:
            return
        self._shut(conn)
        self._after_socket(conn)

    def _shut(self, conn: _Connection) -> None:
        """Unregister the connection's socket and shut it down (paho owns it and closes it later)."""
        sock = conn.sock
        self._unregister(conn)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _unregister(self, conn: _Connection) -> None:
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock = None

    def _forget(self, conn: _Connection) -> None:
        if conn.sock is not None:
            self._shut(conn)
        if self._connections.get(conn.client) is conn:
            del self._connections[conn.client]
        conn.closed.set()

