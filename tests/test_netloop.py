"""The network loop (edgefil/netloop.py): many links on one thread, not one each; a first connect retried with
jittered backoff until the broker comes; a broker restart brings every link of a shared loop back."""
from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
from test_link import LISTENING_S, next_message, settings

from coordinator.broker import Credentials, MosquittoBroker, free_port, mosquitto_path
from edgefil import topics
from edgefil.link import CONNECTED, BrokerSettings, Link
from edgefil.netloop import BACKOFF_BASE_S, BACKOFF_CAP_S, NetworkLoop, backoff_delay

needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"


def test_backoff_is_full_jitter_below_a_doubling_cap():
    rng = random.Random(0)
    assert backoff_delay(0, rng) == 0.0  # the first attempt is made at once
    for failures in range(1, 12):
        bound = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (failures - 1))
        delays = [backoff_delay(failures, rng) for _ in range(200)]
        assert all(0.0 <= d < bound for d in delays)
        assert max(delays) - min(delays) > 0.8 * bound  # spread over the whole window: devices do not move together


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def drain_connects(link: Link, timeout: float) -> int:
    """CONNECTED markers in the link's inbox within `timeout` (other items are dropped)."""
    seen = 0
    deadline = time.monotonic() + timeout
    while (item := link.get(max(0.0, deadline - time.monotonic()))) is not None:
        seen += item.topic == CONNECTED
    return seen


@needs_mosquitto
def test_many_links_share_one_network_thread_and_all_come_back_after_a_broker_restart(tmp_path):
    n = 40
    ids = [f"dev-{i}" for i in range(n)]
    broker = MosquittoBroker(tmp_path, FLEET, {d: f"pw-{d}" for d in ids}, Credentials("coordinator", "pw-c"))
    with broker:
        threads_before = threading.active_count()
        coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=[f"{topics.prefix(FLEET)}/#"])
        coordinator.start()
        network = NetworkLoop()
        links = [Link(settings(broker, d, f"pw-{d}"), f"{FLEET}-{d}", topics.device_subscriptions(FLEET, d),
                      network=network) for d in ids]
        try:
            for link in links:
                link.start(timeout=20)
            assert all(link.wait_subscribed(LISTENING_S) for link in [coordinator, *links])
            # the coordinator's own loop, and the shared loop's one thread for all 40 connections
            assert threading.active_count() == threads_before + 2
            for d, link in zip(ids, links):
                link.publish(topics.from_device(FLEET, d, "status"), d.encode())
            got = {bytes(next_message(coordinator)[1]) for _ in ids}  # a payload is a view of paho's buffer
            assert got == {d.encode() for d in ids}
            for d in ids:  # and the other way: each device gets its own message
                coordinator.publish(topics.to_device(FLEET, d, "round"), d.encode())
            assert [next_message(link) for link in links] == [
                (topics.to_device(FLEET, d, "round"), d.encode()) for d in ids]

            broker.stop()
            assert wait_for(lambda: not any(link.connected for link in links), LISTENING_S)
            broker.start()
            assert wait_for(lambda: all(link.connected for link in links), LISTENING_S), \
                f"{sum(not link.connected for link in links)} of {n} links did not come back"
            assert all(link.connects == 2 for link in links)
            links[7].publish(topics.from_device(FLEET, ids[7], "status"), b"after")
            assert wait_for(lambda: links[7].wait_idle(0.1), LISTENING_S)  # acknowledged: the connection carries traffic
        finally:
            for link in links:
                link.stop()
            network.stop()
            coordinator.stop()
        assert not network.running
        assert threading.active_count() == threads_before


