"""Amplification and takeover, in a real run over mosquitto: what a compromised device can make the coordinator
send, and whose session it can take.

A compromised device (the account of a rostered device, ROGUE) registers, gets selected and then floods
re-registrations, then offline/online flaps and requests: before, each re-registration made the coordinator send the
whole model again. Now registrations and requests are rate-limited per device and the round's weights go to one
device at most `resends_per_round` times; the honest devices' run completes. The same account logging in with
the coordinator's client id gets its own id (the broker makes it the username): the coordinator is not thrown
off and its last rounds complete.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest
from fleet_harness import CEILING_S, SPARE_WAIT_S, Fleet
from mqtt_helpers import Peer

from coordinator.broker import mosquitto_path
from coordinator.limits import RateLimits
from edgefil import topics, wire
from models.manifest import load_manifest, manifest_digest

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
ROGUE = "dev-x"
FLOOD = 100  # of each: re-registrations, offline/online flaps, requests
TOTAL_ROUNDS = 5  # digits-class: 5 tasks of one round


def test_a_registration_status_and_request_flood_is_rate_limited(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    # The round the rogue is selected for waits for it until it goes offline after its flood (its deadline is a
    # ceiling only): so every flood message is handled while the round still awaits the rogue, however slowly.
    fleet = Fleet(tmp_path, artifacts, n_devices=2, spares=(ROGUE,),
                  coordinator_options={"rounds_per_task": 1, "min_clients": 2, "deadline_s": 900.0,
                                       "wait_for_devices_s": SPARE_WAIT_S})
    weights_bytes = 4 * load_manifest(artifacts).num_parameters
    limits = RateLimits()
    register = wire.encode("register", device=ROGUE, profile="attacker", backend="portable",
                           manifest=manifest_digest(artifacts), software="0")
    status = {state: wire.encode("status", device=ROGUE, state=state, round=0) for state in ("idle", "offline")}
    own = {kind: topics.from_device(fleet.fleet, ROGUE, kind) for kind in topics.DEVICE_SENDS}
    try:
        fleet.start()
        fleet.wait_online()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        rogue = Peer(fleet.broker.address, ROGUE, fleet.passwords[ROGUE])
        assert not rogue.connect().is_failure
        for topic in topics.device_subscriptions(fleet.fleet, ROGUE):
            rogue.subscribe(topic)
        rogue.publish(own["register"], register, retain=True)
        rogue.publish(own["status"], status["idle"], retain=True)
        round_message = wire.decode(rogue.expect(topics.to_device(fleet.fleet, ROGUE, "round"), timeout=60))
        request = wire.encode("request", device=ROGUE, round=round_message["round"], names=["anything"])
        # while selected and not delivered: each of these used to re-send the model. The re-registrations and
        # requests come first: the round awaits the rogue until it goes offline, so the coordinator (which handles
        # messages in the broker's order) takes every one of them in that round, however fast or slow the host is.
        # The flaps come last: the first offline may close the round, and what is left of them is taken in later
        # rounds or not at all; the resend bound below holds for each round either way.
        rogue.publish_all([(own["register"], register)] * FLOOD + [(own["request"], request)] * FLOOD + [
            (own["status"], status["offline"]), (own["status"], status["idle"])] * FLOOD)
        rogue.publish(own["status"], status["offline"], retain=True)  # then gone: later rounds do not wait for it
        fleet.wait_rounds(round_message["round"], timeout=CEILING_S)  # its resends were sent before it closed
        rogue.close()
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")

        results = fleet.results()
        counters = results["counters"]
        resends = [p for t, p in rogue.messages if t == topics.to_device(fleet.fleet, ROGUE, "weights")]
        resent = sum(len(p) for p in resends)
        per_round = Counter()  # the flood may outlast the round it began in: the rogue is then selected again
        for payload in resends:
            per_round[wire.decode(payload)["round"]] += len(payload)
        sent_in = FLOOD * (len(register) + len(status["idle"]) + len(status["offline"]))
        print(f"\nflood of {sent_in} bytes ({FLOOD} x register, offline, online, request): "
              f"{resent} bytes of weights re-sent ({resent / sent_in:.2f} out per byte in), counters {counters}")
        assert per_round and max(per_round.values()) <= limits.resends_per_round * (weights_bytes + 4096), per_round
        assert len(per_round) <= counters["missed-deadline"]  # only in the rounds it was selected and missed
        # before: FLOOD x weights_bytes
        assert counters["resend-limited"] >= 1, counters
        # a bucket of N per minute lets at most N through at once, and N more per minute the flood lasts
        allowed_registrations = limits.registrations_per_minute * 2
        assert counters["rate"] >= 2 * FLOOD - allowed_registrations - limits.requests_per_minute * 2, counters
        assert results["rounds_completed"] == TOTAL_ROUNDS
        assert all(set(fleet.devices) <= set(r["received"]) for r in results["history"])
    finally:
        fleet.stop()


def test_a_device_cannot_take_over_the_coordinators_session(tmp_path, export_artifacts):
    """Without `use_username_as_clientid`, this login disconnected the coordinator and the run stalled."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    fleet = Fleet(tmp_path, artifacts, n_devices=2, spares=(ROGUE,),
                  coordinator_options={"rounds_per_task": 1, "min_clients": 2, "wait_for_devices_s": SPARE_WAIT_S})
    try:
        fleet.start()
        fleet.wait_online()
        fleet.start_coordinator()
        fleet.wait_rounds(1, timeout=CEILING_S)
        takeovers = []
        for client_id in (f"coordinator-{fleet.fleet}", "coordinator", f"{fleet.fleet}-dev-0", "dev-0"):
            peer = Peer(fleet.broker.address, ROGUE, fleet.passwords[ROGUE], client_id=client_id)
            assert not peer.connect().is_failure
            takeovers.append(peer)
            time.sleep(0.5)
        for peer in takeovers:
            peer.close()
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        results = fleet.results()
        assert results["rounds_completed"] == TOTAL_ROUNDS
        assert results["reconnects"] == 0  # the coordinator was never thrown off
        assert results["counters"].get("missed-deadline", 0) == 0  # nor were the devices
        assert all(set(fleet.devices) <= set(r["received"]) for r in results["history"])
    finally:
        fleet.stop()
