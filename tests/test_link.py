"""The paho link every device and the coordinator use: refusals are errors, reconnects are announced and
re-subscribe, QoS 1 messages published while the broker is down go out after it comes back, TLS works."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from mqtt_helpers import make_server_cert

from coordinator.broker import Credentials, MosquittoBroker, free_port, inbox_worker_account, mosquitto_path
from coordinator.pki import make_ca, make_client_cert
from coordinator.sites import site_subscriptions
from edgefil import topics
from edgefil.link import CONNECTED, BrokerSettings, ConnectionRefused, Link, TlsFailure
from edgefil.settings import Where, build

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
TOPIC = "edgefil/lab/dev/dev-a/update"
ROOT = Path(__file__).resolve().parents[1]


def settings(broker: MosquittoBroker, user: str, password: str, **tls) -> BrokerSettings:
    address = broker.address
    cafile = Path(address.cafile) if address.cafile else None
    return BrokerSettings(address.host, address.port, user, password, **{"cafile": cafile, **tls}, keepalive=2)


LISTENING_S = 60.0  # a ceiling: how long a link may take to have its subscriptions acknowledged


def next_message(link: Link, timeout: float = 60.0) -> tuple[str, bytes]:
    """The next message, past CONNECTED markers; `timeout` is a ceiling, not an expectation."""
    while (item := link.get(timeout)) is not None and item.topic == CONNECTED:
        pass
    assert item is not None, "nothing arrived"
    return item.topic, item.payload


@pytest.fixture
def broker(tmp_path):
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    broker.start()
    yield broker
    broker.stop()


def test_refused_credentials_and_a_missing_broker_raise(broker):
    with pytest.raises(ConnectionRefused):
        Link(settings(broker, "dev-a", "wrong"), "x").start(timeout=10)
    with pytest.raises(ConnectionError, match="no MQTT broker"):
        Link(BrokerSettings(port=free_port()), "y").start(timeout=1.5)


def test_a_link_kept_waiting_by_its_broker_says_so_early_and_connects_when_it_comes(tmp_path):
    """Started before its broker (a coordinator or a device that boots first), a link's owner hears within
    BROKER_NOTICE_S that it is waiting, the start goes on trying, and it connects once the broker is up."""
    import threading

    from edgefil.link import BROKER_NOTICE_S

    port = free_port()
    broker = MosquittoBroker(tmp_path, "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"), port=port)
    link = Link(BrokerSettings("127.0.0.1", port, "dev-a", "pw-a"), "waiting")
    said = threading.Event()
    outcome: list[object] = []

    def start() -> None:
        try:
            link.start(timeout=600, waiting=said.set)
            outcome.append("connected")
        except Exception as err:  # noqa: BLE001 (the assertion below names it)
            outcome.append(err)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    assert said.wait(BROKER_NOTICE_S + 60), "the owner was never told it waits"
    assert not outcome  # told, and still trying
    broker.start()
    try:
        thread.join(120)
        assert outcome == ["connected"] and link.connected
    finally:
        link.stop()
        broker.stop()


def test_reconnect_resubscribes_and_delivers_what_was_published_while_down(broker):
    coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=["edgefil/lab/#"])
    device = Link(settings(broker, "dev-a", "pw-a"), "d")
    coordinator.start()
    device.start()
    try:
        assert coordinator.get(5) == (CONNECTED, b"", False)
        assert coordinator.wait_subscribed(LISTENING_S)  # else "before" may reach the broker first, and be lost
        device.publish(TOPIC, b"before")
        assert next_message(coordinator) == (TOPIC, b"before")
        broker.stop()
        # queued by paho; retained, so it does not matter which of the two links reconnects first
        device.publish(TOPIC, b"while down", retain=True)
        broker.start()
        assert coordinator.get(LISTENING_S) == (CONNECTED, b"", False)  # the owner is told, to announce itself again
        assert coordinator.wait_subscribed(LISTENING_S)  # and the subscriptions are made again
        assert next_message(coordinator) == (TOPIC, b"while down")  # re-subscribed, and the queue flushed
        assert device.wait_idle(LISTENING_S) and coordinator.connects == 2
    finally:
        device.stop()
        coordinator.stop()


def test_a_link_whose_broker_is_gone_waits_for_no_acknowledgement(broker):
    """A link that has lost its connection does not wait out `wait_idle`'s timeout for an acknowledgement that
    cannot come: an owner stopping beside a broker gone with a killed fleet exits at once."""
    device = Link(settings(broker, "dev-a", "pw-a"), "d")
    device.start()
    try:
        broker.stop()
        deadline = time.monotonic() + LISTENING_S
        while device.connected and time.monotonic() < deadline:  # paho reads the connection's end
            time.sleep(0.05)
        assert not device.connected
        device.publish(TOPIC, b"never acknowledged")  # waits in paho for a reconnect
        started = time.monotonic()
        assert not device.wait_idle(LISTENING_S)
        assert time.monotonic() - started < LISTENING_S  # returned, not timed out
    finally:
        device.stop()


def test_a_link_keeps_no_message_id_of_an_unacknowledged_publish(broker):
    """A QoS 0 message gets no PUBACK: the link waits for none and keeps none of its ids. (paho's on_publish also
    fired for each QoS 0 publish written, which the link kept as an acknowledgement that came early, one id a
    progress status, until paho gave that id to a QoS 1 message, whose own acknowledgement was then not waited for.)"""
    coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=["edgefil/lab/#"])
    device = Link(settings(broker, "dev-a", "pw-a"), "d")
    coordinator.start()
    device.start()
    try:
        assert coordinator.wait_subscribed(LISTENING_S)
        for k, qos in enumerate((0, 1, 0, 0, 1)):
            device.publish(TOPIC, str(k).encode(), qos=qos)
        assert [next_message(coordinator)[1] for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
        assert device.wait_idle(LISTENING_S)
        assert not device._unacked and not device._early_acks
    finally:
        device.stop()
        coordinator.stop()


def test_tls(tmp_path):
    tls = make_server_cert(tmp_path)
    broker = MosquittoBroker(tmp_path / "b", "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"), tls=tls)
    with broker:
        coordinator = Link(settings(broker, "coordinator", "pw-c"), "c", subscriptions=["edgefil/lab/#"])
        device = Link(settings(broker, "dev-a", "pw-a"), "d")
        coordinator.start()
        device.start()
        assert coordinator.wait_subscribed(LISTENING_S)
        device.publish(TOPIC, b"sealed")
        assert next_message(coordinator) == (TOPIC, b"sealed")
        device.stop()
        coordinator.stop()


def test_a_tls_failure_names_its_cause_at_once(tmp_path):
    """Before, each of these waited out the whole timeout and said "no MQTT broker answered"."""
    tls = make_server_cert(tmp_path)
    (tmp_path / "other").mkdir()
    stranger_ca = make_ca(tmp_path / "other", "another")
    plain = MosquittoBroker(tmp_path / "plain", "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"))
    strict = MosquittoBroker(tmp_path / "strict", "lab", {"dev-a": "pw-a"}, Credentials("coordinator", "pw-c"),
                             tls=tls, require_certificate=True)
    with plain, strict:
        cases = [
            (settings(strict, "dev-a", "pw-a", cafile=stranger_ca), "failed verification"),
            (settings(plain, "dev-a", "pw-a", cafile=Path(tls.cafile)), "does not speak TLS"),
            (settings(strict, "dev-a", "pw-a"), "client certificate"),
            (settings(strict, "dev-a", "pw-a", cafile=tmp_path / "missing.crt"), "cannot use the TLS files"),
        ]
        for broker_settings, cause in cases:
            with pytest.raises(TlsFailure, match=cause):
                Link(broker_settings, "d").start(timeout=60)
        certfile, keyfile = make_client_cert(tmp_path, "dev-a", days=2)
        with_cert = Link(settings(strict, "dev-a", "pw-a", certfile=certfile, keyfile=keyfile), "d")
        with_cert.start(timeout=10)  # the certificate and the password: in
        with_cert.stop()


def test_the_credentials_command_makes_a_working_tls_fleet_and_keeps_what_exists(tmp_path):
    out, port = tmp_path / "secrets", free_port()

    def credentials(devices: str, *more: str) -> None:
        subprocess.run([sys.executable, "-m", "edgefil.cli", "credentials", "--fleet", "lab", "--devices", devices,
                        "--host", "127.0.0.1", "--host", "localhost", "--bind", "127.0.0.1", "--port", str(port),
                        "--out", str(out), "--client-certs", *more], check=True, capture_output=True, cwd=ROOT)

    def observer_reads() -> list[str]:
        block = (out / "acl").read_text().split("user observer\n", 1)[1].split("\n\n", 1)[0]
        return [line.removeprefix("topic read ") for line in block.splitlines()]

    def table(path: Path) -> BrokerSettings:
        return build(BrokerSettings, tomllib.loads(path.read_text())["broker"], Where(str(path)), base=path.parent)

    credentials("dev-0,dev-1")
    assert observer_reads() == ["edgefil/lab/dev/+/register", "edgefil/lab/dev/+/status", "edgefil/lab/dev/+/request",
                                "edgefil/lab/dev/+/keys", "edgefil/lab/to/+/round", "edgefil/lab/to/+/notice",
                                "edgefil/lab/to/+/neighbours", "edgefil/lab/to/+/unmask", "edgefil/lab/all/end"]
    credentials("dev-0,dev-1", "--observer-reads-learning")  # the operator's explicit choice
    assert observer_reads() == ["edgefil/lab/#"]
    first = {p.name: p.read_bytes() for p in [out / "ca.crt", out / "server.crt", out / "devices" / "dev-0.toml"]}
    credentials("dev-0,dev-1,dev-2", "--inbox-workers", "1")  # one more device later: what exists stays
    assert {p: (out / ("devices/" if p.endswith("toml") else "") / p).read_bytes() for p in first} == first
    assert oct((out / "ca.key").stat().st_mode & 0o777) == "0o600" and (out / "devices" / "dev-2.key").exists()

    proc = subprocess.Popen([mosquitto_path(), "-c", str(out / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        coordinator = Link(table(out / "coordinator.toml"), "c",
                           subscriptions=[f"{topics.prefix('lab')}/{topics.FROM_DEVICE}/+/+"])
        device = Link(table(out / "devices" / "dev-2.toml"), "d")
        coordinator.start(timeout=20)
        device.start(timeout=20)
        assert coordinator.wait_subscribed(LISTENING_S)
        device.publish(topics.from_device("lab", "dev-2", "status"), b"over mutual TLS")
        assert next_message(coordinator) == (topics.from_device("lab", "dev-2", "status"), b"over mutual TLS")
        # the coordinator's inbox worker: its own account, the coordinator's password and certificate
        account = inbox_worker_account(Credentials("coordinator", table(out / "coordinator.toml").password or ""), 0)
        worker = Link(dataclasses.replace(table(out / "coordinator.toml"), username=account.username,
                                          password=account.password), account.username,
                      subscriptions=[topics.shared_updates("lab")])
        worker.start(timeout=20)
        assert worker.wait_subscribed(LISTENING_S)
        device.publish(topics.from_device("lab", "dev-2", "update"), b"an update's chunk")
        assert next_message(worker) == (topics.from_device("lab", "dev-2", "update"), b"an update's chunk")
        worker.stop()
        device.stop()
        coordinator.stop()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_credentials_command_makes_a_sites_broker_bridged_over_mutual_tls(tmp_path):
    """`edgefil credentials --site a=dev-1@127.0.0.1:PORT --client-certs`: dev-1's table names the site's broker;
    the site's files start a mosquitto bridged to the central one over mutual TLS (as `site-a`); dev-1's status,
    sent to its site, reaches the coordinator at the central broker under the site's prefix, its update reaches the
    site's aggregator (site.toml's account) and not the coordinator, the coordinator's word to the site reaches the
    aggregator, and its round message to dev-1, sent under the site's prefix, reaches dev-1 on its own topic."""
    out, port, site_port = tmp_path / "secrets", free_port(), free_port()
    subprocess.run([sys.executable, "-m", "edgefil.cli", "credentials", "--fleet", "lab", "--devices", "dev-0,dev-1",
                    "--host", "127.0.0.1", "--bind", "127.0.0.1", "--port", str(port), "--out", str(out),
                    "--client-certs", "--site", f"a=dev-1@127.0.0.1:{site_port}"], check=True, capture_output=True,
                   cwd=ROOT)

    def table(path: Path) -> BrokerSettings:
        return build(BrokerSettings, tomllib.loads(path.read_text())["broker"], Where(str(path)), base=path.parent)

    assert table(out / "devices" / "dev-1.toml").port == site_port and table(out / "devices" / "dev-0.toml").port == port
    assert tomllib.loads((out / "sites" / "a" / "site.toml").read_text())["site"] == "a"
    brokers = [subprocess.Popen([mosquitto_path(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT) for conf in (out / "mosquitto.conf",
                                                                       out / "sites" / "a" / "mosquitto.conf")]
    links: list[Link] = []

    def link(path: Path, name: str, *subscriptions: str) -> Link:
        made = Link(table(path), name, subscriptions=list(subscriptions))
        made.start(timeout=20)
        assert made.wait_subscribed(LISTENING_S)
        links.append(made)
        return made

    try:
        coordinator = link(out / "coordinator.toml", "c", f"{topics.prefix('lab')}/{topics.FROM_DEVICE}/+/+",
                           *site_subscriptions("lab", ["a"]))
        aggregator = link(out / "sites" / "a" / "site.toml", "agg",
                          f"{topics.prefix('lab')}/{topics.FROM_DEVICE}/+/update", topics.site("lab", "a", "open"))
        device = link(out / "devices" / "dev-1.toml", "d", topics.to_device("lab", "dev-1", "round"))
        # the bridge connects on its own schedule: the status is sent until the coordinator has it
        status = topics.via_site("lab", "a", topics.FROM_DEVICE, "dev-1", "status")
        deadline = time.monotonic() + LISTENING_S
        while ((got := coordinator.get(0.5)) is None or got.topic != status) and time.monotonic() < deadline:
            device.publish(topics.from_device("lab", "dev-1", "status"), b"from the site")
        assert got is not None and bytes(got.payload) == b"from the site", "the bridge did not connect"
        device.publish(topics.from_device("lab", "dev-1", "update"), b"an update")
        assert next_message(aggregator) == (topics.from_device("lab", "dev-1", "update"), b"an update")
        coordinator.publish(topics.site("lab", "a", "open"), b"a round")
        assert next_message(aggregator) == (topics.site("lab", "a", "open"), b"a round")
        coordinator.publish(topics.via_site("lab", "a", topics.TO_DEVICE, "dev-1", "round"), b"train")
        assert next_message(device) == (topics.to_device("lab", "dev-1", "round"), b"train")
        device.publish(topics.from_device("lab", "dev-1", "status"), b"after the update")  # the update's path
        while (got := coordinator.get(30)) is not None and bytes(got.payload) == b"from the site":
            pass
        assert got is not None and (got.topic, bytes(got.payload)) == (status, b"after the update")
    finally:
        for made in links:
            made.stop()
        for proc in brokers:
            proc.terminate()
            proc.wait(10)
