"""`edgefil watch`: the protocol's messages decoded one line each, refusals with the gate's reason, and, against a
real mosquitto, an observer account that reads a fleet's traffic and cannot write it."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from mqtt_helpers import Peer

from coordinator.broker import Credentials, MosquittoBroker, free_port, mosquitto_path
from coordinator.pki import write_fleet_credentials
from edgefil import topics, wire
from edgefil.link import BrokerSettings
from edgefil.watch import describe, load_watch_config, watch

FLEET = "lab"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_kind_of_message_is_one_line_and_a_blob_is_shown_once():
    register = wire.encode("register", device="pi-1", profile="raspberry-pi-4-4gb", backend="ort", manifest="m",
                           software="0.1.0")
    assert describe(FLEET, topics.from_device(FLEET, "pi-1", "register"), register, retained=True) == (
        "pi-1 -> coordinator register (retained): profile raspberry-pi-4-4gb, backend ort, software 0.1.0")
    error = wire.encode("status", device="pi-1", state="error", round=3, error="x has shape (5,)")
    assert describe(FLEET, topics.from_device(FLEET, "pi-1", "status"), error, False) == (
        "pi-1 -> coordinator status: error (round 3): x has shape (5,)")
    round_ = wire.encode("round", round=4, task=1, model="b", version=3, deadline_s=60.0, config={"epochs": 2})
    assert describe(FLEET, topics.to_device(FLEET, "pi-1", "round"), round_, False) == (
        "coordinator -> pi-1 round: round 4 (task 1), deadline 60 s, epochs=2")
    # a site's device's, relayed under its site's prefix on the central broker (topics.via_site)
    assert describe(FLEET, topics.via_site(FLEET, "a", topics.TO_DEVICE, "pi-1", "round"), round_, False) == (
        "coordinator -> pi-1 (via site a) round: round 4 (task 1), deadline 60 s, epochs=2")
    assert describe(FLEET, topics.via_site(FLEET, "a", topics.FROM_DEVICE, "pi-1", "status"), error, False) == (
        "pi-1 -> coordinator (via site a) status: error (round 3): x has shape (5,)")
    data = wire.weights_bytes(np.zeros(300_000, dtype=np.float32))
    chunks = wire.encode_blob("update", data, device="pi-1", round=4, task=1, model="b", num_samples=120,
                              metrics={"loss": 0.25}).chunks
    assert len(chunks) > 1
    lines = [describe(FLEET, topics.from_device(FLEET, "pi-1", "update"), c, False) for c in chunks]
    assert lines[0] == f"pi-1 -> coordinator update: round 4 (task 1): 120 samples, 1.1 MiB in {len(chunks)} " \
                       f"chunks, loss=0.25"
    assert lines[1:] == [None] * (len(chunks) - 1)
    weights = wire.encode_blob("weights", data, round=4, version=3).chunks[0]
    assert describe(FLEET, topics.to_all(FLEET, "weights"), weights, False).startswith(
        "coordinator -> all weights: round 4, 1.1 MiB in")
    keys = wire.encode("keys", device="pi-1", round=4, session="s1", task=1, model="b", cipher_key=bytes(32),
                       mask_key=bytes(32), commitment=bytes(32), metrics={"loss": 0.25})
    assert describe(FLEET, topics.from_device(FLEET, "pi-1", "keys"), keys, False) == (
        "pi-1 -> coordinator keys: round 4 (task 1), session s1: keys advertised, loss=0.25")
    unmask = wire.encode("unmask", round=4, session="s1", survivors=["pi-2", "pi-3"], dropped=["pi-4"])
    assert describe(FLEET, topics.to_device(FLEET, "pi-1", "unmask"), unmask, False) == (
        "coordinator -> pi-1 unmask: round 4, session s1: 2 neighbours survived, 1 dropped")
    masked = wire.encode_blob("masked", np.zeros(10, np.uint32).data.cast("B"), device="pi-1", round=4,
                              session="s1").chunks[0]
    assert describe(FLEET, topics.from_device(FLEET, "pi-1", "masked"), masked, False) == (
        "pi-1 -> coordinator masked: round 4, 40 B in 1 chunk")


def test_what_the_gate_would_refuse_is_shown_with_its_reason():
    topic = topics.from_device(FLEET, "pi-1", "status")
    assert describe(FLEET, topic, b"\xc1not msgpack", False).startswith("pi-1 -> coordinator status: REFUSED (")
    wrong = wire.encode("status", device="pi-1", state="idle", round=1)
    assert describe(FLEET, topics.from_device(FLEET, "pi-1", "register"), wrong, False) == (
        "pi-1 -> coordinator register: REFUSED (a status message on the register topic)")
    assert describe(FLEET, topic, b"", True) == "pi-1 -> coordinator status (retained): cleared"
    assert describe(FLEET, "edgefil/lab/elsewhere", b"x", False).endswith("not a topic of the protocol")


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_observer_account_follows_a_fleet_live_and_cannot_publish(tmp_path):
    out = tmp_path / "secrets"
    written, = write_fleet_credentials(out, FLEET, ["pi-1"], ["127.0.0.1"], port=free_port(), bind="127.0.0.1")
    fleet, settings = load_watch_config(out / "observer.toml", None)
    assert fleet == FLEET and settings.username == "observer" and (out / "observer.toml").stat().st_mode & 0o077 == 0
    passwords = {"pi-1": load_watch_config(out / "devices" / "pi-1.toml", FLEET)[1].password}
    broker = MosquittoBroker(tmp_path / "broker", FLEET, passwords,
                             Credentials("coordinator", "coordinator-password-1"),
                             observers={"observer": settings.password}, tls=written.tls)
    broker.start()
    try:
        settings = BrokerSettings(host="127.0.0.1", port=broker.port, username="observer",
                                  password=settings.password, cafile=settings.cafile)
        out_text = io.StringIO()
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(FLEET, settings, out_text, done.is_set), daemon=True)
        watcher.start()
        device = Peer(broker.address, "pi-1", passwords["pi-1"])
        assert not device.connect().is_failure
        observer = Peer(broker.address, "observer", settings.password, client_id="observer-writes")
        assert not observer.connect().is_failure
        deadline = time.monotonic() + 30
        while "status: idle" not in out_text.getvalue() and time.monotonic() < deadline:
            device.client.publish(topics.from_device(FLEET, "pi-1", "status"),
                                  wire.encode("status", device="pi-1", state="idle", round=2), qos=1)
            observer.client.publish(topics.from_device(FLEET, "pi-1", "status"),  # denied by the ACL
                                    wire.encode("status", device="pi-1", state="offline", round=9), qos=1)
            time.sleep(0.2)
        done.set()
        watcher.join(timeout=10)
        lines = out_text.getvalue().splitlines()
        assert any(line.endswith("pi-1 -> coordinator status: idle (round 2)") for line in lines), lines
        assert not any("round 9" in line for line in lines)  # the observer reads, it cannot write
        device.close()
        observer.close()
    finally:
        broker.stop()


def test_a_config_without_a_fleet_is_refused_in_one_line(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('[broker]\nhost = "127.0.0.1"\n')
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "watch", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"edgefil watch: {path}: no fleet = \"...\" (or pass --fleet)"]
