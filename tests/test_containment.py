"""Nothing a learning method does, on its own or provoked by one device, can stop the coordinator
(coordinator/containment.py): an update the method cannot use is refused with a reason and the round goes on, a
rule that fails on a whole round loses that round, not the run, and a resumed run gets past the same device again.
The method-level checks run on a contained strategy; the runs go through a real mosquitto."""
from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostile_device import Answer, PoisoningDevice
from thread_fleet import FLEET, ThreadFederation

from coordinator.aggregation import RoundAggregate
from coordinator.broker import mosquitto_path
from coordinator.containment import METHOD_ERROR, RULE_FAILED, ContainedStrategy
from coordinator.guard import UpdateBounds
from coordinator.strategies import AggregateResult, ClientUpdate, RefusedUpdate, RoundContext, make_strategy
from coordinator.strategies.fedavg import FedAvg
from edge_client.policies.generator import GeneratorReplay
from models.generator_record import GeneratorRecord, attachment_name, encode_record
from models.generators import default_spec, sampler_size
from models.manifest import load_manifest, manifest_digest

SIZE = 50


class Failing(FedAvg):
    """Raises from whichever calls the test names (`failing`), as a method with a bug would."""

    name = "test-failing"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.failing: set[str] = set()

    def _maybe(self, call: str) -> None:
        if call in self.failing:
            raise KeyError(f"{call} has a bug")

    def inspect(self, update: ClientUpdate) -> None:
        self._maybe("inspect")
        if "bad" in update.attachments:
            raise RefusedUpdate("bad-payload", "the toy method refuses it")

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        self._maybe("configure")
        return {device: {"toy": 1} for device in devices}

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        self._maybe("answer")
        return {name: b"x" for name in names}

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = RoundContext()) -> AggregateResult:
        self._maybe("aggregate")
        result = super().aggregate(global_weights, updates, ctx)
        result.refused = {u.device: "toy-payload" for u in updates if "odd" in u.attachments}
        result.personalized = {u.device: torch.full((SIZE,), float("nan") if "nan" in u.attachments else 1.0)
                               for u in updates}
        return result

    def save(self, directory: Path) -> None:
        self._maybe("save")

    def load(self, directory: Path) -> None:
        self._maybe("load")


def update(device: str, **attachments: bytes) -> ClientUpdate:
    return ClientUpdate(device, np.full(SIZE, 1.0, np.float32), 10, attachments=attachments)


def test_every_call_into_a_method_is_contained_and_counted(tmp_path):
    counters: Counter[str] = Counter()
    rule = Failing(device="cpu")
    contained = ContainedStrategy(rule, counters)
    assert contained.inspect(update("d0")) is None
    assert contained.inspect(update("d0", bad=b"")) == "bad-payload"
    assert contained.configure(RoundContext(), "d0") == {"toy": 1} and contained.answer("d0", ["a"]) == {"a": b"x"}
    rule.failing = {"inspect", "configure", "answer", "save", "load"}
    assert contained.inspect(update("d0")) == METHOD_ERROR
    assert contained.configure(RoundContext(), "d0") == {} and contained.answer("d0", ["a"]) == {}
    contained.save(tmp_path)
    contained.load(tmp_path)
    assert counters == {"bad-payload": 1, METHOD_ERROR: 5}


def test_a_round_the_rule_fails_on_gives_no_result_and_one_updates_failure_is_that_updates():
    counters: Counter[str] = Counter()
    rule = Failing(device="cpu")

    def close(*updates: ClientUpdate) -> AggregateResult | None:
        aggregate = RoundAggregate(ContainedStrategy(rule, counters), UpdateBounds.only(), np.zeros(SIZE, np.float32),
                                   counters, 1 << 30)  # the rule alone: every bound off (these updates are copies)
        for u in updates:
            aggregate.add(u)
        return aggregate.close()

    result = close(update("d0", odd=b""), update("d1", nan=b""), update("d2"))
    assert result is not None and sorted(result.personalized) == ["d0", "d2"]  # d1's is not finite: dropped
    assert counters == {"toy-payload": 1, "personalized-nonfinite": 1}
    rule.failing = {"aggregate"}
    assert close(update("d0"), update("d1")) is None
    assert counters[RULE_FAILED] == 1
    assert close() is None  # no update at all: nothing to aggregate, the previous model stays


