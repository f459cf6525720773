"""MQTT topic names of the protocol (docs/protocol.md). Both sides import this; the broker's ACL mirrors it.

    edgefil/<fleet>/dev/<device>/<kind>   device -> coordinator   (register, status, update, request)
    edgefil/<fleet>/to/<device>/<kind>    coordinator -> device   (round, weights, payload, broadcast, answer)
    edgefil/<fleet>/all/<kind>            coordinator -> every device (weights, broadcast)
    edgefil/<fleet>/inbox/<k>/<device>    coordinator -> coordinator (an inbox worker passes on a chunk)
    edgefil/<fleet>/site/<site>/<kind>    a site's aggregator <-> coordinator, over the site's bridge
    edgefil/<fleet>/site/<site>/dev/<device>/<kind>   a site's device -> coordinator, relayed by the site's bridge
    edgefil/<fleet>/site/<site>/to/<device>/<kind>    coordinator -> a site's device, relayed by the site's bridge

A site's bridge maps its devices' own topics (dev/, to/ at the site's broker) to and from its site's prefix on the
central broker, so the central broker's ACL grants a site one line (its prefix), checked in constant time a message
whatever the site's size, and the coordinator checks that a relayed device is the site's (coordinator/sites.py).

The kinds below are the whole protocol: the broker's ACL grants exactly these topics and nothing else, and only
the `RETAINED` kinds are meant to be retained (a device's registration and status, so a coordinator that
subscribes later learns who is there); the coordinator refuses and deletes any other retained message.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "edgefil"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FROM_DEVICE, TO_DEVICE, TO_ALL = "dev", "to", "all"
INBOX = "inbox"  # inbox/<worker>/<device>: coordinator -> coordinator (its inbox workers pass chunks on)
SITE = "site"  # site/<site>/...: a site's aggregator and the coordinator (coordinator/broker.py's Site)
# on dev/<device>/<kind>; the last four: secure aggregation's (edgefil/secagg.py)
DEVICE_SENDS = ("register", "status", "update", "request", "keys", "shares", "masked", "reveal")
# on to/<device>/<kind>; the last three: secure aggregation's
DEVICE_RECEIVES = ("round", "weights", "payload", "broadcast", "answer", "notice", "neighbours", "relayed", "unmask")
BROADCASTS = ("weights", "broadcast", "end")  # on all/<kind>
RETAINED = frozenset({"register", "status"})
# The kinds whose messages carry what was learned from devices' data: an update's weights and attachments (what a
# method sends besides the weights), the global and personalised models, and the method payloads built from them.
# Secure aggregation's masked vectors, sealed shares and revealed shares are here too: whoever reads them all can
# unmask what the coordinator unmasks (the sum), and an observer has no need to. The rest is the protocol's
# metadata: who is there, in which state, which round asks whom, what a device requests, a secure session's public
# keys and who survived it. A read-only observer reads the metadata only, unless its operator lets it read these too
# (coordinator/broker.py).
CARRY_LEARNING = frozenset({"update", "weights", "payload", "broadcast", "answer", "masked", "shares", "relayed",
                            "reveal"})


def check_name(name: str, what: str = "name") -> str:
    """Fleet and device names become topic levels: no '/', '+', '#' or empty names."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{what} must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
    return name


def prefix(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}"


def from_device(fleet: str, device: str, kind: str) -> str:
    return f"{prefix(fleet)}/{FROM_DEVICE}/{check_name(device, 'device id')}/{kind}"


def to_device(fleet: str, device: str, kind: str) -> str:
    return f"{prefix(fleet)}/{TO_DEVICE}/{check_name(device, 'device id')}/{kind}"


def to_all(fleet: str, kind: str) -> str:
    return f"{prefix(fleet)}/{TO_ALL}/{kind}"


