"""One MQTT connection (paho) for a device or the coordinator: QoS 1, automatic reconnects, a single inbox.

The network runs on a `NetworkLoop` (edgefil/netloop.py): the link's own, or one shared by every link of a fleet
worker, whose single thread carries all their sockets and makes their (re)connect attempts with jittered backoff.
Everything that thread sees becomes an item of the link's one queue (messages, and a CONNECTED marker after every
successful (re)connect), so the owner handles all protocol logic on its own thread, in order. Subscriptions are
renewed on every connect (clean sessions: a broker restart loses nothing the protocol cannot resend). Publishing
while disconnected is queued by paho and sent on reconnect. paho's copies of large messages are taken out
(edgefil/paho_buffers.py): a received payload is a memoryview of the packet paho read, not a copy. The links of a
shared loop hold one copy of a large payload they all receive (`SharedPayloads`); a blob's chunks are published as
`wire.Frame`s, which paho joins into a packet only when it sends them.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import paho.mqtt.client as mqtt

from edgefil import paho_buffers
from edgefil.netloop import TCP_CONNECT_TIMEOUT_S, NetworkLoop
from edgefil.wakeups import Inbox
from edgefil.wire import Frame

QOS = 1
UNACKNOWLEDGED = 0  # the QoS of a message whose loss costs nothing (`Link.publish`)
CONNECTED = "$connected"  # inbox marker: the link has (re)connected; re-announce yourself
_WAKE = "$wake"  # inbox marker: `wake` was called; `get` returns None for it, as for a timeout
# The smallest payload the links of a shared loop hold once (SharedPayloads): a model's message, not a round's or a
# status (a few hundred bytes, each device's own). At 64 KiB, MNIST-1D's cnn1d (a 21 KB message) passed below it, and
# every device of a fleet worker decoded and checked the same global model again (`shared_models.verified_model`
# takes only a payload object it has seen).
SHARED_PAYLOAD_BYTES = 4 * 1024
SHARED_KEY_BYTES = 256  # how many of its first bytes, and of its last, key a payload held once (SharedPayloads)
BROKER_NOTICE_S = 5.0  # a broker that has not answered a start by then: its owner says it is waiting (`start`)


class SharedPayloads:
    """One copy of each large payload that the links of a process receive alike. A fleet worker's devices each
    receive every global model into a buffer of their own, at about the same time: their inboxes held hundreds of
    copies of the same bytes until each device's thread had its turn (0.12 MB a device at the peak of a round,
    LeNet). A payload is taken for a held one of the same length and the same first and last bytes
    (`SHARED_KEY_BYTES`) only when all its bytes are equal, so a collision costs a comparison and a copy, never a
    wrong message; held weakly, it goes when no inbox or device holds it. Payloads that are not memoryviews (paho as
    shipped hands out bytes, which cannot be held weakly) pass as they are.

    The key is the payload's ends, not a checksum of it: a blob's chunk begins with its blob id and its CRC32C
    (edgefil/wire.py), so its first bytes tell chunks apart, and zlib's CRC-32 of a LeNet's 124 KB took 21.6 us
    where the comparison takes 7.8: at 3000 devices, 65 ms of CPU a round for each device's copy of the same
    global model."""

    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary[tuple[int, bytes, bytes], memoryview] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def take(self, payload: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        if len(payload) < SHARED_PAYLOAD_BYTES or not isinstance(payload, memoryview):
            return payload
        key = (len(payload), bytes(payload[:SHARED_KEY_BYTES]), bytes(payload[-SHARED_KEY_BYTES:]))
        with self._lock:
            held = self._held.get(key)
            if held is not None and np.array_equal(np.frombuffer(held, np.uint8), np.frombuffer(payload, np.uint8)):
                return held
            self._held[key] = payload
            return payload


_shared_payloads = SharedPayloads()


@dataclass(frozen=True)
class BrokerSettings:
    """Where and how to connect. `cafile` switches TLS on (the broker's CA certificate); `certfile` and `keyfile`
    add a client certificate, for a broker that requires one (`edgefil credentials --client-certs`)."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    cafile: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None
    keepalive: int = 10  # seconds; the broker declares the client gone (last will) after 1.5x this

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.keepalive < 1:
            raise ValueError(f"keepalive must be at least 1 s, got {self.keepalive}")


@dataclass(frozen=True)
class Will:
    topic: str
    payload: bytes
    retain: bool = True


class Message(NamedTuple):
    """One inbox item. `retained`: the broker's stored copy, handed over on subscribing (not a live message)."""

    topic: str
    payload: bytes | bytearray | memoryview  # received: a view of paho's packet buffer (read-only use)
    retained: bool = False


class ConnectionRefused(ConnectionError):
    """The broker answered and said no (bad credentials, not authorised): retrying will not help."""


class TlsFailure(ConnectionRefused):
    """The TLS handshake with the broker failed for a reason retrying will not mend (its message says which)."""


TLS_PROBE_S = 5.0
TLS_ALERT_WAIT_S = 0.3


def _tls_context(settings: BrokerSettings) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(settings.cafile))
    if settings.certfile:
        context.load_cert_chain(str(settings.certfile), str(settings.keyfile) if settings.keyfile else None)
    return context


