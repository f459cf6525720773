"""Replay policies, chosen by name in the config."""
from __future__ import annotations

from typing import Any

from edge_client.policies.base import ReplayPolicy, SelectionContext, Samples
from edge_client.policies.class_balanced import ClassBalanced
from edge_client.policies.generator import GeneratorReplay
from edge_client.policies.herding import Herding
from edge_client.policies.no_replay import NoReplay
from edge_client.policies.random_cache import RandomCache
from edge_client.policies.refed import ReFed
from edge_client.policies.reservoir import Reservoir

POLICIES: dict[str, type[ReplayPolicy]] = {
    cls.name: cls for cls in (NoReplay, RandomCache, Reservoir, ClassBalanced, Herding, ReFed, GeneratorReplay)
}


def make_policy(name: str, **options: Any) -> ReplayPolicy:
    """Build a policy by its config name; options go to its constructor (e.g. refed's lam, pim_epochs)."""
    if name not in POLICIES:
        raise ValueError(f"unknown replay policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)


__all__ = ["POLICIES", "ReplayPolicy", "Samples", "SelectionContext", "make_policy"]
