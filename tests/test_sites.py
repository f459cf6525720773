"""Sites (coordinator/sites.py, coordinator/site_aggregator.py) through real mosquitto processes: a central broker,
a broker per site bridged to it, and a site aggregator process at each; a round's updates folded at their sites and
merged at the coordinator into the model one process folds from the same updates; a site's aggregator killed and
restarted."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fleet_harness import CEILING_S, ROOT, Fleet, fedavg_of_sent, write_toml
from mqtt_helpers import Peer
from test_inbox_workers import UNBOUNDED, merged, one_process

from coordinator import guard_settings
from coordinator.aggregation import RoundAggregate
from coordinator.broker import Bridge, Credentials, MosquittoBroker, Site, mosquitto_path
from coordinator.containment import ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.inbox_workers import merged_into
from coordinator.round_share import RoundOpening, SharePlan
from coordinator.sites import Sites, opening_blob, partial_blob, read_partial, site_subscriptions
from coordinator.strategies import ClientUpdate, make_strategy
from edgefil import topics, wire
from edgefil.link import CONNECTED, BrokerSettings, Link
from models.manifest import load_manifest, manifest_digest

needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"
MODEL = "cd" * 32
HEARD_S = 120.0  # a ceiling for each update's word across a bridge: it comes in milliseconds on a quiet host
OFF = GuardSettings(**guard_settings.OFF)
SITES = {"a": ("d0", "d1", "d2"), "b": ("d3", "d4")}


def fedavg(updates: dict[str, tuple[np.ndarray, int]], parameters: int) -> np.ndarray:
    """What one process folds from `updates` (FedAvg, the guard off)."""
    return one_process(updates, parameters, OFF)


class SiteTier:
    """A central mosquitto, a bridged one per site and an aggregator process at each (`edgefil site`)."""

    def __init__(self, root: Path, artifacts: Path) -> None:
        self.root, self.artifacts = root, artifacts
        devices = [d for members in SITES.values() for d in members]
        self.accounts = {name: Credentials(f"site-{name}", f"pw-site-{name}") for name in SITES}
        self.central = MosquittoBroker(root / "central", FLEET, {d: f"pw-{d}" for d in devices},
                                       Credentials("coordinator", "pw-c"),
                                       sites=[Site(name, self.accounts[name])
                                              for name, members in SITES.items()])
        self.brokers: dict[str, MosquittoBroker] = {}
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.central.start()
        address = self.central.address
        for name, members in SITES.items():
            broker = self.brokers[name] = MosquittoBroker(
                self.root / f"site-{name}", FLEET, {d: f"pw-{d}" for d in members},
                Credentials("coordinator", f"pw-agg-{name}"),
                bridge=Bridge(name, address.host, address.port, self.accounts[name]))
            broker.start()
            self.start_site(name)

    def start_site(self, name: str) -> None:
        address = self.brokers[name].address
        config = write_toml(self.root / f"site-{name}.toml", {
            "fleet": FLEET, "site": name, "artifacts": str(self.artifacts),
            "broker": {"host": address.host, "port": address.port, "password": f"pw-agg-{name}"}})
        log = open(self.root / f"site-{name}.log", "ab")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "edgefil.cli", "site", "--config", str(config)],
                                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, name: str) -> None:
        self.processes[name].kill()
        self.processes[name].wait()

    def publish(self, updates: dict[str, tuple[np.ndarray, int]], number: int) -> None:
        """Each update on its site's broker, as its device sends it."""
        for name, members in SITES.items():
            for device in members:
                weights, samples = updates[device]
                sender = Peer(self.brokers[name].address, device, f"pw-{device}")
                sender.connect()
                sender.publish_all([(topics.from_device(FLEET, device, "update"), bytes(frame))
                                    for frame in wire.encode_blob(
                                        "update", wire.weights_bytes(weights), device=device, round=number, task=0,
                                        model=MODEL, num_samples=samples, attachments=[], label_counts=[],
                                        metrics={}).frames])
                sender.close()

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        for broker in self.brokers.values():
            broker.stop()
        self.central.stop()

    def log_tail(self, name: str) -> str:
        return "\n".join((self.root / f"site-{name}.log").read_text(errors="replace").splitlines()[-30:])


