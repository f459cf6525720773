"""No generic file names a learning method: the device daemon, the learner, the coordinator, its gate, the wire and
the base classes speak only of policies, strategies and named payloads (docs/architecture.md). A method's name in
one of them means a method was threaded through generic code again."""
from __future__ import annotations

import re
from pathlib import Path

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