def shared_updates(fleet: str) -> str:
    """The devices' updates as several coordinator processes read them together (an MQTT `$share` subscription:
    the broker hands each message to one of them), coordinator/inbox_workers.py."""
    return f"$share/{check_name(fleet, 'fleet')}-inbox/{prefix(fleet)}/{FROM_DEVICE}/+/update"


def to_inbox_worker(fleet: str, worker: int, device: str) -> str:
    """Where an inbox worker passes on a chunk of `device`'s update to the worker that gathers that device's blobs:
    under the fleet's prefix, which only the coordinator's account writes and reads (and an observer allowed to
    read what carries learning)."""
    return f"{prefix(fleet)}/{INBOX}/{worker}/{check_name(device, 'device id')}"


SITE_SENDS = ("state", "heard", "partial")  # on site/<site>/<kind>: a site's aggregator -> the coordinator
SITE_RECEIVES = ("open", "close")  # the coordinator -> a site's aggregator


def site(fleet: str, name: str, kind: str) -> str:
    """A site's aggregator and the coordinator speak here (coordinator/sites.py), across the site's bridge."""
    return f"{prefix(fleet)}/{SITE}/{check_name(name, 'site')}/{kind}"


def via_site(fleet: str, site_name: str, direction: str, device: str, kind: str) -> str:
    """A site's device's topic on the central broker: `direction` FROM_DEVICE or TO_DEVICE, under the site's prefix
    (its bridge maps it to and from the device's own topic at the site's broker)."""
    if direction not in (FROM_DEVICE, TO_DEVICE):
        raise ValueError(f"direction must be {FROM_DEVICE} or {TO_DEVICE}, got {direction!r}")
    return (f"{prefix(fleet)}/{SITE}/{check_name(site_name, 'site')}/{direction}/"
            f"{check_name(device, 'device id')}/{kind}")


def relayed(fleet: str, topic: str) -> tuple[str, Topic] | None:
    """The site and the device's own topic of a message a site's bridge relays on the central broker (`via_site`),
    or None for any other topic."""
    head = f"{prefix(fleet)}/{SITE}/"
    if not topic.startswith(head):
        return None
    parts = topic[len(head):].split("/")
    if len(parts) == 4 and parts[1] in (FROM_DEVICE, TO_DEVICE) and NAME.fullmatch(parts[0]) \
            and NAME.fullmatch(parts[2]) and parts[3]:
        return parts[0], Topic(parts[1], parts[2], parts[3])
    return None


def device_subscriptions(fleet: str, device: str) -> list[str]:
    """What a device subscribes to: exactly the topics the ACL lets it read (no wildcards the ACL would refuse)."""
    return [to_device(fleet, device, kind) for kind in DEVICE_RECEIVES] + [to_all(fleet, kind) for kind in BROADCASTS]


@dataclass(frozen=True)
class Topic:
    direction: str  # FROM_DEVICE, TO_DEVICE or TO_ALL
    device: str | None
    kind: str


def parse(fleet: str, topic: str) -> Topic | None:
    """The parts of a protocol topic of this fleet, or None for anything else (another fleet, a bad name)."""
    head = prefix(fleet) + "/"
    if not topic.startswith(head):
        return None
    parts = topic[len(head):].split("/")
    if len(parts) == 3 and parts[0] in (FROM_DEVICE, TO_DEVICE) and NAME.fullmatch(parts[1]) and parts[2]:
        return Topic(parts[0], parts[1], parts[2])
    if len(parts) == 2 and parts[0] == TO_ALL and parts[1]:
        return Topic(TO_ALL, None, parts[1])
    return None


def parse_at_any_broker(fleet: str, topic: str) -> tuple[str | None, Topic] | None:
    """A protocol topic as the device's own, whether it was read at the device's broker or relayed by its site's
    bridge (`via_site`), with the site (None at the device's own broker); None for anything else. For readers of
    the central broker that take both alike (`edgefil watch`, the tests' waits)."""
    relay = relayed(fleet, topic)
    if relay is not None:
        return relay
    parsed = parse(fleet, topic)
    return None if parsed is None else (None, parsed)