def tls_problem(settings: BrokerSettings) -> str | None:
    """Why a TLS connection to the broker cannot work, in words, or None (it works, or the broker is not reachable
    yet, which is a matter for retrying). paho only reports such a failure as a connection that never comes."""
    where = f"{settings.host}:{settings.port}"
    try:
        context = _tls_context(settings)
    except (OSError, ssl.SSLError) as err:
        return f"cannot use the TLS files (cafile {settings.cafile}, certfile {settings.certfile}): {err}"
    try:
        raw = socket.create_connection((settings.host, settings.port), timeout=TLS_PROBE_S)
    except OSError:
        return None
    try:
        with context.wrap_socket(raw, server_hostname=settings.host) as sealed:
            # TLS 1.3 refuses a missing client certificate after the handshake: wait briefly for that alert
            sealed.settimeout(TLS_ALERT_WAIT_S)
            try:
                if sealed.recv(1) == b"":
                    return f"the broker at {where} closed the connection right after the TLS handshake"
            except TimeoutError:
                pass
            return None
    except ssl.SSLCertVerificationError as err:
        return (f"the certificate of the broker at {where} failed verification: {err.verify_message} (is "
                f"{settings.cafile} the CA that signed it, and does the certificate name {settings.host}?)")
    except ssl.SSLError as err:
        if "WRONG_VERSION_NUMBER" in str(err) or "record layer failure" in str(err):
            return f"the broker at {where} does not speak TLS on that port ({err.reason})"
        if "CERTIFICATE_REQUIRED" in str(err) or "HANDSHAKE_FAILURE" in str(err):
            return (f"the broker at {where} refused the TLS handshake ({err.reason}): it may require a client "
                    f"certificate (certfile and keyfile in [broker])")
        return f"TLS handshake with the broker at {where} failed: {err}"
    except ConnectionResetError:
        return f"the broker at {where} reset the connection at the TLS handshake: it does not speak TLS on that port"
    except OSError as err:
        return f"TLS handshake with the broker at {where} failed: {err}"
    finally:
        raw.close()


