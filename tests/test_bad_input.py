"""Bad input never crashes the coordinator and never enters aggregation: during a real run, a compromised device
(the credentials of a rostered device, ROGUE), a broker account that is not on the roster and an anonymous client send every kind of
malformed message many times; each is rejected, counted under its reason, and the run completes as usual."""
from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from fleet_harness import CEILING_S, SPARE_WAIT_S, Fleet
from mqtt_helpers import Peer
from wire_frames import pack

from coordinator import inbox
from coordinator.broker import mosquitto_path
from edgefil import topics, wire
from models.manifest import load_manifest, manifest_digest

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
TIMES = 12  # of each malformed kind
ROGUE = "dev-x"  # a rostered device's account with no device process: the attacker holds its password
CHANCE = 0.1


def update_chunks(weights: np.ndarray, device: str = ROGUE, round_: int = 1, **fields) -> list[bytes]:
    header = dict(device=device, round=round_, task=0, model="0" * 64, num_samples=10, metrics={})
    return wire.encode_blob("update", wire.weights_bytes(weights), **{**header, **fields}).chunks


def raw_chunk(**overrides) -> bytes:
    """A chunk message built by hand, to say what the codec itself refuses to write."""
    data = np.zeros(16, dtype="<f8").tobytes()
    message = dict(v=wire.SCHEMA_VERSION, kind="update", blob=wire.blob_id(data), size=len(data),
                   dtype="<f4", index=0, count=1, offset=0, chunk_crc32c=wire.crc32c(data), data=data,
                   device=ROGUE, round=1, task=0, model="0" * 64, num_samples=1, metrics={})
    return pack({**message, **overrides})


def malformed_messages(n_params: int, rng: np.random.Generator) -> dict[str, list[bytes]]:
    """One batch of each kind, keyed by the reason the coordinator must count it under."""
    good = lambda: rng.standard_normal(n_params).astype(np.float32)  # noqa: E731
    nan = good()
    nan[rng.integers(n_params)] = np.nan
    tampered = wire.decode(update_chunks(good())[0])
    tampered["data"] = bytes(len(tampered["data"]))  # zeros, keeping the original chunk_crc32c
    return {
        "malformed": [b"\xc1 not msgpack", b"\x00", msgpack.packb([1, 2, 3])],
        "schema": [msgpack.packb({"v": 99, "kind": "update"})],
        "kind": [wire.encode("status", device=ROGUE, state="idle", round=0)],  # a status on the update topic
        "field": [raw_chunk(num_samples="many")],
        "dtype": [raw_chunk(dtype="<f8")],
        "weights-length": update_chunks(good()[:-1]),
        "weights-nonfinite": update_chunks(nan),
        "chunk-hash": [pack(tampered)],
        "oversized": [bytes(wire.MAX_MESSAGE_BYTES + 1)],
        "impersonation": update_chunks(good(), device="dev-1"),
        "wrong-round": update_chunks(good(), round_=10_000),
    }


def test_every_malformed_message_is_rejected_counted_and_the_run_completes(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=3, outsiders=("intruder",), spares=(ROGUE,),
                  coordinator_options={"rounds_per_task": 3, "min_clients": 3, "wait_for_devices_s": SPARE_WAIT_S,
                                       "strategy": {"name": "fedprox", "mu": 0.01}})
    try:
        fleet.start()
        fleet.wait_online()
        fleet.start_coordinator()
        n_params = load_manifest(artifacts).num_parameters
        fleet.wait_rounds(1, timeout=CEILING_S)

        anonymous = Peer(fleet.broker.address)
        assert anonymous.connect().is_failure  # unauthenticated: the broker says no
        wrong = Peer(fleet.broker.address, "dev-1", "not-the-password")
        assert wrong.connect().is_failure

        rogue = Peer(fleet.broker.address, ROGUE, fleet.passwords[ROGUE])
        intruder = Peer(fleet.broker.address, "intruder", fleet.passwords["intruder"])
        assert not rogue.connect().is_failure and not intruder.connect().is_failure
        own_update = topics.from_device(fleet.fleet, ROGUE, "update")
        rng = np.random.default_rng(0)
        for _ in range(TIMES):
            for reason, payloads in malformed_messages(n_params, rng).items():
                for payload in payloads:
                    rogue.publish(own_update, payload)
            for payload in update_chunks(rng.standard_normal(n_params).astype(np.float32), device="intruder"):
                intruder.publish(topics.from_device(fleet.fleet, "intruder", "update"), payload)
            # the broker's ACL: ROGUE may not speak for dev-1; this never reaches the coordinator
            rogue.publish(topics.from_device(fleet.fleet, "dev-1", "update"), b"\xc1 forged")
        sent_by = fleet.rounds_done()
        fleet.wait_rounds(min(sent_by + 2, 15), timeout=CEILING_S)  # later rounds prove the messages were processed
        rogue.close()
        intruder.close()

        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        results = fleet.results()
        counters = results["counters"]
        for reason, payloads in malformed_messages(n_params, rng).items():
            assert counters.get(reason, 0) == TIMES * len(payloads), (reason, counters)
        assert counters.get("unknown-device", 0) == TIMES  # intruder's single-chunk updates
        assert results["rounds_completed"] == 15
        assert all(sorted(r["received"]) == fleet.devices for r in results["history"])  # ROGUE never registered
        assert results["final_accuracy"] > 3 * CHANCE
    finally:
        fleet.stop()


