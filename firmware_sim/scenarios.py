"""Federated incremental scenarios: which classes or domains each task brings, and which client holds what.

A `Scenario` is plain data (it round-trips through JSON and TOML), one table for every kind; `Scenario.build()`
loads the dataset and returns a `ScenarioData` made of index arrays into it, so no client's data is ever copied
until a device asks for it. What a kind means (its fields, their defaults and checks, how it cuts the data into
tasks) is its class in `firmware_sim/scenario_kinds/`, registered by name: "class", "domain", "flowing" (pFedGRP's
flowing data) and "few-shot" (few-shot class-incremental sessions).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from edgefil.settings import Where, convert

from .array_dataset import ArrayDataset
from .datasets import ARRAYS, load_dataset
from .scenario_kinds import KINDS, ScenarioKind, Task
from .scenario_kinds.base import client_test_split, dirichlet_split, held_out

__all__ = ["OLD_DATA_CACHED", "PRESETS", "Scenario", "ScenarioData", "Task", "check_scenario",
           "client_test_split", "dirichlet_split", "preset", "scenario_from_config", "shared_build"]


def _freeze(value: Any) -> Any:
    # JSON/TOML hand lists back; tuples keep a frozen Scenario equal to the one that was saved.
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Scenario:
    """What to run: a dataset cut into tasks, each task's data spread over `n_clients` clients.

    `kind` names a registered `ScenarioKind` (firmware_sim/scenario_kinds/), whose docstring says what its tasks
    are and which of the optional fields below it takes (a field set for a kind that does not take it is
    refused): "class" (`classes_per_task`, `dynamics` with `old_only`, `joining`, `class_share`), "domain"
    (`domains`), "flowing" (`classes_per_task`, `n_client_tasks`, `sequence`, `replace_every`,
    `samples_per_class`), "few-shot" (`base_classes`, `classes_per_task`, `shots`, `base_training`).
    `alpha` is the Dirichlet concentration of the label split over clients (smaller = more skewed).
    `client_test_fraction`: size of a client's test set relative to its train set (see client_test_split).
    `calibration`: train samples of each class a task keeps apart from every client for the coordinator (its
    guard's trust reference, coordinator/reference.py; 0: none). They come out of the clients' shares after the
    split, so a client's share is what it was less those samples.
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
    calibration: int = 0
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
    base_classes: int | None = None
    shots: int | None = None
    base_training: str | None = None

    def __post_init__(self) -> None:
        normalised = {
            "alpha": float(self.alpha),  # TOML writes `alpha = 1` as an integer
            "client_test_fraction": float(self.client_test_fraction),
            "domains": None if self.domains is None else _freeze(self.domains),
            "dataset_options": MappingProxyType({k: _freeze(v) for k, v in self.dataset_options.items()}),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen
        kind = self.kind_class()
        for name, value in kind.defaults(self).items():
            object.__setattr__(self, name, value)
        self._validate(kind)

    def kind_class(self) -> ScenarioKind:
        """The registered kind this scenario is (ValueError naming every kind otherwise)."""
        if not isinstance(self.kind, str):
            raise ValueError(f"kind must be one of {', '.join(KINDS.names())}, got {self.kind!r}")
        return KINDS.get(self.kind)()

    def _validate(self, kind: ScenarioKind) -> None:
        for name, lowest in (("n_tasks", 1), ("n_clients", 1), ("seed", 0), ("calibration", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha (Dirichlet concentration) must be a positive finite number, got {self.alpha}")
        if not 0 < self.client_test_fraction <= 1:
            raise ValueError(f"client_test_fraction must be in (0, 1], got {self.client_test_fraction}")
        foreign: dict[str, list[str]] = {}  # the kinds that take them -> fields set that this kind does not take
        for name in sorted(kind_fields() - set(kind.takes), key=_FIELD_ORDER.index):
            if getattr(self, name) is not None:
                takers = " or ".join(f"kind={k!r}" for k in KINDS.names() if name in KINDS.get(k).takes)
                foreign.setdefault(takers, []).append(name)
        if foreign:
            raise ValueError("; ".join(f"{', '.join(names)} apply to {takers} only"
                                       for takers, names in foreign.items()))
        kind.validate(self)

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


_FIELD_ORDER = [f.name for f in dataclasses.fields(Scenario)]


def kind_fields() -> set[str]:
    """The optional Scenario fields some kind takes (every other field is every kind's)."""
    return {name for kind in KINDS.names() for name in KINDS.get(kind).takes}


# The Fashion-MNIST presets' scale: images a class kept of each split (two cores run a 5-seed table in hours).
FASHION_SCALE: Mapping[str, Any] = MappingProxyType({"train_per_class": 600, "test_per_class": 200})
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
    # Few-shot class-incremental sessions at digits' scale (the spec's minimal reproduction; the paper has 5
    # clients, Dirichlet alpha 1, a base session trained centrally and 5-way sessions of 25 shots in all).
    "digits-fewshot": Scenario("digits", kind="few-shot", n_tasks=4, base_classes=4, classes_per_task=2, shots=5,
                               n_clients=5, alpha=1.0),
    "mnist1d-fewshot": Scenario("mnist1d", kind="few-shot", n_tasks=4, base_classes=4, classes_per_task=2,
                                shots=5, n_clients=5, alpha=1.0),
    # Fashion-MNIST (Debian's dataset-fashion-mnist), real 28x28 images, cut to FASHION_SCALE images a class (a
    # seeded draw; `dataset_options = {}` takes all 70,000): class-incremental as digits-class, domain-incremental
    # over four transformed domains as digits-domain, few-shot sessions as digits-fewshot, and GLFC's client
    # dynamics on the class-incremental tasks.
    "fashion-class": Scenario("fashion_mnist", kind="class", n_tasks=5, classes_per_task=2, alpha=1.0,
                              dataset_options=FASHION_SCALE),
    "fashion-domain": Scenario("fashion_mnist_domains", kind="domain", n_tasks=4, alpha=0.1,
                               dataset_options=FASHION_SCALE),
    "fashion-fewshot": Scenario("fashion_mnist", kind="few-shot", n_tasks=4, base_classes=4, classes_per_task=2,
                                shots=5, n_clients=5, alpha=1.0, dataset_options=FASHION_SCALE),
    # GLFC's client dynamics (old-data-only clients, 2 clients joining at each task, 60 % of a task's classes each)
    # on 2 tasks of 5 classes, 3 a client: at 2 classes a task the 60 % rule leaves a client one class, and sigmoid
    # heads trained one class a client never separate a task's two (docs/results-history.md, "Under GLFC's own client
    # dynamics")
    "fashion-glfc": Scenario("fashion_mnist", kind="class", n_tasks=2, classes_per_task=5, dynamics="glfc", joining=2,
                             dataset_options=FASHION_SCALE),
})


def preset(name: str, **overrides: Any) -> Scenario:
    """A named scenario, with any field replaced (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def own_scenario(source: str | Path, tasks: int | None, classes_per_task: int | None, **fields: Any) -> Scenario:
    """The class-incremental scenario of the user's data at `source` (`--from`, with `fields` such as n_clients,
    seed, calibration; the data: firmware_sim/own_data.py): how its classes are cut into tasks is the user's to say,
    so both counts are required."""
    if tasks is None or classes_per_task is None:
        raise ValueError("--from needs --tasks and --classes-per-task (how to cut your classes into tasks)")
    return Scenario(dataset=ARRAYS, data_root=str(Path(source).resolve()), kind="class", n_tasks=tasks,
                    classes_per_task=classes_per_task, **fields)


# --- materialised scenario -----------------------------------------------------------------------

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
        """Every client has its own test data (flowing data), and per-client accuracy is measured."""
        return self.scenario.kind_class().per_client

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

    def client_train(self, t: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client k's train samples of task t: what its device receives (firmware_sim/client_shares.py)."""
        return self.tasks[t].client_train(k)

    def client_first_task(self, k: int) -> int | None:
        """The first task that brings client k train samples (None: none does). Before it the client's device
        holds nothing and says "no-data"; from it on it trains each round (on its store where a task brings
        nothing)."""
        return next((t for t, task in enumerate(self.tasks) if len(task.client_train_indices[k])), None)

    def calibration(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Task t's calibration samples (the scenario's `calibration` a class; empty for none)."""
        return self.tasks[t].calibration()

    def host_train(self, t: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A host-trained task's train data (a few-shot base session trained centrally); None otherwise."""
        task = self.tasks[t]
        return task.train() if task.host_trained else None

    def binding_budget(self, cached: float = OLD_DATA_CACHED) -> int:
        """A budget M that binds: N_task (1 + cached (T - 1)), with N_task the mean number of samples one client
        gets per task and T tasks, so a device holds its newest task and `cached` of its older data at the last
        task (Re-Fed's regime; the README's "Choosing M" says the same for a user's own data)."""
        sizes = [len(idx) for task in self.tasks for idx in task.client_train_indices]
        return max(1, round(sum(sizes) / len(sizes) * (1 + cached * (len(self.tasks) - 1))))


def build(scenario: Scenario) -> ScenarioData:
    """Load the dataset and materialise every task's class set, client shares and test sets (by the kind)."""
    loaded = load_dataset(scenario.dataset, scenario.data_root, **scenario.dataset_options)
    tasks = tuple(held_out(task, scenario.calibration, scenario.seed)
                  for task in scenario.kind_class().tasks(scenario, loaded))
    first = tasks[0].data
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