class Link:
    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        subscriptions: Sequence[str] = (),
        will: Will | None = None,
        max_queued: int = 0,
        network: NetworkLoop | None = None,
        persistent: bool = False,
    ) -> None:
        """`network`: the loop to run on (a fleet worker's, shared by its devices); None: a loop of the link's own,
        started and ended with it. `persistent`: the broker keeps this client id's session while the link is away
        (its subscriptions, and the QoS 1 messages that come meanwhile, up to the broker's queue limit), so a
        restarted process gets them: a site's aggregator (coordinator/site_aggregator.py). Clean otherwise."""
        self.settings = settings
        self.client_id = client_id
        self.subscriptions = list(subscriptions)
        self.inbox: Inbox[Message] = Inbox(None if network is None else network.readers)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.connects = 0
        self._lock = threading.Lock()
        self._unacked: set[int] = set()  # message ids handed to paho and not yet acknowledged by the broker
        self._early_acks: set[int] = set()  # acknowledged before publish() returned
        self._connected = threading.Event()
        self._unsubscribed: set[int] = set()  # SUBSCRIBEs of the current connection not yet acknowledged
        self._subscribed = threading.Event()  # every subscription of the current connection acknowledged
        self._refused: str | None = None
        self._decided = threading.Event()
        paho_buffers.install()  # idempotent: received payloads are views of paho's packets from here on
        client = paho_buffers.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=not persistent,
            protocol=mqtt.MQTTv311
        )
        if settings.username is not None:
            client.username_pw_set(settings.username, settings.password)
        if will is not None:
            client.will_set(will.topic, will.payload, qos=QOS, retain=will.retain)
        client.max_queued_messages_set(max_queued)
        # 4 unacknowledged messages at a time (paho's default is 20; ours was 64): 4 MB in flight covers any edge
        # link's bandwidth-delay product, and a burst of 64 chunks made the broker buffer and copy cold memory
        # (benchmarks/transport.py, 11M parameters: broker CPU 1.28 s -> 0.93 s a round, round 1.34x -> 1.13x
        # mosquitto's own clients)
        client.max_inflight_messages_set(4)
        client.connect_timeout = TCP_CONNECT_TIMEOUT_S  # a connect attempt blocks the network loop this long at most
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.acknowledge_to(self._on_acknowledged)  # not paho's on_publish: nothing is built for a QoS 0 one
        client.on_subscribe = self._on_subscribe
        self._client = client
        self._tls_set = False
        self._shared = network
        self._network: NetworkLoop | None = None  # while started
        self._payloads = _shared_payloads if network is not None else None  # one copy for the loop's links

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0, waiting: Callable[[], None] | None = None) -> None:
        """Connect (the loop retries with jittered backoff until `timeout` while the broker is unreachable or does
        not answer); ConnectionRefused if it says no,
        TlsFailure (naming the cause) if the TLS handshake cannot succeed. A stopped link may be started again.
        `waiting` is called once when the broker has not answered within BROKER_NOTICE_S, and the wait goes on: an
        owner that waits for a broker says so early, not after the whole timeout."""
        if self.settings.cafile and not self._tls_set:  # probed once: a restart after an offline stay is not
            problem = tls_problem(self.settings)
            if problem is not None:
                raise TlsFailure(problem)
            self._client.tls_set_context(_tls_context(self.settings))  # paho takes a context once
            self._tls_set = True
        self._decided.clear()
        self._refused = None
        self._client.connect_async(self.settings.host, self.settings.port, keepalive=self.settings.keepalive)
        self._network = self._shared if self._shared is not None else NetworkLoop(name=f"mqtt-{self.client_id}")
        self._network.open(self._client, self.client_id)
        started = time.monotonic()
        if waiting is not None and timeout > BROKER_NOTICE_S and not self._decided.wait(BROKER_NOTICE_S):
            waiting()
        if not self._decided.wait(max(0.0, timeout - (time.monotonic() - started))):
            self.stop()
            problem = tls_problem(self.settings) if self.settings.cafile else None
            if problem is not None:  # the broker came up meanwhile, and TLS is what fails
                raise TlsFailure(problem)
            raise ConnectionError(f"no MQTT broker answered at {self.settings.host}:{self.settings.port}")
        if self._refused is not None:
            self.stop()
            raise ConnectionRefused(f"broker at {self.settings.host}:{self.settings.port} refused: {self._refused}")

    def stop(self) -> None:
        """Disconnect (a DISCONNECT when connected, so no last will) and stop reconnecting."""
        network, self._network = self._network, None
        if network is None:
            return
        network.close(self._client)
        if network is not self._shared:
            network.stop()
        self._connected.clear()
        self.inbox.close()  # its reader is not reading: a place it holds at the gate goes to another (wakeups.py)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # --- traffic ----------------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes | Frame, retain: bool = False, qos: int = QOS) -> None:
        """Hand a message to paho (QoS 1). Raises only when paho's own queue is full; while disconnected the
        message waits in paho and goes out after the reconnect. A blob's chunk may be given as its `wire.Frame`:
        paho then copies it into its packet only when it sends it (edgefil/paho_buffers.py).

        `qos=0` (UNACKNOWLEDGED): for a message whose loss costs nothing, because what it says is said again (a
        device's progress and heartbeat statuses). Over a connection that stays up it arrives as a QoS 1 one does
        (TCP, and the broker's queues are sized for the roster: coordinator/broker.py); it is lost only with the
        connection, and paho drops it at once while disconnected. No acknowledgement is sent for it or awaited, at
        the sender, the broker and the receiver: for a device's 2 progress statuses a round, 8-18 % of the
        coordinator's CPU at 1000 and 3000 devices, none measurable at 10,000 (docs/results.md). It leaves at once,
        past QoS 1 messages waiting for paho's window."""
        if isinstance(payload, Frame) and not paho_buffers.publishes_parts():
            payload = bytes(payload)  # a paho this process could not teach to take parts
        info = self._client.publish(topic, payload, qos=qos, retain=retain)  # type: ignore[arg-type]
        if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:
            raise BufferError(f"MQTT outgoing queue is full; {topic} not sent")
        self.bytes_sent += len(payload)
        if qos == UNACKNOWLEDGED:
            return  # no PUBACK will name it
        with self._lock:
            if info.mid in self._early_acks:
                self._early_acks.discard(info.mid)
            else:
                self._unacked.add(info.mid)

    def get(self, timeout: float | None) -> Message | None:
        """The next message from the inbox, Message(CONNECTED, b"") after a (re)connect, None on timeout or when
        `wake` was called."""
        item = self.inbox.get(timeout)
        return None if item is None or item.topic == _WAKE else item

    def wake(self) -> None:
        """Make a `get` that waits (or the next one) return None now: an owner that wants the reader to look at
        something other than messages (a request to stop) says so without the reader polling for it. From any
        thread, not from a signal handler (it takes the inbox's lock, which the interrupted thread may hold)."""
        self.inbox.put(Message(_WAKE, b""))

    def wait_subscribed(self, timeout: float) -> bool:
        """Wait until the broker has acknowledged every subscription of the current connection. start() returns
        at the CONNACK: a message that another client publishes at once, not retained, may reach the broker before
        this link's SUBSCRIBE does, and is then not delivered here (a protocol that needs it retains it)."""
        return self._subscribed.wait(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every QoS 1 message handed to paho is acknowledged (best effort before a clean exit), while
        the link is connected: without a connection no acknowledgement can come before the owner exits (a fleet
        killed by SIGKILL takes its site's broker with it, and the site's aggregator, told to stop, waited out its
        whole timeout for the word it had published to that broker)."""
        deadline = time.monotonic() + timeout
        while self._unacked and self.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._unacked

    # --- paho callbacks (network thread) ----------------------------------------------------------

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            self._decided.set()
            if self._network is not None:  # no retry with the same credentials (start raises, and stops)
                self._network.close(client, wait_s=None)
            return
        pending = {client.subscribe(topic, qos=QOS)[1] for topic in self.subscriptions}  # SUBACKs come on this thread
        with self._lock:
            self._unsubscribed = pending
            if not pending:
                self._subscribed.set()
        self.connects += 1
        self._connected.set()
        self._decided.set()
        self.inbox.put(Message(CONNECTED, b""))

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected.clear()
        self._subscribed.clear()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._lock:
            self._unsubscribed.discard(mid)
            if not self._unsubscribed:
                self._subscribed.set()

    def _on_acknowledged(self, mid: int) -> None:
        with self._lock:
            if mid in self._unacked:
                self._unacked.discard(mid)
            else:
                self._early_acks.add(mid)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        payload = message.payload if self._payloads is None else self._payloads.take(message.payload)
        self.bytes_received += len(payload)
        self.inbox.put(Message(message.topic, payload, bool(message.retain)))