@contextlib.contextmanager
def site_tier(root: Path, artifacts: Path, rule: str) -> Iterator[tuple[SiteTier, Coordinator]]:
    """The site tier started, and the coordinator's side of it connected once every site's aggregator is up."""
    tier = SiteTier(root, artifacts)
    tier.start()
    plan = SharePlan(FLEET, frozenset(d for members in SITES.values() for d in members), manifest_digest(artifacts),
                     load_manifest(artifacts).num_parameters, rule, guard=OFF)
    coordinator = Coordinator(tier.central.address, plan)
    try:
        coordinator.link.start()
        coordinator.up = {name: coordinator.until_up(name, None) for name in SITES}
        yield tier, coordinator
    finally:
        coordinator.link.stop()
        tier.stop()


def updates_of(parameters: int, seed: int) -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    step = rng.normal(0.0, 0.01, parameters)
    return {d: ((step + rng.normal(0.0, 0.002, parameters)).astype(np.float32), int(rng.integers(5, 50)))
            for members in SITES.values() for d in members}


class Coordinator:
    """The coordinator's side of the sites, as its round loop drives them: its connection, and its message pump
    handing the sites' messages on."""

    def __init__(self, address, plan: SharePlan) -> None:
        self.link = Link(BrokerSettings(address.host, address.port, "coordinator", "pw-c"), "coordinator",
                         site_subscriptions(FLEET, list(SITES)))
        self.sites = Sites(self.link, plan, {name: frozenset(members) for name, members in SITES.items()},
                           HEARD_S, self.pump)
        self.up: dict[str, str] = {}  # each site's aggregator's instance, once up

    def pump(self, timeout: float) -> None:
        item = self.link.get(timeout=max(timeout, 0.0))
        if item is not None and item.topic != CONNECTED:
            self.sites.take(item.topic, item.payload)

    def open(self, opening: RoundOpening, tier: SiteTier) -> None:
        """The round to every site, and until it has crossed each site's bridge: a round message sent after it has
        reached a device at each site's broker (one bridge connection, in order), so what the test's devices then
        send comes after the opening at the site's aggregator, as in a fleet, where a device sends its update only
        once its round message has come. Unwaited, an update sent straight to a site's broker could overtake the
        opening on its way over the bridge and be refused as between rounds."""
        self.sites.open(opening)
        for name, members in SITES.items():
            device = members[0]
            peer = Peer(tier.brokers[name].address, device, f"pw-{device}")
            assert not peer.connect().is_failure
            try:
                peer.subscribe(topics.to_device(FLEET, device, "round"))
                self.link.publish(topics.via_site(FLEET, name, topics.TO_DEVICE, device, "round"),
                                  f"round {opening.number}".encode())  # read by this peer alone
                peer.expect(topics.to_device(FLEET, device, "round"), HEARD_S)
            finally:
                peer.close()

    def words(self, devices: set[str]) -> dict[str, str]:
        """Which site took each device's update (every one taken)."""
        taken: dict[str, str] = {}
        deadline = time.monotonic() + HEARD_S
        while len(taken) < len(devices) and time.monotonic() < deadline:
            self.pump(0.1)
            while (word := self.sites.heard()) is not None:
                assert word.reason is None, word
                taken[word.device] = word.source
        assert len(taken) == len(devices), f"no word on {sorted(devices - set(taken))}"
        return taken

    def until_up(self, name: str, instance: str | None) -> str:
        """Until site `name`'s aggregator has said it is up, as another process than `instance`: the one that did."""
        deadline = time.monotonic() + HEARD_S
        while time.monotonic() < deadline:
            self.pump(0.1)
            up = self.sites.up(name)
            if up is not None and up != instance:
                return up
        raise AssertionError(f"site {name}'s aggregator did not come up")


