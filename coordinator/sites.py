"""Sites: a round's updates aggregated where their devices are, over bridged brokers, and the coordinator's side
of the site protocol (issue 60).

A site (a Jetson or a small server beside its Raspberry Pis) runs its own mosquitto, bridged to the central one
(coordinator/broker.py: `Site`, `Bridge`), and an aggregator process (coordinator/site_aggregator.py). Its devices
connect to the site's broker: their registrations, statuses and requests cross the bridge to the coordinator, the
coordinator's round messages and models cross back, and their updates stay at the site, where the aggregator takes
them into its share of the round (coordinator/round_share.py: the gate, the round's checks, the guard's
per-update bounds, the rule's fold). Across the bridge go one message per update (the site's word on it: what the
round's bookkeeping reads of it, not its weights) and, at the round's close, the site's share: a sum and its
weight, merged into the round's own aggregate as an inbox worker's share is. So a round's model is the one the
coordinator would fold from the same updates (to float rounding of the sum's order), and the central broker and
the coordinator carry one model-sized message per site and round, not one per device.

The protocol, on `site/<site>/<kind>` (edgefil/topics.py; the wire's `site-*` kinds, edgefil/wire.py):
- `open` (coordinator -> site, a blob): the global model, then the attachments `plan` (the rule, its options, the
  guard's settings, the site's roster, the round's context), `selected` (the site's devices selected), and the
  fleet's path (`last_step`, `way_back`) where the guard reads it. Sent at each round's open (and each attempt's),
  and again to a site whose aggregator comes up while a round is open.
- `close` (coordinator -> site): the round number; the site answers with its `partial`, empty where it holds none.
- `state` (site -> coordinator, retained): "up" with the aggregator process's instance id, "gone" as its will.
- `heard` (site -> coordinator): per update, taken or refused (the reason).
- `partial` (site -> coordinator, an attachments-only blob): `partial` (msgpack: the counts, what the round's
  history keeps of each update used, the fold's rule, size, devices and numbers) and one attachment per array of
  the fold's state (`state/<key>`, float64); under a robust rule, its result over the site's updates (`result`,
  float32) instead of a fold.

Before its first round the coordinator waits for every site's aggregator to be up (`wait_for_devices_s`; virtual
time: `wall_limit_s`): the updates of a round opened before an aggregator's first connection would find no session
at its broker to keep them. A site whose aggregator is killed loses the share it held: at the close the coordinator
counts the updates it had taken and that are not in its share (`site-share-lost`), as an inbox worker's lost share
is, and the round goes on without them. The aggregator's session at its broker is persistent, so what its devices
send while it is down waits there; restarted, it says it is up, gets the open round again, and takes them. A site
that is gone at the close is not waited for (`site-lost`); one that does not answer is waited for `site_close_s` at
most.

The robust rules that need a round's updates at once (the median, the trimmed mean, centered clipping) run per
site: each site's aggregator runs the rule over its devices' updates and sends its result with their summed
samples; the coordinator runs the rule again over the sites' results and the updates of the devices at no site
(a median of the sites' medians: not the fleet's median; a site whose devices all lie is one input of the
coordinator's rule). What sites cannot run is refused in one line (`round_share.shares_refused`): secure aggregation,
central DP, the guard's calibration reference, and the rules that read or send more than the weights (pFedGRP,
GLFC, SDD). The guard's bounds that compare an update with the round's compare it with its site's devices
(round_share.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from coordinator.aggregation import PartialRound, Used
from coordinator.guard_settings import GuardSettings
from coordinator.inbox import Update
from coordinator.influence import FleetPath
from coordinator.round_share import Heard, RoundOpening, SharePlan
from coordinator.strategies import ClientUpdate, RoundContext
from coordinator.strategies.base import PartialFold
from edgefil import topics, wire
from edgefil.link import Link

log = logging.getLogger("edgefil.coordinator")
UP, GONE = "up", "gone"
STATE_KEY = "state/"  # attachments of a partial that hold the fold's arrays
RESULT = "result"  # the attachment of a partial that holds a holding rule's result (float32 weights)
MAX_PARTIAL_EXTRA_BYTES = 256 << 20  # a partial's bytes beyond its arrays (its history of the updates it used)
MAX_COUNTERS = 256
WAITING_SAID_EVERY_S = 5.0


# --- the messages ---------------------------------------------------------------------------------

def opening_blob(opening: RoundOpening, plan: SharePlan, roster: frozenset[str]) -> wire.EncodedBlob:
    """A site's `open`: the round as its share takes it, for the site's devices (`roster`)."""
    ctx = opening.ctx
    about = {
        "rule": plan.rule, "options": dict(plan.options), "guard": dataclasses.asdict(plan.guard),
        "max_held_bytes": plan.max_held_bytes, "roster": sorted(roster),
        "ctx": [list(ctx.task_classes), list(ctx.seen_classes), ctx.round_in_task, ctx.rounds_per_task],
        "virtual_deadline_s": opening.virtual_deadline_s,
    }
    attachments = {"plan": msgpack.packb(about, use_bin_type=True),
                   "selected": msgpack.packb(sorted(roster.intersection(opening.selected)), use_bin_type=True)}
    for name in ("last_step", "way_back"):
        array = getattr(opening.path, name)
        if array is not None:
            attachments[name] = np.ascontiguousarray(array, "<f8").tobytes()
    data, layout = wire.pack_attachments(wire.weights_bytes(opening.global_weights), attachments)
    return wire.encode_blob("site-open", data, round=opening.number, task=opening.task, model=opening.model,
                            manifest=plan.manifest, attachments=layout)


def read_opening(blob: wire.Blob, site: SharePlan) -> tuple[RoundOpening, SharePlan]:
    """A site's `open` as its aggregator reads it (WireError if malformed): the round, and `site` (what the site
    knows itself: its fleet and model) with the round's plan (its rule, guard and roster)."""
    num_parameters = site.num_parameters
    weights, attachments = blob.split(num_parameters)
    try:
        about = msgpack.unpackb(bytes(attachments["plan"]), raw=False)
        selected = msgpack.unpackb(bytes(attachments["selected"]), raw=False)
        task_classes, seen_classes, round_in_task, rounds_per_task = about["ctx"]
        ctx = RoundContext(blob.header["round"], blob.header["task"], tuple(task_classes), tuple(seen_classes),
                           int(round_in_task), int(rounds_per_task))
        path = FleetPath(*(np.frombuffer(attachments[name], "<f8", count=num_parameters).copy()
                           if name in attachments else None for name in ("last_step", "way_back")))
        deadline = about["virtual_deadline_s"]
        opening = RoundOpening(blob.header["round"], blob.header["task"], blob.header["model"],
                               tuple(map(str, selected)), weights.copy(), ctx, path,
                               None if deadline is None else float(deadline))
        plan = dataclasses.replace(site, rule=str(about["rule"]), options=dict(about["options"]),
                                   guard=GuardSettings(**about["guard"]), max_held_bytes=int(about["max_held_bytes"]),
                                   roster=frozenset(map(str, about["roster"])))
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as err:
        raise wire.WireError("site-open", f"a round's open the site cannot read: {type(err).__name__}: {err}"
                             ) from None
    return opening, plan


