"""The coordinator's round loop: runs the rounds of every task over MQTT, aggregates, evaluates and checkpoints.

One thread does all protocol work, in the order messages arrive (the link's inbox): a round is opened by
publishing the global weights to every device and a round message to each selected one, then collected until
every selected device has answered or the deadline passes. Every payload goes through the inbox gate first;
only validated updates of the open round reach the strategy. After aggregation the global model is evaluated
on every task seen so far, the run state is checkpointed atomically, then the run's files are rewritten.

What the loop leans on, each in its own module: who is in the fleet and in what state (`roster.py`), what is sent
to the devices and held for them between rounds (`outbox.py`), the checkpoint's generations (`checkpoint.py`), the
record every reader reads (`run_record.py`) and the files written from it (`run_logs.py`: results.json,
metrics.csv, the TensorBoard log, live.json for the dashboard), and whoever takes a round's updates besides this
process (`round_share.py`: inbox workers, `inbox_workers.py`; sites, `sites.py`), whose words on each update count
its deliveries and whose shares the close merges.

Choices: the first round after a start or a resume waits up to `wait_for_devices_s` for the whole roster (so the first
selection sees every device that is coming); later rounds only wait while fewer than the quorum are online. In virtual
time (simulated fleets) the wall clock is a safeguard only (`wall_limit_s`): the first round waits for the whole roster,
and a round for every device it selected, however busy the host. A device that (re)registers while selected for the open
round without having delivered gets the round's weights and message again on its own topics (after a broker restart, or
its own restart), at most `resends_per_round` times. A device that reports it cannot train (status "error") is not
waited for; its reason is logged, counted ("device-error") and kept per device in `results.json`. A device that holds no
data yet (one that joins a later task: status "no-data") stays connected and gets every global model, but is not
selected for the task it said so of (its status names it); from the next task on it is selected again, so one that joins
there trains from the task's first round; selected where it still holds nothing, or before it could say so, it is not
waited for ("no-data" for that round, counted). In virtual time every round names its start on the fleet's clock
(`clock_s` = (round - 1) x deadline_s: a round lasts its deadline there), and an emulated device offline then by its
availability answers "away": not waited for, still selectable (counted). Every device process names itself with a random
instance id: a status from an instance other than the device's newest registered one (the late last will of a replaced
process) is passed over, and an older instance that registers again means two processes share one device id: counted
("duplicate-device"), logged, kept in the results and told to the device (a retained notice). A device whose labels hold
classes outside the tasks' so far follows another class order than the test sets: warned about once per device and task
("class-mismatch"). A device its owner says is out of the run (a simulated fleet's device that failed to start:
`device_failed`) is taken as offline, kept as "failed" and not waited for. When the run ends (complete or failed;
not when stopped to be resumed) the devices are told on `all/end`; a run in which no device's update was aggregated
fails.

What a learning method adds travels as named payloads, and this module never knows which method runs: an update's
attachments go to the strategy (`inspect` when it arrives, `aggregate` with the round); a device's request is
answered with `Strategy.answer` at once, rounds open or not; a device's payloads for its next round — its
personalized model as "personal" (float32 weights), and whatever else the rule returned — go to it as one payload
blob that the round message names. When the test data are per client (flowing data) each round also evaluates
every client's model (its personalized one, else the global one) on that client's test data seen so far: the
per-client accuracies, IAA (Eq. 9), AA and AFM (Eqs. 10-11) go into the history and results.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import queue
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from coordinator.aggregation import RoundAggregate
from coordinator.buffered import STALE, BufferedSchedule, Done, asynchronous_refused
from coordinator.checkpoint import Checkpoints, RoundEntry, RunSchedule, RunState
from coordinator.config import CoordinatorConfig
from coordinator.containment import RULE_FAILED, ContainedStrategy
from coordinator.evaluation import Evaluator, FolderTestSets, TestSets, input_range
from coordinator.host_training import HOST
from coordinator.inbox import Inbox, Registration, Request, Status, Update, UpdateRefused
from coordinator.inbox_workers import InboxWorkers, WorkerPlan, merged_into
from coordinator.influence import FleetPath, HeadLayout
from coordinator.limits import ResendBudget
from coordinator.outbox import Outbox
from coordinator.privacy import CentralPrivacy, PrivacyBudgetSpent, RoundCount
from coordinator.reference import ClassReference, calibration_by_part
from coordinator.roster import Roster
from coordinator.round_share import Heard, RoundOpening, RoundShares, SharePlan, shares_refused
from coordinator.rounds import ROUND_REFUSALS, OpenRound, select
from coordinator.run_logs import RunLogs
from coordinator.run_record import RunRecord
from coordinator.secagg import LIES, Advertised, SecureMessage, SecureRound
from coordinator.sites import Sites, site_subscriptions
from coordinator.strategies import (
    AggregateResult,
    ClientUpdate,
    RoundContext,
    make_strategy,
    makes_inputs,
    privacy_refused,
    secure_aggregation_refused,
)
from edgefil import topics
from edgefil.collector import long_run
from edgefil.lifetime import uninterrupted
from edgefil.link import CONNECTED, ConnectionRefused, Link
from edgefil.logs import LineQuota, names_line
from edgefil.secagg import SecAggError
from models.checkpoint import checkpoint_weights
from models.manifest import load_manifest, manifest_digest

log = logging.getLogger("edgefil.coordinator")
CHECKPOINT_DIR = "checkpoint"
WAITING_SAID_EVERY_S = 5.0  # while it waits for the fleet, the coordinator says how far it is this often
CHECK_EVERY_S = 0.05  # how often a wait for the fleet (registered, back online) checks between messages
# ... at most: a check costs O(devices), and a wait checks no more often than keeps its checks within this share of
# the coordinator's time (at 100,000 devices a check every 50 ms, sorting the roster, kept a core busy while the
# fleet started)
CHECK_SHARE = 0.05
END_GRACE_S = 30.0  # the longest the end of a run waits for the devices' answers to it (`_hear_goodbyes`)
# Devices out of the run (`device_failed`) each said in the log at ERROR; past these, one line says the rest are in
# results.json: a fleet whose every device fails to start (its nodes lack the backend) said so 10,000 times.
FAILURES_SAID = 10
# Registrations said at INFO from the run's start until its first round opens, and in each round after it; the others
# at DEBUG (the first round's wait counts them in its lines): a 10,000-device fleet's start said each of them.
REGISTRATIONS_SAID = 10


class QuorumError(RuntimeError):
    """Not enough devices to run a round, after waiting and retrying as configured."""


class RunAborted(RuntimeError):
    """Something the run depends on outside this process is gone (a simulated fleet's worker process, and every
    device it hosted): its owner said so through `Coordinator.abort`."""


class Coordinator:
    def __init__(self, config: CoordinatorConfig, resume: bool = False, test_sets: TestSets | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        """`test_sets` is what the global model is evaluated on; by default the config's `test_data` folder (a
        simulated fleet passes its scenario's test sets). `progress` is called with each round's history entry
        (round, task, accuracy, ...) once the round is checkpointed."""
        self.config = config
        self.progress = progress
        self._aborted: str | None = None  # why the run must end now (`abort`), until the pump raises it
        self._gone_with_abort: tuple[str, ...] = ()  # the devices `abort` said are gone with it
        self._failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # `device_failed`'s, for the pump
        self._failures_said = LineQuota(FAILURES_SAID)
        self._registrations_said = LineQuota(REGISTRATIONS_SAID)  # renewed as each round opens
        rule = config.strategy["name"]
        options = {k: v for k, v in config.strategy.items() if k != "name"}
        refused = privacy_refused(config.privacy, rule, options)
        if refused is not None:  # a program's settings (a file's were refused as it was read)
            raise ValueError(f"[privacy] {refused}")
        refused = secure_aggregation_refused(config.secure_aggregation, rule)
        if refused is not None:
            raise ValueError(f"[secure_aggregation] {refused}")
        self._secure: SecureRound | None = None  # the open round's secure session (coordinator/secagg.py)
        self.manifest = load_manifest(config.artifacts)
        if test_sets is None:
            if config.test_data is None:
                raise ValueError("the coordinator needs test data: set test_data = \"folder\" (test-<t>.npz files)")
            test_sets = FolderTestSets(config.test_data, self.manifest)
        self.data = test_sets
        reference_runs = config.guard.reference != "off" and any(
            len(test_sets.calibration(t)[1]) for t in range(test_sets.n_tasks))
        if makes_inputs(rule) and "input_range" not in options:
            options["input_range"] = input_range(test_sets)  # where its inputs are made: the data's range
        strategy = make_strategy(rule, device=config.device, manifest=self.manifest, **options)
        for setting, off, used in (("inbox_workers", "inbox_workers = 0", config.inbox_workers),
                                   ("sites", "no [[sites]]", config.sites)):
            refused = shares_refused(strategy, config.secure_aggregation.on, config.privacy.central, reference_runs,
                                     off, per_share=setting == "sites") if used else None
            if refused is not None:
                raise ValueError(f"{setting}: {refused}")
        refused = asynchronous_refused(strategy, config.secure_aggregation.on, config.privacy.central,
                                       bool(config.inbox_workers or config.sites)) if config.asynchronous.on else None
        if refused is not None:
            raise ValueError(f"[asynchronous] {refused}")
        self.evaluator = Evaluator(self.data, self.manifest, device=str(strategy.device))
        self._said_no_calibration = False
        self._previous_weights: np.ndarray | None = None  # g': the global model before this one (`last_step`)
        # g0: the run's first global model (`way_back`), kept only where the guard asks for it
        self._first_weights = checkpoint_weights(config.artifacts) if config.guard.checks_way_back else None
        self._heads = HeadLayout.of(self.manifest.parameters)  # the row bound's, and Krum's class-aware comparison
        self.flowing = self.data.per_client
        if self.flowing and config.rounds_per_task != 1:
            raise ValueError("a flowing-data scenario brings a new task every round: set rounds_per_task = 1")
        self.inbox = Inbox(
            config.fleet, set(config.devices), manifest_digest(config.artifacts), self.manifest.num_parameters,
            config.limits,
        )
        self.checkpoints = Checkpoints(config.out / CHECKPOINT_DIR, config.checkpoint, self.manifest.num_parameters,
                                       RunSchedule(self.data.n_tasks, config.rounds_per_task))
        self.state, resumed_from = self.checkpoints.start(resume, RunState(
            weights=checkpoint_weights(config.artifacts),
            rng=dict(np.random.default_rng(config.seed).bit_generator.state),
        ))
        self.counters: Counter[str] = self.inbox.rejections
        self.counters.update(self.state.counters)
        self.strategy = ContainedStrategy(strategy, self.counters)  # nothing a method does can stop the run
        self.privacy = CentralPrivacy(config.privacy, self.state.history, strategy.built_from,
                                      config.guard.comparing) if config.privacy.central else None
        # central DP's count of the round: the devices its attempts asked (each feeds the round's one aggregate), and
        # how many its selection drew them from
        self._asked: set[str] = set()
        self._eligible = 0
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = self.state.rng
        self.roster = Roster(config.devices)
        # asynchronous rounds (coordinator/buffered.py): who trains what, and which ended work a round takes next;
        # the fleet's clock goes on from the last round's
        self.schedule = BufferedSchedule(
            config.asynchronous, config.virtual_time, config.wall_limit_s,
            _clock_at_end(self.state.history),
        ) if config.asynchronous.on else None
        self._rejoined: set[str] = set()  # asynchronous: devices back since their work, whose next work brings weights
        self.open_round: OpenRound | None = None
        # between two attempts of a round (one missed its quorum): the last one, which still takes the updates
        # that answer it, and the round's aggregation, which both attempts feed
        self._last_attempt: OpenRound | None = None
        self._aggregate: RoundAggregate | None = None
        self._context = RoundContext()  # the round being run, as its rule sees it
        self._first_round = True
        self._class_warned: set[tuple[str, int]] = set()  # (device, task) already warned about its classes
        self._site_topics = f"{topics.prefix(config.fleet)}/{topics.SITE}/"
        # with inbox workers, the updates are theirs (coordinator/inbox_workers.py): this process hears the rest
        kinds = [kind for kind in topics.DEVICE_SENDS if kind != "update"] if config.inbox_workers else ["+"]
        self.link = Link(
            config.broker, client_id=f"coordinator-{config.fleet}",
            subscriptions=[f"{topics.prefix(config.fleet)}/{topics.FROM_DEVICE}/+/{kind}" for kind in kinds]
            + site_subscriptions(config.fleet, [site.name for site in config.sites]),
        )
        # who takes a round's updates besides this process (coordinator/round_share.py): inbox workers, sites
        share = SharePlan(config.fleet, frozenset(config.devices), manifest_digest(config.artifacts),
                          self.manifest.num_parameters, rule, options, config.guard, self._heads,
                          config.max_held_mib << 20)
        self.shares: list[RoundShares] = []
        if config.inbox_workers:
            self.shares.append(InboxWorkers(WorkerPlan(config.broker, share), config.inbox_workers,
                                            on_heard=self.link.wake))
        self.sites = Sites(self.link, share, {site.name: frozenset(site.devices) for site in config.sites},
                           config.wall_limit_s if config.virtual_time else config.site_close_s, self._pump,
                           config.wall_limit_s if config.virtual_time else config.wait_for_devices_s,
                           ) if config.sites else None
        if self.sites is not None:
            self.shares.append(self.sites)
        self.outbox = Outbox(self.link, config.fleet, self.roster, ResendBudget(config.limits.resends_per_round),
                             self.counters, {device: site.name for site in config.sites for device in site.devices})
        if resumed_from is not None:
            self.outbox.restore(self.checkpoints.deliveries(resumed_from, self.state.round))
            self.strategy.load(resumed_from)
        trained = min(config.train_tasks or self.data.n_tasks, self.data.n_tasks)  # the rest: evaluated only
        self.record = RunRecord(
            config.fleet, self.data.describe(), dict(config.strategy), config.describe(), self.state, self.roster,
            self.counters, self.link, total_rounds=trained * config.rounds_per_task,
            total_steps=trained * config.rounds_per_task + self.data.n_tasks - trained,
            history_file=self.checkpoints.history,
        )
        self.logs = RunLogs(config.out, self.record, self.data.n_tasks)

    def _connect(self, timeout: float, wait: bool) -> None:
        broker = f"{self.config.broker.host}:{self.config.broker.port}"

        def waiting() -> None:
            log.warning("waiting for the MQTT broker at %s (no answer yet; %s)", broker,
                        "still trying, Ctrl-C stops" if wait else f"trying for up to {timeout:.0f} s")

        while True:
            try:
                self.link.start(timeout=timeout, waiting=waiting)
                return
            except ConnectionRefused:  # it answered and said no: waiting changes nothing
                raise
            except ConnectionError as err:
                if not wait:
                    raise
                log.warning("%s; still trying (Ctrl-C stops)", err)

    @property
    def outcome(self) -> str:
        return self.record.outcome

    # --- the run ----------------------------------------------------------------------------------

    def run(self, connect_timeout: float = 60.0, wait_for_broker: bool = False) -> dict[str, Any]:
        """Every remaining round; results.json is written at the end however the run ends (its `outcome` says how:
        complete, stopped, or failed with the reason), with the counters up to the end. A broker that does not
        answer is said within seconds; `wait_for_broker`: then waited for however long (a coordinator started
        before its broker, as a device waits), else ConnectionError after `connect_timeout`."""
        self.config.out.mkdir(parents=True, exist_ok=True)
        with long_run():  # what it holds now: not scanned by the garbage collector (edgefil/collector.py)
            return self._run(connect_timeout, wait_for_broker)

    def _run(self, connect_timeout: float, wait_for_broker: bool) -> dict[str, Any]:
        self._connect(connect_timeout, wait_for_broker)
        self.outbox.run_started()
        try:
            for shares in self.shares:
                shares.start()
            while self.state.task < self.data.n_tasks:
                if self.config.train_tasks and self.state.task >= self.config.train_tasks:
                    self.evaluate_only()
                else:
                    self.run_round()
            if self.record.total_rounds and not self._a_device_trained():
                raise QuorumError("no device trained in any round: every device reported it cannot train, sent "
                                  "nothing, or had every update refused (the reasons: device_errors and counters in "
                                  "results.json, the log's lines above)")
            self.record.outcome = "complete"
        except KeyboardInterrupt:
            self.record.outcome = "stopped"
            raise
        except PrivacyBudgetSpent as err:  # what it was told: not a failure
            self.record.outcome = f"privacy-budget: {err}"
            log.warning("the run ends at its privacy budget: %s", err)
        except Exception as err:
            self.record.outcome = f"failed: {type(err).__name__}: {err}"
            raise
        finally:
            if self.record.outcome != "stopped":  # a stopped run resumes: its devices stay
                self.outbox.run_ended(self.record.outcome, self.state.round)
                self._hear_goodbyes(END_GRACE_S)
            self.link.wait_idle(timeout=5.0)
            self.link.stop()
            for shares in self.shares:
                shares.stop()
            self.logs.run_ended()
        results = self.results()
        log.info("run complete: final average accuracy %.4f", results["final_accuracy"])
        return results

    def abort(self, reason: str, gone: Collection[str] = ()) -> None:
        """End the run as failed with `reason` at its next message or wait, from any thread (not a signal handler:
        `Link.wake`). For an owner that watches what the coordinator cannot see (a fleet's worker processes): a
        round would otherwise wait for devices that are gone until its deadline or `wall_limit_s`. The last
        round's checkpoint stays, so `--resume` goes on from it. `gone`: devices the owner knows are gone (a dead
        worker's), taken as offline when the run ends, as their last wills would have it: the end does not wait
        END_GRACE_S for their answers, which may never come: the embedded broker did not always publish a killed
        worker's wills, and such a run's end waited the whole grace (1 to 5 runs in 20-30 of the killed-worker test,
        tests/test_fleet_runner.py; docs/results.md)."""
        self._gone_with_abort = tuple(gone)
        self._aborted = reason
        self.link.wake()

    def device_failed(self, device: str, why: str) -> None:
        """A device is out of the run, from any thread (not a signal handler): its owner (a simulated fleet's
        worker) says it failed to start, or stopped on an error, `why`. A device that never connected leaves no
        last will, and the first round waits for the whole roster: in virtual time up to `wall_limit_s`, silent.
        So at its next message or wait the run takes it as offline (the open round and a secure session stop
        waiting for it), logs `why`, counts it ("device-failed") and keeps it in the roster as "failed" with `why`
        as its error (results.json, the dashboard); the first round's wait counts the roster without it, and a run
        whose quorum the devices left cannot reach ends at once (QuorumError)."""
        self._failures.put((device, why))
        self.link.wake()

    def _take_failures(self) -> None:
        """The devices `device_failed` said are out of the run, taken out as it says (asked at every message: an
        empty queue's answer, not a raised Empty)."""
        while not self._failures.empty():  # this thread alone takes from it
            device, why = self._failures.get()
            if device not in self.roster.records or device in self.roster.failed:
                continue
            self.counters["device-failed"] += 1
            log.log(self._failures_said.level(logging.ERROR), "device %s is out of the run: %s (its fleet worker's "
                    "log says more)", device, why)
            if self._failures_said.just_spent:
                log.error("more devices are out of the run: results.json and the dashboard list them, each with why")
            self._on_status(Status(device, "offline", self.state.round))
            self.roster.fail(device, why)

    def _hear_goodbyes(self, grace_s: float) -> None:
        """After the end: every connected device answers it (offline as it exits, or its state as it stays for the
        next run, `on_end = "wait"`). Those answers are taken in, for at most `grace_s`, so that the results and
        the dashboard show who left, not who was training when the last round closed."""
        ended, deadline = time.time(), time.monotonic() + grace_s
        try:
            while (left := deadline - time.monotonic()) > 0 and any(
                    (self.roster.records[d].last_seen or 0.0) < ended for d in self.roster.connected()):
                self._pump_for(min(left, 0.5))  # checked between slices: O(devices) a check
        except Exception as err:  # the run's own outcome stands; its record keeps the states it had
            log.warning("the devices' answers to the run's end were not all taken in: %s", err)

    def _a_device_trained(self) -> bool:
        """Whether some round aggregated an update a device trained (not the host's)."""
        return any(set(entry["received"]) - {HOST} and entry.get("samples", 0) > 0 for entry in self.state.history
                   if entry.get("trained", True))

    def round_context(self) -> RoundContext:
        """The next round as a rule sees it (`configure`, `aggregate`)."""
        task = self.state.task
        return RoundContext(
            round=self.state.round + 1, task=task, task_classes=tuple(self.data.task_classes(task)),
            seen_classes=tuple(sorted({c for t in range(task + 1) for c in self.data.task_classes(t)})),
            round_in_task=self.state.round_in_task + 1, rounds_per_task=self.config.rounds_per_task,
        )

    def run_round(self) -> None:
        number, task = self.state.round + 1, self.state.task
        self._context = ctx = self.round_context()
        self._aggregate = aggregate = RoundAggregate(
            self.strategy, self.config.guard, self.state.weights, self.counters, self.config.max_held_mib << 20, ctx,
            self.reference(ctx), self.path(), self._heads, self.privacy)
        try:
            host = self.data.host_train(task)
            if host is not None:
                self._run_on_host(number, task, aggregate, *host)
            elif self.schedule is not None:
                self._run_buffered(number, task, aggregate, self.schedule)
            else:
                self._run_attempts(number, task, aggregate)
        finally:
            self._aggregate = self._last_attempt = None

    def path(self) -> FleetPath:
        """Where the fleet's global model g has been, as far as the guard's bounds ask: the last global step g - g'
        (`min_progress`; not known until a round has made a new global model since the coordinator started, so
        not in a resumed run's first round) and the unit way back to the first global model (`way_back`; not
        known while g is the first)."""
        guard, weights = self.config.guard, self.state.weights
        last_step = None
        if guard.checks_progress and self._previous_weights is not None:
            last_step = weights.astype(np.float64) - self._previous_weights
        way_back = None
        if self._first_weights is not None:
            way_back = self._first_weights.astype(np.float64) - weights
            length = math.sqrt(float(np.einsum("i,i->", way_back, way_back)))  # einsum: compute.distance says why
            way_back = way_back / length if length > 0 else None
        return FleetPath(last_step, way_back)

    def reference(self, ctx: RoundContext) -> ClassReference | None:
        """The round's calibration reference for the guard (`[guard] reference`), None when it is off or the test
        data hold no calibration samples (said once)."""
        if self.config.guard.reference == "off":
            return None
        calibration = calibration_by_part([self.data.calibration(t) for t in range(ctx.task + 1)])
        if not calibration:
            if not self._said_no_calibration:
                instead = ("updates are compared with each other instead (Krum selection), which refuses honest "
                           "devices that bring classes no other holds" if self.config.guard.krum_share > 0 else
                           "updates are not compared with it")
                log.warning("[guard] reference = %r, but the test data hold no calibration samples (calibration-<t>"
                            ".npz, `edgefil data split --calibration N`; a scenario's `calibration`): %s",
                            self.config.guard.reference, instead)
                self._said_no_calibration = True
            return None
        # a device masks the classes it has not seen unless the round names the fleet's or says not to mask
        client = self.config.client
        device_masks = client.get("mask_seen_classes") is not False and not client.get("known_classes")
        return ClassReference(self.evaluator, calibration, self.state.weights, ctx, device_masks)

    def _run_on_host(self, number: int, task: int, aggregate: RoundAggregate, x: np.ndarray, y: np.ndarray
                     ) -> None:
        """A task the host learns itself (coordinator/host_training.py): no device is selected; the global model
        trained on the host's data is the round's one update."""
        log.info("round %d (task %d): trained on the host (%d samples)", number, task, len(y))
        weights = self.config.host.train(self.manifest, self.state.weights, x, y, self._context.seen_classes,
                                         self.strategy.device)
        aggregate.add_trusted(ClientUpdate(HOST, weights, len(y)))
        collected = OpenRound.open(number, task, "", [HOST], self.config.deadline_s)
        collected.delivered.add(HOST)
        self._close(collected, aggregate)

    def _run_attempts(self, number: int, task: int, aggregate: RoundAggregate) -> None:
        self._asked, self._eligible = set(), 0
        for attempt in range(1, self.config.max_attempts + 1):
            available = self._wait_for_devices()
            selected = select(available, self.config.fraction, self.config.min_clients, self.rng)
            self._asked.update(selected)
            self._eligible = max(self._eligible, len(available))
            if self.privacy is not None:  # before anything is sent: a round past the budget is not run
                self.privacy.check_budget(RoundCount(len(self._asked), self._eligible).rate,
                                          self.strategy.extra_releases(self._context))
            collected = self._open(number, task, selected, self._last_attempt)
            while not collected.complete and collected.remaining_s() > 0:
                self._pump(collected.remaining_s())
            missing = [d for d in collected.missing() if d not in collected.failed]
            self.open_round, self._last_attempt = None, collected
            if self._secure is not None:
                self._run_secure(self._secure, collected, aggregate)
            self.inbox.drop_partial_updates(before_round=number + 1)
            for expected, said in ((True, "sitting it out"), (False, "cannot train, or refused")):
                which = {d: why for d, why in collected.failed.items() if (d in collected.sitting_out) == expected}
                if which:  # a device away on its schedule is the fleet as it is, not a fault: said, not warned
                    log.log(logging.INFO if expected else logging.WARNING, "round %d closed without %s (%s)", number,
                            names_line(f"{d}: {why}" for d, why in sorted(which.items())), said)
            if missing:
                log.warning("round %d closed without %s (deadline or offline)", number, names_line(missing))
                self.counters["missed-deadline"] += len(missing)
            if len(collected.delivered) >= self.config.min_clients:
                self._close(collected, aggregate)
                return
            if attempt == self.config.max_attempts:
                break
            self.counters["round-retried"] += 1
            backoff = min(self.config.retry_backoff_s * 2 ** (attempt - 1), self.config.wait_for_devices_s)
            log.warning("round %d (attempt %d) got %d updates, quorum %d: running it again after up to %.0f s for "
                        "%s to come back", number, attempt, len(collected.delivered), self.config.min_clients,
                        backoff, names_line(missing) or "devices")
            self._await_return(missing, backoff)
        self._check_spent()
        raise QuorumError(f"round {number} missed its quorum of {self.config.min_clients} "
                          f"{self.config.max_attempts} times")

    def _run_buffered(self, number: int, task: int, aggregate: RoundAggregate, schedule: BufferedSchedule) -> None:
        """An asynchronous round (coordinator/buffered.py): free devices are given the round's model as they come
        free, and the round takes ended work in the schedule's order until its buffer is full, its deadline passed
        with the quorum, or (virtual time) no device is left to train its model."""
        settings = self.config.asynchronous
        quorum = min(self.config.min_clients, settings.buffer)  # a full buffer closes the round whatever the quorum
        self._wait_for_devices()
        model = self.outbox.publish_weights(self.state.weights, number, self.state.round, task)
        schedule.opened(number, self.state.weights)
        # what the dashboard shows of the round: the devices given its work, those whose updates it took
        self.open_round = opened = OpenRound.open(number, task, model, [], self.config.deadline_s,
                                                  virtual=self.config.virtual_time,
                                                  wall_limit_s=self.config.wall_limit_s)
        self.record.round_opened(opened)
        taken: dict[str, int] = {}  # device -> the staleness of its update in the buffer
        ends_s = schedule.now_s() + self.config.deadline_s
        gives_up = time.monotonic() + self.config.deadline_s * self.config.max_attempts
        while len(taken) < settings.buffer:
            for device in schedule.overdue():
                self.counters["missed-deadline"] += 1
                log.warning("%s: silent past wall_limit_s with its work of round %d: given up on", device, number)
            for device in schedule.to_give(self._available(), number) if schedule.changed else ():
                schedule.give(device, number, model)
                opened.selected.append(device)
                self._send_round(device, with_weights=device in self._rejoined)
                self._rejoined.discard(device)
            done = schedule.next_done(before_s=ends_s if len(taken) >= quorum else math.inf)
            if done is not None:
                self._take_buffered(done, task, aggregate, schedule, taken)
                opened.delivered = set(taken)
                continue
            if len(taken) >= quorum and schedule.past(ends_s):
                break  # the deadline, with the quorum
            if self.config.virtual_time and schedule.idle:
                break  # every free device trained this model: nothing more comes for it
            if not self.config.virtual_time and time.monotonic() > gives_up:
                break
            # virtual time waits for the work out (each message may end some); the wall clock, for its deadline too
            self._pump(self.config.wall_limit_s if self.config.virtual_time and schedule.out else CHECK_EVERY_S)
        self.open_round = None
        if len(taken) < quorum:
            raise QuorumError(f"asynchronous round {number} took {len(taken)} updates, quorum {quorum}: no device "
                              f"was left to train its model")
        opened.selected.sort()
        self._close(opened, aggregate, clock_s=schedule.now_s(),
                    staleness=float(np.mean(list(taken.values()))))

    def _take_buffered(self, done: Done, task: int, aggregate: RoundAggregate, schedule: BufferedSchedule,
                       taken: dict[str, int]) -> None:
        """Ended work as the open asynchronous round takes it: its update rebased onto the round's model and weighed
        by its staleness (one of an earlier task's round too: what its device learnt of that task), or refused
        (too stale, a second of its device's in the buffer)."""
        update, number = done.update, aggregate.number
        if update is None:  # it sat the work out: free again
            return
        rebased = schedule.rebased(update.weights, done.round, number)
        reason = "wrong-task" if update.task > task else "duplicate" if update.device in taken else \
            STALE if rebased is None else None
        if reason is not None or rebased is None:
            self.counters[reason or STALE] += 1
            log.warning("update of %s (round %d) not taken into round %d: %s", update.device, done.round, number,
                        reason)
            return
        weights, staleness = rebased
        taken[update.device] = staleness
        schedule.taken(update.device, number)
        self._check_classes(update)
        aggregate.add(dataclasses.replace(update.for_strategy(), weights=weights,
                                          metrics={**update.metrics, "staleness": float(staleness)}))

    def evaluate_only(self) -> None:
        """A task past `train_tasks` (the Fixed baseline): no round, the unchanged model is evaluated on it."""
        state, task = self.state, self.state.task
        accuracies = self.evaluator.accuracies(state.weights, task)
        with uninterrupted():
            state.history.append(self.record.entry(
                round=state.round, task=task, selected=[], received=[], samples=0, accuracy=accuracies,
                aggregate_s=0.0, metrics={}, trained=False,
            ))
            self._finish_round(accuracies, task_done=True)
            log.info("task %d not trained (train_tasks = %d); accuracy on tasks 0..%d: %s%s", task,
                     self.config.train_tasks, task, " ".join(f"{a:.3f}" for a in accuracies), self.record.eta_text())

    def _open(self, number: int, task: int, selected: list[str], earlier: OpenRound | None) -> OpenRound:
        """Publish the round's weights and ask the selected devices to train; `earlier`: the round's previous
        attempt, whose deliveries count in this one."""
        log.info("round %d (task %d): selected %s", number, task, names_line(selected))
        self._registrations_said.renew()
        model = self.outbox.publish_weights(self.state.weights, number, self.state.round, task)
        self.open_round = opened = OpenRound.open(
            number, task, model, selected, self.config.deadline_s, virtual=self.config.virtual_time,
            wall_limit_s=self.config.wall_limit_s,
        )
        if self.config.secure_aggregation.on:  # a new session each attempt: fresh keys on every device
            self._secure = SecureRound(self.config.secure_aggregation, number, secrets.token_hex(8),
                                       self.manifest.num_parameters + 1, self.strategy.weighs_by_samples)
        self.record.round_opened(opened)
        if earlier is not None:
            opened.carry_over(earlier.delivered)
        if self._aggregate is not None:
            for shares in self.shares:
                shares.open(RoundOpening(number, task, model, tuple(selected), self.state.weights, self._context,
                                         self._aggregate.path, opened.virtual_deadline_s))
        for device in opened.missing():
            self._send_round(device)
        return opened

    def _send_round(self, device: str, with_weights: bool = False) -> None:
        """The open round's message to one device, with the round config its rule adds for it; `with_weights`: a
        resend to a device that came back (the outbox limits those)."""
        current = self.open_round
        if current is None:
            return
        config = {**self.config.client, **self.strategy.configure(self._context, device)}
        if self.schedule is not None:  # asynchronous: the work's start on the fleet's clock
            config["clock_s"] = self.schedule.now_s()
        elif self.config.virtual_time:  # the round's start on the fleet's clock: each round lasts its deadline there
            config["clock_s"] = (current.number - 1) * self.config.deadline_s
            # an answer to a device's request comes at once from a quiet host: from a busy one later, but it comes
            config.setdefault("answer_wait_s", self.config.wall_limit_s)
        if self._secure is not None:
            config["secure"] = self.config.secure_aggregation.round_config(self._secure.session,
                                                                           self.strategy.weighs_by_samples)
        if config.pop("known_classes", False):  # the fleet's classes so far, and which of them the task brings
            config["known_classes"] = list(self._context.seen_classes)
            config["task_classes"] = list(self._context.task_classes)
        if self.outbox.send_round(device, current, self.state.round, config, with_weights):
            self.roster.asked_to_train(device)  # the device says nothing of its round until its update

    def _close(self, collected: OpenRound, aggregate: RoundAggregate, **measured: float) -> None:
        """`measured`: what the round's history entry keeps besides (an asynchronous round's clock and staleness);
        in virtual time the entry keeps the round's end on the fleet's clock (`clock_s`) either way."""
        if self.config.virtual_time:
            measured.setdefault("clock_s", collected.number * self.config.deadline_s)
        # None: the rule failed on the round (counted and logged where it was contained). The loop serves the
        # devices while a rule finishes its round off it; an update that comes meanwhile is late.
        self._aggregate = None
        for shares in self.shares:  # the round's shares, bounded and folded where they were taken
            merged_into(aggregate, shares.close(self.counters))
        result = aggregate.close(wait=self._pump, selected=len(self._asked), eligible=self._eligible)
        weights, refused, accuracies = self._judge(result, collected.task, aggregate.refused_sum or RULE_FAILED)
        used = aggregate.used
        state = self.state
        with uninterrupted():  # committed whole: a stop never leaves results.json ahead of the checkpoint
            if result is not None and weights is not None:
                if self.config.guard.checks_progress:
                    self._previous_weights = state.weights
                state.weights = weights
                self.outbox.take({d: w.detach().cpu().numpy().astype(np.float32, copy=False)
                                  for d, w in result.personalized.items()}, result.payloads)
                self.outbox.publish_broadcast(result.broadcast, collected.number, self.strategy.name)
            else:  # the round counts, the previous global model stays (and is what is checkpointed)
                log.warning("round %d: no new global model (%s); the previous one stays", collected.number, refused)
            state.round = collected.number
            state.round_in_task += 1
            state.history.append(self.record.entry(
                round=collected.number, task=collected.task, selected=collected.selected,
                received=sorted(collected.delivered), samples=aggregate.samples,
                accuracy=accuracies, aggregate_s=aggregate.seconds,
                metrics={u.device: dict(u.metrics) for u in sorted(used, key=lambda u: u.device)},
                **({"rule_metrics": result.metrics} if result is not None and result.metrics else {}),
                **({"refused": refused} if refused else {}),
                **({"privacy": aggregate.privacy_spent} if aggregate.privacy_spent else {}),
                **({"secure": aggregate.secure_counts} if aggregate.secure_counts else {}),
                **self._client_evaluation(collected.task), **measured,
            ))
            self._finish_round(accuracies, task_done=state.round_in_task == self.config.rounds_per_task)
            log.info("round %d/%d: %d updates aggregated; accuracy on tasks 0..%d: %s%s", collected.number,
                     self.record.total_rounds, len(used), collected.task, " ".join(f"{a:.3f}" for a in accuracies),
                     self.record.eta_text())

    def _judge(self, result: AggregateResult | None, task: int, why_none: str
               ) -> tuple[np.ndarray | None, str | None, list[float]]:
        """The round's new global model and its accuracies on the tasks so far; or None, why not, and the previous
        model's accuracies: there is no result (`why_none`: the rule failed on the round, `rule-failed`, counted
        where it was contained; or the round's secure sum was refused), or the checkpoint policy refuses the model
        (not finite, exploded, collapsed: counted here)."""
        state, policy = self.state, self.config.checkpoint
        if result is None:
            return None, why_none, self.evaluator.accuracies(state.weights, task)
        weights = result.global_weights.detach().cpu().numpy().astype(np.float32, copy=False)
        refused = policy.problem(weights, state.weights)
        if refused is None:
            accuracies = self.evaluator.accuracies(weights, task)
            if not policy.collapsed(accuracies[task], state.best_accuracy(task)):
                return weights, None, accuracies
            refused = "model-collapsed"
        self.counters[refused] += 1
        return None, refused, self.evaluator.accuracies(state.weights, task)

    def _finish_round(self, accuracies: list[float], task_done: bool) -> None:
        """Move the schedule on, then checkpoint; the run's files are due, written once the next round is open
        (coordinator/run_logs.py)."""
        state = self.state
        if task_done:
            state.accuracy_matrix.append(accuracies)
            state.task += 1
            state.round_in_task = 0
        state.rng = dict(self.rng.bit_generator.state)
        state.counters = dict(self.counters)
        self.checkpoints.save(state, self.outbox.deliveries(), self.strategy.save)
        self.record.round_closed(state.history[-1])
        self.logs.round_due()  # written by the next `_pump`, once the next round is open
        if self.progress is not None:
            self.progress(dict(state.history[-1]))

    def _client_evaluation(self, task: int) -> dict[str, Any]:
        """Flowing data: each client's model (personalized, else global) on its test data seen so far, and IAA."""
        if not self.flowing:
            return {}
        accuracy = {
            k: self.evaluator.client_accuracy(self.outbox.personalized.get(device, self.state.weights), k, task)
            for k, device in enumerate(self.config.devices)
        }
        return {"client_accuracy": {self.config.devices[k]: a for k, a in accuracy.items()},
                "iaa": self.evaluator.iaa(accuracy, task)}

    # --- devices ----------------------------------------------------------------------------------

    def _wait_for_devices(self) -> list[str]:
        """The devices that can be selected now, after waiting as the module docstring says (the first round
        waits for the roster to connect, data or not: a device joining a later task is there all along)."""
        roster = len(self.config.devices) if self._first_round else 0
        deadline = time.monotonic() + self._wait_limit()
        said = time.monotonic()
        while (checked := time.monotonic()) < deadline and self._can_reach_quorum() and (
            len(self.roster.available(self.state.task)) < self.config.min_clients
            or len(self.roster.connected()) < roster - len(self.roster.failed)
        ):
            every = max(CHECK_EVERY_S, (time.monotonic() - checked) / CHECK_SHARE)
            self._pump_for(min(every, deadline - time.monotonic()))
            if time.monotonic() - said >= WAITING_SAID_EVERY_S:  # a fleet's start can take minutes: say so
                said = time.monotonic()
                out = f", {len(self.roster.failed)} out of the run" if self.roster.failed else ""
                log.info("waiting for the fleet: %d of %d devices connected, %d can train%s (%.0f s left)",
                         len(self.roster.connected()), len(self.config.devices), len(self._available()), out,
                         deadline - said)
        self._first_round = False
        available = self._available()
        if len(available) < self.config.min_clients:
            self._check_spent()
            failed = self.roster.failed
            if not self._can_reach_quorum():
                device, why = next(iter(failed.items()))
                raise QuorumError(f"{len(failed)} of {len(self.config.devices)} devices are out of the run, and "
                                  f"the quorum of {self.config.min_clients} cannot be reached without them ({device}: "
                                  f"{why})")
            without = self.roster.without_data
            waiting = f" ({len(without)} more hold no data yet)" if without else ""
            raise QuorumError(f"{len(available)} devices online after {self._wait_limit():.0f} s"
                              f"{waiting}, quorum is {self.config.min_clients}")
        return available

    def _can_reach_quorum(self) -> bool:
        """Whether enough devices are left in the run for a round's quorum (`device_failed`)."""
        return len(self.config.devices) - len(self.roster.failed) >= self.config.min_clients

    def _wait_limit(self) -> float:
        """How long to wait for devices to be online: `wait_for_devices_s`, or in virtual time `wall_limit_s` at
        least (a simulated fleet's devices are all coming; a busy host only makes them slower to start)."""
        if self.config.virtual_time:
            return max(self.config.wait_for_devices_s, self.config.wall_limit_s)
        return self.config.wait_for_devices_s

    def _await_return(self, devices: list[str], seconds: float) -> None:
        """Before a retry: wait up to `seconds` (handling messages) for devices that missed the round to be back
        (reconnected and registered), so the retry does not fire at a fleet that is still restarting."""
        deadline = time.monotonic() + seconds
        back = set(devices)
        while time.monotonic() < deadline and not back <= self.roster.connected():
            self._pump_for(min(CHECK_EVERY_S, deadline - time.monotonic()))

    def _available(self) -> list[str]:
        return sorted(self.roster.available(self.state.task))

    def _pump_for(self, seconds: float) -> None:
        """Handle messages for `seconds`: a loop that waits for the whole fleet checks between such slices, since
        a check costs O(devices) and so do the messages (checked after each one, 9000 registrations took
        minutes of the coordinator's CPU)."""
        end = time.monotonic() + seconds
        while True:
            self._pump(end - time.monotonic())
            if time.monotonic() >= end:
                return

    def _pump(self, timeout: float) -> None:
        """Handle at most one inbox item, waiting up to `timeout` for it, then the words on updates that the round's
        shares have for it: an inbox worker's (which wakes the wait) or a site's, which comes as an item itself.
        Drained only before the wait, a site's last word of a round waited in its queue for whatever message came
        next: rounds of 100 devices at 10,000 took 30-40 s instead of 5 (docs/results.md)."""
        self.logs.write_due()  # before the wait: the round files the last close left, once the next round is open
        item = self.link.get(timeout=max(min(timeout, self.logs.round_files_due_in()), 0.0))  # paced: woken when due
        self._take_failures()
        if self._aborted is not None:
            reason, self._aborted = self._aborted, None  # raised once: the run's end still hears the devices
            for device in self._gone_with_abort:
                if device in self.roster.records:
                    self.roster.take_status(Status(device, "offline", self.state.round), self.state.task)
            raise RunAborted(reason)
        if item is not None and item.topic != CONNECTED:
            self._handle(item.topic, item.payload, item.retained)
        for shares in self.shares:
            while (heard := shares.heard(timeout=0)) is not None:
                self._on_heard(heard)

    def _handle(self, topic: str, payload: bytes | bytearray | memoryview, retained: bool) -> None:
        """One message from the broker: a site's word (for its `Sites`), or a device's own or relayed message."""
        received = topic
        if self.sites is not None and topic.startswith(self._site_topics):
            relayed = self.sites.relayed(topic)  # a site's device's message, under its site's prefix
            if relayed is None:
                self.sites.take(topic, payload)
                return
            if not relayed:  # not that site's device (counted)
                return
            topic = relayed
        event = self.inbox.accept(topic, payload, retained)
        while self.inbox.to_clear:  # refused retained messages: delete them from the broker's store (where it is)
            cleared = self.inbox.to_clear.pop()
            self.link.publish(received if cleared == topic else cleared, b"", retain=True)
        if isinstance(event, Registration):
            self._on_registration(event)
        elif isinstance(event, Status):
            self._on_status(event)
        elif isinstance(event, Update):
            self._on_update(event)
        elif isinstance(event, Request):
            self._on_request(event)
        elif isinstance(event, UpdateRefused):
            self._on_refused(event)
        elif isinstance(event, Advertised):
            self._on_advertised(event)
        elif isinstance(event, SecureMessage):
            self._on_secure_message(event)

    def _on_registration(self, event: Registration) -> None:
        log.log(self._registrations_said.level(logging.INFO), "%s registered (%s backend, profile %s)", event.device,
                event.backend, event.profile)
        if self._registrations_said.just_spent:
            log.info("more devices registering: each said at DEBUG until the next round opens%s",
                     " (the lines waiting for the fleet count them)" if self._first_round else "")
        both = self.roster.register(event)
        if both is not None:  # an older process of the device registered again: two processes share its id
            self.counters["duplicate-device"] += 1
            log.error("two processes use device id %s (instances %s): the broker lets only one connect at a time, "
                      "so they push each other off; stop one", event.device, " and ".join(both))
            self.outbox.notice_duplicate(event.device, both)
        if self.schedule is not None:  # its work (if any) went with its old process; its next brings the model
            self.schedule.lost(event.device)
            self._rejoined.add(event.device)
            return
        current = self.open_round
        if current is not None and current.awaits(event.device):
            self._send_round(event.device, with_weights=True)

    def _on_status(self, event: Status) -> None:
        if self.roster.is_stale(event):
            log.debug("%s: status %s of a replaced process passed over", event.device, event.state)
            return
        self.roster.take_status(event, self.state.task)
        if self.schedule is not None:
            self.schedule.changed = True  # who is available may have changed
            self._on_buffered_status(event, self.schedule)
            return
        current = self.open_round
        if event.state == "error":
            self._on_device_error(event)
        elif event.state == "no-data":
            self._on_no_data(event)
        elif event.state == "away":
            self._on_away(event)
        elif event.state == "spent":
            self._on_spent(event)
        elif event.state != "offline":
            if current is not None and current.came_back(event.device):  # back (or the offline was stale)
                self._send_round(event.device, with_weights=True)
        else:
            if current is not None:
                current.went_offline(event.device)
            if self._secure is not None:  # its session's stages do not wait for it either
                self._secure.went_offline(event.device)

    def _on_buffered_status(self, event: Status, schedule: BufferedSchedule) -> None:
        """Asynchronous rounds: a device that went offline loses its work (given it again when back, with the
        model); one that cannot do its work (error, no data, its privacy spent) is free, and given work again once
        the model moves; one away on its schedule is given the same work again `away_retry_s` later."""
        if event.state == "offline":
            schedule.lost(event.device)
            self._rejoined.add(event.device)
            return
        counted = {"error": "device-error", "no-data": "no-data", "away": "away", "spent": "privacy-spent"}
        if event.state not in counted:
            return
        again_after = self.config.asynchronous.away_retry_s if event.state == "away" else None
        if schedule.ended(event.device, event.round, again_after_s=again_after):
            self.counters[counted[event.state]] += 1
            log.log(logging.WARNING if event.state == "error" else logging.INFO, "%s did not do its work of round "
                    "%d: %s%s", event.device, event.round, event.state, f" ({event.error})" if event.error else "")

    def _on_device_error(self, event: Status) -> None:
        """A device that cannot train: shown per device (the roster keeps its reason), and the open round does not
        wait for it."""
        self.counters["device-error"] += 1
        log.warning("%s cannot train round %d: %s", event.device, event.round, event.error or "(no reason given)")
        if self.open_round is not None and self.open_round.number == event.round:
            self.open_round.failed_with(event.device, event.error)
        if self._secure is not None and self._secure.round == event.round:
            self._secure.went_offline(event.device)

    def _on_no_data(self, event: Status) -> None:
        """A device with nothing to train on: not selected until it says otherwise; the open round it was
        selected for (before it could say so) does not wait for it."""
        current = self.open_round
        if current is not None and current.number == event.round and current.awaits(event.device):
            self.counters["no-data"] += 1
            current.failed_with(event.device, "it holds no data yet", expected=True)

    def _on_away(self, event: Status) -> None:
        """A device offline at the round's start on the fleet's clock (virtual time): it stays connected and
        selectable, and the open round does not wait for it."""
        current = self.open_round
        if current is not None and current.number == event.round and current.awaits(event.device):
            self.counters["away"] += 1
            current.failed_with(event.device, "away: offline at the round's start on the fleet's clock", expected=True)

    def _on_spent(self, event: Status) -> None:
        """A device past the local privacy budget it set itself (edge_client/privacy.py): not selected again, and
        the open round does not wait for it."""
        current = self.open_round
        if current is not None and current.number == event.round and current.awaits(event.device):
            self.counters["privacy-spent"] += 1
            current.failed_with(event.device, event.error or "its local privacy budget is spent", expected=True)

    def _check_spent(self) -> None:
        """PrivacyBudgetSpent where the quorum is out of reach because devices spent their local privacy budgets
        (the run ends at them, as at central DP's), not for want of devices."""
        available, spent = len(self._available()), len(self.roster.spent.keys() & self.roster.connected())
        if spent and available < self.config.min_clients <= available + spent:
            raise PrivacyBudgetSpent(f"{spent} devices have spent their local privacy budget; {available} can "
                                     f"still train, the quorum is {self.config.min_clients}")

    def _on_update(self, update: Update) -> None:
        if self.config.secure_aggregation.on:
            self._on_refused(UpdateRefused(update.device, update.round, "not-secure"))
            self.inbox.reject("not-secure", f"a plain update of {update.device} in a run under secure aggregation")
            return
        reason = self.strategy.inspect(update.for_strategy())
        if reason is not None:
            self._on_refused(UpdateRefused(update.device, update.round, reason))
            return
        if self.schedule is not None:
            self._on_buffered_update(update, self.schedule)
            return
        current = self.open_round or self._last_attempt  # between attempts, the last one still takes its answers
        if current is None or self._aggregate is None:
            self.counters["late" if update.round <= self.state.round else "wrong-round"] += 1
            log.warning("update of %s for round %d arrived between rounds: dropped", update.device, update.round)
            return
        if self._accepted(current, update, "update"):
            self._check_classes(update)
            self._aggregate.add(update.for_strategy())

    def _on_buffered_update(self, update: Update, schedule: BufferedSchedule) -> None:
        """Asynchronous rounds: an update ends its device's work; a round takes it in the schedule's order."""
        work = schedule.out.get(update.device)
        if work is None or work.round != update.round or work.model != update.model:
            reason = "late" if work is None or update.round < work.round else "wrong-round"
            self.counters[reason] += 1
            log.warning("update of %s for round %d dropped: %s (no such work out)", update.device, update.round,
                        reason)
            return
        seconds = float(update.metrics.get("device_seconds", 0.0))
        schedule.ended(update.device, update.round, update, seconds if 0 <= seconds < math.inf else 0.0)
        self.roster.take_update(update)

    def _on_heard(self, heard: Heard) -> None:
        """An inbox worker's word on an update: one it took counts as delivered, as one `_on_update` takes does
        (its weights are in the worker's share); one it refused whole, or its rule refused, ends the round's wait
        for its device; a round's own refusals (late, not selected, ...) the worker counted."""
        if heard.reason is None and heard.update is not None:
            current = self.open_round or self._last_attempt
            if current is not None and self._accepted(current, heard.update, "update"):
                self._check_classes(heard.update)
        elif heard.reason is not None and heard.reason not in ROUND_REFUSALS:
            self._on_refused(UpdateRefused(heard.device, heard.round, heard.reason))

    def _accepted(self, current: OpenRound, answer: Update | Advertised, what: str) -> bool:
        """Offer a device's answer (its update, or its keys in a secure round) to the round: whether the round takes
        it, and the roster then records what it says of its device; else why not is counted and logged."""
        reason = current.offer(answer, self.counters)
        if reason is not None:
            log.warning("%s of %s for round %d dropped: %s", what, answer.device, answer.round, reason)
            return False
        self.roster.take_update(answer)
        return True

    def _on_advertised(self, event: Advertised) -> None:
        """A device's keys for the open round's secure session: its delivery, which the round judges as an update
        (its round, its model, its deadline), and its entry into the session."""
        current, secure = self.open_round, self._secure
        if current is None or secure is None or event.session != secure.session:
            self.counters["late" if event.round <= self.state.round or current is None else "wrong-round"] += 1
            log.warning("keys of %s for round %d arrived outside its secure session: dropped", event.device,
                        event.round)
            return
        if self._accepted(current, event, "keys"):
            secure.advertise(event)

    def _on_secure_message(self, event: SecureMessage) -> None:
        secure = self._secure
        try:
            if secure is None:
                raise SecAggError("session", f"{event.kind} of {event.device} with no session open")
            secure.take(event)
        except SecAggError as err:
            self.inbox.reject(f"secure-{err.reason}", f"round {event.round}: {err}")

    def _run_secure(self, secure: SecureRound, collected: OpenRound, aggregate: RoundAggregate) -> None:
        """The secure session's stages once the round's collection closed (coordinator/secagg.py), each until every
        device it awaits has answered or gone, at most `stage_s` (virtual time: `wall_limit_s`); then the sum goes
        into the round's aggregation as one update, and the round's deliveries are the devices it sums (a session
        that fails delivers none: counted, and the attempt misses its quorum)."""
        settings = self.config.secure_aggregation
        limit = self.config.wall_limit_s if self.config.virtual_time else settings.stage_s
        carried = collected.delivered - secure.keys.keys()  # the round's earlier attempts' (in its aggregate)
        stages = (("neighbours", lambda: secure.begin_sharing(self.rng)), ("relayed", secure.begin_masking),
                  ("unmask", secure.begin_unmasking))
        try:
            for kind, begin in stages:
                for device, payload in begin().items():
                    self.link.publish(self.outbox.to_device(device, kind), payload)
                began, deadline = time.monotonic(), time.monotonic() + limit
                while secure.awaiting and time.monotonic() < deadline:
                    self._pump(deadline - time.monotonic())
                missing = f" without {', '.join(sorted(secure.awaiting))}" if secure.awaiting else ""
                log.info("round %d: secure stage %s closed after %.1f s%s", secure.round, kind,
                         time.monotonic() - began, missing)
            summed = secure.result()
        except SecAggError as err:
            self.counters[f"secure-{err.reason}"] += 1
            if err.reason in LIES:  # a device lied: running the round again would meet it again
                log.warning("round %d: the secure session's sum is refused (%s): the round keeps its previous model",
                            secure.round, err)
                collected.delivered = carried | secure.survivors
                aggregate.sum_refused(f"secure-{err.reason}", secure.counts)
            else:
                log.warning("round %d: the secure session failed (%s): no update from its %d devices", secure.round,
                            err, len(secure.keys))
                collected.delivered = carried
            return
        finally:
            self._secure = None
        collected.delivered = carried | summed.survivors
        log.info("round %d: secure sum of %d devices (%s)", secure.round, len(summed.survivors),
                 ", ".join(f"{k} {v}" for k, v in secure.counts.items()))
        aggregate.add_sum(summed, self.state.weights, {d: secure.keys[d].metrics for d in summed.survivors},
                          secure.counts)

    def _check_classes(self, update: Update) -> None:
        """Warn, once per device and task, when its labels hold classes that are not among the tasks' so far: its
        data follow another class order than the coordinator's test sets, and its accuracy would be garbage."""
        seen = set(self._context.seen_classes)
        held = {c for c, n in enumerate(update.label_counts) if n > 0}
        if self.flowing or not seen or held <= seen or (update.device, update.task) in self._class_warned:
            return
        self._class_warned.add((update.device, update.task))
        self.counters["class-mismatch"] += 1
        log.warning("%s's data hold classes %s, not among tasks 0..%d's (%s): its task files follow another class "
                    "order than the coordinator's test sets (edgefil data split writes the order to classes.json)",
                    update.device, ", ".join(map(str, sorted(held - seen))), self._context.task,
                    ", ".join(map(str, sorted(seen))))

    def _on_refused(self, refused: UpdateRefused) -> None:
        """A selected device's update for the open round was refused (counted where it was): the round stops
        waiting for it, as for a device that said it cannot train, rather than wait for it until its deadline."""
        if self.schedule is not None:  # asynchronous: its work ended without an update
            self.schedule.ended(refused.device, refused.round)
            return
        current = self.open_round
        if current is not None and current.number == refused.round:
            current.failed_with(refused.device, f"its update was refused ({refused.reason})")

    def _on_request(self, request: Request) -> None:
        """Answer with the named payloads the rule can give (an empty answer otherwise)."""
        given = self.strategy.answer(request.device, request.names)
        self.outbox.answer(request.device, request.round, given)
        log.info("%s asked for %s: sent %s", request.device, list(request.names), sorted(given))

    # --- results ----------------------------------------------------------------------------------

    def results(self) -> dict[str, Any]:
        return self.record.results()


def _clock_at_end(history: list[RoundEntry]) -> float:
    """The fleet's clock at the end of the last round a run's history holds (0 before any, or where it holds none)."""
    clock = history[-1].get("clock_s", 0.0) if history else 0.0
    return float(clock) if isinstance(clock, (int, float)) and 0 <= clock < math.inf else 0.0


def run_coordinator(
    config: CoordinatorConfig, resume: bool = False, device: str | None = None, test_sets: TestSets | None = None
) -> dict[str, Any]:
    """`edgefil coordinator --config FILE [--resume] [--device cpu|cuda]` (the command line builds a scenario's
    test sets when the file names a scenario)."""
    if device is not None:
        config = dataclasses.replace(config, device=device)
    return Coordinator(config, resume=resume, test_sets=test_sets).run(wait_for_broker=True)
