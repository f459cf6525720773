"""The device daemon: one real device, from connecting to uploading, driven by the coordinator's messages.

Loop: on every (re)connect announce yourself (registration and status, both retained, so a coordinator that
starts later still learns of this device); assemble global weights as they arrive and hand each to the policy
(`on_global_model`: every device, selected or not); on a round message for a new round, take the round's global
weights, start the task when it is new (the policy picks the cache, the store enforces the budget), train, save
the client state atomically, upload.

A learning method speaks to its coordinator half through named payloads, and this daemon only carries them (it
never knows which method runs): a round message may name a payload blob for this device (`payload`: e.g. a
personalized model), which the device waits for like the weights and hands to the policy before training, and a
broadcast blob (`broadcast`: payloads for every device, e.g. an old model), which the device keeps by id
(KEPT_BROADCASTS of them) and waits for only when it does not hold it, so a payload that changes once per task
crosses the link once per task; the
policy may ask for payloads by name (`request`), the answer is awaited for up to the round config's
`answer_wait_s` while other messages wait in a backlog, in order, and goes to the policy before its own update
step; the update carries the policy's attachments and the device's label counts.

A round the device cannot train (its data missing or malformed, its configuration wrong for the task, training that
diverges to a non-finite loss) is reported to the coordinator as a status "error" with a one-line reason, which the
coordinator shows per device, instead of the device going silent until the deadline. A device that holds nothing and
whose source has nothing for the task the coordinator last named (one that joins a later task) says "no-data" in its
statuses instead of "idle", and the coordinator does not select it (`_ready_state`). A simulated device that its
availability has away at the round's start on the fleet's clock (virtual time) answers "away". A device whose task
brings no samples but whose store holds some (a client left with its old data only) starts the task and trains on
its store, whatever its method. A notice from the coordinator (e.g. that two processes use this device id) is logged
as an error.

Restarts on either side are safe: a round message for the round this device already trained (same global
model) is answered with the same update again, rebuilt from the saved state after a process restart, so a
coordinator that re-sends after a broker restart or its own resume gets an update without a second training.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import math
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_client.budget import Budget, DeviceBudget
from edge_client.config import DeviceConfig
from edge_client.environment import Environment, RealEnvironment, TurnsClosed
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import ReplayPolicy, split_policy
from edge_client.privacy import LocalPrivacy
from edge_client.secagg import SecureRoundSettings, SecureUpload
from edge_client.shared_models import remember_verified, shared_model, verified_model
from edge_client.sources import TaskSource, check_task_data, open_source
from edge_client.state import StateError, load_state
from edge_client.store import ReplayStore, StoreDiskFullError
from edge_client.stream import Chunk
from edge_client.systemd import notify
from edge_client.trainers.base import Proximal
from edge_client.trainers.choice import make_trainer
from edgefil import topics, wire
from edgefil.collector import long_run
from edgefil.link import CONNECTED, QOS, UNACKNOWLEDGED, ConnectionRefused, Link, Message, Will
from edgefil.netloop import NetworkLoop
from edgefil.secagg import SecAggError
from models.manifest import manifest_digest, software_version

log = logging.getLogger("edgefil.device")
KEPT_MODELS = 4  # weight blobs kept in memory: the current global and personal ones, and the next, arriving early
KEPT_BROADCASTS = 2  # broadcast blobs kept: the current one, and the next, arriving early
# The longest an idle device sleeps before it looks whether it was asked to stop, where a signal handler asks (it
# may not take the inbox's lock to wake the device). A device whose owner stops it with `request_stop` (a fleet
# worker) is woken instead and does not poll: 10,000 devices polling every 5 s were 2000 thread wake-ups a second
# on a 2-core host, each a handover of its worker's GIL (benchmarks/fleet_scale.py).
STOP_POLL_S = 5.0
MAX_PAYLOAD_BYTES = 64 << 20  # the largest payload or answer blob the device assembles
ANSWER_WAIT_S = 10.0  # how long a device waits for the answer to its request, unless the round config says


class Device:
    def __init__(
        self, config: DeviceConfig, source: TaskSource | None = None, environment: Environment | None = None,
        network: NetworkLoop | None = None, stop_poll_s: float | None = STOP_POLL_S,
    ) -> None:
        """`source` and `environment` default to the config's data folder and the device's own surroundings; a
        simulated fleet passes a scenario's share and an emulated profile instead (built by firmware_sim), and the
        network loop its worker's devices share (None: the device's link runs a loop of its own). `stop_poll_s`:
        how often an idle device looks at `stop_requested` (STOP_POLL_S); None where its owner stops it only with
        `request_stop`, which wakes it."""
        self.config = config
        self.stop_poll_s = stop_poll_s
        self.id = config.device_id
        self.instance = secrets.token_hex(8)  # this process: a restart has another (duplicate-id detection)
        self.trainer = make_trainer(config.trainer, config.artifacts)
        self.num_parameters = self.trainer.manifest.num_parameters
        store = ReplayStore.within(DeviceBudget(Budget(config.store.max_samples, config.store.max_bytes)),
                                   config.state_dir / "store", tuple(self.trainer.manifest.input_shape))
        policy, around = split_policy(config.policy)
        settings = config.learner
        self.learner = Learner(
            self.trainer, store, policy,
            LearnerConfig(epochs=settings.epochs, batch_size=settings.batch_size,
                          mask_seen_classes=settings.mask_seen_classes, detect_new_tasks=settings.detect_new_tasks,
                          task_detectors=settings.task_detectors, between_rounds=settings.between_rounds, **around),
            seed=_seed_of(self.id),
        )
        self.learner.restore(config.state_dir)
        self.learner.open_policy(config.state_dir, config.artifacts)
        self.privacy = local_privacy(config, self.learner.policy)
        self.learner.idle()  # until its first round
        self.source = source if source is not None else open_source(config.data.folder if config.data else None)
        self.environment = environment if environment is not None else RealEnvironment()
        self.manifest = manifest_digest(config.artifacts)
        self.models: dict[str, np.ndarray] = {}  # global weight blobs by id (wire.blob_id)
        self.reassembler = wire.Reassembler(max_blob_bytes=4 * self.num_parameters, max_pending=4)
        self.payload_reassembler = wire.Reassembler(max_blob_bytes=MAX_PAYLOAD_BYTES, max_pending=2)
        self.answer_reassembler = wire.Reassembler(max_blob_bytes=MAX_PAYLOAD_BYTES, max_pending=2)
        self.payloads: dict[str, dict[str, bytes]] = {}  # payload blobs by id, as named byte strings
        self.broadcast_reassembler = wire.Reassembler(max_blob_bytes=MAX_PAYLOAD_BYTES, max_pending=2)
        self.broadcasts: dict[str, dict[str, bytes]] = {}  # broadcast blobs by id (their version)
        self.broadcasts_received = 0  # broadcast blobs assembled (one per change, when nothing is lost)
        self.task_heard: int | None = None  # the task the latest global model or round message names
        self._source_has: tuple[int, bool] | None = None  # (task, whether the source has data for it): asked once
        self.waiting: wire.Message | None = None  # a round message whose weights have not arrived yet
        self.backlog: collections.deque[Message] = collections.deque()  # set aside while awaiting a reply
        self.rejected = 0
        self._told_head = False  # said once that a "fleet" head got a round without the fleet's classes
        self.notices: list[str] = []  # what the coordinator reported about this device
        self.run_ended: str | None = None  # how the coordinator's run ended, once it says so
        self.secure: SecureUpload | None = None  # this device's part in the open secure session (edge_client/secagg.py)
        self._last_status = 0.0
        self.stop_requested = threading.Event()
        fleet = config.fleet
        self.link = Link(
            config.broker, client_id=f"{fleet}-{self.id}",
            subscriptions=topics.device_subscriptions(fleet, self.id),
            will=Will(topics.from_device(fleet, self.id, "status"), self._status("offline")),
            network=network,
        )

    # --- the loop ---------------------------------------------------------------------------------

    def run(self, connect_timeout: float = 60.0, waiting: Callable[[], None] | None = None,
            connected: Callable[[], None] | None = None) -> None:
        """Connect (`waiting`: called when the broker keeps the device waiting, `Link.start`; `connected`: once the
        broker has taken the connection), then handle messages until asked to stop or the run ends. While it
        handles them, what the process holds is not scanned by the garbage collector (edgefil/collector.py); a
        connection that fails freezes nothing (`run_until_stopped` tries again and again)."""
        self.link.start(timeout=connect_timeout, waiting=waiting)
        log.info("%s connected to %s:%s", self.id, self.config.broker.host, self.config.broker.port)
        if connected is not None:
            connected()
        notify("READY=1")  # under systemd (edge_client/systemd.py): started
        try:
            with long_run():
                while not self.stop_requested.is_set():
                    away = self.environment.offline_for()
                    if away > 0:
                        self._stay_away(away)
                        continue
                    item = self.backlog.popleft() if self.backlog else self.link.get(timeout=self._idle_wait())
                    try:
                        if item is not None:
                            self.handle(item.topic, item.payload)
                        elif time.monotonic() - self._last_status >= self.config.heartbeat_s:
                            self._publish_status(self._ready_state(), progress=True)
                            notify("WATCHDOG=1")
                    except Exception:  # the daemon outlives any one message; what failed is in the log
                        log.exception("%s failed to handle a message; carrying on", self.id)
        finally:
            self._publish_status("offline")
            self.link.wait_idle(timeout=5.0)
            self.link.stop()
            self.learner.store.close()

    def request_stop(self) -> None:
        """Ask the device to leave, and wake it if it waits for a message (not from a signal handler: set
        `stop_requested` there, which an idle device sees within its `stop_poll_s`)."""
        self.stop_requested.set()
        self.link.wake()

    def _idle_wait(self) -> float:
        """How long to wait for a message: until the next heartbeat is due or the availability schedule may take
        the device away, at most `stop_poll_s`. Not a fixed short poll: a fleet worker's thousands of idle device
        threads waking every second kept its network thread from the GIL (connections timed out at 5000)."""
        heartbeat = self._last_status + self.config.heartbeat_s - time.monotonic()
        poll = self.stop_poll_s if self.stop_poll_s is not None else threading.TIMEOUT_MAX  # (a wait's longest)
        return max(0.0, min(heartbeat, self.environment.online_for(), poll))

    def _stay_away(self, seconds: float) -> None:
        """Offline (availability): say so, disconnect, come back when the environment says so, asking it again at
        least every STOP_POLL_S (or leave for good on stop)."""
        log.info("%s goes offline for %.1f s", self.id, seconds)
        self._publish_status("offline")
        self.link.wait_idle(timeout=5.0)
        self.link.stop()
        while seconds > 0 and not self.stop_requested.wait(min(seconds, STOP_POLL_S)):
            seconds = self.environment.offline_for()
        if not self.stop_requested.is_set():
            self.link.start()  # the CONNECTED marker makes the device announce itself again
            log.info("%s is back online", self.id)

    def handle(self, topic: str, payload: bytes | bytearray | memoryview) -> None:
        if topic == CONNECTED:
            self._announce()
            return
        parsed = topics.parse(self.config.fleet, topic)
        if parsed is None or parsed.direction == topics.FROM_DEVICE:
            # not meant for a device: amqtt 0.12 hands new clients retained messages of others' subscriptions
            self.rejected += 1
            log.debug("%s ignored a message on %s", self.id, topic)
            return
        if not len(payload):  # a retained message deleted (the end of an earlier run, cleared): nothing to do
            return
        if parsed.kind == "weights" and (known := verified_model(payload)) is not None:
            self._take_verified(*known)  # another device of the process checked this very message
            return
        try:
            message = wire.decode(payload)
            if message["kind"] == "weights":
                self._take_weights(message, payload)
            elif message["kind"] == "payload" and parsed.device == self.id:
                self._take_payload(message)
            elif message["kind"] == "broadcast":
                self._take_broadcast(message)
            elif message["kind"] == "round" and parsed.device == self.id:
                self._take_round(message)
            elif message["kind"] == "answer":
                log.debug("%s ignored a late answer to a request", self.id)
            elif message["kind"] == "notice" and parsed.device == self.id:
                self._take_notice(message)
            elif message["kind"] == "end" and parsed.direction == topics.TO_ALL:
                self._take_end(message)
            elif message["kind"] in ("neighbours", "relayed", "unmask") and parsed.device == self.id:
                self._take_secure(message)
            else:
                raise wire.WireError("kind", f"{message['kind']} on {topic}")
        except wire.WireError as err:
            self.rejected += 1
            log.warning("%s ignored a message on %s: %s", self.id, topic, err)

    # --- protocol steps ---------------------------------------------------------------------------

    def _announce(self) -> None:
        fleet, backend = self.config.fleet, self.trainer.backend
        self.link.publish(topics.from_device(fleet, self.id, "register"), wire.encode(
            "register", device=self.id, profile=self.config.profile, backend=backend, manifest=self.manifest,
            software=software_version(), instance=self.instance,
        ), retain=True)
        self._publish_status(self._ready_state())

    def _ready_state(self, task: int | None = None) -> str:
        """"idle", or "no-data" while the device holds nothing and its source has nothing for the task the coordinator
        last named (a device that joins a later task): the coordinator selects no device that says so. Before any
        task is named the device says "idle" and answers a round it cannot train with "no-data". `task`: for that
        task instead of the one last named."""
        task = self.task_heard if task is None else task
        if task is None or len(self.learner.store):
            return "idle"
        if self._source_has is None or self._source_has[0] != task:
            try:
                x, _ = self.source.task_data(task)
                has = len(x) > 0
            except FileNotFoundError:  # a folder source without the task's file: nothing collected yet
                has = False
            except ValueError:  # a damaged file is data the round must report on ("error"), not a missing one
                has = True
            self._source_has = (task, has)
        return "idle" if self._source_has[1] else "no-data"

    def _hear_task(self, task: Any) -> None:
        """The coordinator named the task being trained: a device whose readiness changes with it says so now
        (published before the task counts as heard, so whoever sees `task_heard` knows the status has gone)."""
        if not isinstance(task, int) or task == self.task_heard:
            return
        before = self._ready_state()  # the old task first: the source is asked once per task, the newest kept
        now = self._ready_state(task)
        if now != before:
            self._publish_status(now, task=task)
        self.task_heard = task

    def _take_weights(self, message: wire.Message, payload: bytes | bytearray | memoryview) -> None:
        blob = self.reassembler.add("coordinator", message)
        if blob is None:
            return
        weights = shared_model(blob.id, blob.weights(self.num_parameters))
        if message["count"] == 1:  # the payload is the whole model: the process's other devices take it as checked
            remember_verified(payload, blob.id, blob.header)
        self._take_model(blob.id, blob.header, weights)

    def _take_verified(self, blob: str, header: dict[str, Any], weights: np.ndarray) -> None:
        """A global model whose message another device of the process verified (edge_client/shared_models.py):
        taken as the reassembler would return it, once a round."""
        if self.reassembler.delivered("coordinator", blob, header.get("round")):
            self._take_model(blob, header, weights)

    def _take_model(self, blob: str, header: dict[str, Any], weights: np.ndarray) -> None:
        self.models[blob] = weights
        while len(self.models) > KEPT_MODELS:
            self.models.pop(next(iter(self.models)))
        # Not a turn: every device takes every global model, and the hook is to be cheap (ReplayPolicy).
        self.learner.global_model_arrived(weights)
        self._hear_task(header.get("task"))
        self._arrived(blob)

    def _take_payload(self, message: wire.Message) -> None:
        blob = self.payload_reassembler.add("coordinator", message)
        if blob is None:
            return
        self.payloads[blob.id] = blob.attachments()
        while len(self.payloads) > KEPT_MODELS:
            self.payloads.pop(next(iter(self.payloads)))
        self._arrived(blob.id)

    def _take_broadcast(self, message: wire.Message) -> None:
        if message["blob"] in self.broadcasts:  # held already (sent to the fleet and to this device alike)
            return
        blob = self.broadcast_reassembler.add("coordinator", message)
        if blob is None:
            return
        self.broadcasts[blob.id] = blob.attachments()
        self.broadcasts_received += 1
        while len(self.broadcasts) > KEPT_BROADCASTS:
            self.broadcasts.pop(next(iter(self.broadcasts)))
        self._arrived(blob.id)

    def _arrived(self, blob: str) -> None:
        """A blob is whole: run the round that was waiting for it, if it has everything now."""
        if self.waiting is not None and blob in _needed(self.waiting):
            waiting, self.waiting = self.waiting, None
            self._take_round(waiting)

    def _take_round(self, message: wire.Message) -> None:
        round_, model = message["round"], message["model"]
        self.task_heard = message["task"]
        done = self.learner.state.round
        if round_ == done and self._resend(message):
            return
        if round_ <= done and self.learner.state.task >= 0:
            log.info("%s ignored round %d: already past it (at %d)", self.id, round_, done)
            return
        if any(blob not in self.models and blob not in self.payloads and blob not in self.broadcasts
               for blob in _needed(message)):
            self.waiting = message  # its weights or payload are still on their way
            return
        self._train_round(message, self.models[model])

    def _take_end(self, message: wire.Message) -> None:
        """The coordinator's run is over: exit (`on_end = "exit"`), or stay connected for the next (`"wait"`)."""
        self.run_ended = f"{message['outcome']} after {message['rounds']} rounds"
        if self.config.on_end == "exit":
            log.info("%s: the run is over (%s): exiting", self.id, self.run_ended)
            self.stop_requested.set()
        else:
            log.info("%s: the run is over (%s): waiting for the next one (on_end = \"wait\")", self.id,
                     self.run_ended)
            self._publish_status(self._ready_state())  # its answer to the end: still here (an exit's is offline)

    def _take_notice(self, message: wire.Message) -> None:
        """What the coordinator wants this device's operator to know; a notice about other processes is not
        about this one."""
        named = message.get("instances")
        if isinstance(named, list) and self.instance not in named:
            return
        self.notices.append(f"{message['reason']}: {message['detail']}")
        log.error("%s: the coordinator reports %s: %s", self.id, message["reason"], message["detail"])

    def _train_round(self, message: wire.Message, global_weights: np.ndarray) -> None:
        """Train and upload; a round that cannot be trained is reported to the coordinator (status "error")."""
        try:
            self._train(message, global_weights)
        except TurnsClosed:  # its process stops its devices: the round is left, nothing of it saved or sent
            log.info("%s stops: round %d not trained", self.id, message["round"])
        except Exception as err:  # its data, its configuration, a diverged training: the coordinator must know
            reason = f"{type(err).__name__}: {err}"[:wire.MAX_TEXT_CHARS]
            log.error("%s cannot train round %d: %s", self.id, message["round"], reason)
            self._publish_status("error", message["round"], error=reason)

    def _train(self, message: wire.Message, global_weights: np.ndarray) -> None:
        round_, task, config = message["round"], message["task"], message["config"]
        if self._ready_state() == "no-data":  # nothing stored, nothing to take (it joins a later task)
            log.info("%s holds no data yet: round %d passed over", self.id, round_)
            self._publish_status("no-data", round_)
            return
        if self.environment.away_at(_clock_s(config)):  # offline then on the fleet's clock: it sits the round out
            log.info("%s is away at round %d's start (the fleet's clock): round passed over", self.id, round_)
            self._publish_status("away", round_)
            return
        secure = self._secure_settings(config)
        refusal = None if self.privacy is None else self.privacy.refusal()
        if refusal is not None:  # its data is not spent past what it allows: the run selects it no more
            log.warning("%s: %s; round %d not trained", self.id, refusal, round_)
            self._publish_status("spent", round_, refusal)
            return
        blob_bytes = 4 * self.num_parameters
        messages = wire.chunk_count(blob_bytes)
        device_seconds = self.environment.transfer(blob_bytes, messages, upload=False)
        try:
            self.environment.check_training(
                self.trainer.manifest, self.config.learner.batch_size, self.config.trainer.optimizer
            )
        except MemoryError as err:  # an out-of-memory kill: the device drops out (its will says offline)
            log.error("%s: %s; leaving the fleet", self.id, err)
            self.stop_requested.set()
            return
        started = self.environment.cpu_time()  # CPU time, not wall: virtual devices share the host's cores
        self.trainer.set_weights(global_weights)
        if "lr" in config:
            self.trainer.set_learning_rate(float(config["lr"]))
        self.learner.known_classes = self._known_classes(config.get("known_classes", ()))
        self.learner.task_classes = self._known_classes(config.get("task_classes", ()), "task_classes")
        if self.learner.policy.head_classes == "fleet" and not self.learner.known_classes and not self._told_head:
            self._told_head = True
            log.warning("%s: policy %s trains its head over the fleet's classes, and the round names none: set "
                        "[client] known_classes = true on the coordinator", self.id, self.learner.policy.name)
        self.learner.round_mask = self._round_switch(config, "mask_seen_classes")
        self.learner.fresh_optimizer = self._round_switch(config, "fresh_optimizer") is True
        disk_full, started_task = False, False
        if task != self.learner.state.data_task:
            x, y = self.source.task_data(task)
            manifest = self.trainer.manifest
            if len(y) or not len(self.learner.store):  # a task that brings nothing: the device trains on its store
                check_task_data(x, y, manifest.input_shape, manifest.num_classes, task)
            else:
                x, y = np.zeros((0, *manifest.input_shape), np.float32), np.zeros(0, np.int64)
                log.info("%s: task %d brings no new samples: training on its store (%d samples)", self.id, task,
                         len(self.learner.store))
            try:
                self.learner.state.data_task = task  # taken, whatever the store keeps of it
                chunk = Chunk(x, y, None if self.config.learner.detect_new_tasks else task)
                started_task = self.environment.turn(lambda: self.learner.observe(chunk, global_weights=global_weights))
            except StoreDiskFullError as err:  # the store kept its last committed state: train on that
                log.warning("%s: disk full while storing task %d: %s", self.id, task, err)
                disk_full = True
        if not len(self.learner.store) and not disk_full:
            raise ValueError(f"no samples to train on in round {round_}: the store kept none of the task's")
        policy = self.learner.policy
        self._give(policy, {**self.broadcasts.get(message.get("broadcast", ""), {}),
                            **self.payloads.get(message.get("payload", ""), {})})
        asked = self._request(round_, policy.requests(self.learner.view(), config))
        mu = float(config.get("mu", 0.0))
        epochs = int(config["epochs"]) if "epochs" in config else None
        proximal = Proximal(mu, global_weights) if mu > 0 else None
        # Not a turn while awaiting an answer above: that is no CPU work.
        loss = self.environment.turn(lambda: self.learner.train(epochs=epochs, proximal=proximal))
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged: loss {loss} (learning rate too high for this data?)")
        if asked:
            self._give(policy, self._await_answer(round_, float(config.get("answer_wait_s", ANSWER_WAIT_S))))
        # The policy's own update (a generator's training) is CPU work too: in a turn, not beside the other hosted
        # devices' (their torch work in parallel threads fought over the GIL); a policy without one takes no turn.
        if policy.acts_after_training():
            self.environment.turn(self.learner.finish_round)
        passes = (epochs or self.config.learner.epochs) * len(self.learner.store)  # what modelled compute counts
        device_seconds += self.environment.compute(self.environment.cpu_time() - started, passes)
        if self.environment.offline_for() > 0:  # went away while training: the round is lost
            log.info("%s went offline during round %d; dropping it", self.id, round_)
            return
        attachments = self._attachments()  # encoded once: timed here, sent below
        upload_bytes = blob_bytes + sum(len(a) for a in attachments.values())
        device_seconds += self.environment.transfer(upload_bytes, wire.chunk_count(upload_bytes), upload=True)
        self.learner.state.round = round_
        self.learner.state.model = message["model"]
        if self.privacy is not None:  # what is saved (and resent) is the release: one release a round
            weights, released = self.privacy.release(self.trainer.get_weights(), global_weights,
                                                     self.learner.policy.attached_values() if attachments else None)
            self.trainer.set_weights(weights)
            attachments = attachments if released is None else released
        self.learner.state.metrics = {
            **self.learner.policy.metrics(),
            **({} if self.privacy is None else {"local_epsilon": self.privacy.epsilon()}),
            "loss": loss, "device_seconds": device_seconds, "disk_full": float(disk_full),
            # where the device's own tasks start (with detect_new_tasks, its detectors decide: benchmarks count them)
            "device_task": float(self.learner.state.task), "task_started": float(started_task),
            "disk_free_bytes": float(shutil.disk_usage(self.config.state_dir).free),
        }
        try:
            if not self.learner.save(self.config.state_dir):
                log.warning("%s: no room for its weights: saved its task and counts only", self.id)
                self.learner.state.metrics["disk_full"] = 1.0
        except OSError as err:  # the previous state stays whole (atomic replace); report and go on
            log.warning("%s: could not save its state: %s", self.id, err)
            self.learner.state.metrics["disk_full"] = 1.0
        log.info("%s trained round %d (task %d): loss %.4f on %d stored samples, %.2f device seconds",
                 self.id, round_, task, loss, len(self.learner.store), device_seconds)
        self._upload(round_, message["model"], self.learner.state.metrics, attachments, secure=secure)
        self.learner.idle()  # saved and sent: what the next round needs waits on disk (between_rounds)
        notify("WATCHDOG=1")  # a round trained: alive

    def _give(self, policy: ReplayPolicy, payloads: dict[str, bytes]) -> None:
        """Hand named payloads to the policy; one it cannot use is counted and logged, and the round goes on."""
        if not payloads:
            return
        try:
            policy.receive(self.learner.view(), payloads)
        except ValueError as err:
            self.rejected += 1
            log.warning("%s ignored payloads %s: %s", self.id, sorted(payloads), err)

    def _request(self, round_: int, names: list[str]) -> bool:
        """Ask the coordinator for the named payloads the policy wants this round."""
        if not names:
            return False
        self.link.publish(topics.from_device(self.config.fleet, self.id, "request"),
                          wire.encode("request", device=self.id, round=round_, names=names))
        return True

    def _await_answer(self, round_: int, timeout: float) -> dict[str, bytes]:
        """The coordinator's answer to this round's request; {} when it does not come in time. Other messages
        that arrive meanwhile are set aside, in order, for the main loop."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            item = self.link.get(timeout=left)
            if item is None:
                break
            parsed = topics.parse(self.config.fleet, item[0])
            if parsed is None or parsed.kind != "answer" or parsed.device != self.id:
                self.backlog.append(item)
                continue
            try:
                message = wire.decode(item[1])
                # keyed by round: the same answer to the same request in two rounds is one blob id, and not a repeat
                blob = self.answer_reassembler.add(f"coordinator/{message['round']}", message)
                if blob is None or blob.header["round"] != round_:
                    continue
                return blob.attachments()
            except wire.WireError as err:
                self.rejected += 1
                log.warning("%s ignored an answer to its request: %s", self.id, err)
        log.info("%s: no answer to its request arrived in %.1f s; going on without it", self.id, timeout)
        return {}

    def _resend(self, message: wire.Message) -> bool:
        """Answer a repeated round message with the update already made for it, rebuilt from the saved state (the
        same path in a running process and after a restart: the update is not kept in memory, where a fleet
        worker's hundreds of devices would each hold one); False when there is none. A secure round's update goes
        into the round's new session, once the global model it answers is here."""
        round_, model = message["round"], message["model"]
        if self.learner.state.model != model:
            return False
        try:
            secure = self._secure_settings(message["config"])
        except ValueError as err:
            self._publish_status("error", round_, error=str(err))
            return True
        if secure is not None and model not in self.models:
            self.waiting = message  # the change it sends is against the global model
            return True
        try:
            saved = load_state(self.config.state_dir)
        except StateError as err:
            log.warning("%s cannot resend round %d: %s", self.id, round_, err)
            return False
        if saved is None or saved.model != model or saved.weights is None:  # its save failed: nothing to resend
            return False
        # under local DP the attachments' release was not kept: the weights' release goes alone
        self._upload(round_, model, saved.metrics, {} if self.privacy is not None else None, saved.weights, secure)
        return True

    def _upload(self, round_: int, model: str, metrics: dict[str, float],
                attachments: dict[str, bytes] | None = None, weights: np.ndarray | None = None,
                secure: SecureRoundSettings | None = None) -> None:
        """The update: `weights` (default: the trainer's), the policy's attachments (default: asked now); in a
        secure round, its keys instead, which open its part in the round's session (`_take_secure` goes on)."""
        store, policy = self.learner.store, self.learner.policy
        weights, num_samples = self._claims(model, self.trainer.get_weights() if weights is None else weights)
        metrics = {
            **metrics, "stored_samples": len(store), "stored_bytes": self.learner.budget.used(),
            "bytes_sent": self.link.bytes_sent, "bytes_received": self.link.bytes_received,
            "store_budget_bytes": self.learner.budget.max_bytes or 0,
            "store_budget_samples": self.learner.budget.max_samples or 0,
        }
        if secure is not None:
            session = self.secure
            if session is None or (session.session, session.round) != (secure.session, round_):  # else: resent
                session = self.secure = SecureUpload(self.id, round_, secure, weights.astype(np.float64)
                                                     - self.models[model], num_samples,
                                                     self.learner.state.data_task, model, metrics)
            self._publish_secure("keys", session.advertisement)
            self._last_status = time.monotonic()  # heard: the next heartbeat counts from here
            return
        data, layout = wire.pack_attachments(wire.weights_bytes(weights),
                                             policy.attachments(self.learner.view()) if attachments is None
                                             else attachments)
        frames = wire.encode_blob(
            "update", data, device=self.id, round=round_, task=self.learner.state.data_task, model=model,
            num_samples=num_samples, attachments=layout, label_counts=self.learner.state.label_counts,
            trained_counts=trained_parts(store), metrics=metrics,
        ).frames
        for frame in frames:  # over `data`, which is the update's alone (a copy the trainer or the state gave)
            self.link.publish(topics.from_device(self.config.fleet, self.id, "update"), frame)
        self._last_status = time.monotonic()  # heard: the next heartbeat counts from here

    def _secure_settings(self, config: dict[str, Any]) -> SecureRoundSettings | None:
        """The round's secure aggregation (None: a plain round); ValueError (one line) when it cannot be run here."""
        return secure_round(config, self.learner.policy, self.config.privacy.require_secure_aggregation)

    def _take_secure(self, message: wire.Message) -> None:
        """The coordinator's next message in this device's secure session, answered (edge_client/secagg.py). One that
        the device refuses ends its part, said as an error status: the session does not wait for it."""
        session = self.secure
        if session is None or message["session"] != session.session or message["round"] != session.round:
            log.debug("%s ignored a %s message of another secure session", self.id, message["kind"])
            return
        try:
            if message["kind"] == "neighbours":
                self._publish_secure("shares", session.on_neighbours(message))
            elif message["kind"] == "relayed":
                for frame in session.on_relayed(message).frames:
                    self._publish_secure("masked", frame)
            else:
                self._publish_secure("reveal", session.on_unmask(message))
                self.secure = None  # its part is done
        except SecAggError as err:
            self.secure = None
            self.rejected += 1
            log.warning("%s left secure session %s of round %d: %s", self.id, session.session, session.round, err)
            self._publish_status("error", session.round, error=f"secure aggregation: {err}")

    def _publish_secure(self, kind: str, payload: bytes | wire.Frame) -> None:
        self.link.publish(topics.from_device(self.config.fleet, self.id, kind), payload)

    def _attachments(self) -> dict[str, bytes]:
        """What the update carries beside its weights: the policy's attachments (a compromised device of a
        simulated fleet sends others: firmware_sim/adversary.py)."""
        return self.learner.policy.attachments(self.learner.view())

    def _claims(self, model: str, weights: np.ndarray) -> tuple[np.ndarray, int]:
        """What this device's update for global model `model` says: its trained weights, and the samples they
        learnt from (its store's). Weights that training left exactly as the global model was learnt nothing, and
        claim no samples: a device whose store holds one class, and which masks the classes it has not seen, has a
        loss of 0 and no gradient. Counting its samples would weigh the global model back into the round (its
        update says it has nothing, rather than riding free: at Dirichlet 0.1, 13 % of honest updates were such,
        and the guard refused them as free riders; issue 56). Measured against FedAvg's way (its samples counted) and
        against a mask under which its step is not empty, claiming nothing learns as well or better (docs/results.md,
        "A device that holds one class"). A compromised device of a simulated fleet says otherwise
        (firmware_sim/adversary.py)."""
        start = self.models.get(model)
        if start is not None and np.array_equal(start, weights):
            return weights, 0
        return weights, len(self.learner.store)

    def _status(self, state: str, round_: int | None = None, error: str | None = None,
                task: int | None = None) -> bytes:
        """`task`: the task a "no-data" is about (default: the one last heard): the coordinator selects the device
        again when the run moves past it."""
        done = self.learner.state.round if round_ is None else round_
        extra: dict[str, Any] = {"error": error} if error else {}
        about = self.task_heard if task is None else task
        if state == "no-data" and about is not None:
            extra["task"] = about
        return wire.encode("status", device=self.id, state=state, round=done, instance=self.instance, **extra)

    def _known_classes(self, value: object, key: str = "known_classes") -> tuple[int, ...]:
        """The round's `known_classes` (or `task_classes`), when they are class ids of this model; refused (none)
        otherwise."""
        k = self.trainer.manifest.num_classes
        if isinstance(value, (list, tuple)) and len(value) <= k and all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < k for c in value):
            return tuple(value)
        log.warning("%s: the round's %s are not class ids of this model: ignored", self.id, key)
        return ()

    def _round_switch(self, config: dict[str, Any], key: str) -> bool | None:
        """The round's `key` (mask_seen_classes, fresh_optimizer) when it is true or false; None where the round
        leaves it out, and for anything else, which is ignored (the device's own setting holds)."""
        value = config.get(key)
        if value is None or isinstance(value, bool):
            return value
        log.warning("%s: the round's %s is not true or false: ignored", self.id, key)
        return None

    def _publish_status(self, state: str, round_: int | None = None, error: str | None = None,
                        task: int | None = None, progress: bool = False) -> None:
        """`progress`: a status the coordinator does not wait on (a heartbeat) goes
        unacknowledged (QoS 0): a connection that drops loses it, and every (re)connect announces the device's
        state again at QoS 1 (`_announce`). The statuses that answer a round (error, no-data, away, spent), the
        announcement and the exit's offline stay QoS 1. A round that the device trains says nothing of its
        progress: its round message and its update tell the coordinator, which shows it training between the two
        (coordinator/roster.py); the two statuses a device and round it sent before were 14 % of a 200-device
        fleet's CPU (docs/results.md, "A device's round without what it repeats")."""
        self._last_status = time.monotonic()
        topic = topics.from_device(self.config.fleet, self.id, "status")
        self.link.publish(topic, self._status(state, round_, error, task), retain=True,
                          qos=UNACKNOWLEDGED if progress else QOS)