def heard_message(site: str, instance: str, heard: Heard) -> bytes:
    """The site's word on one update (its fields but its weights and attachments)."""
    fields: dict[str, Any] = {"site": site, "instance": instance, "device": heard.device, "round": heard.round}
    update = heard.update
    if update is not None:
        fields.update(task=update.task, model=update.model, num_samples=update.num_samples,
                      metrics=dict(update.metrics), label_counts=list(update.label_counts))
    else:  # refused whole before it was read: nothing of it is known but its device and round
        fields.update(task=0, model="", num_samples=0, metrics={})
    if heard.reason is not None:
        fields["reason"] = heard.reason
    return wire.encode("site-heard", **fields)


def read_heard(message: wire.Message) -> Heard:
    reason = message.get("reason")
    update = None if reason is not None and not message["model"] else Update(
        message["device"], message["round"], message["task"], message["model"], message["num_samples"],
        message["metrics"], np.empty(0, np.float32), tuple(message.get("label_counts", ())))
    return Heard(message["site"], message["device"], message["round"], reason, update)


def partial_blob(site: str, instance: str, number: int, part: PartialRound | None) -> wire.EncodedBlob:
    """A site's share of round `number` (None: it holds none)."""
    about: dict[str, Any] = {"sound": True, "used": [], "counters": {}, "from_devices": 0, "within_clip": 0,
                             "seconds": 0.0, "fold": None}
    attachments: dict[str, bytes] = {}
    if part is not None:
        about.update(sound=part.sound, counters=dict(part.counters), from_devices=part.from_devices,
                     within_clip=part.within_clip, seconds=part.seconds,
                     used=[[u.device, u.num_samples, dict(u.metrics)] for u in part.used])
        if part.fold is not None:
            numbers = {}
            for key, value in part.fold.state.items():
                if isinstance(value, np.ndarray):
                    attachments[STATE_KEY + key] = np.ascontiguousarray(value, "<f8").tobytes()
                else:
                    numbers[key] = value
            about["fold"] = {"rule": part.fold.rule, "size": part.fold.size, "devices": sorted(part.fold.devices),
                             "numbers": numbers}
        if part.result is not None:  # a holding rule's result over the site's updates
            about["result"] = {"device": part.result.device, "num_samples": part.result.num_samples}
            attachments[RESULT] = np.ascontiguousarray(part.result.weights, "<f4").tobytes()
    data, layout = wire.pack_attachments(b"", {"partial": msgpack.packb(about, use_bin_type=True), **attachments})
    return wire.encode_blob("site-partial", data, site=site, instance=instance, round=number, attachments=layout)