@needs_mosquitto
def test_two_sites_merge_into_the_model_of_one_process_and_a_killed_site_loses_its_share_alone(tmp_path,
                                                                                              export_artifacts):
    """Five devices' updates sent to their sites' brokers (three at one, two at the other): each site's
    aggregator takes its own, the coordinator hears a word on each across the bridge, and the two shares merge
    into the model one process folds from the same updates (to float32 rounding). Then a site's aggregator is killed
    after it took its round's updates: that round's close counts its share lost and merges the other's (the model
    of the other site's updates alone); restarted, it takes the next round's updates, some sent while it was down
    (its session at its broker kept them)."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    parameters = load_manifest(artifacts).num_parameters
    with site_tier(tmp_path, artifacts, "fedavg") as (tier, coordinator):
        sites = coordinator.sites
        everyone = tuple(sorted(coordinator.sites.plan.roster))
        updates = updates_of(parameters, 0)
        coordinator.open(RoundOpening(1, 0, MODEL, everyone, np.zeros(parameters, np.float32)), tier)
        tier.publish(updates, 1)
        taken = coordinator.words(set(updates))
        assert taken == {d: name for name, members in SITES.items() for d in members}
        counters: Counter[str] = Counter()
        parts = sites.close(counters)
        assert all(part is not None for part in parts) and not counters, (counters, tier.log_tail("a"))
        np.testing.assert_allclose(merged(parts, parameters), fedavg(updates, parameters), rtol=1e-6, atol=1e-9)

        updates = updates_of(parameters, 1)
        coordinator.open(RoundOpening(2, 0, MODEL, everyone, np.zeros(parameters, np.float32)), tier)
        tier.publish(updates, 2)
        coordinator.words(set(updates))
        tier.kill("a")
        parts = sites.close(counters)
        assert parts[0] is None and parts[1] is not None
        assert counters == {"site-lost": 1, "site-share-lost": len(SITES["a"])}
        np.testing.assert_allclose(merged(parts, parameters),
                                   fedavg({d: updates[d] for d in SITES["b"]}, parameters), rtol=1e-6, atol=1e-9)

        updates = updates_of(parameters, 2)
        coordinator.open(RoundOpening(3, 0, MODEL, everyone, np.zeros(parameters, np.float32)), tier)
        tier.publish(updates, 3)  # site a's wait at its broker for its aggregator
        tier.start_site("a")
        coordinator.until_up("a", coordinator.up["a"])
        coordinator.words(set(updates))
        counters.clear()
        parts = sites.close(counters)
        assert all(part is not None for part in parts) and not counters, counters
        np.testing.assert_allclose(merged(parts, parameters), fedavg(updates, parameters), rtol=1e-6, atol=1e-9)


@needs_mosquitto
def test_a_robust_rule_runs_at_each_site_and_again_over_the_sites_results(tmp_path, export_artifacts):
    """The median with sites: each site's aggregator takes the median of its devices' updates (three at one site,
    two at the other), and the round's model is the median of those two results (here their mean), with every
    device's update in the round's record: what one process computes from the same updates, per site then over the
    sites."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    parameters = load_manifest(artifacts).num_parameters
    updates = updates_of(parameters, 3)
    with site_tier(tmp_path, artifacts, "median") as (tier, coordinator):
        coordinator.open(RoundOpening(1, 0, MODEL, tuple(sorted(updates)), np.zeros(parameters, np.float32)), tier)
        tier.publish(updates, 1)
        coordinator.words(set(updates))
        parts = coordinator.sites.close()
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("median", device="cpu"), counters), OFF,
                               np.zeros(parameters, np.float32), counters, 1 << 30)
    merged = merged_into(aggregate, parts)
    model = merged.close().global_weights.numpy()
    assert sorted(u.device for u in merged.used) == sorted(updates)
    per_site = [np.median(np.stack([updates[d][0] for d in members]), axis=0) for members in SITES.values()]
    np.testing.assert_allclose(model, np.mean(per_site, axis=0), rtol=1e-6, atol=1e-8)
    assert [part.result.num_samples for part in parts] == [sum(updates[d][1] for d in members)
                                                           for members in SITES.values()]


