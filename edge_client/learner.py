"""One device's continual learner: the replay store, a replay policy and a trainer, tied together.

`observe()` takes the stream; at a task switch the policy ranks the samples of earlier tasks and the store keeps
the best M - N_new of them (M counts the current task's samples too), then the new task's samples are stored.
`train()` runs E local epochs on what the policy makes of everything the store holds. The store enforces its
budgets; this class only decides what to ask for.

Choices (documented, configurable where it matters):
- New data larger than the room left (N_new >= M, or later chunks of a task) is subsampled uniformly.
- A later chunk of the current task that does not fit makes the policy rank the old cache again (smaller keep).
- With a byte budget tighter than M samples, the lowest-ranked cached samples go first, then new samples.
- Training and evaluation mask the classes the device has not seen (`mask_seen_classes`).
- A task starts where the stream announces one; where it does not, where a chunk brings an unseen label
  (`detect_new_tasks`) or where the policy says so (`task_boundary`, e.g. a detector on the received model);
  `task_detectors` keeps one of the two alone ("labels", "policy"), to measure each.
- `group_by` ("class" or "task") puts quotas around any policy's ranking (`group_ranking`): the policy ranks all
  the old samples, each group keeps its water-filled share in the policy's order. Every other hook is the
  policy's own, so grouping never changes how a method trains.
- `new_share` splits M between the newest task and the older ones around any policy's ranking (`new_task_quota`):
  by default the papers' budget rule (the newest task keeps everything it brings, the old data get M - N_new);
  "stream" gives the newest task its share of everything seen, as uniform sampling of the stream does; a number s
  at most s M. The newest task's samples beyond its quota are dropped uniformly (a later chunk fills what its quota
  leaves). The papers have only the default: the split is ours (docs/results-history.md, "The budget split").
- Every hook sees the device through one frozen `RoundView` (`view()`), never the learner itself.
- M belongs to one `DeviceBudget`: the store writes within what the policy's files leave, and the policy within
  what the store leaves (edge_client/budget.py). A streaming policy decides admission itself.
- Between rounds (`between_rounds`) the weights, the optimiser state and the store's database connection stay in
  memory ("memory", a device's default: the optimiser state is not saved, and a restart starts it afresh), or
  the first two are saved with the state at every save and all three let go until the next round ("disk", a
  fleet's default: thousands of devices share a host's memory; a restart resumes the optimiser where it was).
  Either way the same steps are taken. A round may start the optimiser afresh instead (`fresh_optimizer`, the
  coordinator's `[client] fresh_optimizer`: its state zero and its step count 0 at each round's first step, as
  Flower's clients and most FedAvg implementations train): then its state is neither saved nor held between rounds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.policies import (
    GROUPINGS,
    PolicyContext,
    ReplayPolicy,
    RoundView,
    Samples,
    check_new_share,
    group_ranking,
    new_task_quota,
)
from edge_client.state import ClientState, StateError, load_state, save_state, save_state_keeping_weights
from edge_client.store import ReplayStore
from edge_client.stream import Chunk, NoveltyDetector
from edge_client.trainers.base import EvalResult, OptimizerState, Proximal, Trainer

log = logging.getLogger(__name__)
BETWEEN_ROUNDS = ("memory", "disk")
# With detect_new_tasks, what starts a task: an unseen label ("labels"), the policy's `task_boundary` ("policy", e.g.
# a jump in the entropy of the received model's outputs), or either ("both")
TASK_DETECTORS = ("both", "labels", "policy")


@dataclass(frozen=True)
class LearnerConfig:
    epochs: int = 1
    batch_size: int = 32
    mask_seen_classes: bool = True
    detect_new_tasks: bool = False  # the stream does not say where tasks start: the detectors do
    task_detectors: str = "both"  # which detectors decide then (TASK_DETECTORS)
    group_by: str | None = None  # quotas per "class" or "task" around the policy's ranking (GROUPINGS)
    new_share: float | str | None = None  # M's split between the newest task and the old ones (new_task_quota)
    between_rounds: str = "memory"  # where the weights and the optimiser state are between rounds (BETWEEN_ROUNDS)

    def __post_init__(self) -> None:
        if self.group_by is not None and self.group_by not in GROUPINGS:
            raise ValueError(f"unknown group_by {self.group_by!r}; choose one of {', '.join(GROUPINGS)}")
        if self.task_detectors not in TASK_DETECTORS:
            raise ValueError(f"unknown task_detectors {self.task_detectors!r}; choose one of "
                             f"{', '.join(TASK_DETECTORS)}")
        if self.between_rounds not in BETWEEN_ROUNDS:
            raise ValueError(f"unknown between_rounds {self.between_rounds!r}; choose one of "
                             f"{', '.join(BETWEEN_ROUNDS)}")
        check_new_share(self.new_share)


class Learner:
    def __init__(
        self,
        trainer: Trainer,
        store: ReplayStore,
        policy: ReplayPolicy,
        config: LearnerConfig = LearnerConfig(),
        seed: int = 0,
    ) -> None:
        """M is the store's budget (`ReplayStore.device_budget`): the policy's own files share it."""
        self.trainer = trainer
        self.store = store
        self.policy = policy
        # where the last whole save is, while the trainer holds what it holds, and its record where this process
        # saved it (None after a restart: the newest record there is read)
        self._saved_in: tuple[str | Path, dict[str, Any] | None] | None = None
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.state = ClientState()
        self._detector = NoveltyDetector()
        self.budget = store.device_budget()
        self.global_weights: np.ndarray | None = None  # the latest global model received (read-only)
        # the last view made: what it shows by value, what by identity, and the view (`view`)
        self._last_view: tuple[tuple[Any, ...], tuple[Any, ...], RoundView] | None = None

    def open_policy(self, state_dir: str | Path, model_artifacts: str | Path) -> None:
        """Let the policy open what it keeps besides the store (its own files, within M), once the trainer is
        known to run what the policy needs of it."""
        lacking = self.policy.trainer_graphs() - self.trainer.graphs
        if lacking:
            raise ValueError(f"policy {self.policy.name} needs the optional trainer graphs "
                             f"{', '.join(sorted(lacking))} with these options, which the {self.trainer.backend} "
                             f"backend's artifacts lack: export them again with those graphs, or change the options")
        self.policy.open(PolicyContext(Path(state_dir), Path(model_artifacts), self.budget, self.trainer))

    # --- the stream -------------------------------------------------------------------------------

    known_classes: tuple[int, ...] = ()  # what the coordinator's round said the fleet knows (class_mask)
    task_classes: tuple[int, ...] = ()  # ... and which of those the task being trained brings
    round_mask: bool | None = None  # the coordinator's round says whether to mask (None: `mask_seen_classes`)
    fresh_optimizer: bool = False  # the coordinator's round starts the optimiser afresh (module docstring)

    def view(self, global_weights: np.ndarray | None = None) -> RoundView:
        """What a policy's hook sees of this device now (`global_weights`: the model to show as the latest). The
        last view again where nothing it shows has changed since (`_last_view`): a device's round asks for one at
        each of its hooks (the global model's arrival, the round's requests, the training, the attachments), and
        each made its class mask and counts afresh, 17 us a view beside a fleet's training (docs/results.md, issue
        57). Its arrays are read-only, as the view is frozen: what one hook sees, the next sees."""
        shown = self.global_weights if global_weights is None else global_weights
        values = (self.state.task, self.state.n_seen, self.round_mask, self.known_classes, self.task_classes)
        # the state's lists are replaced where they change, never changed in place; held here, none is another's id
        held = (self.state.seen_classes, self.state.label_counts, self.state.task_counts, shown)
        last = self._last_view
        if last is not None and last[0] == values and all(a is b for a, b in zip(last[1], held)):
            return last[2]
        k = self.trainer.manifest.num_classes
        view = RoundView(
            trainer=self.trainer, rng=self.rng, batch_size=self.config.batch_size,
            class_mask=self.class_mask(), task=self.state.task,
            label_counts=_read_only(_padded(self.state.label_counts, k)),
            task_counts=_read_only(_padded(self.state.task_counts, k)), n_seen=self.state.n_seen,
            global_weights=shown, read_store=self._stored, count_store=self.store.__len__,
            known_classes=self.known_classes, task_classes=self.task_classes,
        )
        self._last_view = values, held, view
        return view

    def global_model_arrived(self, weights: np.ndarray) -> None:
        """A global model reached the device (selected for the round or not): the policy's hook runs, and the
        model becomes the latest one its hooks see."""
        self.policy.on_global_model(self.view(), weights)
        self.global_weights = weights

    def observe(self, chunk: Chunk, global_weights: np.ndarray | None = None) -> bool:
        """Take a chunk of the stream; returns True when it started a new task."""
        if global_weights is not None:
            self.global_weights = global_weights
        announced = chunk.task is not None and chunk.task != self.state.task
        detected = chunk.task is None and self.state.task >= 0 and self._detected(chunk)
        starts = announced or detected or self.state.task < 0
        if starts:
            self.state.task = chunk.task if chunk.task is not None else self.state.task + 1
            self.state.task_counts = []
        self._count_labels(chunk.y)
        self._admit(chunk.x, chunk.y)
        self._detector.update(chunk.y)
        self.state.seen_classes = sorted(self._detector.seen)
        self.state.n_seen += len(chunk.y)
        return starts

    def _detected(self, chunk: Chunk) -> bool:
        """Whether the detectors `task_detectors` names say this unannounced chunk starts a task; both are asked
        every chunk where they decide (a detector may follow the stream: an entropy detector, the chunk before)."""
        which = self.config.task_detectors
        labels = which != "policy" and self.config.detect_new_tasks and self._detector.is_new_task(chunk.y)
        policy = which != "labels" and self.policy.task_boundary(self.view(), chunk.x, chunk.y)
        return bool(labels or policy)

    def start_task(self, task: int, x: np.ndarray, y: np.ndarray, global_weights: np.ndarray | None = None) -> None:
        """A task boundary announced together with the task's data."""
        self.observe(Chunk(x, y, task), global_weights)

    # --- training ---------------------------------------------------------------------------------

    def train(self, epochs: int | None = None, proximal: Proximal | None = None) -> float:
        """E local epochs on what the policy makes of the store's contents (by default the contents themselves,
        with the plain loss, trained by the trainer's `fit`); returns the last epoch's loss."""
        self._saved_in = None  # the trainer's weights and state move on from what was saved
        if self.fresh_optimizer:
            self.trainer.reset_optimizer()
        x, y, _ = self.store.samples()
        view = self.view()
        return self.policy.fit(view, self.policy.training_set(view, x, y), epochs or self.config.epochs, proximal)

    def finish_round(self) -> None:
        """After local training: the policy's own update on the current task's real samples, where it has one
        (`acts_after_training`; the samples are read only then)."""
        if not self.policy.acts_after_training():
            return
        x, y, _ = self.store.samples(self.state.task)
        self.policy.after_training(self.view(), x, y)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        return self.trainer.evaluate(x, y, class_mask=self.class_mask())

    def class_mask(self) -> np.ndarray | None:
        """The classes the device has seen, and those the coordinator says the fleet knows (`known_classes`); None
        where the device does not mask (its `mask_seen_classes`, or the round's `round_mask` when it says). Read-only:
        a view holds it (`view`)."""
        masking = self.config.mask_seen_classes if self.round_mask is None else self.round_mask
        if not masking or not (self.state.seen_classes or self.known_classes):
            return None
        mask = np.zeros(self.trainer.manifest.num_classes, dtype=np.float32)
        mask[self.state.seen_classes] = 1.0
        mask[list(self.known_classes)] = 1.0
        return _read_only(mask)

    # --- persistence ------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> bool:
        """The state with the trainer's weights, to disk; True when whole. The weights are not kept in `state` as
        well: the trainer holds them (a fleet worker's hundreds of devices would hold a second copy each).

        Where the disk has no room for the weight file (OSError), the record alone is saved, beside the weights of
        the last whole save: the task, round, seen classes and counts survive a restart (which otherwise starts the
        task again and forgets what the device has seen), and the record names no model (`model` "", no metrics),
        so no update is rebuilt from weights that are not this round's; False. OSError when not even that fits.

        With `between_rounds = "disk"` the optimiser state is saved too, and `idle()` may then park what the save
        holds. Where the round starts the optimiser afresh (`fresh_optimizer`), its state is let go first: the
        next round does not use it (nor does a restart)."""
        on_disk = self.config.between_rounds == "disk"
        self._saved_in = None
        if self.fresh_optimizer:
            self.trainer.reset_optimizer()
        try:
            state = self.state.with_optimizer(self.trainer.optimizer_state() if on_disk else None,
                                              weights=self.trainer.get_weights())
            record = save_state(directory, state)
        except OSError:
            save_state_keeping_weights(directory, replace(self.state, model="", metrics={}, weights=None))
            return False
        self._saved_in = directory, record  # as given: a save parses no path it need not
        return True

    def idle(self) -> None:
        """The learner's work is done until the next round (a device has saved and uploaded). With `between_rounds
        = "disk"` the store lets its database connection go (`ReplayStore.release`) and the trainer parks
        (`Trainer.park`) the weights and optimiser state that the last save holds, when it holds the trainer's
        current ones (no step since, and the save whole), so a device between rounds holds none of them. With
        "memory" all three stay: the connection holds memory (70-160 KiB here, its cached pages included), and
        opened again each round it costs CPU (`benchmarks/learner_round.py`), which a device with that memory to
        spare need not pay."""
        if self.config.between_rounds != "disk":
            return
        self.store.release()
        last_save = self._saved_in
        if last_save is not None:
            self.trainer.park(lambda weights, state: self._saved_training(*last_save, weights, state))

    def _saved_training(self, directory: str | Path, record: dict[str, Any] | None, weights: bool, state: bool
                        ) -> tuple[np.ndarray | None, OptimizerState | None]:
        """The weights and (or) the optimiser state of the last whole save (`record`, or the newest record there
        where None): what a parked trainer takes back."""
        saved = load_state(directory, weights=weights, optimizer=state, saved=record)
        if saved is None or (weights and saved.weights is None):
            raise StateError(f"the state saved in {directory} lost the weights this device parked there")
        return saved.weights, saved.optimizer_state(self.trainer.manifest.num_parameters) if state else None

    def restore(self, directory: str | Path) -> bool:
        """Reload the saved state, its weights into the trainer; False when there is none."""
        state = load_state(directory)
        if state is None:
            return False
        whole = state.weights is not None  # the trainer then holds what the save holds: it may park again
        if state.weights is not None:
            self.trainer.set_weights(state.weights)
            state.weights = None
        optimizer = state.optimizer_state(self.trainer.manifest.num_parameters)
        if optimizer is not None and self.config.between_rounds == "disk":
            self.trainer.set_optimizer_state(optimizer)
        state = state.with_optimizer(None)  # the trainer holds it (a second copy here would cost what parking saves)
        self._saved_in = (directory, None) if whole else None
        self.state = state
        self._detector = NoveltyDetector(state.seen_classes)
        return True

    # --- what the store keeps ---------------------------------------------------------------------

    def _count_labels(self, y: np.ndarray) -> None:
        k = self.trainer.manifest.num_classes
        counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=k)
        self.state.label_counts = (_padded(self.state.label_counts, k) + counts).tolist()
        self.state.task_counts = (_padded(self.state.task_counts, k) + counts).tolist()

    def _capacity(self) -> int:
        limit = self.store.budget.max_samples
        return limit if limit is not None else len(self.store) + self.store.room_for(1 << 30)

    def _stored(self, task: int | None) -> Samples:
        return Samples(*self.store.samples(task))

    def _admit(self, x: np.ndarray, y: np.ndarray) -> None:
        ids = self.store.ids()
        admission = self.policy.admit(self.view(), len(y), self._capacity())
        if admission is not None:
            if len(admission.stays) < len(ids):
                self.store.keep_only(ids[admission.stays])
            self._insert_within_bytes(x[admission.enters], y[admission.enters],
                                      ranked_old=self.rng.permutation(ids[admission.stays]))
            return
        task = self.state.task
        tasks = self.store.tasks(ids)
        current, old = ids[tasks == task], ids[tasks != task]
        capacity = self._capacity()
        quota = new_task_quota(self.config.new_share, capacity, int(sum(self.state.task_counts)),
                               self.state.n_seen + len(y), len(old) if self.policy.keeps_old else 0)
        room = max(min(capacity, quota) - len(current), 0)
        if len(y) > room:
            pick = np.sort(self.rng.choice(len(y), room, replace=False))
            x, y = x[pick], y[pick]
        keep_old = capacity - len(current) - len(y) if self.policy.keeps_old else 0
        bytes_short = self.store.room_for(len(y)) < len(y)  # the byte budget will cut into the cache too
        if len(old) > keep_old or (bytes_short and len(old)):
            ranked = old[self._rank(old, min(keep_old, len(old)))]
            if len(ranked) < len(old):
                self.store.keep_only(np.concatenate([current, ranked]))
            old = ranked
        self._insert_within_bytes(x, y, ranked_old=old)

    def _rank(self, old_ids: np.ndarray, keep: int) -> np.ndarray:
        """The policy's ranking of the old samples (under the grouping's quotas, when one is set)."""
        if keep <= 0:
            return np.empty(0, dtype=np.int64)
        x, y = self.store.get(old_ids)
        old = Samples(x, y, self.store.tasks(old_ids))
        view = self.view(self.trainer.get_weights() if self.global_weights is None else None)
        group_by = self.config.group_by
        if group_by is None:
            return self.policy.rank(old, keep, view)
        return group_ranking(self.policy.rank(old, len(old), view), GROUPINGS[group_by](old), keep)

    def _insert_within_bytes(self, x: np.ndarray, y: np.ndarray, ranked_old: np.ndarray) -> None:
        """Insert; where the byte budget is the tighter one, drop the lowest-ranked cache, then new samples."""
        cache = list(ranked_old)
        while self.store.room_for(len(y)) < len(y) and cache:
            short = len(y) - self.store.room_for(len(y))
            drop, cache = cache[-short:], cache[:-short]
            self.store.delete(np.asarray(drop, dtype=np.int64))
        if self.store.room_for(len(y)) < len(y) and self.policy.release_bytes(self.view()):
            log.warning("policy %s released its own files: the new task's real samples come first (held now: %s)",
                        self.policy.name, self.budget.held())
        room = self.store.room_for(len(y))
        if room < len(y):
            log.warning("the byte budget takes only %d of %d new samples (held: %s): lower what the method "
                        "keeps beside the store, or raise max_bytes", room, len(y), self.budget.held())
            pick = np.sort(self.rng.choice(len(y), room, replace=False))
            x, y = x[pick], y[pick]
        if len(y):
            self.store.insert(x, y, self.state.task)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _padded(counts: list[int], length: int) -> np.ndarray:
    out = np.zeros(length, dtype=np.int64)
    out[: len(counts)] = counts
    return out