def read_partial(blob: wire.Blob, roster: frozenset[str], size: int) -> PartialRound:
    """A site's share as the coordinator merges it: WireError unless it is well formed, of the model's size, finite,
    and of the site's own devices (a site speaks for its devices only)."""
    attachments = blob.split(0)[1]
    try:
        about = msgpack.unpackb(bytes(attachments["partial"]), raw=False)
        used = tuple(Used(str(device), int(samples), _metrics(metrics)) for device, samples, metrics in about["used"])
        counters = {str(k): int(v) for k, v in about["counters"].items()}
        fold = None
        if about["fold"] is not None:
            spec = about["fold"]
            state: dict[str, Any] = {key: value for key, value in spec["numbers"].items()
                                     if isinstance(value, (int, float, bool))}
            for name, data in attachments.items():
                if name.startswith(STATE_KEY):
                    array = np.frombuffer(data, "<f8").copy()  # writable: the merge adds it to a tensor
                    if array.size != size or not np.isfinite(array).all():
                        raise ValueError(f"{name}: {array.size} values, or not finite, for a model of {size}")
                    state[name[len(STATE_KEY):]] = array
            fold = PartialFold(str(spec["rule"]), int(spec["size"]), frozenset(map(str, spec["devices"])), state)
        result = None
        if about.get("result") is not None:
            weights = np.frombuffer(attachments[RESULT], "<f4").copy()
            if weights.size != size or not np.isfinite(weights).all():
                raise ValueError(f"a result of {weights.size} values, or not finite, for a model of {size}")
            result = ClientUpdate(str(about["result"]["device"]), weights, int(about["result"]["num_samples"]))
        part = PartialRound(fold, bool(about["sound"]), used, counters, int(about["from_devices"]),
                            int(about["within_clip"]), float(about["seconds"]), result)
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as err:
        raise wire.WireError("site-partial", f"a site's share it cannot read: {type(err).__name__}: {err}") from None
    strangers = {u.device for u in used} - roster | (fold.devices - roster if fold is not None else set())
    if strangers or len(counters) > MAX_COUNTERS or any(n < 0 for n in counters.values()):
        raise wire.WireError("site-partial", f"a share naming devices not at its site ({sorted(strangers)[:3]}) or "
                                             f"counts that are not counts")
    return part


def _metrics(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                and not isinstance(v, bool) and math.isfinite(v)
                                                for k, v in metrics.items()):
        raise ValueError("an update's metrics are not names and finite numbers")
    return metrics


# --- the coordinator's side -----------------------------------------------------------------------

@dataclass
class _SiteState:
    roster: frozenset[str]
    instance: str | None = None  # the aggregator process that said it is up last (None: none yet)
    up: bool = False
    taken: set[str] = dataclasses.field(default_factory=set)  # the open round's updates its words said it took
    part: PartialRound | None = None  # its answer to the open round's close, once it came
    answered: bool = False