def test_a_share_that_names_another_sites_device_or_is_not_finite_is_refused():
    """A site speaks for its own devices: a share that names another's, or whose sum is not finite or of another
    model's size, is refused with the wire's one reason; a well-formed one reads back as it was sent."""
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters), OFF,
                               np.zeros(4, np.float32), counters, 1 << 30)
    aggregate.add(ClientUpdate("d0", np.ones(4, np.float32), 3))
    part = aggregate.partial()

    def sent(part_) -> wire.Blob:
        reassembler = wire.Reassembler(1 << 20)  # a fresh one: a blob it has delivered once it passes over
        blob = partial_blob("a", "i", 1, part_)
        return next(b for frame in blob.chunks if (b := reassembler.add("a", wire.decode(frame))) is not None)

    back = read_partial(sent(part), frozenset({"d0"}), 4)
    assert back.fold is not None and back.fold.devices == {"d0"} and [u.device for u in back.used] == ["d0"]
    np.testing.assert_array_equal(back.fold.state["sum"], part.fold.state["sum"])
    with pytest.raises(wire.WireError, match="not at its site"):
        read_partial(sent(part), frozenset({"d1"}), 4)
    with pytest.raises(wire.WireError, match="site-partial"):
        read_partial(sent(part), frozenset({"d0"}), 5)
    state = dict(part.fold.state, sum=np.full(4, np.nan))
    with pytest.raises(wire.WireError, match="not finite"):
        read_partial(sent(replace(part, fold=replace(part.fold, state=state))), frozenset({"d0"}), 4)


