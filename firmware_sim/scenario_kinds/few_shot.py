"""Kind "few-shot": few-shot class-incremental sessions (F2SCIL, spec shared/specs/fewshot-sdd.md, Sec. 1).

Session 0, the base session, brings `base_classes` classes with every train sample of them. Sessions 1 ..
n_tasks - 1 are N-way K-shot: `classes_per_task` (N) new classes each, with `shots` (K) train samples per class
in all, K being the number over all clients (the paper's reading, not per client), drawn at random from the
class's train samples; a session's samples are split over the clients by Dirichlet(alpha) per class, with the
repair rule of `dirichlet_split`, so every client holds at least one sample (which needs N * K >= n_clients).
Each session is tested on every test sample of its classes, so accuracy after session t is over all classes
seen so far, as the paper's tables report.

`base_training`: "central" (the paper's: the host trains the base model on the base session's data, and no
client holds any of it; the session is `host_trained`), or "federated" (the base session's samples are split over
the clients by Dirichlet(alpha), and the fleet learns it as any task).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import DOMAIN_STREAMS, known_num_classes
from firmware_sim.scenario_kinds.base import (
    ORDER,
    SHOTS,
    SPLIT,
    ScenarioKind,
    Task,
    dirichlet_split,
    dirichlet_task,
    given,
    one_dataset,
    require_classes,
    require_int,
    rng_for,
    split_classes,
    split_task,
)

if TYPE_CHECKING:
    from firmware_sim.scenarios import Scenario

BASE_TRAINING: tuple[str, ...] = ("central", "federated")


class FewShot(ScenarioKind):
    name = "few-shot"
    takes = ("base_classes", "classes_per_task", "shots", "base_training")

    def calibration(self, scenario: Scenario) -> int:
        """None: a session's classes come with `shots` samples a device, none to spare for the coordinator."""
        return 0

    def defaults(self, scenario: Scenario) -> dict[str, Any]:
        return {"base_training": "central" if scenario.base_training is None else scenario.base_training}

    def validate(self, scenario: Scenario) -> None:
        if scenario.dataset in DOMAIN_STREAMS:
            raise ValueError(f"kind='few-shot' splits one dataset's classes; {scenario.dataset!r} is a domain "
                             f"stream")
        for name in ("base_classes", "classes_per_task", "shots"):
            require_int(scenario, name, 1)
        require_int(scenario, "n_tasks", 2)  # the base session and at least one few-shot session
        if scenario.base_training not in BASE_TRAINING:
            raise ValueError(f"base_training must be one of {BASE_TRAINING}; got {scenario.base_training!r}")
        per_session = given(scenario.classes_per_task) * given(scenario.shots)
        if per_session < scenario.n_clients:
            raise ValueError(f"{scenario.classes_per_task}-way {scenario.shots}-shot sessions hold "
                             f"{per_session} samples: fewer than the {scenario.n_clients} clients, each of which "
                             f"must hold one")
        self.check_classes(scenario, known_num_classes(scenario.dataset))

    def check_classes(self, scenario: Scenario, num_classes: int | None) -> None:
        needed = given(scenario.base_classes) + (scenario.n_tasks - 1) * given(scenario.classes_per_task)
        require_classes(scenario, needed, f"{scenario.base_classes} base classes + {scenario.n_tasks - 1} "
                        f"sessions x {scenario.classes_per_task}", num_classes)

    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        data = one_dataset(scenario, loaded)
        self.check_classes(scenario, data.num_classes)
        shots = given(scenario.shots)
        smallest = int(np.bincount(data.y_train, minlength=data.num_classes).min())
        if shots > smallest:
            raise ValueError(f"shots={shots}, but a class of {scenario.dataset!r} has only {smallest} train "
                             f"samples")
        order = rng_for(scenario.seed, ORDER).permutation(data.num_classes)
        groups = split_classes(order, [given(scenario.base_classes)]
                               + [given(scenario.classes_per_task)] * (scenario.n_tasks - 1))
        tasks = [self._base(scenario, data, groups[0])]
        for t, classes in enumerate(groups[1:], start=1):
            pick = rng_for(scenario.seed, SHOTS, t)
            train_idx = np.sort(np.concatenate([pick.choice(np.flatnonzero(data.y_train == c), shots, replace=False)
                                                for c in classes]))
            clients = dirichlet_split(data.y_train[train_idx], scenario.n_clients, scenario.alpha,
                                      rng_for(scenario.seed, SPLIT, t))
            tasks.append(split_task(scenario, t, data, classes, None, train_idx, clients))
        return tuple(tasks)

    def setting(self, scenario: Scenario) -> str:
        learnt = "learnt by the host" if scenario.base_training == "central" else "federated"
        return (f"few-shot: {scenario.base_classes} base classes {learnt}, then {scenario.n_tasks - 1} sessions of "
                f"{scenario.classes_per_task}-way {scenario.shots}-shot over {scenario.n_clients} clients, Dirichlet "
                f"alpha {scenario.alpha}")

    def task_label(self, scenario: Scenario, t: int) -> str:
        return "base" if t == 0 else f"session {t}"

    def _base(self, scenario: Scenario, data: ArrayDataset, classes: tuple[int, ...]) -> Task:
        if scenario.base_training == "federated":
            return dirichlet_task(scenario, 0, data, classes)
        empty = tuple(np.empty(0, np.int64) for _ in range(scenario.n_clients))
        return Task(index=0, classes=classes, domain=None, data=data,
                    train_indices=np.flatnonzero(np.isin(data.y_train, classes)),
                    test_indices=np.flatnonzero(np.isin(data.y_test, classes)),
                    client_train_indices=empty, client_test_indices=empty, host_trained=True)
