"""The broker against real mosquitto and amqtt processes and real paho clients: passwords, the per-device ACL,
TLS, the packet limit, restarts and the embedded broker."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.broker import (
    MIN_QUEUED,
    QUEUED_PER_DEVICE,
    BrokerAddress,
    Credentials,
    EmbeddedBroker,
    MosquittoBroker,
    Site,
    free_port,
    generate_password,
    mosquitto_path,
)
from edgefil.topics import BROADCASTS, CARRY_LEARNING, DEVICE_RECEIVES, DEVICE_SENDS, device_subscriptions
from edgefil.topics import prefix as topic_prefix

sys.path.insert(0, str(Path(__file__).parent))
from fleet_harness import default_signals  # noqa: E402
from mqtt_helpers import Peer, make_server_cert  # noqa: E402

needs_mosquitto = pytest.mark.skipif(
    mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it with apt-get)"
)

FLEET = "lab"
P = topic_prefix(FLEET)
QUIET = 0.7  # seconds to wait for a message that must not come, after a later one did


@pytest.fixture
def passwords() -> dict[str, str]:
    return {"dev-a": generate_password(), "dev-b": generate_password(), "coordinator": generate_password()}


def make_broker(workdir: Path, passwords: dict[str, str], **kwargs) -> MosquittoBroker:
    devices = {name: pw for name, pw in passwords.items() if name != "coordinator"}
    return MosquittoBroker(workdir, FLEET, devices, Credentials("coordinator", passwords["coordinator"]), **kwargs)


@pytest.fixture
def broker(tmp_path, passwords):
    with make_broker(tmp_path / "broker", passwords) as running:
        yield running


@pytest.fixture
def peers(passwords):
    """connect(address, user) -> a connected Peer logged in with that user's password; all closed afterwards."""
    made: list[Peer] = []

    def connect(address, user: str) -> Peer:
        peer = Peer(address, user, passwords[user])
        made.append(peer)
        reason = peer.connect()
        assert reason is not None and not reason.is_failure, f"{user} refused: {reason}"
        return peer

    yield connect
    for peer in made:
        peer.close()


@needs_mosquitto
def test_device_and_coordinator_exchange_messages(broker, peers):
    coordinator = peers(broker.address, "coordinator")
    coordinator.subscribe(f"{P}/#")
    device = peers(broker.address, "dev-a")
    for topic in device_subscriptions(FLEET, "dev-a"):
        device.subscribe(topic)

    device.publish(f"{P}/dev/dev-a/update", b"weights-a")
    assert coordinator.expect(f"{P}/dev/dev-a/update") == b"weights-a"
    coordinator.publish(f"{P}/to/dev-a/round", b"round-1")
    coordinator.publish(f"{P}/all/weights", b"global")
    assert device.expect(f"{P}/to/dev-a/round") == b"round-1"
    assert device.expect(f"{P}/all/weights") == b"global"


@needs_mosquitto
def test_wrong_password_unknown_user_and_anonymous_are_refused(broker, passwords):
    attempts = [
        Peer(broker.address, "dev-a", passwords["dev-b"]),
        Peer(broker.address, "dev-z", passwords["dev-a"]),
        Peer(broker.address),
    ]
    for peer in attempts:
        reason = peer.connect()
        assert reason is not None and reason.is_failure, reason
        assert reason.getName() == "Not authorized"
    right = Peer(broker.address, "dev-a", passwords["dev-a"])  # the refusals above are not a broken broker
    assert not right.connect().is_failure
    right.close()


@needs_mosquitto
def test_a_device_cannot_write_or_read_topics_of_another(broker, peers):
    coordinator = peers(broker.address, "coordinator")
    coordinator.subscribe(f"{P}/#")
    a = peers(broker.address, "dev-a")
    b = peers(broker.address, "dev-b")
    for topic in device_subscriptions(FLEET, "dev-b"):
        b.subscribe(topic)
    a.subscribe(f"{P}/to/dev-b/#")  # mosquitto may grant the SUBACK; what matters is that nothing arrives
    a.subscribe(f"{P}/#")

    forged = [f"{P}/dev/dev-b/update", f"{P}/to/dev-b/round", f"{P}/all/weights"]
    for topic in forged:
        a.publish(topic, b"forged")  # QoS 1: acknowledged although dropped
    a.publish(f"{P}/dev/dev-a/update", b"after")  # same connection, so it arrives after anything forged would
    b.publish(f"{P}/dev/dev-b/update", b"private-b")
    coordinator.publish(f"{P}/to/dev-b/round", b"for-b")

    assert coordinator.expect(f"{P}/dev/dev-a/update") == b"after"
    assert coordinator.expect(f"{P}/dev/dev-b/update") == b"private-b"
    assert b.expect(f"{P}/to/dev-b/round") == b"for-b"
    time.sleep(QUIET)
    assert [m for m in coordinator.messages if m[1] == b"forged"] == []
    assert b.messages == [(f"{P}/to/dev-b/round", b"for-b")]
    assert a.messages == []  # neither b's update nor the coordinator's message to b


