"""Inbox workers (coordinator/inbox_workers.py) through a real mosquitto: a round's updates shared among worker
processes by the broker, gathered, bounded and folded apart, merged at the close into the model one process makes."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mqtt_helpers import Peer

from coordinator import guard_settings
from coordinator.aggregation import RoundAggregate
from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from coordinator.containment import ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.inbox_workers import InboxWorkers, WorkerPlan, merged_into, owner
from coordinator.round_share import RoundOpening, SharePlan
from coordinator.strategies import make_strategy
from edgefil import topics, wire
from edgefil.link import BrokerSettings

needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (scripts/test installs it)")
FLEET = "lab"
MODEL = "ab" * 32
MANIFEST = "m" * 64
HEARD_S = 60.0  # a ceiling for each update's word: it comes in milliseconds on a quiet host


def round_updates(parameters: int, devices: int, seed: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    """Honest-looking updates: one step, each device's own noise and sample count."""
    rng = np.random.default_rng(seed)
    step = rng.normal(0.0, 0.01, parameters)
    return {f"d{k}": ((step + rng.normal(0.0, 0.002, parameters)).astype(np.float32), int(rng.integers(5, 50)))
            for k in range(devices)}


def one_process(updates: dict[str, tuple[np.ndarray, int]], parameters: int, guard: GuardSettings) -> np.ndarray:
    from coordinator.strategies import ClientUpdate

    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters), guard,
                               np.zeros(parameters, np.float32), counters, 1 << 30)
    for device, (weights, samples) in sorted(updates.items()):
        aggregate.add(ClientUpdate(device, weights, samples))
    return aggregate.close().global_weights.numpy()


def run_round(broker: MosquittoBroker, workers: int, updates: dict[str, tuple[np.ndarray, int]], parameters: int,
              guard: GuardSettings) -> tuple[np.ndarray, list[str], Counter[str]]:
    address = broker.address
    plan = WorkerPlan(BrokerSettings(address.host, address.port, "coordinator", "pw-c"),
                      SharePlan(FLEET, frozenset(updates), MANIFEST, parameters, "fedavg", guard=guard))
    pool = InboxWorkers(plan, workers)
    pool.start()
    try:
        pool.open(RoundOpening(1, 0, MODEL, tuple(sorted(updates)), np.zeros(parameters, np.float32)))
        sender = Peer(address, "coordinator", "pw-c")
        sender.connect()
        chunks = {device: wire.encode_blob("update", wire.weights_bytes(weights), device=device, round=1, task=0,
                                           model=MODEL, num_samples=samples, attachments=[], label_counts=[],
                                           metrics={}).chunks
                  for device, (weights, samples) in updates.items()}
        interleaved = [(topics.from_device(FLEET, device, "update"), bytes(frames[index]))
                       for index in range(max(map(len, chunks.values())))
                       for device, frames in chunks.items() if index < len(frames)]
        sender.publish_all(interleaved)
        sender.close()
        heard = {}
        while len(heard) < len(updates):
            word = pool.heard(timeout=HEARD_S)
            assert word is not None, f"no word on {sorted(set(updates) - set(heard))}"
            heard[word.device] = word
        assert all(word.reason is None for word in heard.values()), heard
        parts = pool.close()
    finally:
        pool.stop()
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters), guard,
                               np.zeros(parameters, np.float32), counters, 1 << 30)
    merged = merged_into(aggregate, parts)
    taken = [len(part.used) for part in parts if part is not None]
    return merged.close().global_weights.numpy(), sorted(u.device for u in merged.used), Counter(
        {str(k): n for k, n in enumerate(taken)})


def publish_round(address, updates: dict[str, tuple[np.ndarray, int]], number: int) -> None:
    sender = Peer(address, "coordinator", "pw-c")
    sender.connect()
    sender.publish_all([(topics.from_device(FLEET, device, "update"), bytes(frame))
                        for device, (weights, samples) in updates.items()
                        for frame in wire.encode_blob("update", wire.weights_bytes(weights), device=device,
                                                      round=number, task=0, model=MODEL, num_samples=samples,
                                                      attachments=[], label_counts=[], metrics={}).chunks])
    sender.close()


def words_on(pool: InboxWorkers, devices: set[str]) -> dict[str, int]:
    """Which worker took each device's update (every one taken)."""
    taken = {}
    while len(taken) < len(devices):
        word = pool.heard(timeout=HEARD_S)
        assert word is not None, f"no word on {sorted(devices - set(taken))}"
        assert word.reason is None, word
        taken[word.device] = int(word.source)
    return taken


