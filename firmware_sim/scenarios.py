"""Federated incremental scenarios: which classes or domains each task brings, and which client holds what.

A `Scenario` is plain data (it round-trips through JSON and TOML); `Scenario.build()` loads the dataset
and returns a `ScenarioData` made of index arrays into it, so no client's data is ever copied until a
device asks for it.

Kind "flowing" is pFedGRP's flowing data (docs/flowing-data.md): every round is a task, each client has its own
task sequence and receives a fresh part of `samples_per_class` samples of each class of its task. Two choices
the paper leaves open ([R]):
- a class's parts running out (the paper's MNIST has < 30 parts of 200 for some digits, and a gradual loop can
  keep a task longer): the client starts over with a fresh permutation of that class, so a sample appears at
  most once per pass; the remainder of a pass (fewer than `samples_per_class` samples) is left out of that pass;
- test parts: a class's test samples are cut into as many consecutive parts as the class has train parts per
  pass; with fewer test samples than parts, neighbouring parts share a sample, so every part holds at least one.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from edgefil.settings import Where, convert

from .datasets import DOMAIN_STREAMS, ArrayDataset, known_num_classes, load_dataset

KINDS: tuple[str, ...] = ("class", "domain", "flowing")
SEQUENCES: tuple[str, ...] = ("circulating", "gradual")
_FLOWING_ONLY: tuple[str, ...] = ("n_client_tasks", "sequence", "replace_every", "samples_per_class")
DYNAMICS: tuple[str, ...] = ("glfc",)
_DYNAMICS_ONLY: tuple[str, ...] = ("old_only", "joining", "class_share")

# Independent random streams per purpose (and per task or client), so changing one setting, e.g. the number
# of tasks, does not reshuffle what every other task looks like.
_ORDER, _SPLIT, _CLIENT_TEST, _GROUPS, _SEQUENCE, _PARTS, _DYNAMICS = 0, 1, 2, 3, 4, 5, 6


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def _freeze(value: Any) -> Any:
    # JSON/TOML hand lists back; tuples keep a frozen Scenario equal to the one that was saved.
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Scenario:
    """What to run: a dataset cut into tasks, each task's data spread over `n_clients` clients.

    kind "class": `n_tasks` tasks of `classes_per_task` new classes each, from a seeded class order.
    kind "domain": one task per domain of a domain stream (all labels every time); `domains` picks
    and orders them by name, else the stream's first `n_tasks` domains are used.
    `dynamics = "glfc"` (kind "class" only) gives GLFC's client dynamics: of the `n_clients`, `joining` new clients
    join at each task from the second (holding data from then on only: S_n), and the rest hold data from the
    start; at each task a share `old_only` of the clients already there gets no new data (they keep their old
    data: S_o), the others (S_b) new data; each client with new data sees a random share `class_share` of the
    task's classes (at least one: with 2 classes a task GLFC's 60 % is one class), and each class's samples are cut
    into disjoint shards among the clients that see it (a class nobody drew goes to one of them). `alpha` does not
    apply. GLFC's authors give every client of a class all of its images; disjoint shards are the spec's
    suggestion for small data. A client that has not joined yet holds no data: its device says so (status
    "no-data") and is not selected before its task (docs/protocol.md, "One round").
    kind "flowing" (pFedGRP): `n_tasks` rounds, one task each; every client splits the classes at random into
    `n_client_tasks` tasks (default 5) of `classes_per_task` classes and walks them in its `sequence`:
    "circulating" (T1 -> ... -> Tn -> T1 ...) or "gradual" (a loop T1, T2, T1, ... of which one task is
    replaced by another of the client's tasks every `replace_every` rounds, default 30). Each round a client
    gets a fresh part of `samples_per_class` samples of each class of its task. `alpha` and
    `client_test_fraction` do not apply (test parts are cut in proportion, see the module docstring).
    `alpha` is the Dirichlet concentration of the label split over clients (smaller = more skewed).
    `client_test_fraction`: size of a client's test set relative to its train set (see client_test_split).
    `seed` drives the class order and the splits; the dataset's own train/test split is fixed by
    its loader's options (`dataset_options`), so seeds vary the federation, not the benchmark.
    """

    dataset: str
    kind: str = "class"
    n_tasks: int = 5
    classes_per_task: int | None = None
    domains: tuple[str, ...] | None = None
    n_clients: int = 20
    alpha: float = 1.0
    seed: int = 0
    client_test_fraction: float = 0.25
    data_root: str | None = None
    dataset_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    n_client_tasks: int | None = None
    sequence: str | None = None
    replace_every: int | None = None
    samples_per_class: int | None = None
    dynamics: str | None = None
    old_only: float | None = None
    joining: int | None = None
    class_share: float | None = None

    def __post_init__(self) -> None:
        normalised = {
            "alpha": float(self.alpha),  # TOML writes `alpha = 1` as an integer
            "client_test_fraction": float(self.client_test_fraction),
            "domains": None if self.domains is None else _freeze(self.domains),
            "dataset_options": MappingProxyType({k: _freeze(v) for k, v in self.dataset_options.items()}),
        }
        if self.dynamics is not None:  # GLFC's defaults (its code: 10 % old-only, 60 % of the classes)
            normalised["old_only"] = 0.1 if self.old_only is None else float(self.old_only)
            normalised["joining"] = 0 if self.joining is None else self.joining
            normalised["class_share"] = 0.6 if self.class_share is None else float(self.class_share)
        if self.kind == "flowing":  # the paper's defaults, spelled out so a saved scenario states them
            normalised["n_client_tasks"] = 5 if self.n_client_tasks is None else self.n_client_tasks
            if self.sequence == "gradual" and self.replace_every is None:
                normalised["replace_every"] = 30
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen
        self._validate()

    def _validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name, lowest in (("n_tasks", 1), ("n_clients", 1), ("seed", 0)):
            self._check_int(name, lowest)
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha (Dirichlet concentration) must be a positive finite number, got {self.alpha}")
        if not 0 < self.client_test_fraction <= 1:
            raise ValueError(f"client_test_fraction must be in (0, 1], got {self.client_test_fraction}")
        is_stream = self.dataset in DOMAIN_STREAMS
        self._validate_dynamics()
        if self.kind != "flowing":
            given = [name for name in _FLOWING_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply to kind='flowing' only")
        if self.kind == "class":
            if is_stream:
                raise ValueError(f"{self.dataset!r} is a domain stream: use kind='domain'")
            if self.domains is not None:
                raise ValueError("domains applies to kind='domain' only")
            if not isinstance(self.classes_per_task, int) or self.classes_per_task < 1:
                raise ValueError(f"kind='class' needs classes_per_task, an integer >= 1; got {self.classes_per_task!r}")
            check_class_budget(self, known_num_classes(self.dataset))
        elif self.kind == "flowing":
            self._validate_flowing(is_stream)
        else:
            if not is_stream:
                raise ValueError(f"kind='domain' needs a domain stream, one of {DOMAIN_STREAMS}; got {self.dataset!r}")
            if self.classes_per_task is not None:
                raise ValueError("classes_per_task applies to kind='class' only")
            if self.domains is not None and len(self.domains) != self.n_tasks:
                raise ValueError(f"n_tasks={self.n_tasks} but {len(self.domains)} domains given: {self.domains}")

    def _validate_dynamics(self) -> None:
        if self.dynamics is None:
            given = [name for name in _DYNAMICS_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply with dynamics = \"glfc\" only")
            return
        if self.dynamics not in DYNAMICS or self.kind != "class":
            raise ValueError(f"dynamics must be one of {DYNAMICS}, with kind='class'; got {self.dynamics!r} with "
                             f"kind={self.kind!r}")
        self._check_int("joining", 0)
        first = self.n_clients - _given(self.joining) * (self.n_tasks - 1)
        if first < 1:
            raise ValueError(f"{self.joining} clients joining at each of {self.n_tasks - 1} tasks leave none of "
                             f"the {self.n_clients} for the first task")
        for name in ("old_only", "class_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0 or (name == "class_share" and value == 0.0):
                raise ValueError(f"{name} must lie in {'(0' if name == 'class_share' else '[0'}, 1], got {value}")

    def _validate_flowing(self, is_stream: bool) -> None:
        if is_stream or self.domains is not None:
            raise ValueError(f"kind='flowing' splits one dataset's classes; domains and domain streams "
                             f"({', '.join(DOMAIN_STREAMS)}) do not apply")
        if not isinstance(self.classes_per_task, int) or self.classes_per_task < 1:
            raise ValueError(f"kind='flowing' needs classes_per_task, an integer >= 1; got {self.classes_per_task!r}")
        if self.sequence not in SEQUENCES:
            raise ValueError(f"kind='flowing' needs sequence, one of {SEQUENCES}; got {self.sequence!r}")
        self._check_int("samples_per_class", 1)
        # A gradual loop holds 2 tasks and replaces one by another: it needs a third task to change to.
        self._check_int("n_client_tasks", 3 if self.sequence == "gradual" else 1)
        if self.sequence == "gradual":
            self._check_int("replace_every", 1)
        elif self.replace_every is not None:
            raise ValueError("replace_every applies to sequence='gradual' only")
        check_class_budget(self, known_num_classes(self.dataset))

    def _check_int(self, name: str, lowest: int) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON- and TOML-ready: lists instead of tuples, and unset (None) fields left out (TOML has no null)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["dataset_options"] = {k: _thaw(v) for k, v in self.dataset_options.items()}
        return {k: _thaw(v) for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        """Inverse of to_dict; a missing optional field takes its default, an unknown key is an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown scenario field(s) {unknown}; fields are {sorted(names)}")
        return cls(**data)

    def build(self) -> ScenarioData:
        return build(self)


def _given(value: int | None) -> int:
    """A Scenario field that __post_init__ fills in for the scenario's kind (None only where the kind has no use)."""
    if value is None:
        raise ValueError("a scenario field this kind needs is unset")
    return value


def check_class_budget(scenario: Scenario, num_classes: int | None) -> None:
    """A scenario cannot ask for more disjoint classes than the dataset has (None: not known yet): the class
    kind's tasks, or each flowing client's own tasks."""
    flowing = scenario.kind == "flowing"
    groups = scenario.n_client_tasks if flowing else scenario.n_tasks
    needed = _given(groups) * _given(scenario.classes_per_task)
    if num_classes is not None and needed > num_classes:
        raise ValueError(
            f"{groups} {'client ' if flowing else ''}tasks x {scenario.classes_per_task} classes = {needed} classes, "
            f"but {scenario.dataset!r} has {num_classes}"
        )


PRESETS: Mapping[str, Scenario] = MappingProxyType({
    # Re-Fed's defaults: 20 clients; alpha as for its CIFAR10 (class) and Digit10 (domain) runs.
    "digits-class": Scenario("digits", kind="class", n_tasks=5, classes_per_task=2, alpha=1.0),
    "digits-domain": Scenario("digits_domains", kind="domain", n_tasks=4, alpha=0.1),
    "mnist1d-class": Scenario("mnist1d", kind="class", n_tasks=5, classes_per_task=2, alpha=1.0),
    # pFedGRP's setting (10 clients, 5 tasks of 2 classes per client) scaled to short runs: 20 rounds, parts of
    # 30 (digits: ~135 train images per class) or 100 (MNIST-1D: ~1,600) samples per class. The paper replaces
    # a gradual loop task every 30 of its 150 rounds; every 6 of 20 lets a short run see changes.
    "digits-flowing-circulating": Scenario(
        "digits", kind="flowing", n_tasks=20, classes_per_task=2, n_clients=10, n_client_tasks=5,
        sequence="circulating", samples_per_class=30),
    "digits-flowing-gradual": Scenario(
        "digits", kind="flowing", n_tasks=20, classes_per_task=2, n_clients=10, n_client_tasks=5,
        sequence="gradual", replace_every=6, samples_per_class=30),
    "mnist1d-flowing-circulating": Scenario(
        "mnist1d", kind="flowing", n_tasks=20, classes_per_task=2, n_clients=10, n_client_tasks=5,
        sequence="circulating", samples_per_class=100),
    "mnist1d-flowing-gradual": Scenario(
        "mnist1d", kind="flowing", n_tasks=20, classes_per_task=2, n_clients=10, n_client_tasks=5,
        sequence="gradual", replace_every=6, samples_per_class=100),
})


def preset(name: str, **overrides: Any) -> Scenario:
    """A named scenario, with any field replaced (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# --- splitting -----------------------------------------------------------------------------------

def _split_classes(order: np.ndarray, groups: int, size: int) -> list[tuple[int, ...]]:
    """The first `groups` consecutive groups of `size` classes of a class order, each sorted."""
    return [tuple(sorted(order[g * size:(g + 1) * size].tolist())) for g in range(groups)]


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
        for part in parts:
            if not part:
                donor = max(parts, key=len)
                part.append(donor.pop(int(rng.integers(len(donor)))))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def glfc_split(labels: np.ndarray, scenario: Scenario, t: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Task t's positions over the clients under GLFC's dynamics (`Scenario` docstring): clients not joined yet
    and the old-only share get none; every other client draws its share of the classes, and each class's samples
    are cut into disjoint shards among the clients that drew it."""
    joining, n = _given(scenario.joining), scenario.n_clients
    present = n - joining * (scenario.n_tasks - 1) + joining * t  # clients 0..present-1 are there at task t
    earlier = present - (joining if t else 0)  # of which these were there before
    old_only = set(rng.choice(earlier, size=round(_given_float(scenario.old_only) * earlier), replace=False)
                   .tolist()) if t else set()
    learning = [k for k in range(present) if k not in old_only]
    classes = np.unique(labels)
    share = max(1, round(_given_float(scenario.class_share) * len(classes)))
    drawn = {k: set(rng.choice(classes, size=min(share, len(classes)), replace=False).tolist()) for k in learning}
    parts: list[list[int]] = [[] for _ in range(n)]
    for c in classes.tolist():
        holders = [k for k in learning if c in drawn[k]] or [int(rng.choice(learning))]
        members = rng.permutation(np.flatnonzero(labels == c))
        for k, shard in zip(holders, np.array_split(members, len(holders))):
            parts[k].extend(shard.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _given_float(value: float | None) -> float:
    if value is None:
        raise ValueError("a scenario field this kind needs is unset")
    return value


def client_test_split(
    client_labels: Sequence[np.ndarray], test_labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client's test set: positions into `test_labels` with the label mix of its train data.

    For every class c a client trains on with n_c samples, it gets ceil(fraction * n_c) test samples
    of class c (at most all of them), drawn without replacement. The ceiling gives every client at
    least one test sample of each class it holds. Clients draw independently, so two clients' test
    sets may overlap; each is a subset of the task's test set.
    """
    splits = []
    for labels in client_labels:
        picks = [np.empty(0, np.int64)]
        for c, n in zip(*np.unique(labels, return_counts=True)):
            pool = np.flatnonzero(test_labels == c)
            picks.append(rng.choice(pool, size=min(len(pool), math.ceil(fraction * n)), replace=False))
        splits.append(np.sort(np.concatenate(picks)))
    return splits


# --- materialised scenario -----------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Task:
    """One task: index arrays into `data` (train indices into x_train, test indices into x_test).

    For kind "flowing" a task is one round: clients hold different classes (`client_classes`, None for the
    other kinds) and their parts may overlap, so `train_indices`/`test_indices` are the union of the clients'."""

    index: int
    classes: tuple[int, ...]
    domain: str | None  # the domain's dataset name for domain-incremental tasks, else None
    data: ArrayDataset
    train_indices: np.ndarray
    test_indices: np.ndarray
    client_train_indices: tuple[np.ndarray, ...]
    client_test_indices: tuple[np.ndarray, ...]
    client_classes: tuple[tuple[int, ...], ...] | None = None

    @property
    def n_clients(self) -> int:
        return len(self.client_train_indices)

    def client_task_classes(self, k: int) -> tuple[int, ...]:
        """The classes client k's task brings: its own (flowing), else the task's."""
        return self.classes if self.client_classes is None else self.client_classes[k]

    def train(self) -> tuple[np.ndarray, np.ndarray]:
        """All of the task's train samples (the union of the clients' shares)."""
        return self.data.x_train[self.train_indices], self.data.y_train[self.train_indices]

    def test(self) -> tuple[np.ndarray, np.ndarray]:
        """The task's global held-out test set."""
        return self.data.x_test[self.test_indices], self.data.y_test[self.test_indices]

    def client_train(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.client_train_indices[k]
        return self.data.x_train[idx], self.data.y_train[idx]

    def client_test(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.client_test_indices[k]
        return self.data.x_test[idx], self.data.y_test[idx]


OLD_DATA_CACHED = 0.25  # the share of its old data a device caches at the last task under the default M


@dataclass(frozen=True, eq=False)
class ScenarioData:
    """A built scenario. `num_classes` is the dataset's class count: the model's fixed head size
    (labels keep their dataset ids, they are not renumbered per task)."""

    scenario: Scenario
    tasks: tuple[Task, ...]
    num_classes: int
    input_shape: tuple[int, ...]

    # --- what the coordinator evaluates on (coordinator.evaluation.TestSets) ------------------------

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    @property
    def per_client(self) -> bool:
        """Flowing data: every client has its own test data, and per-client accuracy is measured."""
        return self.scenario.kind == "flowing"

    def describe(self) -> dict[str, Any]:
        return self.scenario.to_dict()

    def task_classes(self, t: int) -> tuple[int, ...]:
        return self.tasks[t].classes

    def task_test(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tasks[t].test()

    def seen_test(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Union of the test sets of tasks 0..t: what accuracy after task t is measured on."""
        parts = [task.test() for task in self.tasks[: t + 1]]
        return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])

    def client_seen_test(self, k: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Client k's local test set after task t (pFedGRP's a_k^t): the union of its test sets of tasks 0..t.

        Flowing parts of one class recur, so indices into one dataset are merged without repeats (sorted);
        the tasks of a domain stream index different datasets, which are concatenated in task order."""
        by_data: dict[int, tuple[ArrayDataset, list[np.ndarray]]] = {}
        for task in self.tasks[: t + 1]:
            by_data.setdefault(id(task.data), (task.data, []))[1].append(task.client_test_indices[k])
        picked = [(data, np.unique(np.concatenate(parts))) for data, parts in by_data.values()]
        return (np.concatenate([data.x_test[idx] for data, idx in picked]),
                np.concatenate([data.y_test[idx] for data, idx in picked]))

    def client_seen_classes(self, k: int, t: int) -> tuple[int, ...]:
        """The classes client k's tasks 0..t brought (sorted): what its device trains and is evaluated on."""
        return tuple(sorted({c for task in self.tasks[: t + 1] for c in task.client_task_classes(k)}))

    def client_samples_seen(self, k: int, t: int) -> int:
        """n_k^t of pFedGRP's IAA (Eq. 9): the train samples client k received in tasks 0..t."""
        return sum(len(task.client_train_indices[k]) for task in self.tasks[: t + 1])

    def binding_budget(self, cached: float = OLD_DATA_CACHED) -> int:
        """A budget M that binds: N_task (1 + cached (T - 1)), with N_task the mean number of samples one client
        gets per task and T tasks, so a device holds its newest task and `cached` of its older data at the last
        task (Re-Fed's regime; the README's "Choosing M" says the same for a user's own data)."""
        sizes = [len(idx) for task in self.tasks for idx in task.client_train_indices]
        return max(1, round(sum(sizes) / len(sizes) * (1 + cached * (len(self.tasks) - 1))))


def _make_task(
    scenario: Scenario, t: int, data: ArrayDataset, classes: tuple[int, ...], domain: str | None
) -> Task:
    train_idx = np.flatnonzero(np.isin(data.y_train, classes))
    test_idx = np.flatnonzero(np.isin(data.y_test, classes))
    y_train = data.y_train[train_idx]
    if scenario.dynamics == "glfc":
        clients = glfc_split(y_train, scenario, t, _rng(scenario.seed, _DYNAMICS, t))
    else:
        clients = dirichlet_split(y_train, scenario.n_clients, scenario.alpha, _rng(scenario.seed, _SPLIT, t))
    client_tests = client_test_split(
        [y_train[p] for p in clients], data.y_test[test_idx], scenario.client_test_fraction,
        _rng(scenario.seed, _CLIENT_TEST, t),
    )
    return Task(
        index=t, classes=classes, domain=domain, data=data, train_indices=train_idx, test_indices=test_idx,
        client_train_indices=tuple(train_idx[p] for p in clients),
        client_test_indices=tuple(test_idx[p] for p in client_tests),
    )


def _pick_domains(scenario: Scenario, stream: list[ArrayDataset]) -> list[ArrayDataset]:
    by_name = {d.name: d for d in stream}
    names = scenario.domains or tuple(by_name)[: scenario.n_tasks]
    missing = [n for n in names if n not in by_name]
    if missing or len(names) < scenario.n_tasks:
        raise ValueError(
            f"{scenario.dataset!r} has domains {tuple(by_name)}; cannot make {scenario.n_tasks} tasks"
            + (f" (unknown: {missing})" if missing else "")
        )
    chosen = [by_name[n] for n in names]
    if len({(d.num_classes, d.input_shape) for d in chosen}) != 1:
        raise ValueError(f"domains of {scenario.dataset!r} differ in classes or input shape; they must match")
    return chosen


# --- flowing data (pFedGRP) ----------------------------------------------------------------------

def _client_sequence(scenario: Scenario, k: int) -> list[int]:
    """Which of client k's tasks (0..n_client_tasks-1) it gets in each round."""
    if scenario.sequence == "circulating":
        return [t % _given(scenario.n_client_tasks) for t in range(scenario.n_tasks)]
    rng = _rng(scenario.seed, _SEQUENCE, k)
    loop, sequence = [0, 1], []
    for t in range(scenario.n_tasks):
        if t and t % _given(scenario.replace_every) == 0:
            others = [i for i in range(_given(scenario.n_client_tasks)) if i not in loop]
            loop[int(rng.integers(2))] = int(rng.choice(others))
        sequence.append(loop[t % 2])
    return sequence


def _test_parts(test_pos: np.ndarray, n_parts: int) -> list[np.ndarray]:
    """Consecutive near-equal parts; with fewer samples than parts, neighbours share one ([R], module docstring)."""
    n = len(test_pos)
    return [test_pos[j * n // n_parts: max((j + 1) * n // n_parts, j * n // n_parts + 1)] for j in range(n_parts)]


def _class_parts(
    train_pos: np.ndarray, test_pos: np.ndarray, size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One client's parts of one class in order, each with its test part; a fresh permutation every pass."""
    n_parts = len(train_pos) // size
    test_parts = _test_parts(rng.permutation(test_pos), n_parts)
    while True:
        order = rng.permutation(train_pos)
        for j in range(n_parts):
            yield order[j * size:(j + 1) * size], test_parts[j]


def _client_rounds(
    scenario: Scenario, data: ArrayDataset, k: int
) -> list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]:
    """Client k's (classes, train indices, test indices) of every round."""
    groups = _split_classes(_rng(scenario.seed, _GROUPS, k).permutation(data.num_classes),
                            _given(scenario.n_client_tasks), _given(scenario.classes_per_task))
    parts = {
        c: _class_parts(np.flatnonzero(data.y_train == c), np.flatnonzero(data.y_test == c),
                        _given(scenario.samples_per_class), _rng(scenario.seed, _PARTS, k, c))
        for group in groups for c in group
    }
    rounds = []
    for g in _client_sequence(scenario, k):
        train, test = zip(*(next(parts[c]) for c in groups[g]))
        rounds.append((groups[g], np.sort(np.concatenate(train)), np.sort(np.concatenate(test))))
    return rounds


def _flowing_tasks(scenario: Scenario, data: ArrayDataset) -> tuple[Task, ...]:
    smallest = int(np.bincount(data.y_train, minlength=data.num_classes).min())
    if _given(scenario.samples_per_class) > smallest:
        raise ValueError(f"samples_per_class={scenario.samples_per_class}, but a class of {scenario.dataset!r} "
                         f"has only {smallest} train samples")
    clients = [_client_rounds(scenario, data, k) for k in range(scenario.n_clients)]
    tasks = []
    for t in range(scenario.n_tasks):
        classes, train, test = zip(*(rounds[t] for rounds in clients))
        tasks.append(Task(
            index=t, classes=tuple(sorted(set().union(*classes))), domain=None, data=data,
            train_indices=np.unique(np.concatenate(train)), test_indices=np.unique(np.concatenate(test)),
            client_train_indices=train, client_test_indices=test, client_classes=classes,
        ))
    return tuple(tasks)


def build(scenario: Scenario) -> ScenarioData:
    """Load the dataset and materialise every task's class set, client shares and test sets."""
    loaded = load_dataset(scenario.dataset, scenario.data_root, **scenario.dataset_options)
    if scenario.kind != "domain" and not isinstance(loaded, ArrayDataset):
        raise ValueError(f"{scenario.dataset!r} is a stream of domains: use kind = \"domain\"")
    if isinstance(loaded, ArrayDataset) and scenario.kind == "class":
        check_class_budget(scenario, loaded.num_classes)
        order = _rng(scenario.seed, _ORDER).permutation(loaded.num_classes)
        tasks = tuple(
            _make_task(scenario, t, loaded, classes, None)
            for t, classes in enumerate(_split_classes(order, scenario.n_tasks, _given(scenario.classes_per_task)))
        )
        first = loaded
    elif isinstance(loaded, ArrayDataset):  # flowing
        check_class_budget(scenario, loaded.num_classes)
        tasks, first = _flowing_tasks(scenario, loaded), loaded
    else:
        domains = _pick_domains(scenario, loaded if isinstance(loaded, list) else [loaded])
        labels = tuple(range(domains[0].num_classes))
        tasks = tuple(_make_task(scenario, t, d, labels, d.name) for t, d in enumerate(domains))
        first = domains[0]
    return ScenarioData(scenario, tasks, first.num_classes, first.input_shape)


SHARED_SCENARIOS = 4  # built scenarios a process keeps (a fleet worker needs one; tests build several)
_shared: dict[Scenario, ScenarioData] = {}
_shared_lock = threading.Lock()


def shared_build(scenario: Scenario) -> ScenarioData:
    """The scenario built once per process and shared by every caller. A fleet worker hosts hundreds of devices of
    one scenario: each building its own made start-up CPU grow as N^2 (every device splits all N clients' data,
    holding the GIL) and memory as N copies of the dataset. Sharing is safe: a built scenario is index arrays into
    the dataset, and a client's share is a fresh array (fancy indexing copies). The lock makes concurrent first
    callers wait for one build instead of each doing it; the oldest of more than `SHARED_SCENARIOS` is dropped."""
    with _shared_lock:
        data = _shared.get(scenario)
        if data is None:
            data = _shared[scenario] = scenario.build()
            while len(_shared) > SHARED_SCENARIOS:
                del _shared[next(iter(_shared))]
        return data


class ClientSource:
    """One client's share of a scenario, task by task: the data stream of a simulated device."""

    def __init__(self, scenario: Scenario | Mapping[str, Any], client: int) -> None:
        if not isinstance(scenario, Scenario):
            scenario = scenario_from_config(scenario)
        if not 0 <= client < scenario.n_clients:
            raise ValueError(f"client {client} is not one of the scenario's {scenario.n_clients} clients")
        self.client = client
        self.data = shared_build(scenario)

    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        return self.data.tasks[task].client_train(self.client)


def check_scenario(raw: Any, where: Where) -> Scenario:
    """A scenario table checked key by key (ConfigError naming the key), then built (its own checks)."""
    if not isinstance(raw, Mapping):
        raise where.error(None, "expected a table (preset = ..., or every Scenario field)")
    fields = {f.name for f in dataclasses.fields(Scenario)}
    unknown = sorted(set(raw) - fields - {"preset"})
    if unknown:
        raise where.error(unknown[0], f"unknown key; valid keys: {', '.join(sorted(fields | {'preset'}))}")
    if "preset" in raw and raw["preset"] not in PRESETS:
        raise where.error("preset", f"unknown preset {raw['preset']!r}; choose one of {', '.join(PRESETS)}")
    if "preset" not in raw and "dataset" not in raw:
        raise where.error("dataset", f"missing (required without a preset; presets: {', '.join(PRESETS)})")
    hints = typing.get_type_hints(Scenario)
    for key, value in raw.items():
        if key != "preset":
            convert(hints[key], value, where, key, None)
    try:
        return scenario_from_config(raw)
    except (ValueError, TypeError) as err:
        raise where.error(None, str(err)) from None


def scenario_from_config(config: Mapping[str, Any]) -> Scenario:
    """A scenario from a config table: `preset = "digits-class"` plus overrides, or every field spelled out."""
    config = dict(config)
    name = config.pop("preset", None)
    return preset(name, **config) if name is not None else Scenario.from_dict(config)