def site_subscriptions(fleet: str, names: list[str]) -> list[str]:
    """What the coordinator subscribes to for its sites: their aggregators' topics and their devices' relayed ones
    (`topics.via_site`)."""
    return [topics.site(fleet, name, kind) for name in names for kind in topics.SITE_SENDS] + [
        f"{topics.prefix(fleet)}/{topics.SITE}/{name}/{topics.FROM_DEVICE}/+/+" for name in names]


class Sites:
    """The coordinator's side of its sites (module docstring): per round `open`, `heard` as the sites' words come,
    `close`. It speaks over the coordinator's own connection (the central broker makes a client's id its username:
    a second connection of the coordinator's account would push the first out), whose loop hands it the sites'
    messages (`take`, on `site_subscriptions`) and whose message pump it runs while a close waits for the shares."""

    def __init__(self, link: Link, plan: SharePlan, sites: Mapping[str, frozenset[str]], close_s: float,
                 pump: Callable[[float], None], wait_s: float = 0.0) -> None:
        """`wait_s`: how long `start` waits for every site's aggregator to be up."""
        self.link = link
        self.plan = plan
        self.close_s = close_s
        self.wait_s = wait_s
        self.pump = pump
        self._sites = {name: _SiteState(frozenset(devices)) for name, devices in sites.items()}
        self._head = f"{topics.prefix(plan.fleet)}/{topics.SITE}/"
        self._reassembler = wire.Reassembler(max_blob_bytes=8 * plan.num_parameters + MAX_PARTIAL_EXTRA_BYTES)
        self._heard: deque[Heard] = deque()
        self._opening: RoundOpening | None = None
        self._closing: int | None = None
        self.counters: Counter[str] = Counter()  # refused site messages, by reason (taken into the round's at close)

    @property
    def pids(self) -> list[int]:
        return []  # the sites' processes run at the sites

    def start(self) -> None:
        """Wait (running the coordinator's pump) until every site's aggregator has said it is up, at most `wait_s`:
        the updates of a round opened before an aggregator first connected would find no session at its broker to
        keep them. A site still down then is warned about; its devices' updates wait at its broker from the
        aggregator's first connection on."""
        deadline = time.monotonic() + self.wait_s
        said = time.monotonic()
        while (down := sorted(name for name, site in self._sites.items() if not site.up)) and (
                left := deadline - time.monotonic()) > 0:
            if time.monotonic() - said > WAITING_SAID_EVERY_S:
                log.info("waiting for the aggregators of sites %s (%.0f s left)", ", ".join(down), left)
                said = time.monotonic()
            self.pump(min(left, 0.5))
        if down:
            log.warning("the aggregators of sites %s are not up: their devices' updates are not taken until they "
                        "are", ", ".join(down))

    def stop(self) -> None:
        """Nothing to stop (as `start`)."""

    def up(self, name: str) -> str | None:
        """The instance of site `name`'s aggregator that said last it is up; None while none is."""
        site = self._sites[name]
        return site.instance if site.up else None

    def open(self, opening: RoundOpening) -> None:
        """The round (or its next attempt) to every site."""
        if self._opening is None or self._opening.number != opening.number:
            for site in self._sites.values():
                site.taken, site.part, site.answered = set(), None, False
        self._opening, self._closing = opening, None
        for name in self._sites:
            self._send_opening(name, opening)

    def heard(self, timeout: float | None = None) -> Heard | None:
        """The next word of a site that `take` read (the coordinator's pump feeds them: no wait here)."""
        return self._heard.popleft() if self._heard else None

    def close(self, counters: Counter[str] | None = None) -> list[PartialRound | None]:
        """Each site's share of the open round, in site order: waited for from every site that is up, at most
        `close_s`; a site gone or silent has its share lost (None), and the updates a site said it took that are
        not in its share are counted lost."""
        opening = self._opening
        if opening is None:
            return []
        self._closing = opening.number
        for name in self._sites:
            self.link.publish(topics.site(self.plan.fleet, name, "close"),
                              wire.encode("site-close", round=opening.number))
        deadline = time.monotonic() + self.close_s
        while not all(site.answered or not site.up for site in self._sites.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.pump(min(left, 0.5))
        parts = []
        for name, site in self._sites.items():
            if not site.answered:
                log.warning("site %s %s at round %d's close: the %d updates it took are not in the model", name,
                            "is gone" if not site.up else f"did not answer within {self.close_s:.0f} s",
                            opening.number, len(site.taken))
                self.counters["site-lost"] += 1
            kept = {u.device for u in site.part.used} if site.part is not None else set()
            lost = site.taken - kept
            if lost and site.answered:
                log.warning("site %s: %d updates it took this round are not in its share (its aggregator "
                            "restarted): not in the model", name, len(lost))
            self.counters["site-share-lost"] += len(lost)
            parts.append(site.part)
        self._opening, self._closing = None, None
        if counters is not None:
            counters.update(+self.counters)
        self.counters.clear()
        return parts

    def _send_opening(self, name: str, opening: RoundOpening) -> None:
        blob = opening_blob(opening, self.plan, self._sites[name].roster)
        for frame in blob.frames:
            self.link.publish(topics.site(self.plan.fleet, name, "open"), frame)

    def relayed(self, topic: str) -> str | None:
        """The device's own topic of a message a site relayed for one of its devices (`topics.via_site`): None where
        `topic` is no such message (a site's own, `take`), "" where the device is not that site's (counted
        `site-stranger`: the central broker lets a site write anything under its prefix, and this is the check)."""
        relay = topics.relayed(self.plan.fleet, topic)
        if relay is None or relay[1].direction != topics.FROM_DEVICE:
            return None
        name, own = relay
        site = self._sites.get(name)
        if site is None or own.device is None or own.device not in site.roster:
            self.counters["site-stranger"] += 1
            log.warning("site %s relayed a message of %s, not one of its devices: refused", name, own.device)
            return ""
        return topics.from_device(self.plan.fleet, own.device, own.kind)

    def take(self, topic: str, payload: bytes | bytearray | memoryview) -> None:
        """One message on a site's topics (`site_subscriptions`); what cannot be used is counted and logged."""
        name, _, kind = topic[len(self._head):].partition("/")
        site = self._sites.get(name)
        if site is None or not payload:  # not a site of this coordinator's, or a retained state cleared
            return
        try:
            message = wire.decode(payload)
            expected = {"state": "site-state", "heard": "site-heard", "partial": "site-partial"}.get(kind)
            if message["kind"] != expected or message.get("site", name) != name:
                raise wire.WireError("site-topic", f"a {message['kind']} on {topic}")
            if kind == "state":
                self._on_state(name, message)
            elif kind == "heard":
                self._on_heard(name, read_heard(message))
            else:
                blob = self._reassembler.add(name, message)
                if blob is not None:
                    self._on_partial(name, blob)
        except wire.WireError as err:
            self.counters[err.reason] += 1
            log.warning("site %s: %s refused: %s", name, kind, err)

    def _on_state(self, name: str, message: wire.Message) -> None:
        site = self._sites[name]
        came = message["state"] == UP and (not site.up or site.instance != message["instance"])
        site.up, site.instance = message["state"] == UP, message["instance"]
        if came:
            log.info("site %s's aggregator is up (instance %s)", name, message["instance"])
            if self._opening is not None:  # the open round again, for a site that came (back) while it is open
                self._send_opening(name, self._opening)
            if self._closing is not None:
                self.link.publish(topics.site(self.plan.fleet, name, "close"),
                                  wire.encode("site-close", round=self._closing))
        elif message["state"] == GONE:
            log.warning("site %s's aggregator is gone", name)

    def _on_heard(self, name: str, heard: Heard) -> None:
        site = self._sites[name]
        if heard.device not in site.roster:
            raise wire.WireError("site-stranger", f"a word on {heard.device}, not a device of site {name}")
        if heard.reason is None:
            site.taken.add(heard.device)
        self._heard.append(heard)

    def _on_partial(self, name: str, blob: wire.Blob) -> None:
        site = self._sites[name]
        part = read_partial(blob, site.roster, self.plan.num_parameters)
        if blob.header["round"] != self._closing or blob.header["instance"] != site.instance:
            # an earlier round's (a restarted site answers the close its broker kept for it), or a process gone
            log.debug("site %s: a share of round %d passed over", name, blob.header["round"])
            return
        site.part = part if part.fold is not None or part.used or part.counters else None
        site.answered = True