@needs_mosquitto
def test_a_fleet_with_two_sites_aggregates_what_its_devices_sent_and_survives_a_sites_restart(tmp_path,
                                                                                             export_artifacts):
    """Five device processes: two at site a, two at site b (each connected to its site's broker, bridged to the
    central one), one at the central broker. A site's aggregator is killed after the first round and started again;
    the run completes, the rounds after the restart take every device's update, and the last round's global model
    is FedAvg of the updates the devices sent in it (read off the three brokers by observers allowed to read them),
    computed here in one process: what the sites' shares and the coordinator's own fold merge into is the flat
    fleet's model, to float32 rounding. The devices beat once an hour, so a round whose last message is a site's
    word closes on that word: none comes after it to carry it in (a round then lost the update at its deadline)."""
    from coordinator.checkpoint import load_latest

    fleet = Fleet(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)), n_devices=5, sites={"a": (0, 1), "b": (2, 3)},
                  coordinator_options={"rounds_per_task": 2, "min_clients": 3, "train_tasks": 2, "guard": UNBOUNDED},
                  device_options={"policy": {"name": "random"}, "heartbeat_s": 3600.0}, observer_reads_learning=True)
    observers: list[Peer] = []
    try:
        fleet.start()
        fleet.wait_online()  # (its observer first: an observer's own id is its name, so one at a time)
        for broker in (fleet.broker, *fleet.site_brokers.values()):
            observer = Peer(broker.address, "observer", fleet.observer_credentials.password)
            assert not observer.connect().is_failure
            observer.subscribe(f"{topics.prefix(fleet.fleet)}/{topics.FROM_DEVICE}/+/update")
            observers.append(observer)
        fleet.start_coordinator()
        fleet.wait_rounds(1, CEILING_S)
        fleet.kill("site-a")
        fleet.start_site("a")
        assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
        results = fleet.results()
        state, _ = load_latest(fleet.root / "run" / "checkpoint")
        sent = [message for observer in observers for message in observer.received()]
    finally:
        for observer in observers:
            observer.close()
        fleet.stop()
    trained = [entry for entry in results["history"] if entry.get("trained", True)]
    assert len(trained) == 4
    assert all(set(entry["metrics"]) <= set(entry["received"]) for entry in trained)
    for entry in trained[2:]:  # after the restart
        assert sorted(entry["received"]) == fleet.devices and sorted(entry["metrics"]) == fleet.devices, entry
    assert "site a's aggregator is up" in fleet.log_tail("coordinator", lines=10_000)
    devices, expected = fedavg_of_sent(sent, trained[-1]["round"], state.weights.size)
    assert devices == fleet.devices
    np.testing.assert_allclose(state.weights, expected.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_what_sites_cannot_run_and_a_bad_sites_table_are_refused_in_one_line(tmp_path, export_artifacts):
    """A device at two sites, or at a site and not on the roster, is refused where the file is read; so is a site
    aggregator's file with a typo; a robust rule that needs a round's updates all at once runs per site but is
    refused with inbox workers, and a rule that reads more than the weights (pFedGRP) is refused with sites too
    (`shares_refused`, naming the setting that keeps the round in one process)."""
    from coordinator.config import CoordinatorConfig, SiteConfig, SiteDevices
    from coordinator.round_share import shares_refused
    from edgefil.settings import ConfigError

    def config(*sites: SiteDevices) -> CoordinatorConfig:
        return CoordinatorConfig("lab", Path("out"), Path("art"), ("d0", "d1"), test_data=Path("t"), sites=sites)

    assert config(SiteDevices("a", ("d0",)), SiteDevices("b", ("d1",))).sites[1].devices == ("d1",)
    with pytest.raises(ValueError, match="two sites"):
        config(SiteDevices("a", ("d0",)), SiteDevices("b", ("d0",)))
    with pytest.raises(ValueError, match="not on the roster"):
        config(SiteDevices("a", ("d9",)))
    with pytest.raises(ValueError, match="site name"):
        SiteDevices("a/b", ("d0",))
    (tmp_path / "site.toml").write_text('fleet = "lab"\nsite = "a"\nartifacts = "art"\nbrokr = {}\n')
    with pytest.raises(ConfigError, match="brokr") as refused:
        SiteConfig.load(tmp_path / "site.toml")
    assert "\n" not in str(refused.value)
    median = make_strategy("median", device="cpu")
    assert shares_refused(median, False, False, False, "no [[sites]]", per_share=True) is None  # runs per site
    reason = shares_refused(median, False, False, False, "inbox_workers = 0")
    assert reason is not None and "median" in reason and "inbox_workers = 0" in reason and "\n" not in reason
    manifest = load_manifest(export_artifacts("lenet", 10, (1, 8, 8)))
    pfedgrp = make_strategy("pfedgrp", device="cpu", manifest=manifest)  # per-device models: not per site
    reason = shares_refused(pfedgrp, False, False, False, "no [[sites]]", per_share=True)
    assert reason is not None and "pfedgrp" in reason and "\n" not in reason


SITES_FLEET = {  # the guard off: every update the sites took is in the model, which the test checks
    "name": "sites", "out": "run", "devices": 4, "sites": 2, "model": "lenet", "seed": 0, "broker": "mosquitto",
    "scenario": {"preset": "digits-class", "n_clients": 4, "seed": 0}, "policy": {"name": "random"},
    "client": {"epochs": 2},
    "coordinator": {"rounds_per_task": 2, "min_clients": 4, "train_tasks": 2, "guard": dict(guard_settings.OFF)},
}


@needs_mosquitto
def test_a_simulated_fleet_runs_its_devices_at_sites(tmp_path):
    """`sites = 2` in a fleet file: each site a mosquitto bridged to the fleet's and an aggregator process, the
    devices split over them; every round takes every device's update through its site, and the sites' logs say
    they sent their shares."""
    from fleet_harness import run_fleet_file

    from edgefil.settings import dump_toml

    results = run_fleet_file(tmp_path, dump_toml(SITES_FLEET))
    trained = [entry for entry in results["history"] if entry.get("trained", True)]
    devices = sorted(f"dev-{k:03d}" for k in range(4))
    assert len(trained) == 4
    assert all(sorted(entry["received"]) == devices and sorted(entry["metrics"]) == devices for entry in trained)
    assert not {"site-lost", "site-share-lost"} & set(results["counters"])
    for site in ("site-0", "site-1"):
        assert "share sent (2 updates)" in (tmp_path / "run" / "logs" / f"{site}.log").read_text()


def test_a_sites_aggregator_holds_updates_until_a_round_and_passes_over_what_it_cannot_run(tmp_path, export_artifacts,
                                                                                           caplog):
    """Without a broker: an update that comes before any round (a restarted site's backlog) is held and taken once
    the round opens; an open that is not a message, or names a rule this site's software does not have, is said in
    one line and passed over (the site goes on, its share of that round empty)."""
    from coordinator.config import SiteConfig
    from coordinator.site_aggregator import SiteAggregator

    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    parameters = load_manifest(artifacts).num_parameters
    site = SiteAggregator(SiteConfig(FLEET, "a", artifacts))
    said = []
    site._say = said.append  # the words it would publish
    weights, samples = updates_of(parameters, 4)["d0"]
    update = wire.encode_blob("update", wire.weights_bytes(weights), device="d0", round=1, task=0, model=MODEL,
                              num_samples=samples, attachments=[], label_counts=[], metrics={}).chunks[0]
    site.take(topics.from_device(FLEET, "d0", "update"), update)
    assert site.share is None and said == []

    def opening(rule: str) -> bytes:
        plan = SharePlan(FLEET, frozenset(SITES["a"]), manifest_digest(artifacts), parameters, rule, guard=OFF)
        blob = opening_blob(RoundOpening(1, 0, MODEL, SITES["a"], np.zeros(parameters, np.float32)), plan,
                            frozenset(SITES["a"]))
        return blob.chunks[0]

    site.take(topics.site(FLEET, "a", "open"), b"\x00 not a message")
    site.take(topics.site(FLEET, "a", "open"), opening("no-such-rule"))
    assert site.share is None and "cannot run the coordinator's round" in caplog.text
    site.take(topics.site(FLEET, "a", "open"), opening("fedavg"))
    assert [(word.device, word.reason) for word in said] == [("d0", None)]
    part = site.share.close(1)
    assert [u.device for u in part.used] == ["d0"]
    site.link.stop()


def test_a_sites_relayed_message_is_its_devices_own_and_a_strangers_is_refused():
    """The central broker lets a site's bridge write anything under its prefix; the coordinator takes a message
    relayed there as its device's own only where the device is that site's (else counted `site-stranger`), and a
    site's own topics and other topics are not relays."""
    plan = SharePlan(FLEET, frozenset({"d0", "d1"}), MODEL, 4, "fedavg")
    sites = Sites(Link(BrokerSettings(), "unstarted"), plan, {"a": frozenset({"d0"}), "b": frozenset({"d1"})}, 1.0,
                  lambda _: None)
    assert sites.relayed(topics.via_site(FLEET, "a", topics.FROM_DEVICE, "d0", "status")) == \
        topics.from_device(FLEET, "d0", "status")
    assert sites.relayed(topics.via_site(FLEET, "a", topics.FROM_DEVICE, "d1", "register")) == ""
    assert sites.relayed(topics.via_site(FLEET, "c", topics.FROM_DEVICE, "d0", "status")) == ""
    assert sites.counters["site-stranger"] == 2
    assert sites.relayed(topics.site(FLEET, "a", "heard")) is None
    assert sites.relayed(topics.from_device(FLEET, "d0", "status")) is None