def test_a_fold_that_refuses_an_update_folds_the_rest():
    counters: Counter[str] = Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters),
                               UpdateBounds.only(), np.zeros(SIZE, np.float32), counters, 1 << 30)
    for u in (update("d0"), update("d0"), update("d1")):  # d0 twice: the fold refuses the second
        aggregate.add(u)
    result = aggregate.close()
    assert result is not None and [u.device for u in aggregate.used] == ["d0", "d1"]
    assert counters == {METHOD_ERROR: 1}


pytestmark_broker = pytest.mark.skipif(mosquitto_path() is None,
                                       reason="mosquitto is not installed (scripts/test installs it)")
GENERATORS = {"policy": {"name": "generator", "init_steps": 20, "transfer_steps": 5},
              "trainer": {"backend": "torch"}, "store": {"max_samples": 100}}
PFEDGRP = {"name": "pfedgrp", "weight_steps": 2, "replay_per_class": 10}


def hostile_records() -> list[tuple[str, dict[str, Any], int, float]]:
    """(name, spec, sampler length, value) of each record the hostile device sends, in turn: specs the fleet does
    not use (an unknown kind, a negative latent size, another input shape, a width of 30,000 that would cost 3.6 GB to
    build), a sampler shorter than its spec, and a well-formed generator whose samples are not finite (weights of
    +-1e30: its layers overflow, and inf - inf is NaN)."""
    good = default_spec("vae", (1, 8, 8))
    size = sampler_size(good)
    return [
        ("unknown-kind", {**good.to_dict(), "kind": "gan-9000"}, size, 0.01),
        ("negative-latent", {**good.to_dict(), "latent_dim": -4}, size, 0.01),
        ("short-sampler", good.to_dict(), 10, 0.01),
        ("width-30000", {**good.to_dict(), "width": 30_000}, size, 0.01),
        ("other-shape", {**good.to_dict(), "input_shape": [1, 28, 28]}, size, 0.01),
        ("exploding", good.to_dict(), size, 1e30),
    ]


def hostile_generators(round_: int, g: np.ndarray, rng: np.random.Generator) -> Answer:
    name, spec, length, value = hostile_records()[(round_ - 1) % len(hostile_records())]
    record = GeneratorRecord(label=0, spec=spec, precision="float32", auxiliary=None, trained_samples=10, steps=5,
                             sampler=np.resize(np.array([value, -value], np.float32), length))
    return Answer(name, g, 40, {attachment_name(0): encode_record(record)}, label_counts=(10,))


@contextmanager
def hostile_beside(federation: ThreadFederation, artifacts: Path,
                   answer: Callable[[int, np.ndarray, np.random.Generator], Answer]) -> Iterator[PoisoningDevice]:
    """The federation's spare account dev-x, run by a hostile device that answers each round with `answer`."""
    hostile = PoisoningDevice(federation.address, FLEET, "dev-x", federation.passwords["dev-x"],
                              manifest_digest(artifacts), load_manifest(artifacts).num_parameters, answer=answer)
    hostile.start()
    try:
        yield hostile
    finally:
        hostile.stop()
    assert not hostile.errors, hostile.errors


