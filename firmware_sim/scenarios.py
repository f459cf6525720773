"""Federated incremental scenarios: which classes or domains each task brings, and which client holds what.

A `Scenario` is plain data (it round-trips through JSON and TOML); `Scenario.build()` loads the dataset
and returns a `ScenarioData` made of index arrays into it, so no client's data is ever copied until a
device asks for it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from .datasets import DOMAIN_STREAMS, ArrayDataset, known_num_classes, load_dataset

KINDS: tuple[str, ...] = ("class", "domain")

# Independent random streams per purpose (and per task), so changing one setting, e.g. the number
# of tasks, does not reshuffle what every other task looks like.
_ORDER, _SPLIT, _CLIENT_TEST = 0, 1, 2


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

    def __post_init__(self) -> None:
        normalised = {
            "alpha": float(self.alpha),  # TOML writes `alpha = 1` as an integer
            "client_test_fraction": float(self.client_test_fraction),
            "domains": None if self.domains is None else _freeze(self.domains),
            "dataset_options": MappingProxyType({k: _freeze(v) for k, v in self.dataset_options.items()}),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen
        self._validate()

    def _validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name, lowest in (("n_tasks", 1), ("n_clients", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha (Dirichlet concentration) must be a positive finite number, got {self.alpha}")
        if not 0 < self.client_test_fraction <= 1:
            raise ValueError(f"client_test_fraction must be in (0, 1], got {self.client_test_fraction}")
        is_stream = self.dataset in DOMAIN_STREAMS
        if self.kind == "class":
            if is_stream:
                raise ValueError(f"{self.dataset!r} is a domain stream: use kind='domain'")
            if self.domains is not None:
                raise ValueError("domains applies to kind='domain' only")
            if not isinstance(self.classes_per_task, int) or self.classes_per_task < 1:
                raise ValueError(f"kind='class' needs classes_per_task, an integer >= 1; got {self.classes_per_task!r}")
            check_class_budget(self, known_num_classes(self.dataset))
        else:
            if not is_stream:
                raise ValueError(f"kind='domain' needs a domain stream, one of {DOMAIN_STREAMS}; got {self.dataset!r}")
            if self.classes_per_task is not None:
                raise ValueError("classes_per_task applies to kind='class' only")
            if self.domains is not None and len(self.domains) != self.n_tasks:
                raise ValueError(f"n_tasks={self.n_tasks} but {len(self.domains)} domains given: {self.domains}")

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


def check_class_budget(scenario: Scenario, num_classes: int | None) -> None:
    """A class-incremental scenario cannot ask for more classes than the dataset has (None: not known yet)."""
    needed = scenario.n_tasks * scenario.classes_per_task
    if num_classes is not None and needed > num_classes:
        raise ValueError(
            f"{scenario.n_tasks} tasks x {scenario.classes_per_task} classes = {needed} classes, "
            f"but {scenario.dataset!r} has {num_classes}"
        )


PRESETS: Mapping[str, Scenario] = MappingProxyType({
    # Re-Fed's defaults: 20 clients; alpha as for its CIFAR10 (class) and Digit10 (domain) runs.
    "digits-class": Scenario("digits", kind="class", n_tasks=5, classes_per_task=2, alpha=1.0),
    "digits-domain": Scenario("digits_domains", kind="domain", n_tasks=4, alpha=0.1),
    "mnist1d-class": Scenario("mnist1d", kind="class", n_tasks=5, classes_per_task=2, alpha=1.0),
})


def preset(name: str, **overrides: Any) -> Scenario:
    """A named scenario, with any field replaced (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# --- splitting -----------------------------------------------------------------------------------

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
    """One task: index arrays into `data` (train indices into x_train, test indices into x_test)."""

    index: int
    classes: tuple[int, ...]
    domain: str | None  # the domain's dataset name for domain-incremental tasks, else None
    data: ArrayDataset
    train_indices: np.ndarray
    test_indices: np.ndarray
    client_train_indices: tuple[np.ndarray, ...]
    client_test_indices: tuple[np.ndarray, ...]

    @property
    def n_clients(self) -> int:
        return len(self.client_train_indices)

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


@dataclass(frozen=True, eq=False)
class ScenarioData:
    """A built scenario. `num_classes` is the dataset's class count: the model's fixed head size
    (labels keep their dataset ids, they are not renumbered per task)."""

    scenario: Scenario
    tasks: tuple[Task, ...]
    num_classes: int
    input_shape: tuple[int, ...]

    def seen_test(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Union of the test sets of tasks 0..t: what accuracy after task t is measured on."""
        parts = [task.test() for task in self.tasks[: t + 1]]
        return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def _make_task(
    scenario: Scenario, t: int, data: ArrayDataset, classes: tuple[int, ...], domain: str | None
) -> Task:
    train_idx = np.flatnonzero(np.isin(data.y_train, classes))
    test_idx = np.flatnonzero(np.isin(data.y_test, classes))
    y_train = data.y_train[train_idx]
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


def build(scenario: Scenario) -> ScenarioData:
    """Load the dataset and materialise every task's class set, client shares and test sets."""
    loaded = load_dataset(scenario.dataset, scenario.data_root, **scenario.dataset_options)
    if scenario.kind == "class":
        check_class_budget(scenario, loaded.num_classes)
        order = _rng(scenario.seed, _ORDER).permutation(loaded.num_classes)
        c = scenario.classes_per_task
        tasks = tuple(
            _make_task(scenario, t, loaded, tuple(sorted(order[t * c:(t + 1) * c].tolist())), None)
            for t in range(scenario.n_tasks)
        )
        first = loaded
    else:
        domains = _pick_domains(scenario, loaded)
        labels = tuple(range(domains[0].num_classes))
        tasks = tuple(_make_task(scenario, t, d, labels, d.name) for t, d in enumerate(domains))
        first = domains[0]
    return ScenarioData(scenario, tasks, first.num_classes, first.input_shape)


class ClientSource:
    """One client's share of a scenario, task by task: the data stream of a simulated device."""

    def __init__(self, scenario: Scenario | Mapping[str, Any], client: int) -> None:
        if not isinstance(scenario, Scenario):
            scenario = scenario_from_config(scenario)
        if not 0 <= client < scenario.n_clients:
            raise ValueError(f"client {client} is not one of the scenario's {scenario.n_clients} clients")
        self.client = client
        self.data = scenario.build()

    def task_data(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        return self.data.tasks[task].client_train(self.client)


def scenario_from_config(config: Mapping[str, Any]) -> Scenario:
    """A scenario from a config table: `preset = "digits-class"` plus overrides, or every field spelled out."""
    config = dict(config)
    name = config.pop("preset", None)
    return preset(name, **config) if name is not None else Scenario.from_dict(config)
