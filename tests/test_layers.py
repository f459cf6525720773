"""The layers that import-linter cannot see. No generic file names a learning method: the device daemon, the learner,
the coordinator, its gate, the wire and the base classes speak only of policies, strategies and named payloads
(docs/architecture.md); a method's name in one of them means a method was threaded through generic code again. And
no module imports one that imports it back: the order in which data flow is the order of the imports."""
from __future__ import annotations

import re
from pathlib import Path

import grimp
import pytest

from coordinator.strategies import strategy_names
from edge_client.policies import policy_names

ROOT = Path(__file__).resolve().parents[1]
GENERIC = [
    "edge_client/device.py", "edge_client/learner.py", "edge_client/policies/base.py", "edge_client/trainers/base.py",
    "coordinator/server.py", "coordinator/inbox.py", "coordinator/rounds.py", "coordinator/strategies/base.py",
    "edgefil/wire.py", "edgefil/topics.py",
]
# baselines the generic docs use as examples, and names that are plain words there ("class-balanced" prefixes)
NOT_SEARCHED = {"none", "random", "fedavg", "fedprox", "class-balanced", "generator"}
# the papers, and generator replay's own vocabulary (its policy name, "generator", alone also means a random
# number generator, so its attachment names and types are searched for instead)
PAPERS = ["pFedGRP", "Re-Fed", "GLFC", "SDD", "generators", r"generator[/_]\w*", "GeneratorRecord", "GeneratorBank"]


def method_names() -> list[str]:
    names = (set(policy_names()) | set(strategy_names())) - NOT_SEARCHED
    return sorted({re.escape(n) for n in names} | set(PAPERS))


@pytest.mark.parametrize("path", GENERIC)
def test_no_generic_file_names_a_method(path):
    pattern = re.compile(r"(?<![\w.])(" + "|".join(method_names()) + r")(?![\w-])", re.IGNORECASE)
    found = [f"{path}:{n}: {line.strip()}" for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, "\n".join(found)


PACKAGES = ("edgefil", "edge_client", "coordinator", "firmware_sim", "models")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_runtimes_modules_import_one_another_without_a_circle():
    """Which way the data flow is read off the imports: a module that imports one that imports it back (at any
    remove, lazily included) has no place in that order. Imports for annotations only (`if TYPE_CHECKING:`) are
    not arrows: a scenario kind reads the Scenario it is registered for, whose validation looks the kind up. The
    graph is import-linter's (grimp), which does not follow a registry's dynamic imports (`import_submodules`);
    its own `acyclic_siblings` contract asks no circle between a package's members taken whole, which edge_client
    breaks (its config checks a name against the policies' registry, and GLFC's policy reads the config when it
    opens Gamma's trainer, the policies package loading GLFC's module dynamically), and it would miss a circle
    through another package (a fleet's sites through the command line)."""
    imports = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)  # import-linter's
    graph = {module: imports.find_modules_directly_imported_by(module) for module in imports.modules}
    assert _circles(graph) == []
