"""A site's aggregator: the process that takes its devices' updates at the site and hands the coordinator one share
of each round (`edgefil site --config site.toml`; the protocol: coordinator/sites.py).

It connects to the site's broker with the site broker's coordinator account, in a persistent session (what its
devices send while it is down waits at the broker), says it is up on `site/<site>/state` (retained; its will says
"gone"), and then serves: a round's `open` builds or reuses its share (coordinator/round_share.py: the gate, the
round's checks, the guard's per-update bounds, the rule's fold, on this process's CPU), each update it takes or
refuses gets a word to the coordinator, and a `close` is answered with its share. Updates that come before it knows
of any round (a restart, with the persistent session's backlog ahead of the coordinator's open) are held, up to the
plan's `max_held_bytes`, and taken once a round opens: those of the open round count, the others are late.

The site's file (coordinator/config.py, `SiteConfig`): `fleet`, `site` (its name in the coordinator's
`[[sites]]`), `artifacts` (the fleet's model: the digest every update and round must match, its size and head rows)
and `[broker]` (the site's broker and its coordinator account). Everything about a round (the rule, the guard, the
roster) comes from the coordinator.
"""
from __future__ import annotations

import logging
import secrets

from coordinator.config import SiteConfig
from coordinator.influence import HeadLayout
from coordinator.round_share import Heard, RoundShare, SharePlan
from coordinator.sites import GONE, UP, heard_message, partial_blob, read_opening
from edgefil import topics, wire
from edgefil.link import CONNECTED, Link, Will
from models.manifest import load_manifest, manifest_digest

log = logging.getLogger("edgefil.site")
MAX_HELD_BEFORE_A_ROUND = 256 << 20  # update bytes held before the first round is known


class SiteAggregator:
    """One site's aggregator (module docstring): `run` until stopped."""

    def __init__(self, config: SiteConfig) -> None:
        self.config = config
        manifest = load_manifest(config.artifacts)
        self.manifest = manifest_digest(config.artifacts)
        # what the site knows itself; a round's open brings the rest (the rule, the guard, the roster)
        self.site = SharePlan(config.fleet, frozenset(), self.manifest, manifest.num_parameters, "fedavg",
                              heads=HeadLayout.of(manifest.parameters))
        self.instance = secrets.token_hex(8)
        fleet, site = config.fleet, config.site
        self._state_topic = topics.site(fleet, site, "state")
        self.link = Link(config.broker, client_id=f"{site}-aggregator",
                         subscriptions=[f"{topics.prefix(fleet)}/{topics.FROM_DEVICE}/+/update",
                                        *(topics.site(fleet, site, kind) for kind in topics.SITE_RECEIVES)],
                         will=Will(self._state_topic, self._state(GONE)), persistent=True)
        self.share: RoundShare | None = None
        # an open: the model (float32) and the fleet's path (two float64 arrays), and its plan and selection
        self._openings = wire.Reassembler(max_blob_bytes=20 * manifest.num_parameters + (64 << 20))
        self._early: list[tuple[str, bytes]] = []  # updates before any round (module docstring)
        self._early_bytes = 0
        self._stopping = False

    def _state(self, state: str) -> bytes:
        return wire.encode("site-state", site=self.config.site, instance=self.instance, state=state)

    def stop(self) -> None:
        self._stopping = True
        self.link.wake()

    def run(self, timeout: float = 60.0) -> None:
        self.link.start(timeout=timeout)
        try:
            if not self.link.wait_subscribed(timeout):
                raise TimeoutError("the site's broker did not acknowledge the subscriptions")
            self.link.publish(self._state_topic, self._state(UP), retain=True)
            log.info("site %s's aggregator is up (instance %s)", self.config.site, self.instance)
            try:
                while not self._stopping:
                    item = self.link.get(timeout=None)
                    if item is None:
                        continue
                    if item.topic == CONNECTED:  # (re)connected: say so again, the broker may have restarted
                        self.link.publish(self._state_topic, self._state(UP), retain=True)
                        continue
                    self.take(item.topic, item.payload)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where the command line turns it into one
                pass
            self.link.publish(self._state_topic, self._state(GONE), retain=True)
            self.link.wait_idle(timeout=5.0)
        finally:
            self.link.stop()

    def take(self, topic: str, payload: bytes | bytearray | memoryview) -> None:
        """One message: the coordinator's word to the site (a round's open or close; what cannot be used is said
        in one line and passed over), or a device's update."""
        kind = topic.rsplit("/", 1)[-1]
        if topic.startswith(f"{topics.prefix(self.config.fleet)}/{topics.SITE}/"):
            try:
                message = wire.decode(payload)
                if kind == "open" and message["kind"] == "site-open":
                    blob = self._openings.add("coordinator", message)
                    if blob is not None:
                        self._open(blob)
                elif kind == "close" and message["kind"] == "site-close":
                    self._close(message["round"])
                else:
                    raise wire.WireError("site-topic", f"a {message['kind']} on {topic}")
            except wire.WireError as err:
                log.warning("site %s: the coordinator's %s refused: %s", self.config.site, kind, err)
            except (ValueError, TypeError, KeyError) as err:  # a rule or guard this site's software cannot run
                log.error("site %s cannot run the coordinator's round: %s: %s (is its edgefil the coordinator's "
                          "version?)", self.config.site, type(err).__name__, err)
            return
        if self.share is None:
            if self._early_bytes + len(payload) <= MAX_HELD_BEFORE_A_ROUND:
                self._early.append((topic, bytes(payload)))
                self._early_bytes += len(payload)
            return
        self._say(self.share.take(topic, payload))

    def _say(self, heard: Heard | None) -> None:
        if heard is not None:
            self.link.publish(topics.site(self.config.fleet, self.config.site, "heard"),
                              heard_message(self.config.site, self.instance, heard))

    def _open(self, blob: wire.Blob) -> None:
        if blob.header["manifest"] != self.manifest:
            raise wire.WireError("manifest", f"the coordinator's model {blob.header['manifest'][:12]} is not this "
                                             f"site's artifacts' {self.manifest[:12]}")
        opening, plan = read_opening(blob, self.site)
        share = self.share if self.share is not None and self.share.plan == plan else RoundShare(plan, self.config.site)
        share.open(opening)  # (one this site cannot open leaves it as it was)
        self.share = share
        early, self._early, self._early_bytes = self._early, [], 0
        for topic, payload in early:
            self._say(self.share.take(topic, payload))

    def _close(self, number: int) -> None:
        part = self.share.close(number) if self.share is not None else None
        blob = partial_blob(self.config.site, self.instance, number, part)
        for frame in blob.frames:
            self.link.publish(topics.site(self.config.fleet, self.config.site, "partial"), frame)
        log.info("site %s: round %d's share sent (%d updates)", self.config.site, number,
                 len(part.used) if part is not None else 0)
