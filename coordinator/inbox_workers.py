"""Inbox workers: the coordinator's per-update work (the gate, the round's checks, the guard's bounds, the fold)
spread over processes, each folding a partial sum that the round merges at its close (issue 60).

One coordinator process spends about 2 ms of CPU on each update (docs/results.md, "Beyond one coordinator
process"): at 100,000 devices, minutes of one core a round. Here each worker is a process with an MQTT connection
of its own (the coordinator's account, a client id of its own) in one shared subscription to the devices' updates
(`topics.shared_updates`, MQTT 5's `$share`, which mosquitto 2 serves to 3.1.1 clients too): the broker hands each
message to one worker of the group, in turn. A blob of more than one chunk has to meet its other chunks in one
process, and the broker splits a device's chunks over the workers like any other messages; so a worker that gets a
chunk of such a blob passes it on to the device's own worker (`owner`: the CRC32 of its id modulo the workers) on
that worker's topic (`topics.to_inbox_worker`), unless it is that worker. Updates of one chunk (any model under
about 1 MB: LeNet's 124 KB) are taken where they land and cost no second trip.

A round, from the coordinator's side (`InboxWorkers`): `open` hands every worker the round (and waits until each
has it); each worker holds a `RoundShare` (coordinator/round_share.py: the gate, the round's checks, the guard's
per-update bounds and the rule's fold) of what it receives and says of each update whether it took it (`Heard`);
`close` asks each for its share (`PartialRound`), which the round's own aggregate merges. What a share changes
against one process, that module says; here besides:
- The guard's calibration reference (a mix of held-out samples the coordinator scores updates on) is not run in
  the workers: it needs the model and the samples there, which is the next step; a worker's round has none.
- A copy sent to two workers is not seen as one; a free rider or a far update still is, against its worker's
  median.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from coordinator.aggregation import PartialRound, RoundAggregate
from coordinator.broker import Credentials, inbox_worker_account
from coordinator.round_share import Heard, RoundOpening, RoundShare, SharePlan, folds
from coordinator.strategies import make_strategy
from edgefil import topics, wire
from edgefil.link import CONNECTED, BrokerSettings, Link
from edgefil.thread_names import NamedThread

log = logging.getLogger("edgefil.coordinator")
READY_S = 60.0  # how long a worker may take to start (spawn, imports) and subscribe


def owner(device: str, workers: int) -> int:
    """The worker that gathers `device`'s blobs of more than one chunk: the same in every worker and every run."""
    return zlib.crc32(device.encode()) % workers


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker of a coordinator is made with (it crosses into the worker's process)."""

    broker: BrokerSettings  # the coordinator's account: each worker connects as its own (`inbox_worker_account`)
    share: SharePlan


class WorkerLost(RuntimeError):
    """A worker's process ended while the coordinator waited for its answer."""


class InboxWorkers:
    """`count` worker processes sharing the fleet's updates (module docstring): `start`, then per round `open`,
    `heard` as updates come, `close`; `stop` at the end."""

    def __init__(self, plan: WorkerPlan, count: int, on_heard: Callable[[], None] | None = None) -> None:
        """`on_heard`: called (from a reader thread) as each word comes, to wake whoever waits for it elsewhere."""
        if count < 1:
            raise ValueError(f"inbox workers: at least 1, got {count}")
        if not folds(make_strategy(plan.share.rule, device="cpu", **plan.share.options)):
            raise ValueError(f"inbox workers: the {plan.share.rule} rule needs a round's updates all at once; only "
                             f"rules that fold spread over workers")
        self.plan = plan
        self.count = count
        self.on_heard = on_heard
        self._connections: list[Connection] = []
        self._processes: list[Any] = []
        self._replies: list[queue.Queue[Any]] = []  # what each worker answered besides its `Heard`s
        self._heard: queue.Queue[Heard] = queue.Queue()
        self.opened: int | None = None

    def start(self, timeout: float = READY_S) -> None:
        """Start the workers and wait until each is subscribed (the broker then shares the updates among them)."""
        for index in range(self.count):
            self._spawn(index)
        for index in range(self.count):
            self._reply(index, "ready", timeout)
        log.info("%d inbox workers take the devices' updates (processes %s)", self.count,
                 ", ".join(map(str, self.pids)))

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (what a benchmark reads their CPU time by)."""
        return [process.pid for process in self._processes]

    def open(self, opening: RoundOpening, timeout: float = READY_S) -> None:
        """The round (or its next attempt: the same number, whose shares so far stay) to every worker, returning
        once each has it open: the round's messages go to the devices after this, and an update that reached a
        worker before its opening would be refused as between rounds (seen on a busy host: the worker's pipe read
        after the broker's delivery). A worker that is gone or does not answer is left to the close, which counts
        its share lost and starts it anew."""
        for connection in self._connections:
            try:
                connection.send(("open", opening))
            except OSError:  # gone: its reader has said so (below)
                pass
        self.opened = opening.number
        for index in range(self.count):
            try:
                self._reply(index, "opened", timeout)
            except WorkerLost:
                pass  # the close finds it gone too
            except TimeoutError as err:
                log.warning("inbox worker %d: %s", index, err)

    def heard(self, timeout: float | None = None) -> Heard | None:
        """The next word of a worker on an update of the open round, or None after `timeout`."""
        try:
            return self._heard.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, counters: Counter[str] | None = None, timeout: float = READY_S) -> list[PartialRound | None]:
        """Each worker's share of the open round (its partial aggregate and counts), in worker order. A worker that
        is gone, or does not answer within `timeout`, has its share lost (None, counted as `inbox-worker-lost` in
        `counters`: the updates it took are not in the round's model) and is started anew for the next round."""
        for connection in self._connections:
            try:
                connection.send(("close", self.opened))
            except OSError:
                pass
        self.opened = None
        parts: list[PartialRound | None] = []
        for index in range(self.count):
            try:
                parts.append(self._reply(index, "partial", timeout))
            except (WorkerLost, TimeoutError) as err:
                log.warning("inbox worker %d is lost (%s): the updates it took this round are not in its model; "
                            "it starts anew", index, err)
                if counters is not None:
                    counters["inbox-worker-lost"] += 1
                parts.append(None)
                self._processes[index].kill()
                self._spawn(index)
                self._reply(index, "ready", timeout)
        return parts

    def _spawn(self, index: int) -> None:
        """Worker `index`'s process, its pipe and the thread that reads it (anew, where one was lost)."""
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads (paho's, torch's)
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, args=(self.plan, index, self.count, theirs),
                                  name=f"inbox-worker-{index}", daemon=True)
        process.start()
        theirs.close()
        replies: queue.Queue[Any] = queue.Queue()
        reader = NamedThread(target=self._read, args=(replies, ours), daemon=True,
                             name=f"inbox-worker-{index}-reader")
        reader.start()
        if index < len(self._processes):
            self._connections[index].close()
            self._connections[index], self._processes[index], self._replies[index] = ours, process, replies
        else:
            self._connections.append(ours)
            self._processes.append(process)
            self._replies.append(replies)

    def stop(self) -> None:
        for connection in self._connections:
            try:
                connection.send(("stop", None))
            except OSError:
                pass
        for process in self._processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
        for connection in self._connections:
            connection.close()
        self._connections, self._processes = [], []

    def _read(self, replies: queue.Queue[Any], connection: Connection) -> None:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                replies.put(("gone", None))
                return
            if isinstance(message, Heard):
                self._heard.put(message)
                if self.on_heard is not None:
                    self.on_heard()
            else:
                replies.put(message)

    def _reply(self, index: int, kind: str, timeout: float) -> Any:
        while True:
            try:
                got, value = self._replies[index].get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"inbox worker {index} did not answer {kind} within {timeout:.0f} s") from None
            if got != "opened" or kind == "opened":  # (an opening's answer after `open` stopped waiting: passed over)
                break
        if got == "gone":  # for good: said again to whoever waits next (`open` and then the close)
            self._replies[index].put((got, value))
            raise WorkerLost(f"its process ended (waiting for {kind})")
        if got != kind:
            raise RuntimeError(f"inbox worker {index}: {value if got == 'failed' else got} (waiting for {kind})")
        return value


class _Worker:
    """One worker: its round share, its MQTT connection, and the chunks it passes on to their device's worker."""

    def __init__(self, plan: WorkerPlan, index: int, count: int, connection: Connection) -> None:
        self.plan = plan
        self.index = index
        self.count = count
        self.connection = connection
        self.share = RoundShare(plan.share, str(index))
        fleet = plan.share.fleet
        self.passed_on = topics.to_inbox_worker(fleet, index, "x")[:-1]  # this worker's topic, less the device
        account = inbox_worker_account(Credentials(plan.broker.username or "", plan.broker.password or ""), index)
        settings = dataclasses.replace(plan.broker, username=account.username, password=account.password)
        self.link = Link(settings, account.username, [topics.shared_updates(fleet), self.passed_on + "+"],
                         max_queued=0)

    def take(self, topic: str, payload: bytes | bytearray | memoryview) -> None:
        """One message of the shared subscription or passed on to this worker."""
        fleet = self.plan.share.fleet
        if topic.startswith(self.passed_on):
            device = topic[len(self.passed_on):]
            if topics.NAME.fullmatch(device) is None:  # the gate would refuse its topic: refused here, alike
                self.share.inbox.reject("topic", f"{topic}: not a device's name")
                return
            topic = topics.from_device(fleet, device, "update")
        elif self.count > 1:  # a lone worker gathers every blob itself: no chunk's header read twice
            parsed = topics.parse(fleet, topic)
            if parsed is not None and parsed.device is not None and wire.chunks_of_blob(payload) > 1:
                gatherer = owner(parsed.device, self.count)
                if gatherer != self.index:
                    self.link.publish(topics.to_inbox_worker(fleet, gatherer, parsed.device), bytes(payload))
                    return
        heard = self.share.take(topic, payload)
        if heard is not None:
            self.connection.send(heard)


def serve(plan: WorkerPlan, index: int, count: int, connection: Connection) -> None:
    """A worker process's life: connect and subscribe, then take messages and the coordinator's word (a thread
    reads the pipe and wakes the loop) until told to stop."""
    torch.set_num_threads(1)  # one core a worker: the workers are the parallelism
    worker = _Worker(plan, index, count, connection)
    commands: queue.Queue[tuple[str, Any]] = queue.Queue()

    def read_commands() -> None:
        while True:
            try:
                command = connection.recv()
            except (EOFError, OSError):
                command = ("stop", None)
            commands.put(command)
            worker.link.wake()
            if command[0] == "stop":
                return

    try:
        worker.link.start()
        if not worker.link.wait_subscribed(READY_S):
            raise TimeoutError("the broker did not acknowledge the subscriptions")
    except Exception as err:  # the coordinator's start says why, in one line
        connection.send(("failed", f"{type(err).__name__}: {err}"))
        return
    NamedThread(target=read_commands, daemon=True, name="commands").start()
    connection.send(("ready", None))
    try:
        while True:
            item = worker.link.get(timeout=None)
            while not commands.empty():
                kind, value = commands.get()
                if kind == "stop":
                    return
                if kind == "open":
                    worker.share.open(value)
                    connection.send(("opened", value.number))
                elif kind == "close":
                    _drain(worker)
                    connection.send(("partial", worker.share.close(value)))
            if item is not None and item.topic != CONNECTED:
                worker.take(item.topic, item.payload)
    finally:
        worker.link.stop()


def _drain(worker: _Worker) -> None:
    """Take what has already arrived before a round's close is answered (a wake-up among it is passed over)."""
    for _ in range(worker.link.inbox.qsize()):
        item = worker.link.get(timeout=0)
        if item is not None and item.topic != CONNECTED:
            worker.take(item.topic, item.payload)


def merged_into(aggregate: RoundAggregate, parts: Sequence[PartialRound | None]) -> RoundAggregate:
    """The round's own aggregate with every worker's share folded in."""
    for part in parts:
        if part is not None:
            aggregate.merge(part)
    return aggregate

