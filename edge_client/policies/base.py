"""The ReplayPolicy interface: the device half of a learning method.

A method lives in its own files: a policy here (`edge_client/policies/<name>.py`, or a package) and, when it needs
one, a strategy on the coordinator (`coordinator/strategies/<name>.py`). The generic parts — the learner, the
device daemon, the wire, the coordinator — call the hooks below at fixed points of a round and never name a
method. A policy can:

- rank the samples of earlier tasks (`rank`, most valuable first, so the learner can always keep a prefix) and
  decide which new samples enter while the data stream in (`admit`; by default the learner's task-switch rule);
  class or task quotas are the learner's (`group_by`), applied around any ranking;
- follow every global model the device receives, selected for the round or not (`on_global_model`), and declare a
  task boundary itself where the stream does not announce one (`task_boundary`);
- keep more than samples on disk (`open` gets the device's `DeviceBudget`: register what you keep, write within
  `room`), so everything shares the one budget M;
- shape local training (`training_set`: extra samples and `LossInputs` — per-sample weights, soft or multi-hot
  targets, a teacher's logits with a weight, a soft-target term, class costs, the CE or BCE head — and a rate per
  parameter), with any trainer backend; or run the round's
  local training itself (`fit`) when its step is not a shaped loss (one softmax per task's head, an adversary on
  the features), on the trainer's public steps;
- speak to its strategy through named payloads: ask for some (`requests`, answered through `receive`), take those
  the coordinator sends with a round (`receive`), attach some to its update (`attachments`);
- report numbers (`metrics`).

Every hook but `open` sees the device through one frozen `RoundView` (the trainer, rng, batch size, class mask,
label and task counts, the latest global model, the tasks of the stored samples), made by the learner at the call,
so a policy needs no learner internals. A policy never touches the store's files: the learner loads candidates,
asks for a ranking, and tells the store what to keep.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edge_client.budget import DeviceBudget
from edge_client.trainers.base import LossInputs, Proximal, Trainer
from edgefil.registry import Registry


@dataclass(frozen=True)
class Samples:
    """Samples in memory: inputs, labels and the task each came from."""

    x: np.ndarray
    y: np.ndarray
    task: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class RoundView:
    """What every hook of a policy sees of its device, made by the learner at the call and frozen: the task
    model's trainer, the learner's rng and batch size, the seen-class mask, the task, the samples seen per class
    over the device's life (`label_counts`) and in the current task (`task_counts`), how many it has seen, and
    the latest global model it received (None before the first). How many samples it stores, their tasks and the
    samples themselves are read when asked (`n_stored`, `stored_tasks`, `stored`): most hooks never need them, and a
    fleet worker makes a view for each of its devices at every broadcast."""

    trainer: Trainer
    rng: np.random.Generator
    batch_size: int
    class_mask: np.ndarray | None
    task: int
    label_counts: np.ndarray
    task_counts: np.ndarray
    n_seen: int
    global_weights: np.ndarray | None
    read_store: Callable[[int | None], Samples] = field(repr=False, compare=False)
    count_store: Callable[[], int] = field(repr=False, compare=False)
    # what the coordinator's round said of the fleet (`[client] known_classes`): the classes of its tasks so far, and
    # of those the classes of the task being trained (both empty where the round does not say)
    known_classes: tuple[int, ...] = ()
    task_classes: tuple[int, ...] = ()

    @classmethod
    def of_samples(cls, trainer: Trainer, global_weights: np.ndarray | None, class_mask: np.ndarray | None,
                   rng: np.random.Generator, batch_size: int = 64, stored: Samples | None = None) -> RoundView:
        """A view of no learner: samples held in memory (`stored`, none by default) ranked with a trainer (the
        benchmarks that time a ranking, tools that rank a data set). Counts are taken from `stored`."""
        k = trainer.manifest.num_classes if trainer is not None else 0
        held = stored if stored is not None else Samples(np.empty((0,)), np.empty(0, np.int64), np.empty(0, np.int64))
        task = int(held.task.max()) if len(held) else 0

        def read(only: int | None) -> Samples:
            pick = slice(None) if only is None else held.task == only
            return Samples(held.x[pick], held.y[pick], held.task[pick])

        return cls(trainer, rng, batch_size, class_mask, task, np.bincount(held.y, minlength=k),
                   np.bincount(read(task).y, minlength=k), len(held), global_weights, read, lambda: len(held))

    def n_stored(self) -> int:
        """How many samples the store holds now (a query: a fleet worker makes a view per device per broadcast)."""
        return self.count_store()

    def stored(self, task: int | None = None) -> Samples:
        """The stored samples (of one task when given), in the order `training_set` receives them."""
        return self.read_store(task)

    def stored_tasks(self) -> np.ndarray:
        """The task of every stored sample, in the order `training_set` and `fit` receive them."""
        return self.read_store(None).task

    def seen_before_task(self) -> np.ndarray:
        """Classes the device had seen before the current task."""
        return np.flatnonzero(self.label_counts - self.task_counts > 0)

    def old_classes(self) -> np.ndarray:
        """The classes of earlier tasks: those this device had seen before the current task, and those the round
        names as the fleet's but not as the task's own (`known_classes` less `task_classes`), sorted. A head over
        the fleet's classes keeps what the fleet learnt of these, a device's own share of them included."""
        fleet = set(self.known_classes) - set(self.task_classes) - set(np.flatnonzero(self.task_counts).tolist())
        return np.union1d(self.seen_before_task(), np.asarray(sorted(fleet), dtype=np.int64)).astype(np.int64)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may open with: the device's state folder (its files go in a folder of their own there), the
    model's artifact folder, the budget M every byte it keeps counts against, and the task model's trainer."""

    state_dir: Path
    artifacts: Path
    budget: DeviceBudget
    trainer: Trainer


