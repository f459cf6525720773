"""Replay policies (the device halves of learning methods), chosen by name in the config.

Every module of this package is imported once and every `ReplayPolicy` subclass that sets a `name` registers
itself, so adding a method adds files and touches nothing here. A method defined elsewhere (a plugin, a test)
registers the same way when its module is imported.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_client.policies.base import (
    GROUPINGS,
    POLICIES,
    Admission,
    PolicyContext,
    ReplayPolicy,
    RoundView,
    Samples,
    TrainingSet,
    group_ranking,
)
from edgefil.registry import import_submodules
from edgefil.settings import Where, check_options

import_submodules(__name__, __path__)


def policy_names() -> list[str]:
    return POLICIES.names()


def check_policy(raw: Mapping[str, Any], where: Where) -> dict[str, Any]:
    """A `[policy]` table checked: `name` (a registered policy), `group_by` (quotas the learner applies around the
    policy's ranking, `GROUPINGS`), and the policy's own options against its constructor (names, types, and the
    values it refuses); ConfigError naming the key otherwise."""
    name = raw.get("name")
    if name is None:
        raise where.error("name", f"missing (required); one of {', '.join(policy_names())}")
    if not isinstance(name, str) or name not in policy_names():
        raise where.error("name", f"unknown replay policy {name!r}; choose one of {', '.join(policy_names())}")
    group_by = raw.get("group_by")
    if group_by is not None and group_by not in GROUPINGS:
        raise where.error("group_by", f"expected one of {', '.join(map(repr, GROUPINGS))}, got {group_by!r}")
    options = check_options(POLICIES.get(name), raw, where, also=("name", "group_by"))
    try:
        make_policy(name, **options)
    except (ValueError, TypeError) as err:
        raise where.error(None, str(err)) from None
    return {"name": name, **({"group_by": group_by} if group_by is not None else {}), **options}


def make_policy(name: str, **options: Any) -> ReplayPolicy:
    """Build a policy by its config name; options go to its constructor (e.g. refed's lam, pim_epochs)."""
    return POLICIES.get(name)(**options)


def split_policy(table: Mapping[str, Any]) -> tuple[ReplayPolicy, str | None]:
    """A checked `[policy]` table as the policy it names and the grouping the learner applies around its ranking
    (`LearnerConfig.group_by`)."""
    options = dict(table)
    group_by = options.pop("group_by", None)
    return make_policy(**options), group_by


__all__ = ["GROUPINGS", "Admission", "PolicyContext", "ReplayPolicy", "RoundView", "Samples", "TrainingSet",
           "group_ranking", "make_policy", "policy_names", "split_policy"]
