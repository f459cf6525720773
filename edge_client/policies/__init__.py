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
    STREAM_SHARE,
    Admission,
    PolicyContext,
    ReplayPolicy,
    RoundView,
    Samples,
    TrainingSet,
    check_new_share,
    group_ranking,
    new_task_quota,
)
from edgefil.registry import import_submodules
from edgefil.settings import Where, check_options

import_submodules(__name__, __path__)


def policy_names() -> list[str]:
    return POLICIES.names()


# `[policy]` keys every policy takes, applied by the learner around the policy's hooks (LearnerConfig's fields)
AROUND_ANY_POLICY = ("group_by", "new_share")


def check_policy(raw: Mapping[str, Any], where: Where) -> dict[str, Any]:
    """A `[policy]` table checked: `name` (a registered policy), what the learner applies around any policy's
    ranking (`group_by`: quotas, `GROUPINGS`; `new_share`: how M is split between the newest task and the older
    ones, `new_task_quota`), and the policy's own options against its constructor (names, types, and the values it
    refuses); ConfigError naming the key otherwise."""
    name = raw.get("name")
    if name is None:
        raise where.error("name", f"missing (required); one of {', '.join(policy_names())}")
    if not isinstance(name, str) or name not in policy_names():
        raise where.error("name", f"unknown replay policy {name!r}; choose one of {', '.join(policy_names())}")
    group_by = raw.get("group_by")
    if group_by is not None and group_by not in GROUPINGS:
        raise where.error("group_by", f"expected one of {', '.join(map(repr, GROUPINGS))}, got {group_by!r}")
    new_share = raw.get("new_share")
    try:
        check_new_share(new_share)
    except ValueError as err:
        raise where.error("new_share", str(err)) from None
    if new_share not in (None, STREAM_SHARE) and POLICIES.get(name).admit is not ReplayPolicy.admit:
        raise where.error("new_share", f"{name} admits the stream itself, so each task keeps its share of the "
                                       f"stream: only new_share = \"{STREAM_SHARE}\" (its own split) applies")
    options = check_options(POLICIES.get(name), raw, where, also=("name", *AROUND_ANY_POLICY))
    try:
        make_policy(name, **options)
    except (ValueError, TypeError) as err:
        raise where.error(None, str(err)) from None
    around = {key: raw[key] for key in AROUND_ANY_POLICY if raw.get(key) is not None}
    return {"name": name, **around, **options}


def make_policy(name: str, **options: Any) -> ReplayPolicy:
    """Build a policy by its config name; options go to its constructor (e.g. refed's lam, pim_epochs)."""
    return POLICIES.get(name)(**options)


def split_policy(table: Mapping[str, Any]) -> tuple[ReplayPolicy, dict[str, Any]]:
    """A checked `[policy]` table as the policy it names and what the learner applies around it (`group_by`,
    `new_share`: LearnerConfig's fields of those names, only those given)."""
    options = dict(table)
    around = {key: options.pop(key) for key in AROUND_ANY_POLICY if key in options}
    return make_policy(**options), around


__all__ = ["AROUND_ANY_POLICY", "GROUPINGS", "STREAM_SHARE", "Admission", "PolicyContext", "ReplayPolicy",
           "RoundView", "Samples", "TrainingSet", "check_new_share", "group_ranking", "make_policy", "new_task_quota",
           "policy_names", "split_policy"]