def local_privacy(config: DeviceConfig, policy: ReplayPolicy) -> LocalPrivacy | None:
    """The device's local DP (edge_client/privacy.py), None when off; ValueError (one line) for a policy whose
    attachments its noise would not cover."""
    if not config.privacy.local:
        return None
    if not policy.releases_values():
        raise ValueError(f"[privacy] mode = \"local\" noises the weights and numbers a policy attaches: policy "
                         f"{policy.name} attaches more to its updates (built from the device's data), which would "
                         f"leave unprotected")
    return LocalPrivacy(config.privacy, config.state_dir, stream=_seed_of(config.device_id))


def secure_round(config: dict[str, Any], policy: ReplayPolicy, required: bool = False) -> SecureRoundSettings | None:
    """A round config's secure aggregation (edge_client/secagg.py), None for a plain round; ValueError (one line)
    when its entry is broken, the policy attaches payloads to its updates, which a sum of weights would leave out,
    or the round is plain and the device `required` secure aggregation."""
    try:
        secure = SecureRoundSettings.of(config.get("secure"))
    except SecAggError as err:
        raise ValueError(f"secure aggregation: {err}") from None
    if secure is None and required:
        raise ValueError("[privacy] require_secure_aggregation: this device sends its update only masked, and the "
                         "round is plain (the coordinator's [secure_aggregation] is off)")
    if secure is not None and policy.attaches():
        raise ValueError(f"secure aggregation sums the weights alone: policy {policy.name} attaches more to its "
                         f"updates")
    return secure


