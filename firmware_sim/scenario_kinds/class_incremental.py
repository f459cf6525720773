"""Kind "class": `n_tasks` tasks of `classes_per_task` new classes each, from a seeded class order; each task's
samples split over the clients by Dirichlet(alpha) per class, or under GLFC's client dynamics (`dynamics`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import DOMAIN_STREAMS, known_num_classes
from firmware_sim.scenario_kinds.base import (
    DYNAMICS,
    ORDER,
    ScenarioKind,
    Task,
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

CLIENT_DYNAMICS: tuple[str, ...] = ("glfc",)
_DYNAMICS_ONLY: tuple[str, ...] = ("old_only", "joining", "class_share")


class ClassIncremental(ScenarioKind):
    """`dynamics = "glfc"` gives GLFC's client dynamics: of the `n_clients`, `joining` new clients join at each
    task from the second (holding data from then on only: S_n), and the rest hold data from the start; at each
    task a share `old_only` of the clients already there gets no new data (they keep their old data: S_o), the
    others (S_b) new data; each client with new data sees a random share `class_share` of the task's classes (at
    least one: with 2 classes a task GLFC's 60 % is one class), and each class's samples are cut into disjoint
    shards among the clients that see it (a class nobody drew goes to one of them). `alpha` does not apply.
    GLFC's authors give every client of a class all of its images; disjoint shards are the spec's suggestion for
    small data. A client that has not joined yet holds no data: its device says so (status "no-data") and is not
    selected before its task (docs/protocol.md, "One round")."""

    name = "class"
    takes = ("classes_per_task", "dynamics", *_DYNAMICS_ONLY)

    def defaults(self, scenario: Scenario) -> dict[str, Any]:
        if scenario.dynamics is None:
            return {}
        # GLFC's defaults (its code: 10 % old-only, 60 % of the classes)
        return {"old_only": 0.1 if scenario.old_only is None else float(scenario.old_only),
                "joining": 0 if scenario.joining is None else scenario.joining,
                "class_share": 0.6 if scenario.class_share is None else float(scenario.class_share)}

    def validate(self, scenario: Scenario) -> None:
        if scenario.dataset in DOMAIN_STREAMS:
            raise ValueError(f"{scenario.dataset!r} is a domain stream: use kind='domain'")
        if not isinstance(scenario.classes_per_task, int) or scenario.classes_per_task < 1:
            raise ValueError(f"kind='class' needs classes_per_task, an integer >= 1; got "
                             f"{scenario.classes_per_task!r}")
        self._validate_dynamics(scenario)
        self.check_classes(scenario, known_num_classes(scenario.dataset))

    def _validate_dynamics(self, scenario: Scenario) -> None:
        if scenario.dynamics is None:
            given_ = [name for name in _DYNAMICS_ONLY if getattr(scenario, name) is not None]
            if given_:
                raise ValueError(f"{', '.join(given_)} apply with dynamics = \"glfc\" only")
            return
        if scenario.dynamics not in CLIENT_DYNAMICS:
            raise ValueError(f"dynamics must be one of {CLIENT_DYNAMICS}; got {scenario.dynamics!r}")
        require_int(scenario, "joining", 0)
        first = scenario.n_clients - given(scenario.joining) * (scenario.n_tasks - 1)
        if first < 1:
            raise ValueError(f"{scenario.joining} clients joining at each of {scenario.n_tasks - 1} tasks leave "
                             f"none of the {scenario.n_clients} for the first task")
        for name in ("old_only", "class_share"):
            value = getattr(scenario, name)
            if not 0.0 <= value <= 1.0 or (name == "class_share" and value == 0.0):
                raise ValueError(f"{name} must lie in {'(0' if name == 'class_share' else '[0'}, 1], got {value}")

    def check_classes(self, scenario: Scenario, num_classes: int | None) -> None:
        require_classes(scenario, scenario.n_tasks * given(scenario.classes_per_task),
                        f"{scenario.n_tasks} tasks x {scenario.classes_per_task} classes", num_classes)

    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        data = one_dataset(scenario, loaded)
        self.check_classes(scenario, data.num_classes)
        order = rng_for(scenario.seed, ORDER).permutation(data.num_classes)
        groups = split_classes(order, [given(scenario.classes_per_task)] * scenario.n_tasks)
        if scenario.dynamics is None:
            return tuple(dirichlet_task(scenario, t, data, classes) for t, classes in enumerate(groups))
        tasks = []
        for t, classes in enumerate(groups):
            train_idx = np.flatnonzero(np.isin(data.y_train, classes))
            clients = glfc_split(data.y_train[train_idx], scenario, t, rng_for(scenario.seed, DYNAMICS, t))
            tasks.append(split_task(scenario, t, data, classes, None, train_idx, clients))
        return tuple(tasks)


def glfc_split(labels: np.ndarray, scenario: Scenario, t: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Task t's positions over the clients under GLFC's dynamics (the class docstring): clients not joined yet
    and the old-only share get none; every other client draws its share of the classes, and each class's samples
    are cut into disjoint shards among the clients that drew it."""
    joining, n = given(scenario.joining), scenario.n_clients
    present = n - joining * (scenario.n_tasks - 1) + joining * t  # clients 0..present-1 are there at task t
    earlier = present - (joining if t else 0)  # of which these were there before
    old_only = set(rng.choice(earlier, size=round(given(scenario.old_only) * earlier), replace=False)
                   .tolist()) if t else set()
    learning = [k for k in range(present) if k not in old_only]
    classes = np.unique(labels)
    share = max(1, round(given(scenario.class_share) * len(classes)))
    drawn = {k: set(rng.choice(classes, size=min(share, len(classes)), replace=False).tolist()) for k in learning}
    parts: list[list[int]] = [[] for _ in range(n)]
    for c in classes.tolist():
        holders = [k for k in learning if c in drawn[k]] or [int(rng.choice(learning))]
        members = rng.permutation(np.flatnonzero(labels == c))
        for k, shard in zip(holders, np.array_split(members, len(holders))):
            parts[k].extend(shard.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
