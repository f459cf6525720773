"""Replay policies (the device halves of learning methods), chosen by name in the config.

Every module of this package is imported once and every `ReplayPolicy` subclass that sets a `name` registers
itself, so adding a method adds files and touches nothing here. A method defined elsewhere (a plugin, a test)
registers the same way when its module is imported.
"""
from __future__ import annotations

from typing import Any

from edge_client.policies.base import (
    POLICIES,
    Admission,
    PolicyContext,
    ReplayPolicy,
    Samples,
    SelectionContext,
    TrainingSet,
)
from edge_client.policies.class_balanced import GROUPINGS, ClassBalanced
from edgefil.registry import import_submodules

import_submodules(__name__, __path__)


def policy_names() -> list[str]:
    return POLICIES.names()


def make_policy(name: str, group_by: str | None = None, **options: Any) -> ReplayPolicy:
    """Build a policy by its config name; options go to its constructor (e.g. refed's lam, pim_epochs);
    `group_by = "class"` wraps it in per-class quotas (`ClassBalanced`)."""
    cls = POLICIES.get(name)
    if group_by is not None and group_by not in GROUPINGS:
        raise ValueError(f"unknown group_by {group_by!r}; choose one of {', '.join(GROUPINGS)}")
    policy = cls(**options)
    return ClassBalanced(policy) if group_by == "class" else policy


__all__ = ["Admission", "ClassBalanced", "PolicyContext", "ReplayPolicy", "Samples", "SelectionContext",
           "TrainingSet", "make_policy", "policy_names"]