@pytest.fixture
def broker(tmp_path):
    devices = {f"d{k}": f"pw-{k}" for k in range(12)}
    broker = MosquittoBroker(tmp_path, FLEET, devices, Credentials("coordinator", "pw-c"), inbox_workers=2)
    broker.start()
    yield broker
    broker.stop()


@needs_mosquitto
@pytest.mark.parametrize("parameters", [20_000, 300_000], ids=["one-chunk", "two-chunks"])
def test_two_inbox_workers_aggregate_the_model_of_one(broker, parameters):
    """12 devices' updates through the shared subscription: with one worker and with two, every update is taken
    once and the merged model is the one process's (to float32 rounding); with two, both took a share. Updates of two
    chunks (300,000 values: 1.2 MB) meet in the worker that owns their device, whichever worker the broker gave
    each chunk to. The guard's per-update bounds judge only each update alone here, and the honest round passes
    them in either split."""
    guard = GuardSettings(norm_bound="off", sample_factor=0.0, free_rider_factor=0.0, krum_share=0.0)
    updates = round_updates(parameters, 12)
    expected = one_process(updates, parameters, guard)
    for workers in (1, 2):
        model, used, shares = run_round(broker, workers, updates, parameters, guard)
        assert used == sorted(updates)
        np.testing.assert_allclose(model, expected, rtol=1e-6, atol=1e-9)
        assert len(shares) == workers and all(n > 0 for n in shares.values())
    if parameters > 250_000:  # every device's blob was gathered by its owner
        owners = Counter(owner(device, 2) for device in updates)
        assert owners == Counter({int(k): n for k, n in shares.items()})


UNBOUNDED = dict(guard_settings.OFF)  # no bound changes an update: the model is the updates' mean, to compare