@needs_mosquitto
def test_the_acl_grants_exactly_the_protocols_topics(broker, peers):
    """A device writes only its own topics of the four kinds it sends (no junk topics under its prefix, retained
    or not) and reads only the kinds it is sent, whatever it subscribes to (mosquitto filters every message)."""
    coordinator = peers(broker.address, "coordinator")
    coordinator.subscribe(f"{P}/#")
    a = peers(broker.address, "dev-a")
    a.subscribe(f"{P}/#")
    for junk in (f"{P}/dev/dev-a/junk", f"{P}/dev/dev-a/update/deeper", f"{P}/dev/dev-a"):
        a.publish(junk, b"junk", retain=True)
    for kind in DEVICE_SENDS:
        a.publish(f"{P}/dev/dev-a/{kind}", kind.encode())
    for topic in (f"{P}/all/other", f"{P}/to/dev-a/other", f"{P}/to/dev-a/round"):
        coordinator.publish(topic, b"to a")
    assert a.expect(f"{P}/to/dev-a/round") == b"to a"  # the last one: the others would have come first
    assert coordinator.expect(f"{P}/dev/dev-a/request") == b"request"
    time.sleep(QUIET)
    assert sorted(set(coordinator.topics())) == sorted(
        [f"{P}/dev/dev-a/{kind}" for kind in DEVICE_SENDS] + [f"{P}/all/other", f"{P}/to/dev-a/other",
                                                                f"{P}/to/dev-a/round"])
    assert a.topics() == [f"{P}/to/dev-a/round"]


@needs_mosquitto
def test_one_listener_only_and_client_ids_are_usernames(broker, passwords, peers):
    """mosquitto opens exactly the configured listener (a per-listener option placed before `listener` made it open
    a default one on 0.0.0.0:1883), and a device logging in with the coordinator's client id gets its own."""
    log = broker.log_path.read_text()
    assert log.count("listen socket on port") == 1 and f"port {broker.address.port}." in log, log
    honest = peers(broker.address, "coordinator")
    honest.subscribe(f"{P}/dev/+/update")
    hijacker = Peer(broker.address, "dev-a", passwords["dev-a"], client_id="coordinator")
    assert not hijacker.connect().is_failure
    hijacker.publish(f"{P}/dev/dev-a/update", b"from the hijacker")
    assert honest.expect(f"{P}/dev/dev-a/update") == b"from the hijacker"  # the coordinator is still connected
    assert not honest.disconnected.is_set()
    hijacker.close()
    assert "as dev-a (" in broker.log_path.read_text()  # mosquitto logs the id it gave the client


@needs_mosquitto
def test_password_file_is_hashed_and_no_plaintext_stays_on_disk(broker, passwords):
    lines = (broker.workdir / "passwd").read_text().splitlines()
    assert sorted(line.split(":", 1)[0] for line in lines) == sorted(passwords)
    assert all(line.split(":", 1)[1].startswith("$7$") for line in lines)  # PBKDF2-SHA512
    for path in broker.workdir.iterdir():
        data = path.read_bytes()
        for password in passwords.values():
            assert password.encode() not in data, f"{path.name} holds a plaintext password"
    assert oct((broker.workdir / "passwd").stat().st_mode & 0o777) == "0o600"


