"""Replay policies (the device halves of learning methods), chosen by name in the config.

Every module of this package is imported once and every `ReplayPolicy` subclass that sets a `name` registers
itself, so adding a method adds files and touches nothing here. A method defined elsewhere (a plugin, a test)
registers the same way when its module is imported.
"""
from __future__ import annotations

from collections.abc import Mapping
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
from edgefil.settings import Where, check_options

import_submodules(__name__, __path__)


def policy_names() -> list[str]:
    return POLICIES.names()


def check_policy(raw: Mapping[str, Any], where: Where) -> dict[str, Any]:
    """A `[policy]` table checked: `name` (a registered policy), `group_by`, and the policy's own options against
    its constructor (names, types, and the values it refuses); ConfigError naming the key otherwise."""
    name = raw.get("name")
    if name is None:
        raise where.error("name", f"missing (required); one of {', '.join(policy_names())}")
    if not isinstance(name, str) or name not in policy_names():
        raise where.error("name", f"unknown replay policy {name!r}; choose one of {', '.join(policy_names())}")
    group_by = raw.get("group_by")
    if group_by is not None and group_by not in GROUPINGS:
        raise where.error("group_by", f"expected one of {', '.join(map(repr, GROUPINGS))}, got {group_by!r}")
    options = check_options(POLICIES.get(name), raw, where, skip=("inner",), also=("name", "group_by"))
    checked = {"name": name, **({"group_by": group_by} if group_by is not None else {}), **options}
    try:
        make_policy(**checked)
    except (ValueError, TypeError) as err:
        raise where.error(None, str(err)) from None
    return checked


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
