"""A link's inbox and the bound on readers a message wakes at once (edgefil/wakeups.py): the bound holds while every
message is read in order, a reader's own timeout is not held back, a place handed to a reader with nothing left to
read goes on to the next, and a fleet worker's links share one gate."""
from __future__ import annotations

import threading

import pytest

from edgefil.wakeups import Inbox, ReaderGate

WAIT_S = 60.0  # the most any event below is waited for; none takes that long unless the gate has lost a wake-up


def wait_asleep(*inboxes: Inbox) -> None:
    """Until every inbox's reader waits in its get: only a message to a sleeping reader goes through the gate (one
    that comes before is read at once, with no place)."""
    deadline = threading.Event()
    timer = threading.Timer(WAIT_S, deadline.set)
    timer.start()
    try:
        while not all(inbox._asleep for inbox in inboxes):
            assert not deadline.wait(0.001), "a reader never began to wait"
    finally:
        timer.cancel()


def take_at_its_own_timeouts(inbox: Inbox[str]) -> str | None:
    """A reader that wakes every 50 ms of its own until something came: it is never held back for a place."""
    while (item := inbox.get(0.05)) is None:
        pass
    return item


def test_a_message_to_every_reader_wakes_at_most_limit_of_them_and_every_message_is_read_in_order():
    gate = ReaderGate(4)
    inboxes = [Inbox[int](gate) for _ in range(120)]
    lock = threading.Lock()
    awake, most = 0, 0
    read: list[list[int]] = [[] for _ in inboxes]
    done = threading.Semaphore(0)

    def reader(k: int) -> None:
        nonlocal awake, most
        while True:
            item = inboxes[k].get()
            if item is None:
                inboxes[k].close()  # the reader goes: its place with it
                return
            with lock:
                awake += 1
                most = max(most, awake)
            read[k].append(item)
            threading.Event().wait(0.0005)  # hold the place a moment, as a device's handling does
            with lock:
                awake -= 1
            done.release()

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(len(inboxes))]
    for thread in threads:
        thread.start()
    wait_asleep(*inboxes)
    for item in range(3):
        for inbox in inboxes:
            inbox.put(item)
    for _ in range(3 * len(inboxes)):
        assert done.acquire(timeout=WAIT_S)
    assert most <= 4
    assert read == [[0, 1, 2]] * len(inboxes)
    for inbox in inboxes:
        inbox.put(None)
    for thread in threads:
        thread.join(WAIT_S)
    assert gate.awake == 0


def test_a_reader_wakes_at_its_own_timeout_with_what_came_though_the_gate_is_full():
    gate = ReaderGate(1)
    holder, waiter = Inbox[str](gate), Inbox[str](gate)
    got: list[str | None] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        got.append(holder.get(WAIT_S))
        holding.set()
        release.wait(WAIT_S)  # awake, holding the gate's one place
        holder.get(0.0)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    wait_asleep(holder)
    holder.put("first")
    assert holding.wait(WAIT_S) and got == ["first"]
    assert waiter.get(0.05) is None  # nothing came: a timeout is None
    taken: list[str | None] = []
    reader = threading.Thread(target=lambda: taken.append(take_at_its_own_timeouts(waiter)), daemon=True)
    reader.start()
    wait_asleep(waiter)
    waiter.put("queued")  # no place for its reader: it waits for one, but only until its own timeout
    reader.join(WAIT_S)  # while the holder still holds the one place: held back, it would never return
    assert taken == ["queued"]
    release.set()
    thread.join(WAIT_S)
    waiter.get(0.0)  # the place the gate handed the waiter when the holder let go: it waits again, and gives it back
    assert gate.awake == 0


def test_a_place_handed_to_a_reader_with_nothing_left_goes_on_to_the_next():
    """The one place is held; B's message queues it; B takes the message at its own timeout; the place, freed, is
    handed to B, which has nothing to read: B must hand it on, or C's message is never read."""
    gate = ReaderGate(1)
    a, b, c = Inbox[str](gate), Inbox[str](gate), Inbox[str](gate)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        a.get(WAIT_S)
        holding.set()
        release.wait(WAIT_S)
        a.get(0.0)  # waits again: its place is handed to the first queued reader, B

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    wait_asleep(a)
    a.put("a")
    assert holding.wait(WAIT_S)
    first: list[str | None] = []
    taking = threading.Thread(target=lambda: first.append(take_at_its_own_timeouts(b)), daemon=True)
    taking.start()
    wait_asleep(b)
    b.put("b")  # queues B for the place
    taking.join(WAIT_S)
    assert first == ["b"]  # at its own timeout
    third: list[str | None] = []

    def read_c() -> None:
        third.append(c.get(None))  # no timeout: only a place wakes it
        c.close()  # and it goes, its place with it (a reader that kept it would hold the gate's one place for good)

    reading = threading.Thread(target=read_c, daemon=True)
    reading.start()
    wait_asleep(c)
    c.put("c")  # queued behind B
    second: list[str | None] = []
    waiter = threading.Thread(target=lambda: second.append(b.get(None)), daemon=True)
    waiter.start()  # B waits again (or is about to) when the place comes to it
    release.set()
    thread.join(WAIT_S)
    reading.join(WAIT_S)
    assert third == ["c"]
    b.put("end")
    waiter.join(WAIT_S)
    assert second == ["end"]


def test_a_gate_lets_at_least_one_reader_through():
    with pytest.raises(ValueError, match="at least 1"):
        ReaderGate(0)


def test_a_fleet_workers_links_share_its_gate():
    from edgefil.link import BrokerSettings, Link
    from edgefil.netloop import NetworkLoop

    gate = ReaderGate(2)
    network = NetworkLoop(name="test-gate", readers=gate)
    try:
        links = [Link(BrokerSettings("127.0.0.1", 1), f"d{k}", network=network) for k in range(2)]
        assert all(link.inbox._gate is gate for link in links)
        assert Link(BrokerSettings("127.0.0.1", 1), "alone").inbox._gate is None  # a device of its own: unbounded
    finally:
        network.stop()


@pytest.mark.parametrize("gated", [False, True])
def test_a_reader_asleep_in_get_is_woken_though_another_thread_closed_its_inbox(gated):
    """A link stopped from another thread while its reader waits (a coordinator's shutdown, then `wake`): the
    reader is there, so what comes next still wakes it."""
    inbox = Inbox[str](ReaderGate(1) if gated else None)
    got: list[str | None] = []
    reader = threading.Thread(target=lambda: got.append(inbox.get(None)), daemon=True)
    reader.start()
    while not inbox._asleep:  # (its get has begun waiting)
        threading.Event().wait(0.001)
    inbox.close()
    inbox.put("wake")
    reader.join(WAIT_S)
    assert got == ["wake"]