@needs_mosquitto
def test_restart_and_crash_keep_the_port_and_clients_reconnect(broker, peers):
    port = broker.address.port
    for interrupt in (broker.restart, lambda: (broker.kill(), broker.start())):
        interrupt()
        assert broker.running and broker.address.port == port
        coordinator = peers(broker.address, "coordinator")
        coordinator.subscribe(f"{P}/dev/+/update")
        device = peers(broker.address, "dev-a")
        device.publish(f"{P}/dev/dev-a/update", b"again")
        assert coordinator.expect(f"{P}/dev/dev-a/update") == b"again"
        # closed before the next interruption: reconnecting with the same client id (the username), a peer of this
        # pass would take the next pass's session over, its messages with it, as soon as the broker was back
        coordinator.close()
        device.close()
    broker.stop()
    broker.stop()  # idempotent
    assert not broker.running


@needs_mosquitto
def test_persistence_keeps_a_retained_status_across_restart(tmp_path, passwords, peers):
    with make_broker(tmp_path / "broker", passwords, persistence=True) as broker:
        device = peers(broker.address, "dev-a")
        device.publish(f"{P}/dev/dev-a/status", b"online", retain=True)
        broker.restart()
        coordinator = peers(broker.address, "coordinator")
        coordinator.subscribe(f"{P}/dev/+/status")
        assert coordinator.expect(f"{P}/dev/dev-a/status") == b"online"
        assert (broker.workdir / "mosquitto.db").exists()


@needs_mosquitto
def test_add_device_while_running(broker, passwords, peers):
    passwords["dev-c"] = generate_password()
    refused = Peer(broker.address, "dev-c", passwords["dev-c"])
    assert refused.connect().is_failure
    broker.add_device("dev-c", passwords["dev-c"])
    coordinator = peers(broker.address, "coordinator")
    coordinator.subscribe(f"{P}/dev/#")
    device = peers(broker.address, "dev-c")  # right after add_device returns
    device.publish(f"{P}/dev/dev-c/update", b"hello")
    assert coordinator.expect(f"{P}/dev/dev-c/update") == b"hello"


@needs_mosquitto
def test_tls_listener(tmp_path, passwords, peers):
    tls = make_server_cert(tmp_path)
    with make_broker(tmp_path / "broker", passwords, tls=tls) as broker:
        assert broker.address.cafile == tls.cafile
        coordinator = peers(broker.address, "coordinator")  # verifies the certificate against the CA
        coordinator.subscribe(f"{P}/#")
        device = peers(broker.address, "dev-a")
        device.publish(f"{P}/dev/dev-a/update", b"over tls")
        assert coordinator.expect(f"{P}/dev/dev-a/update") == b"over tls"

        plain = Peer(broker.address, "dev-a", passwords["dev-a"], tls=False)
        reason = plain.connect(timeout=3.0)
        assert reason is None or reason.is_failure


@needs_mosquitto
def test_a_publish_over_the_packet_limit_is_not_delivered(tmp_path, passwords, peers):
    limit = 64 * 1024
    with make_broker(tmp_path / "broker", passwords, max_packet_bytes=limit) as broker:
        coordinator = peers(broker.address, "coordinator")
        coordinator.subscribe(f"{P}/#")
        device = peers(broker.address, "dev-a")
        device.publish(f"{P}/dev/dev-a/update", bytes(limit - 1024))
        assert len(coordinator.expect(f"{P}/dev/dev-a/update")) == limit - 1024

        device.client.publish(f"{P}/dev/dev-a/big", bytes(limit), qos=1)
        assert device.disconnected.wait(60.0), "mosquitto kept a client that sent an oversized packet"
        time.sleep(QUIET)
        assert f"{P}/dev/dev-a/big" not in coordinator.topics()


def _received_when_quiet(peer: Peer, timeout: float = 30.0) -> int:
    """How many messages `peer` has once none came for QUIET seconds."""
    deadline = time.monotonic() + timeout
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(peer.received())
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > QUIET:
            break
        time.sleep(0.05)
    return seen


def test_a_central_broker_sizes_the_coordinators_queue_for_the_devices_its_sites_relay(tmp_path):
    """A fleet whose devices are all at sites has no device account at its central broker, yet every registration
    and status crosses it to the coordinator: its queue is sized for the relayed devices as for its own (at 10,000
    devices behind 10 sites, mosquitto's default 1000 dropped 961 registrations and the run waited for them)."""
    site = Site("north", Credentials("site-north", generate_password()))
    coordinator = Credentials("coordinator", generate_password())
    alone = MosquittoBroker(tmp_path / "alone", FLEET, {}, coordinator, sites=[site])
    relaying = MosquittoBroker(tmp_path / "relaying", FLEET, {}, coordinator, sites=[site], relayed_devices=10_000)
    assert alone.max_queued_messages == MIN_QUEUED
    assert relaying.max_queued_messages == 10_000 * QUEUED_PER_DEVICE
    relaying.write_config()
    assert f"max_queued_messages {10_000 * QUEUED_PER_DEVICE}\n" in (tmp_path / "relaying" / "mosquitto.conf").read_text()
    with pytest.raises(ValueError, match="relayed_devices"):
        MosquittoBroker(tmp_path / "bad", FLEET, {}, coordinator, relayed_devices=-1)