@needs_mosquitto
def test_a_coordinator_with_one_or_two_inbox_workers_aggregates_the_updates_it_received(tmp_path, export_artifacts):
    """A fleet (4 device processes) whose coordinator's updates go to one inbox worker, then to two: every round
    takes every device's update in both, and the last round's global model is FedAvg of the updates the devices
    sent in it (read off the broker by an observer allowed to read them), computed here in one process: what the
    workers' shares merge into is the one process's model, to float32 rounding. (Two fleets' devices do not train
    to the same bits, so the two runs' models are each compared with their own updates.) The coordinator's other
    messages (registrations, statuses) its own process hears as before."""
    from fleet_harness import CEILING_S, Fleet, fedavg_of_sent

    from coordinator.checkpoint import load_latest

    for workers in (1, 2):
        fleet = Fleet(tmp_path / f"workers-{workers}", export_artifacts("lenet", 10, (1, 8, 8)), n_devices=4,
                      coordinator_options={"inbox_workers": workers, "rounds_per_task": 2, "min_clients": 4,
                                           "train_tasks": 2, "guard": UNBOUNDED},
                      device_options={"policy": {"name": "random"}}, observer_reads_learning=True)
        try:
            fleet.start()
            observer = Peer(fleet.broker.address, "observer", fleet.observer_credentials.password)
            assert not observer.connect().is_failure
            observer.subscribe(f"{topics.prefix(fleet.fleet)}/{topics.FROM_DEVICE}/+/update")
            fleet.start_coordinator()
            assert fleet.wait_coordinator(timeout=CEILING_S) == 0, fleet.log_tail("coordinator")
            results = fleet.results()
            state, _ = load_latest(fleet.root / "run" / "checkpoint")
            sent = observer.received()
            observer.close()
        finally:
            fleet.stop()
        trained = [entry for entry in results["history"] if entry.get("trained", True)]
        assert len(trained) == 4 and all(sorted(entry["received"]) == fleet.devices for entry in trained)
        assert all(sorted(entry["metrics"]) == fleet.devices for entry in trained)  # every update in the model
        devices, expected = fedavg_of_sent(sent, trained[-1]["round"], state.weights.size)
        assert devices == fleet.devices
        np.testing.assert_allclose(state.weights, expected.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_what_the_workers_cannot_run_is_refused_in_one_line_each():
    """Inbox workers spread a folding rule's per-update work; what needs every update in one process is refused,
    each for its reason, and a rule that folds with nothing else in the way is not."""
    from coordinator.config import CoordinatorConfig
    from coordinator.round_share import shares_refused

    def workers_refused(*args):
        return shares_refused(*args, "inbox_workers = 0")

    fedavg = make_strategy("fedavg", device="cpu")
    assert workers_refused(fedavg, False, False, False) is None
    assert workers_refused(make_strategy("fedprox", device="cpu", mu=0.1), False, False, False) is None
    reasons = [workers_refused(fedavg, True, False, False), workers_refused(fedavg, False, True, False),
               workers_refused(fedavg, False, False, True),
               workers_refused(make_strategy("median", device="cpu"), False, False, False)]
    assert all(r is not None and "\n" not in r for r in reasons)
    assert [w in r for w, r in zip(("secure aggregation", "central DP", "reference", "median"), reasons)] == [True] * 4
    with pytest.raises(ValueError, match="inbox_workers"):
        CoordinatorConfig("lab", Path("out"), Path("art"), ("d0",), test_data=Path("t"), inbox_workers=-1)


@needs_mosquitto
def test_a_lost_worker_loses_its_share_of_the_round_alone_and_is_started_anew(broker):
    """A worker killed after it took its share: the round's close counts it lost, merges the other worker's share
    (FedAvg of exactly the updates that worker took), and the next round's updates are shared by both again."""
    parameters = 20_000
    address = broker.address
    updates = round_updates(parameters, 12)
    plan = WorkerPlan(BrokerSettings(address.host, address.port, "coordinator", "pw-c"),
                      SharePlan(FLEET, frozenset(updates), MANIFEST, parameters, "fedavg",
                                guard=GuardSettings(**guard_settings.OFF)))
    pool = InboxWorkers(plan, 2)
    pool.start()
    try:
        pool.open(RoundOpening(1, 0, MODEL, tuple(sorted(updates)), np.zeros(parameters, np.float32)))
        publish_round(address, updates, 1)
        taken = words_on(pool, set(updates))
        assert set(taken.values()) == {0, 1}
        pool._processes[1].kill()
        counters: Counter[str] = Counter()
        parts = pool.close(counters)
        assert parts[1] is None and parts[0] is not None and counters == {"inbox-worker-lost": 1}
        kept = {d: updates[d] for d, worker in taken.items() if worker == 0}
        np.testing.assert_allclose(merged(parts, parameters), one_process(kept, parameters, plan.share.guard), rtol=1e-6,
                                   atol=1e-9)
        again = round_updates(parameters, 12, seed=1)
        pool.open(RoundOpening(2, 0, MODEL, tuple(sorted(again)), np.zeros(parameters, np.float32)))
        publish_round(address, again, 2)
        assert set(words_on(pool, set(again)).values()) == {0, 1}
        assert all(part is not None for part in pool.close())
        pool._processes[0].kill()  # gone before a round's opening, which waits for every worker's answer:
        pool._processes[0].join()
        pool.open(RoundOpening(3, 0, MODEL, tuple(sorted(again)), np.zeros(parameters, np.float32)))
        assert list(pool._replies[0].queue) == [("gone", None)]  # its end kept for the close, which else would wait
        counters = Counter()
        assert pool.close(counters)[0] is None and counters == {"inbox-worker-lost": 1}  # not waited for, but lost
    finally:
        pool.stop()


def merged(parts, parameters: int) -> np.ndarray:
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters),
                               GuardSettings(**guard_settings.OFF), np.zeros(parameters, np.float32), counters,
                               1 << 30)
    return merged_into(aggregate, parts).close().global_weights.numpy()


def test_a_chunk_passed_on_under_a_name_no_device_has_is_refused_not_raised():
    """The workers' own topic (inbox/<k>/<device>) is the coordinator's accounts' alone; a message there whose
    device level is no device's name is refused as the gate refuses a bad topic, and the worker goes on."""
    import multiprocessing

    from coordinator.inbox_workers import _Worker

    ours, theirs = multiprocessing.Pipe()
    plan = WorkerPlan(BrokerSettings(username="coordinator", password="pw-c"),
                      SharePlan(FLEET, frozenset({"d0"}), MANIFEST, 100, "fedavg"))
    worker = _Worker(plan, 0, 1, theirs)
    worker.take(worker.passed_on + "d\u00e9vice", b"anything")
    assert worker.share.inbox.rejections == {"topic": 1}
    ours.close()
    theirs.close()