@needs_mosquitto
def test_a_first_connect_is_retried_until_the_broker_comes(tmp_path):
    """A device that boots before its broker connects when the broker starts, within its deadline (before, paho
    retried on its own thread; now the loop does, with backoff)."""
    port = free_port()
    broker = MosquittoBroker(tmp_path, FLEET, {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"), port=port)
    link_box: list[Link] = []
    errors: list[BaseException] = []

    def start() -> None:
        link = Link(settings_on(port), "lab-dev-a")
        link_box.append(link)
        try:
            link.start(timeout=30)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    thread = threading.Thread(target=start)
    thread.start()
    time.sleep(2.0)  # several attempts fail: nothing listens on the port
    with broker:
        thread.join(35)
        assert not errors and link_box[0].connected
        assert drain_connects(link_box[0], 0.5) == 1
        link_box[0].stop()


def settings_on(port: int) -> BrokerSettings:
    return BrokerSettings("127.0.0.1", port, "dev-a", "pw-a", keepalive=2)


@needs_mosquitto
def test_links_of_one_loop_hold_one_copy_of_a_large_payload_they_all_receive(tmp_path):
    """A broadcast of SHARED_PAYLOAD_BYTES or more reaches every link of a shared loop as one object (the devices
    of a fleet worker hold one copy of each global model, not one each); a payload of the same length with other
    bytes stays its own, as does every payload of a link on a loop of its own."""
    from edgefil.link import SHARED_PAYLOAD_BYTES

    ids = [f"dev-{i}" for i in range(3)]
    broker = MosquittoBroker(tmp_path, FLEET, {d: f"pw-{d}" for d in ids}, Credentials("coordinator", "pw-c"))
    with broker:
        coordinator = Link(settings(broker, "coordinator", "pw-c"), "c")
        network = NetworkLoop()
        shared = [Link(settings(broker, d, f"pw-{d}"), f"{FLEET}-{d}", topics.device_subscriptions(FLEET, d),
                       network=network) for d in ids[:2]]
        alone = Link(settings(broker, ids[2], f"pw-{ids[2]}"), f"{FLEET}-{ids[2]}",
                     topics.device_subscriptions(FLEET, ids[2]))
        links = [*shared, alone]
        try:
            for link in [coordinator, *links]:
                link.start(timeout=20)
            assert all(link.wait_subscribed(LISTENING_S) for link in links)
            first = bytes(range(256)) * (SHARED_PAYLOAD_BYTES // 256 + 1)
            second = first[1:] + first[:1]  # the same length, other bytes
            for payload in (first, second):
                coordinator.publish(topics.to_all(FLEET, "weights"), payload)
            got = [[next_message(link)[1] for _ in range(2)] for link in links]
            for received in got:
                assert [bytes(p) for p in received] == [first, second]
            assert got[0][0] is got[1][0] and got[0][1] is got[1][1]  # one object for the loop's links
            assert got[0][0] is not got[0][1]
            assert got[2][0] is not got[0][0]  # a link on its own loop keeps its own
        finally:
            for link in links:
                link.stop()
            network.stop()
            coordinator.stop()


def test_a_connection_s_keepalive_is_looked_at_only_a_few_times_a_period():
    """paho's keepalive check (loop_misc) runs KEEPALIVE_CHECKS times a keepalive period, not at every tick of the
    loop: the loop's housekeeping driven over three periods on its own clock (no waiting), a real paho client."""
    import paho.mqtt.client as mqtt

    from edgefil.netloop import KEEPALIVE_CHECKS, TICK_S, _Connection

    keepalive = 4
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="q")
    client.connect_async("127.0.0.1", 1, keepalive=keepalive)  # records the keepalive; nothing connects
    checks = 0
    loop_misc = client.loop_misc

    def counted():  # the real client's own check, counted
        nonlocal checks
        checks += 1
        return loop_misc()

    client.loop_misc = counted
    network = NetworkLoop()
    try:
        conn = _Connection(client, "q", sock=object())  # as the loop holds a connected client
        ticks = int(3 * keepalive / TICK_S)
        for tick in range(ticks + 1):
            network._housekeep(conn, 1000.0 + tick * TICK_S)
        driven_s = ticks * TICK_S  # the span of the loop's own clock driven above (nothing waited)
        assert 1 <= checks <= driven_s / (keepalive / KEEPALIVE_CHECKS) + 2  # not once a tick (TICK_S)
        assert checks < ticks
    finally:
        network.stop()


def test_a_tick_looks_only_at_the_connections_whose_deadlines_are_due():
    """A tick of the loop looks at a connection (its keepalive, its CONNACK's and its DISCONNECT's deadlines) only
    when one of them is due, not at every connection at every tick: 200 connections with a keepalive of 10 s, over
    two periods of ticks on the loop's own clock, are looked at KEEPALIVE_CHECKS times a period each, where every
    tick looked at all of them; one whose CONNACK is late loses its socket at the first tick past its deadline, and
    one closing at the first tick past its grace, as before."""
    import socket
    from collections import Counter

    import paho.mqtt.client as mqtt

    from edgefil.netloop import CONNACK_TIMEOUT_S, KEEPALIVE_CHECKS, TICK_S, _Connection

    network = NetworkLoop()
    network.stop()  # its thread gone: the test drives the loop's own methods, on a clock of its own
    looked: Counter[str] = Counter()
    housekeep = network._housekeep

    def counted(conn: _Connection, now: float) -> None:
        looked[conn.name] += 1
        housekeep(conn, now)

    network._housekeep = counted  # type: ignore[method-assign]
    start, keepalive, count = 1000.0, 10, 200
    ends = []
    for k in range(count):
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"c{k}")
        client.connect_async("127.0.0.1", 1, keepalive=keepalive)  # records the keepalive; nothing connects
        end, other = socket.socketpair()
        ends += [end, other]
        conn = _Connection(client, f"c{k}", sock=end, keepalive_at=start)
        if k == 0:  # its CONNACK never comes
            conn.attempt_at, conn.keepalive_at = start, start + 100 * keepalive
        if k == 1:  # closing: its DISCONNECT never goes out
            conn.close_by, conn.keepalive_at = start + 3.0, start + 100 * keepalive
        network._connections[client] = conn
        network._plan_housekeeping(conn)
    late, closing = list(network._connections.values())[:2]
    ticks = int(2 * keepalive / TICK_S)
    try:
        for tick in range(ticks + 1):
            now = start + tick * TICK_S
            network._housekeep_due(now)
            assert (late.sock is None) == (now >= start + CONNACK_TIMEOUT_S)
            assert (closing.sock is None) == (now >= start + 3.0)
        assert looked["c0"] == looked["c1"] == 1
        checks = 2 * KEEPALIVE_CHECKS + 1  # each period's checks, and the first at the start
        assert all(looked[f"c{k}"] == checks for k in range(2, count))
        assert sum(looked.values()) < count * (ticks + 1) / 3  # every tick at every connection: (ticks + 1) each
    finally:
        for end in ends:
            end.close()


@needs_mosquitto
def test_a_quiet_connection_keeps_alive_with_the_thinned_checks(tmp_path):
    """With its keepalive looked at only KEEPALIVE_CHECKS times a period, a connection that sends nothing still
    pings in time: it gets its answers, twice, on its first connection (waited for as events, not for a time)."""
    broker = MosquittoBroker(tmp_path, FLEET, {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    with broker:
        keepalive = 4
        link = Link(BrokerSettings("127.0.0.1", broker.address.port, "dev-a", "pw-a", keepalive=keepalive), "q")
        answers: list[str] = []
        link._client.on_log = lambda client, userdata, level, text: answers.append(text) \
            if text == "Received PINGRESP" else None
        link.start(timeout=30)
        assert wait_for(lambda: len(answers) >= 2, timeout=60.0)  # a ceiling: each comes after a quiet keepalive
        assert drain_connects(link, 0.0) == 1  # still the first connection: no keepalive lapsed
        assert link.connected
        link.stop()


@needs_mosquitto
def test_a_packet_queued_as_a_write_ends_goes_out_without_waiting_for_the_next_one(tmp_path):
    """paho checks and sets its write flag without a lock, so a device thread's publish racing the end of a write on
    the loop's thread can find the flag still set (no callback) and the write's "done" come after it. That end state
    made outright: the flag set, a packet queued, the "done" posted. The packet goes out now, not with its client's
    next packet (a ping, a keepalive of 10 minutes away; at 100,000 devices five registrations waited so)."""
    broker = MosquittoBroker(tmp_path, FLEET, {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    with broker:
        coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=[f"{topics.prefix(FLEET)}/#"])
        coordinator.start()
        network = NetworkLoop()
        link = Link(dataclasses.replace(settings(broker, "dev-a", "pw-a"), keepalive=600), "lab-dev-a",
                    network=network)
        try:
            link.start(timeout=LISTENING_S)
            assert coordinator.wait_subscribed(LISTENING_S) and link.wait_idle(LISTENING_S)
            client = link._client
            client._registered_write = True  # paho believes the loop selects for writing: it says nothing
            topic = topics.from_device(FLEET, "dev-a", "status")
            link.publish(topic, b"queued")
            network._done_writing(client, None, client.socket())  # the ended write's word, after the publish
            assert next_message(coordinator) == (topic, b"queued")
        finally:
            link.stop()
            network.stop()
            coordinator.stop()
