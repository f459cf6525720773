"""What every kind of scenario shares: the `ScenarioKind` interface and registry, the `Task` a kind makes, and
the splitting rules several kinds use.

A kind is one class in a module of this package, registered by the name a scenario's `kind` field gives (as a
learning method registers by its `name`): it says which of the scenario's optional fields it reads, fills in
their defaults, checks them, and cuts a loaded dataset into tasks. `firmware_sim.scenarios` owns the `Scenario`
table itself (one schema for every kind, checked key by key from a config) and asks the kind for the rest.
"""
from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgefil.registry import Registry
from firmware_sim.array_dataset import ArrayDataset

if TYPE_CHECKING:
    from firmware_sim.scenarios import Scenario

# Independent random streams per purpose (and per task or client), so changing one setting, e.g. the number
# of tasks, does not reshuffle what every other task looks like.
ORDER, SPLIT, CLIENT_TEST, GROUPS, SEQUENCE, PARTS, DYNAMICS, SHOTS, CALIBRATION = 0, 1, 2, 3, 4, 5, 6, 7, 8


def rng_for(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def given(value: Any) -> Any:
    """A Scenario field that its kind fills in (`ScenarioKind.defaults`; None only where the kind has no use)."""
    if value is None:
        raise ValueError("a scenario field this kind needs is unset")
    return value


@dataclass(frozen=True, eq=False)
class Task:
    """One task: index arrays into `data` (train indices into x_train, test indices into x_test).

    For kind "flowing" a task is one round: clients hold different classes (`client_classes`, None for the
    other kinds) and their parts may overlap, so `train_indices`/`test_indices` are the union of the clients'.
    `host_trained`: no client holds this task's data; the host trains on it (`train()`) before the fleet's first
    round (a few-shot scenario's base session, trained centrally as its paper does).
    `calibration_indices`: train samples no client gets, which the coordinator keeps (the scenario's `calibration`,
    `held_out`)."""

    index: int
    classes: tuple[int, ...]
    domain: str | None  # the domain's dataset name for domain-incremental tasks, else None
    data: ArrayDataset
    train_indices: np.ndarray
    test_indices: np.ndarray
    client_train_indices: tuple[np.ndarray, ...]
    client_test_indices: tuple[np.ndarray, ...]
    client_classes: tuple[tuple[int, ...], ...] | None = None
    host_trained: bool = False
    calibration_indices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @property
    def n_clients(self) -> int:
        return len(self.client_train_indices)

    def client_task_classes(self, k: int) -> tuple[int, ...]:
        """The classes client k's task brings: its own (flowing), else the task's."""
        return self.classes if self.client_classes is None else self.client_classes[k]

    def train(self) -> tuple[np.ndarray, np.ndarray]:
        """All of the task's train samples (the union of the clients' shares, or the host's)."""
        return self.data.x_train[self.train_indices], self.data.y_train[self.train_indices]

    def test(self) -> tuple[np.ndarray, np.ndarray]:
        """The task's global held-out test set."""
        return self.data.x_test[self.test_indices], self.data.y_test[self.test_indices]

    def calibration(self) -> tuple[np.ndarray, np.ndarray]:
        """The task's calibration samples (`held_out`): the coordinator's own, apart from every client and test set."""
        return self.data.x_train[self.calibration_indices], self.data.y_train[self.calibration_indices]

    def client_train(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.client_train_indices[k]
        return self.data.x_train[idx], self.data.y_train[idx]

    def client_test(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.client_test_indices[k]
        return self.data.x_test[idx], self.data.y_test[idx]


KINDS: Registry[ScenarioKind] = Registry("scenario kind")


CALIBRATION_SAMPLES = 10  # a class's calibration samples in a first federation (`ScenarioKind.calibration`)


class ScenarioKind(ABC):
    """One kind of scenario. `takes`: the optional Scenario fields it reads (a field set for a kind that does not
    take it is refused); `per_client`: every client has test data of its own, and per-client accuracy is
    measured."""

    name: ClassVar[str]
    takes: ClassVar[tuple[str, ...]] = ()
    per_client: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            KINDS.add(cls.name, cls)

    def masks(self, scenario: Scenario) -> bool:
        """Whether a fleet's devices on this scenario mask the classes they have not seen (the [learner]'s
        `mask_seen_classes` where a fleet file leaves it out). Chosen per kind by measurement
        (docs/results-history.md, "The class mask"); on by default."""
        return True

    def calibration(self, scenario: Scenario) -> int:
        """The calibration samples a class a first federation keeps for its coordinator (`edgefil init`'s data split
        and rehearsal): the guard's trust reference, without which it falls back to comparing devices with each
        other (coordinator/guard.py). 10 a class: what the attack suite was measured with (docs/security.md)."""
        return CALIBRATION_SAMPLES

    def defaults(self, scenario: Scenario) -> dict[str, Any]:
        """Fields to fill in where the scenario leaves them unset, so a saved scenario states them."""
        return {}

    @abstractmethod
    def validate(self, scenario: Scenario) -> None:
        """ValueError, in one line, for a field this kind cannot take (the generic fields are checked already)."""

    def check_classes(self, scenario: Scenario, num_classes: int | None) -> None:
        """ValueError where the scenario asks for more classes than the dataset has (None: not known yet)."""

    @abstractmethod
    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        """The loaded dataset (a list for a domain stream) cut into tasks."""

    def setting(self, scenario: Scenario) -> str:
        """The scenario in words, for the run reports."""
        return (f"{self.name}-incremental, {scenario.n_tasks} tasks, {scenario.n_clients} clients, Dirichlet alpha "
                f"{scenario.alpha}")

    def task_label(self, scenario: Scenario, t: int) -> str:
        """Task t's name in the reports' tables and plots."""
        return f"task {t}"


def require_classes(scenario: Scenario, needed: int, what: str, num_classes: int | None) -> None:
    """The one wording of "more classes asked for than the dataset has"."""
    if num_classes is not None and needed > num_classes:
        raise ValueError(f"{what} = {needed} classes, but {scenario.dataset!r} has {num_classes}")


def require_int(scenario: Scenario, name: str, lowest: int) -> None:
    value = getattr(scenario, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")


def one_dataset(scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> ArrayDataset:
    if not isinstance(loaded, ArrayDataset):
        raise ValueError(f"{scenario.dataset!r} is a stream of domains: use kind = \"domain\"")
    return loaded


def split_classes(order: np.ndarray, sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive groups of a class order, of the given sizes, each sorted."""
    cuts = np.cumsum([0, *sizes])
    return [tuple(sorted(order[cuts[g]:cuts[g + 1]].tolist())) for g in range(len(sizes))]


def dirichlet_split(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Partition positions 0..len(labels)-1 over clients: per class, shares ~ Dirichlet(alpha * 1_K).

    Repair rule: with alpha small and few classes per task most clients would get nothing (so
    re-drawing until all are served may never end). Instead, when there are at least K samples,
    each empty client in turn takes one random sample from the currently largest client (ties: the
    lowest id). That client holds >= 2 samples whenever one is empty, so nobody is emptied; with
    fewer than K samples some clients stay empty. Returns sorted int64 positions, one array per client.
    """
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        shares = rng.dirichlet(np.full(n_clients, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, cuts)):
            part.extend(chunk.tolist())
    if len(labels) >= n_clients:
        # the largest client found through a heap of (-size, id), entries whose size is out of date passed over: a
        # search of every client for each empty one took minutes at 100,000 clients (the same clients either way)
        largest = [(-len(part), k) for k, part in enumerate(parts)]
        heapq.heapify(largest)
        for k, part in enumerate(parts):
            if part:
                continue
            while -largest[0][0] != len(parts[largest[0][1]]):
                heapq.heappop(largest)
            donor = largest[0][1]
            part.append(parts[donor].pop(int(rng.integers(len(parts[donor])))))
            heapq.heappush(largest, (-len(parts[donor]), donor))
            heapq.heappush(largest, (-1, k))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def client_test_split(
    client_labels: Sequence[np.ndarray], test_labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client's test set: positions into `test_labels` with the label mix of its train data.

    For every class c a client trains on with n_c samples, it gets ceil(fraction * n_c) test samples
    of class c (at most all of them), drawn without replacement. The ceiling gives every client at
    least one test sample of each class it holds. Clients draw independently, so two clients' test
    sets may overlap; each is a subset of the task's test set.
    """
    pools: dict[int, np.ndarray] = {}  # a class's test positions, found once: per client they took minutes at 100,000
    splits = []
    for labels in client_labels:
        picks = [np.empty(0, np.int64)]
        for c, n in zip(*np.unique(labels, return_counts=True)):
            pool = pools.get(c)
            if pool is None:
                pool = pools[c] = np.flatnonzero(test_labels == c)
            picks.append(rng.choice(pool, size=min(len(pool), math.ceil(fraction * n)), replace=False))
        splits.append(np.sort(np.concatenate(picks)))
    return splits


def split_task(scenario: Scenario, t: int, data: ArrayDataset, classes: tuple[int, ...], domain: str | None,
               train_idx: np.ndarray, clients: list[np.ndarray]) -> Task:
    """A task of `data`'s samples `train_idx` (of `classes`), cut over the clients as `clients` (positions into
    `train_idx`), with the test samples of its classes and each client's test share (`client_test_split`)."""
    test_idx = np.flatnonzero(np.isin(data.y_test, classes))
    y_train = data.y_train[train_idx]
    client_tests = client_test_split(
        [y_train[p] for p in clients], data.y_test[test_idx], scenario.client_test_fraction,
        rng_for(scenario.seed, CLIENT_TEST, t),
    )
    return Task(
        index=t, classes=classes, domain=domain, data=data, train_indices=train_idx, test_indices=test_idx,
        client_train_indices=tuple(train_idx[p] for p in clients),
        client_test_indices=tuple(test_idx[p] for p in client_tests),
    )


def dirichlet_task(scenario: Scenario, t: int, data: ArrayDataset, classes: tuple[int, ...],
                   domain: str | None = None) -> Task:
    """Every train sample of `classes`, split over the clients by Dirichlet(alpha) per class."""
    train_idx = np.flatnonzero(np.isin(data.y_train, classes))
    clients = dirichlet_split(data.y_train[train_idx], scenario.n_clients, scenario.alpha,
                              rng_for(scenario.seed, SPLIT, t))
    return split_task(scenario, t, data, classes, domain, train_idx, clients)


def held_out(task: Task, per_class: int, seed: int) -> Task:
    """`task` with up to `per_class` train samples of each of its classes taken from the clients and kept apart as
    its calibration set: a seeded draw of its own, so it does not depend on how the clients were split, and the
    clients' shares keep their order. A class keeps at least one train sample for the clients."""
    if per_class <= 0:
        return task
    rng = rng_for(seed, CALIBRATION, task.index)
    labels = task.data.y_train[task.train_indices]
    picks = [np.empty(0, np.int64)]
    for c in np.unique(labels):
        pool = task.train_indices[labels == c]
        picks.append(rng.choice(pool, size=min(per_class, len(pool) - 1), replace=False))
    kept = np.sort(np.concatenate(picks))
    return replace(task, train_indices=task.train_indices[~np.isin(task.train_indices, kept)],
                   client_train_indices=tuple(idx[~np.isin(idx, kept)] for idx in task.client_train_indices),
                   calibration_indices=kept)
