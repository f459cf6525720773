"""Kind "domain": one task per domain of a domain stream, all labels every time; `domains` picks and orders them
by name, else the stream's first `n_tasks` domains are used."""
from __future__ import annotations

from typing import TYPE_CHECKING

from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import DOMAIN_STREAMS
from firmware_sim.scenario_kinds.base import ScenarioKind, Task, dirichlet_task

if TYPE_CHECKING:
    from firmware_sim.scenarios import Scenario


class DomainIncremental(ScenarioKind):
    name = "domain"
    takes = ("domains",)

    def validate(self, scenario: Scenario) -> None:
        if scenario.dataset not in DOMAIN_STREAMS:
            raise ValueError(f"kind='domain' needs a domain stream, one of {DOMAIN_STREAMS}; got "
                             f"{scenario.dataset!r}")
        if scenario.domains is not None and len(scenario.domains) != scenario.n_tasks:
            raise ValueError(f"n_tasks={scenario.n_tasks} but {len(scenario.domains)} domains given: "
                             f"{scenario.domains}")

    def tasks(self, scenario: Scenario, loaded: ArrayDataset | list[ArrayDataset]) -> tuple[Task, ...]:
        domains = _pick_domains(scenario, loaded if isinstance(loaded, list) else [loaded])
        labels = tuple(range(domains[0].num_classes))
        return tuple(dirichlet_task(scenario, t, d, labels, d.name) for t, d in enumerate(domains))


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
