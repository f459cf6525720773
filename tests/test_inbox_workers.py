"""Inbox workers (coordinator/inbox_workers.py) through a real mosquitto: a round's updates shared among worker
processes by the broker, gathered, bounded and folded apart, merged at the close into the model one process makes."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from mqtt_helpers import Peer

from coordinator.aggregation import RoundAggregate
from coordinator.broker import Credentials, MosquittoBroker, mosquitto_path
from coordinator.containment import ContainedStrategy
from coordinator.guard_settings import GuardSettings
from coordinator.inbox_workers import InboxWorkers, RoundOpening, WorkerPlan, merged_into, owner
from coordinator.strategies import make_strategy
from edgefil import topics, wire
from edgefil.link import BrokerSettings

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
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
    plan = WorkerPlan(BrokerSettings(address.host, address.port, "coordinator", "pw-c"), FLEET,
                      frozenset(updates), MANIFEST, parameters, "fedavg", guard=guard)
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


@pytest.fixture
def broker(tmp_path):
    devices = {f"d{k}": f"pw-{k}" for k in range(12)}
    broker = MosquittoBroker(tmp_path, FLEET, devices, Credentials("coordinator", "pw-c"), inbox_workers=2)
    broker.start()
    yield broker
    broker.stop()


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