@needs_mosquitto
def test_the_coordinators_queue_holds_a_round_of_every_devices_messages_and_an_overrun_is_reported(
        tmp_path, passwords, peers):
    """mosquitto acknowledges a device's publish before it queues it for the coordinator, and drops what its queue
    cannot hold. The queue is sized to the roster, so a burst of a round's messages from every device waits for a
    coordinator that is busy elsewhere; a burst beyond it is what `dropping()` reports."""
    passwords.update({f"dev-{k}": generate_password() for k in range(18)})  # a roster of 20
    with make_broker(tmp_path / "broker", passwords, queued_per_device=64) as broker:
        assert broker.max_queued_messages == 20 * 64
        coordinator = peers(broker.address, "coordinator")
        coordinator.subscribe(f"{P}/dev/#")
        device = peers(broker.address, "dev-a")
        topic = f"{P}/dev/dev-a/update"

        coordinator.client.loop_stop()  # busy: it reads nothing while the burst arrives
        device.publish_all([(topic, b"%d" % k) for k in range(20 * 60)])
        coordinator.client.loop_start()
        assert _received_when_quiet(coordinator) == 20 * 60
        assert [int(p) for _, p in coordinator.received()] == list(range(20 * 60))
        assert broker.dropping() == []

        coordinator.client.loop_stop()
        device.publish_all([(topic, b"x")] * (2 * 20 * 64))  # twice what the queue holds
        coordinator.client.loop_start()
        assert _received_when_quiet(coordinator) < 20 * 60 + 2 * 20 * 64
        assert broker.dropping() == ["coordinator"]


@needs_mosquitto
def test_start_fails_with_the_log_when_the_port_is_taken(tmp_path, passwords):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        broker = make_broker(tmp_path / "broker", passwords, port=squatter.getsockname()[1])
        with pytest.raises(RuntimeError, match="Address already in use"):
            broker.start(timeout=5.0)
        assert not broker.running


def test_names_and_passwords_are_validated(tmp_path):
    assert topic_prefix("fleet_1-x") == "edgefil/fleet_1-x"
    for bad in ["", "a/b", "a+b", "#", "é", "x" * 65]:
        with pytest.raises(ValueError):
            topic_prefix(bad)
    coordinator = Credentials("coordinator", "pw")
    with pytest.raises(ValueError):
        MosquittoBroker(tmp_path, FLEET, {"dev/1": "pw"}, coordinator)
    with pytest.raises(ValueError):
        MosquittoBroker(tmp_path, FLEET, {"coordinator": "pw"}, coordinator)
    with pytest.raises(ValueError):
        MosquittoBroker(tmp_path, FLEET, {"dev-1": "a:b"}, coordinator)
    assert len({generate_password() for _ in range(100)}) == 100


def test_embedded_broker_round_trips_a_megabyte_at_qos_1():
    payload = os.urandom(1024 * 1024)
    with EmbeddedBroker() as broker:
        assert broker.running
        receiver = Peer(broker.address)
        sender = Peer(broker.address)
        try:
            assert not receiver.connect().is_failure and not sender.connect().is_failure
            receiver.subscribe(f"{P}/all/#")
            sender.publish(f"{P}/all/weights", payload)
            assert receiver.expect(f"{P}/all/weights") == payload
        finally:
            receiver.close()
            sender.close()
    assert not broker.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", broker.address.port), timeout=1.0).close()


def test_broker_command_serves_until_ctrl_c(tmp_path):
    port = free_port()
    script = textwrap.dedent(f"""
        import argparse
        from coordinator.broker import add_broker_parser
        parser = argparse.ArgumentParser(prog="edgefil")
        add_broker_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["broker", "--port", "{port}"])
        raise SystemExit(args.run(args))
    """)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    try:
        assert f"127.0.0.1:{port}" in proc.stdout.readline()
        peer = Peer(BrokerAddress("127.0.0.1", port))
        assert not peer.connect().is_failure
        peer.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10.0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_mosquitto
