"""Kind "flowing": pFedGRP's flowing data (docs/flowing-data.md). `n_tasks` rounds, one task each; every client
splits the classes at random into `n_client_tasks` tasks (default 5) of `classes_per_task` classes and walks them
in its `sequence`: "circulating" (T1 -> ... -> Tn -> T1 ...) or "gradual" (a loop T1, T2, T1, ... of which one
task is replaced by another of the client's tasks every `replace_every` rounds, default 30). Each round a client
gets a fresh part of `samples_per_class` samples of each class of its task. `alpha` and `client_test_fraction` do
not apply (test parts are cut in proportion).

Two choices the paper leaves open ([R]):
- a class's parts running out (the paper's MNIST has < 30 parts of 200 for some digits, and a gradual loop can
  keep a task longer): the client starts over with a fresh permutation of that class, so a sample appears at
  most once per pass; the remainder of a pass (fewer than `samples_per_class` samples) is left out of that pass;
- test parts: a class's test samples are cut into as many consecutive parts as the class has train parts per
  pass; with fewer test samples than parts, neighbouring parts share a sample, so every part holds at least one.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import DOMAIN_STREAMS, known_num_classes
from firmware_sim.scenario_kinds.base import (
    GROUPS,
    PARTS,
    SEQUENCE,
    ScenarioKind,
    Task,
    given,
    one_dataset,
    require_classes,
    require_int,
    rng_for,
    split_classes,
)

if TYPE_CHECKING:
    from firmware_sim.scenarios import Scenario

SEQUENCES: tuple[str, ...] = ("circulating", "gradual")


class Flowing(ScenarioKind):
    name = "flowing"
    takes = ("classes_per_task", "n_client_tasks", "sequence", "replace_every", "samples_per_class")
    per_client = True

    def defaults(self, scenario: Scenario) -> dict[str, Any]:
        """The paper's defaults, spelled out so a saved scenario states them."""
        filled: dict[str, Any] = {"n_client_tasks": 5 if scenario.n_client_tasks is None else scenario.n_client_tasks}
        if scenario.sequence == "gradual" and scenario.replace_every is None:
            filled["replace_every"] = 30
        return filled

    def validate(self, scenario: Scenario) -> None:
        if scenario.dataset in DOMAIN_STREAMS:
            raise ValueError(f"kind='flowing' splits one dataset's classes; domains and domain streams "
                             f"({', '.join(DOMAIN_STREAMS)}) do not apply")
        if not isinstance(scenario.classes_per_task, int) or scenario.classes_per_task < 1:
            raise ValueError(f"kind='flowing' needs classes_per_task, an integer >= 1; got "
                             f"{scenario.classes_per_task!r}")
        if scenario.sequence not in SEQUENCES:
            raise ValueError(f"kind='flowing' needs sequence, one of {SEQUENCES}; got {scenario.sequence!r}")
        require_int(scenario, "samples_per_class", 1)
        # A gradual loop holds 2 tasks and replaces one by another: it needs a third task to change to.
        require_int(scenario, "n_client_tasks", 3 if scenario.sequence == "gradual" else 1)
        if scenario.sequence == "gradual":
            require_int(scenario, "replace_every", 1)
        elif scenario.replace_every is not None:
            raise ValueError("replace_every applies to sequence='gradual' only")
        self.check_classes(scenario, known_num_classes(scenario.dataset))

    def setting(self, scenario: Scenario) -> str:
        return (f"flowing data ({scenario.sequence}), {scenario.n_tasks} rounds, {scenario.n_clients} clients, "
                f"{scenario.samples_per_class} samples per class per round")

    def task_label(self, scenario: Scenario, t: int) -> str:
        return f"round {t + 1}"

    def check_classes(self, scenario: Scenario, num_classes: int | None) -> None:
        require_classes(scenario, given(scenario.n_client_tasks) * given(scenario.classes_per_task),
                        f"{scenario.n_client_tasks} client tasks x {scenario.classes_per_task} classes", num_classes)

    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        data = one_dataset(scenario, loaded)
        self.check_classes(scenario, data.num_classes)
        smallest = int(np.bincount(data.y_train, minlength=data.num_classes).min())
        if given(scenario.samples_per_class) > smallest:
            raise ValueError(f"samples_per_class={scenario.samples_per_class}, but a class of "
                             f"{scenario.dataset!r} has only {smallest} train samples")
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


def _client_sequence(scenario: Scenario, k: int) -> list[int]:
    """Which of client k's tasks (0..n_client_tasks-1) it gets in each round."""
    if scenario.sequence == "circulating":
        return [t % given(scenario.n_client_tasks) for t in range(scenario.n_tasks)]
    rng = rng_for(scenario.seed, SEQUENCE, k)
    loop, sequence = [0, 1], []
    for t in range(scenario.n_tasks):
        if t and t % given(scenario.replace_every) == 0:
            others = [i for i in range(given(scenario.n_client_tasks)) if i not in loop]
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
    groups = split_classes(rng_for(scenario.seed, GROUPS, k).permutation(data.num_classes),
                           [given(scenario.classes_per_task)] * given(scenario.n_client_tasks))
    parts = {
        c: _class_parts(np.flatnonzero(data.y_train == c), np.flatnonzero(data.y_test == c),
                        given(scenario.samples_per_class), rng_for(scenario.seed, PARTS, k, c))
        for group in groups for c in group
    }
    rounds = []
    for g in _client_sequence(scenario, k):
        train, test = zip(*(next(parts[c]) for c in groups[g]))
        rounds.append((groups[g], np.sort(np.concatenate(train)), np.sort(np.concatenate(test))))
    return rounds