def test_retained_garbage_on_a_device_topic_cannot_crash_a_resume(tmp_path, export_artifacts):
    """A compromised device leaves hostile retained messages on its own topics; the broker re-delivers them to
    every coordinator that subscribes, so a resumed coordinator meets them first. It counts them, deletes them from
    the broker's store (so no later subscriber meets them again) and finishes."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2,
                  coordinator_options={"rounds_per_task": 1, "min_clients": 1,
                                       "wait_for_devices_s": 5.0})
    hostile = {  # topic kind -> (payload, the reason it is refused)
        "register": (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": [1, 2], "device": "dev-0"}), "kind"),
        "status": (b"\xc1" + b"[" * 10_000, "malformed"),
        # updates and requests are never retained: refused as such, whatever they hold
        "update": (msgpack.packb({"v": wire.SCHEMA_VERSION, "kind": "update", "device": "dev-0",
                                  "round": {"nested": [[[]]]}}), "retained"),
        "request": (wire.encode("request", device="dev-0", round=1, names=["x"]), "retained"),
    }
    try:
        fleet.start()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        fleet.kill("coordinator")
        fleet.kill("dev-0")  # compromised: its own retained messages would replace the garbage
        rogue = Peer(fleet.broker.address, "dev-0", fleet.passwords["dev-0"])
        assert not rogue.connect().is_failure
        for kind, (payload, _) in hostile.items():
            rogue.publish(topics.from_device(fleet.fleet, "dev-0", kind), payload, retain=True)
        rogue.close()
        fleet.start_coordinator(resume=True)
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        counters = fleet.results()["counters"]
        assert all(counters.get(reason, 0) >= 1 for _, reason in hostile.values()), counters
        assert counters["retained"] >= 2, counters
        assert fleet.results()["rounds_completed"] == 5  # the scenario's 5 tasks, one round each

        observer = Peer(fleet.broker.address, "observer", fleet.observer_credentials.password)
        assert not observer.connect().is_failure
        observer.subscribe(topics.from_device(fleet.fleet, "dev-0", "#"))
        time.sleep(1.0)  # retained messages come right after the SUBACK
        observer.close()
        assert observer.messages == [], [t for t, _ in observer.messages]
    finally:
        fleet.stop()


FLOOD = 200  # first chunks of distinct blobs, each claiming the largest blob the coordinator takes
FLOOD_PEAK_BOUND_MB = 64  # what the flood may add to the coordinator's peak resident memory


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the peak, since part-way blobs are freed again when their round closes."""
    status = open(f"/proc/{pid}/status").read().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def test_a_flood_of_claimed_blobs_costs_the_bytes_that_arrived(tmp_path, export_artifacts):
    """A compromised device sends first chunks that each claim a blob of model + 64 MiB. Before, the coordinator
    allocated every claim (40 of them took it from 0.9 to 1.8 GB); now a device holds at most two part-way blobs
    of the bytes it actually sent, and the run goes on."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2, spares=(ROGUE,),
                  coordinator_options={"rounds_per_task": 2, "min_clients": 2, "wait_for_devices_s": SPARE_WAIT_S})
    n_params = load_manifest(artifacts).num_parameters
    claimed = 4 * n_params + inbox.MAX_ATTACHMENT_BYTES
    try:
        fleet.start()
        fleet.wait_online()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        pid = fleet.processes["coordinator"].pid
        before = peak_rss_mb(pid)
        rogue = Peer(fleet.broker.address, ROGUE, fleet.passwords[ROGUE])
        assert not rogue.connect().is_failure
        data = bytes(wire.MIN_CHUNK_BYTES)
        for i in range(FLOOD):
            rogue.publish(topics.from_device(fleet.fleet, ROGUE, "update"), pack(dict(
                v=wire.SCHEMA_VERSION, kind="update", blob=f"{i:064x}", size=claimed, dtype=wire.WEIGHTS_DTYPE,
                index=0, count=claimed // wire.MIN_CHUNK_BYTES, offset=0, chunk_crc32c=wire.crc32c(data),
                data=data, device=ROGUE, round=fleet.rounds_done() + 1, task=0, model="0" * 64, num_samples=1,
                metrics={})))
        rogue.close()
        fleet.wait_rounds(fleet.rounds_done() + 2, timeout=CEILING_S)  # later rounds: the flood was taken in
        grown = peak_rss_mb(pid) - before
        assert grown < FLOOD_PEAK_BOUND_MB, f"the coordinator's peak memory grew by {grown:.0f} MB"
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    finally:
        fleet.stop()


ROUNDS_ALLOWANCE_MB = 16  # what the coordinator's own rounds may add to its peak beside a flood


def scattered_chunks(size: int, round_: int) -> list[bytes]:
    """Chunks of 4 bytes over two blobs of `size` bytes, none continuing what came before it: 4000 a page apart,
    then 25 placed 2 MiB apart beyond them (each a huge page of its own, where the kernel gives them)."""
    data = b"abcd"
    offsets = [4096 * i for i in range(1, 4001)] + [(2 << 20) * j for j in range(8, 33)]
    return [pack(dict(v=wire.SCHEMA_VERSION, kind="update", blob=f"{b:064x}", size=size, dtype=wire.WEIGHTS_DTYPE,
                      index=k + 1, count=size // wire.MIN_CHUNK_BYTES, offset=offset, chunk_crc32c=wire.crc32c(data),
                      data=data, device=ROGUE, round=round_, task=0, model="0" * 64, num_samples=1, metrics={}))
            for b in range(2) for k, offset in enumerate(offsets)]


def test_a_flood_of_scattered_chunks_costs_what_it_sent(tmp_path, export_artifacts):
    """A compromised device spreads chunks of 4 bytes over two blobs of model + 64 MiB. Each was written where it
    said it went, committing a page (a huge page 2 MiB apart): 66 of them grew a coordinator by 106 MB for 19 KB
    sent. Now a chunk that does not continue its blob's start is held as a copy until it does, and the flood
    costs at most the stated bound (wire.PENDING_COST_FACTOR x the bytes sent, plus a page per part-way blob).
    The device registers, so the round it is selected for waits for it (its deadline only a ceiling) until it
    says it went offline, after its flood: every chunk is handled inside that round, however slowly."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2, spares=(ROGUE,),
                  coordinator_options={"rounds_per_task": 1, "min_clients": 2, "wait_for_devices_s": CEILING_S,
                                       "deadline_s": CEILING_S})
    size = 4 * load_manifest(artifacts).num_parameters + inbox.MAX_ATTACHMENT_BYTES
    own = {kind: topics.from_device(fleet.fleet, ROGUE, kind) for kind in topics.DEVICE_SENDS}
    try:
        fleet.start()
        rogue = Peer(fleet.broker.address, ROGUE, fleet.passwords[ROGUE])
        assert not rogue.connect().is_failure
        rogue.subscribe(topics.to_device(fleet.fleet, ROGUE, "round"))
        rogue.publish(own["register"], wire.encode("register", device=ROGUE, profile="attacker", backend="portable",
                                                   manifest=manifest_digest(artifacts), software="0"), retain=True)
        rogue.publish(own["status"], wire.encode("status", device=ROGUE, state="idle", round=0), retain=True)
        fleet.start_coordinator()
        opened = wire.decode(rogue.expect(topics.to_device(fleet.fleet, ROGUE, "round"), timeout=CEILING_S))
        pid = fleet.processes["coordinator"].pid
        before = peak_rss_mb(pid)
        messages = scattered_chunks(size, opened["round"])
        for start in range(0, len(messages), 500):  # as fast as the broker takes them, in order
            rogue.publish_all([(own["update"], m) for m in messages[start:start + 500]])
        rogue.publish(own["status"], wire.encode("status", device=ROGUE, state="offline", round=0), retain=True)
        fleet.wait_rounds(opened["round"], timeout=CEILING_S)  # the round closed: the flood was handled in it
        grown = peak_rss_mb(pid) - before
        rogue.close()
        sent = sum(map(len, messages))
        bound = (wire.PENDING_COST_FACTOR * sent + 2 * wire.PENDING_COST_SLACK) / 2**20 + ROUNDS_ALLOWANCE_MB
        print(f"\nscattered flood: {sent / 2**20:.1f} MiB sent, the coordinator's peak grew {grown:.1f} MB "
              f"(bound {bound:.1f} MB)")
        assert grown <= bound, f"the coordinator's peak memory grew by {grown:.0f} MB, over {bound:.0f} MB"
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
    finally:
        fleet.stop()