def test_last_will_on_its_own_status_is_delivered_and_a_forged_will_dropped(broker, passwords, peers):
    status = f"{P}/dev/dev-a/status"
    coordinator = peers(broker.address, "coordinator")
    coordinator.subscribe(f"{P}/dev/+/status")
    forged = f"{P}/dev/dev-c/status"
    wills = {status: Peer(broker.address, "dev-a", passwords["dev-a"]),
             forged: Peer(broker.address, "dev-b", passwords["dev-b"])}
    for topic, device in wills.items():
        device.client.will_set(topic, b"offline", qos=1, retain=True)
        assert not device.connect().is_failure  # mosquitto 2.0.11 accepts a forged will and drops it later
    wills[status].publish(status, b"online", retain=True)
    assert coordinator.expect(status) == b"online"
    for device in wills.values():
        device.client.socket().shutdown(socket.SHUT_RDWR)  # gone without a DISCONNECT, as when a device dies
        device.close()
    assert coordinator.expect(status, index=1) == b"offline"
    coordinator.close()  # one session per username: a second login would take this one over
    late = peers(broker.address, "coordinator")
    late.subscribe(f"{P}/dev/+/status")
    assert late.expect(status) == b"offline"  # retained
    time.sleep(QUIET)
    assert forged not in coordinator.topics() + late.topics()


def test_the_embedded_broker_stays_on_loopback_unless_told_and_warns_beyond_it(caplog):
    for host in ("0.0.0.0", "192.0.2.1", "::"):
        with pytest.raises(ValueError, match="loopback only"):
            EmbeddedBroker(host)
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "broker", "--host", "0.0.0.0"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 2 and "--allow-remote" in done.stderr, done.stderr
    with caplog.at_level("INFO"), EmbeddedBroker():  # on loopback: said, not warned (a clean demo's own broker)
        pass
    said = [r for r in caplog.records if "NO authentication" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"], said
    caplog.clear()
    with caplog.at_level("INFO"), EmbeddedBroker("0.0.0.0", allow_remote=True):  # reachable from the network
        pass
    said = [r for r in caplog.records if "NO authentication" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], said


@needs_mosquitto
@pytest.mark.parametrize("reads_learning", [False, True])
def test_an_observer_reads_the_protocols_metadata_and_what_carries_learning_only_when_let(
        tmp_path, passwords, peers, reads_learning):
    """By default the observer account (`edgefil watch`) reads registrations, statuses, requests, rounds, notices
    and the end, and none of the updates, models and method payloads (`topics.CARRY_LEARNING`), not even
    subscribed to by name; with `observers_read_learning` it reads them all."""
    observer = Credentials("observer", generate_password())
    with make_broker(tmp_path / "broker", passwords, observers={observer.username: observer.password},
                     observers_read_learning=reads_learning) as broker:
        watcher = Peer(broker.address, observer.username, observer.password)
        assert not watcher.connect().is_failure
        try:
            watcher.subscribe(f"{P}/#")
            watcher.subscribe(f"{P}/dev/dev-a/update")
            coordinator = peers(broker.address, "coordinator")
            device = peers(broker.address, "dev-a")
            sent = [f"{P}/dev/dev-a/{kind}" for kind in DEVICE_SENDS]
            for topic in sent:
                device.publish(topic, b"from a")
            sent += [f"{P}/to/dev-a/{kind}" for kind in DEVICE_RECEIVES]
            sent += [f"{P}/all/{kind}" for kind in BROADCASTS]
            for topic in sent[len(DEVICE_SENDS):]:
                coordinator.publish(topic, b"from the coordinator")
            assert watcher.expect(f"{P}/all/end")  # the last one: the others would have come first
            time.sleep(QUIET)
        finally:
            watcher.close()
    metadata = [t for t in sent if t.rsplit("/", 1)[1] not in CARRY_LEARNING]
    assert set(metadata) >= {f"{P}/dev/dev-a/register", f"{P}/dev/dev-a/status", f"{P}/to/dev-a/round"}
    assert sorted(set(watcher.topics())) == sorted(sent if reads_learning else metadata)