class StopAfter:
    """A coordinator's `progress` hook that stops the run (as Ctrl-C would) once `rounds` rounds are committed."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def __call__(self, entry: dict[str, Any]) -> None:
        if entry["round"] >= self.rounds:
            raise KeyboardInterrupt


def stopped_then_resumed(federation: ThreadFederation, strategy: dict[str, Any], stop_after: int,
                         **options: Any) -> dict[str, Any]:
    """Run the coordinator until round `stop_after` is committed, stop it, resume it to the end: its results."""
    first = federation.coordinator(strategy, **options)
    first.progress = StopAfter(stop_after)
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert json.loads((federation.root / "run" / "results.json").read_text())["outcome"] == "stopped"
    return federation.coordinator(strategy, resume=True, **options).run()


@pytestmark_broker
def test_hostile_generator_specs_are_refused_and_the_run_and_its_resume_complete(tmp_path, export_artifacts):
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    GeneratorReplay.export_artifacts(GENERATORS["policy"], artifacts)
    with ThreadFederation(tmp_path, artifacts, GENERATORS, tasks=3, spares=("dev-x",)) as federation, \
            hostile_beside(federation, artifacts, hostile_generators) as hostile:
        results = stopped_then_resumed(federation, PFEDGRP, stop_after=3, min_clients=2)
    assert results["outcome"] == "complete" and results["rounds_completed"] == 6
    assert sorted(hostile.sent.values()) == sorted(name for name, *_ in hostile_records())
    refused = [r for r, name in hostile.sent.items() if name != "exploding"]
    assert results["counters"]["generator"] == len(refused), results["counters"]
    for entry in results["history"]:  # the refused updates are not waited for, and never aggregated
        assert ("dev-x" in entry["received"]) == (entry["round"] not in refused), entry
        assert "refused" not in entry


@pytestmark_broker
def test_a_rule_that_fails_on_a_round_loses_that_round_not_the_run(tmp_path, export_artifacts):
    """`aggregate` raises on every even round: those rounds keep the previous model and count; the run completes,
    and so does its resume, which meets a failing round again."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))

    class EvenRoundsFail(FedAvg):
        name = "test-even-rounds-fail"
        calls = 0

        def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                      ctx: RoundContext = RoundContext()) -> AggregateResult:
            type(self).calls += 1
            if type(self).calls % 2 == 0:
                raise struct.error("a bug the method did not foresee")
            return super().aggregate(global_weights, updates, ctx)

    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=2) as federation:
        results = stopped_then_resumed(federation, {"name": EvenRoundsFail.name}, stop_after=2)
    assert results["outcome"] == "complete" and results["rounds_completed"] == 4
    assert results["counters"][RULE_FAILED] == 2
    history = {entry["round"]: entry for entry in results["history"]}
    assert [r for r, entry in history.items() if entry.get("refused") == RULE_FAILED] == [2, 4]
    assert history[2]["accuracy"] == history[1]["accuracy"]  # the same model, evaluated again


def nan_weights(round_: int, g: np.ndarray, rng: np.random.Generator) -> Answer:
    weights = g.copy()
    weights[::7] = np.nan
    return Answer("nan", weights)


@pytestmark_broker
def test_a_refused_update_is_not_waited_for_until_the_deadline(tmp_path, export_artifacts):
    """A selected device whose update the gate refuses (not finite) will not answer again: the round closes when
    the others have delivered. The deadline is an hour, so a round that waited for it would never end here."""
    artifacts = export_artifacts("lenet", 10, (1, 8, 8))
    device = {"policy": {"name": "random"}, "store": {"max_samples": 100}}
    with ThreadFederation(tmp_path, artifacts, device, tasks=1, spares=("dev-x",)) as federation, \
            hostile_beside(federation, artifacts, nan_weights) as hostile:
        results = federation.coordinator({"name": "fedavg"}, min_clients=2, deadline_s=3600.0).run()
    assert results["outcome"] == "complete" and len(hostile.sent) == results["rounds_completed"] == 2
    assert results["counters"]["weights-nonfinite"] == 2 and "missed-deadline" not in results["counters"]


def test_a_background_job_that_fails_gives_no_result_and_the_next_one_runs():
    from coordinator.background import BackgroundJob

    job: BackgroundJob[int] = BackgroundJob("test")

    def fails(deadline):
        raise RuntimeError("reconstruction blew up")

    assert job.start(fails, budget_s=10.0) and job.wait(30)
    assert job.take() is None and job.failures == 1
    assert job.start(lambda deadline: 7 if deadline.left() > 0 else -1, budget_s=10.0) and job.wait(30)
    assert job.take() == 7 and job.take() is None  # once