@dataclass(frozen=True)
class Admission:
    """A streaming policy's decision for one chunk: positions of the stored samples that stay (into the store's
    ids) and of the arriving samples that enter."""

    stays: np.ndarray
    enters: np.ndarray


@dataclass(frozen=True)
class TrainingSet:
    """What one round trains on: inputs, labels and, when the policy shapes the loss, its inputs; and, when it
    trains some parameters at rates of their own, each parameter's rate as a multiple of the learning rate
    (`Trainer.scaled_rates`; `class_rate_scale` makes one for some classes' head)."""

    x: np.ndarray
    y: np.ndarray
    loss: LossInputs | None = None
    rate_scale: np.ndarray | None = None


POLICIES: Registry[ReplayPolicy] = Registry("replay policy")  # every policy class by its config name


class ReplayPolicy(ABC):
    """The device half of a learning method (see the module docstring); every hook but `rank` is a no-op here."""

    name: ClassVar[str]
    keeps_old: ClassVar[bool] = True  # False: earlier tasks' samples leave the store at every task switch
    # The classes the model's head trains: "seen" (the default) those this device has seen (its class mask); "fleet"
    # those of the fleet's tasks so far as the round names them (`[client] known_classes`), which a one-vs-rest
    # (sigmoid) head needs: its loss pushes down every visible class but the label, and a class the device never
    # holds would otherwise never be pushed down anywhere. Classes no task has named stay hidden either way. A fleet
    # sends known_classes for a "fleet" policy (firmware_sim/fleet.py); a device that gets a round without them
    # says so once.
    head_classes: ClassVar[str] = "seen"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            POLICIES.add(cls.name, cls)

    @abstractmethod
    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        """Positions into `old` of at most `keep` samples to cache, most valuable first. `view.global_weights` is
        the model the new task starts from."""

    def admit(self, view: RoundView, n_new: int, capacity: int) -> Admission | None:
        """Decide, as the data stream in, which stored samples stay and which new ones enter (`view.n_seen` seen
        before this chunk, `view.n_stored()` stored, `capacity` the most the store may hold); None (the default)
        leaves it to the learner's task-switch rule (rank the old, keep M - N_new of them)."""
        return None

    def task_boundary(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> bool:
        """A chunk of the stream that does not announce its task: True starts a new task with it (beside the
        learner's unseen-label detector, `detect_new_tasks`). Never asked where the stream announces tasks."""
        return False

    def on_global_model(self, view: RoundView, weights: np.ndarray) -> None:
        """A global model arrived (read-only `weights`; `view.global_weights` is the one before it). Every device
        runs this for every global model it receives, whether or not it is selected for the round, on its own
        thread and not in its turn (edge_client/environment.py): keep it cheap (note what arrived, do the work
        when the round trains). A turn each cost a fleet worker's 1500 devices a handoff to the turns thread
        every round (a 3000-device round 2.5x as long)."""

    @classmethod
    def export_artifacts(cls, options: Mapping[str, Any], model_artifacts: Path, seed: int = 0) -> None:
        """Host side (a fleet, before its devices start): write what the policy opens besides the model's
        artifacts (e.g. a generative model's) when it is missing. Nothing by default."""

    def trainer_graphs(self) -> frozenset[str]:
        """The optional trainer computations (`models.manifest.OPTIONAL_GRAPHS`) the policy runs with its options:
        a fleet exports only these of the optional graphs, and the learner refuses to open the policy on a trainer
        that lacks one (`Trainer.graphs`). None by default: a policy whose `training_set` or `fit` gives a loss that
        is not plain (`LossInputs.plain`) says "gradient" (`models.manifest.FULL_GRADIENT`)."""
        return frozenset()

    def open(self, ctx: PolicyContext) -> None:
        """Open what the policy keeps on disk besides the store, registering it with `ctx.budget`."""

    def requests(self, view: RoundView, config: Mapping[str, Any]) -> list[str]:
        """Names of payloads to ask the coordinator for this round (`config` is the round's configuration, where
        the method's strategy may have said what it holds); the answer comes through `receive`."""
        return []

    def receive(self, view: RoundView, payloads: Mapping[str, bytes]) -> None:
        """Named payloads from the coordinator: those sent with the round (e.g. "personal", a personalized model's
        float32 weights) before training, and the answer to `requests` after it."""

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        """What to train on, given the store's samples: by default exactly those, with the plain loss."""
        return TrainingSet(x, y)

    def fit(self, view: RoundView, batch: TrainingSet, epochs: int, proximal: Proximal | None) -> float:
        """The round's local training on `batch` (what `training_set` made); returns the last epoch's mean loss.
        By default the trainer's `fit`: E epochs of shuffled batches under the seen-class mask, at the batch's
        rates, with the strategy's proximal term when it sends one."""
        with view.trainer.scaled_rates(batch.rate_scale):
            return view.trainer.fit(
                batch.x, batch.y, epochs=epochs, batch_size=view.batch_size, class_mask=view.class_mask,
                rng=view.rng, proximal=proximal, loss=batch.loss,
            )

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        """Called after the task model's local training with the current task's real samples, where the policy
        `acts_after_training`."""

    def acts_after_training(self) -> bool:
        """Whether `after_training` is to be called: the learner reads the current task's samples for it, and a
        fleet's device takes a turn for it, only then (a policy that has nothing to do then saves both every round).
        By default whether the policy's class overrides `after_training`, so that a policy written without this
        hook keeps its own; one whose override does nothing under some options may say False for them."""
        return type(self).after_training is not ReplayPolicy.after_training

    def release_bytes(self, view: RoundView) -> bool:
        """The byte budget cannot take the new task's real samples beside what the policy keeps: give up what it
        can (its own files), as the current task's real data come first. True if anything was freed."""
        return False

    def attachments(self, view: RoundView) -> dict[str, bytes]:
        """Named byte strings the round's update carries besides the model."""
        return {}

    def attaches(self) -> bool:
        """Whether its updates may carry attachments (with its options). A policy that overrides `attachments` says
        True."""
        return False

    def attached_values(self) -> AttachedValues | None:
        """The attachments it last gave (`attachments`) as numbers that local DP releases with the weights, one
        Gaussian mechanism (edge_client/privacy.py); None while it gives none (a policy that attaches nothing gives
        none). A policy whose attachments are not such numbers raises NotImplementedError: local DP refuses it
        (`releases_values`)."""
        if not self.attaches():
            return None
        raise NotImplementedError(f"policy {self.name} gives its attachments as no numbers local DP can release")

    def releases_values(self) -> bool:
        """Whether local DP can release its attachments (`attached_values`): every policy that attaches nothing, and
        those that say so."""
        return not self.attaches()

    def metrics(self) -> dict[str, float]:
        """The last round's numbers worth reporting."""
        return {}


@dataclass(frozen=True)
class AttachedValues:
    """A policy's attachments as flat numbers (float64) and how numbers of that length become attachments again: what
    local DP noises and sends in their place."""

    values: np.ndarray
    encode: Callable[[np.ndarray], dict[str, bytes]]


def balanced_quotas(labels: np.ndarray, keep: int) -> dict[int, int]:
    """Split `keep` slots over the classes as evenly as their sample counts allow (water-filling)."""
    classes, counts = np.unique(labels, return_counts=True)
    quotas = dict.fromkeys(classes.tolist(), 0)
    remaining = min(keep, int(counts.sum()))
    open_classes = sorted(zip(counts.tolist(), classes.tolist()))
    while remaining and open_classes:
        share = remaining // len(open_classes)
        if share == 0:  # fewer slots than classes: one each, smallest classes first (seeded order upstream)
            for _, c in open_classes[:remaining]:
                quotas[c] += 1
            break
        still_open = []
        for count, c in open_classes:
            take = min(share, count - quotas[c])
            quotas[c] += take
            remaining -= take
            if quotas[c] < count:
                still_open.append((count, c))
        open_classes = still_open
    return quotas


def interleave_by_class(order_per_class: dict[int, np.ndarray]) -> np.ndarray:
    """Merge per-class rankings round-robin, so any prefix of the result stays class-balanced."""
    lists = [list(v) for v in order_per_class.values()]
    merged: list[int] = []
    for depth in range(max((len(v) for v in lists), default=0)):
        merged.extend(v[depth] for v in lists if depth < len(v))
    return np.asarray(merged, dtype=np.int64)


# What a ranking can be grouped by: the key of each sample. The learner applies it (`LearnerConfig.group_by`)
# around any policy's `rank`, as Avalanche's buffers compose `groupby` with any selection strategy.
GROUPINGS: dict[str, Callable[[Samples], np.ndarray]] = {
    "class": lambda samples: samples.y,
    "task": lambda samples: samples.task,
}


# How M is split between the newest task and the older ones (`LearnerConfig.new_share`), applied by the learner at
# the task-switch rule around any policy's ranking: None (the papers' budget rule, the default) gives the newest
# task all it brings and the old data M - N_new; "stream" gives it its share of everything seen (the split of a
# uniform sample of the stream, at a task switch); a number s in (0, 1] gives it at most s M. Room the other side
# cannot fill goes to the side that can.
STREAM_SHARE = "stream"


def check_new_share(value: object) -> None:
    """ValueError, in one line, unless `value` is a split `new_task_quota` takes."""
    if value is None or value == STREAM_SHARE:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"new_share must be \"{STREAM_SHARE}\" or a number in (0, 1], got {value!r}")


def new_task_quota(new_share: float | str | None, capacity: int, n_task: int, n_seen: int, n_old: int) -> int:
    """The most samples of the newest task the store keeps under the split `new_share` (see STREAM_SHARE):
    `capacity` is M, `n_task` the newest task's samples seen so far, `n_seen` every sample seen so far (the task's
    included), `n_old` the older samples stored. Never less than what the old samples leave empty."""
    if new_share is None:
        return capacity
    share = n_task / max(n_seen, 1) if new_share == STREAM_SHARE else float(new_share)
    return max(math.ceil(share * capacity), capacity - n_old, 0)


def group_ranking(order: np.ndarray, keys: np.ndarray, keep: int) -> np.ndarray:
    """A ranking under per-group quotas: each group (samples of one key) gets a water-filled share of `keep`
    (`balanced_quotas`), filled by the group's first samples in `order`, the groups interleaved so every prefix
    stays balanced. `order` holds positions into `keys`, most valuable first."""
    order = np.asarray(order, dtype=np.int64)
    quotas = balanced_quotas(keys[order], keep)
    chosen = {key: order[keys[order] == key][:quota] for key, quota in quotas.items() if quota}
    return interleave_by_class(chosen)