def _needed(message: wire.Message) -> list[str]:
    """The blobs a round message needs: the global model, and its payload and broadcast blobs when it names them."""
    return [message["model"], *(message[k] for k in ("payload", "broadcast") if k in message)]


def _clock_s(config: dict[str, Any]) -> float | None:
    """The round's start on the fleet's clock (`clock_s`, virtual time), when the round names a finite one."""
    value = config.get("clock_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _seed_of(device_id: str) -> int:
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:4], "little")


def run_device(device: Device, connect_timeout: float = 60.0) -> None:
    """`edgefil client --config FILE`: run until SIGTERM/SIGINT or the run's end, then leave cleanly (status
    offline), waiting for its broker however long (`run_until_stopped`)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: device.stop_requested.set())
    run_until_stopped(device, connect_timeout)


def run_until_stopped(device: Device, connect_timeout: float = 60.0,
                      connected: Callable[[], None] | None = None) -> None:
    """Run `device` until it is asked to stop or the run ends. A broker that does not answer is waited for, however
    long (a device often boots before it, or outlives its restart; a fleet worker's devices connect while the host
    is busy starting thousands more); one that refuses the device (its password, its certificate) is not:
    ConnectionRefused. `connected`: as `Device.run`'s."""
    broker = f"{device.config.broker.host}:{device.config.broker.port}"

    def waiting() -> None:  # said within seconds, not after the whole timeout
        log.warning("%s: waiting for the MQTT broker at %s (no answer yet; still trying until stopped)", device.id,
                    broker)

    while not device.stop_requested.is_set():
        try:
            device.run(connect_timeout, waiting, connected)
            return
        except ConnectionRefused:
            raise
        except ConnectionError as err:
            log.warning("%s: %s; still trying until stopped", device.id, err)
            notify("WATCHDOG=1")  # waiting for a broker is not being stuck


def trained_parts(store: ReplayStore) -> list[list[int]]:
    """What an update was trained on, for the coordinator's calibration reference: [task, class, samples] of the
    store, by task as well as class (a domain-incremental store holds a class in every domain it has seen), the
    4096 largest (the wire's bound; a store of more distinct parts is compared on those)."""
    return [[task, class_, n] for task, class_, n in store.counts() if task >= 0 and class_ >= 0][:4096]
