"""Aggregation rules (the coordinator halves of learning methods) by name: the coordinator builds its strategy from
the configuration's name and options. Every module here is imported once and each `Strategy` subclass with a
`name` registers itself, so a new rule adds a file and touches nothing else."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coordinator.privacy import BuiltFrom, PrivacySettings
from coordinator.secagg import SecureAggregationSettings, secure_refused
from coordinator.strategies.base import (
    STRATEGIES,
    AggregateResult,
    ClientUpdate,
    Fold,
    RefusedUpdate,
    RoundContext,
    Strategy,
    validate_updates,
)
from edgefil.registry import import_submodules
from edgefil.settings import Where, check_options
from models.manifest import Manifest

import_submodules(__name__, __path__)


def strategy_names() -> list[str]:
    return STRATEGIES.names()


def check_strategy(raw: Mapping[str, Any], where: Where, privacy: PrivacySettings | None = None,
                   secure: SecureAggregationSettings | None = None) -> dict[str, Any]:
    """A `[strategy]` table checked: `name` (a registered rule), its options against the rule's constructor, and
    whether `privacy` and `secure` (the coordinator's [privacy] and [secure_aggregation]) can run with it."""
    name = raw.get("name")
    if not isinstance(name, str) or name not in strategy_names():
        problem = "missing (required)" if name is None else f"unknown strategy {name!r}"
        raise where.error("name", f"{problem}; choose one of {', '.join(strategy_names())}")
    options = check_options(STRATEGIES.get(name), raw, where, skip=("device", "manifest"), also=("name",))
    refused = None if privacy is None else privacy_refused(privacy, name, options)
    if refused is not None:
        raise where.error("name", f"[privacy] {refused}")
    refused = None if secure is None else secure_aggregation_refused(secure, name)
    if refused is not None:
        raise where.error("name", f"[secure_aggregation] {refused}")
    return {"name": name, **options}


def privacy_refused(privacy: PrivacySettings, name: str, options: Mapping[str, Any]) -> str | None:
    """Why central DP cannot run with rule `name` and its options (one line), or None: the rule's to say."""
    return STRATEGIES.get(name).central_dp_refused(options) if privacy.central else None


def secure_aggregation_refused(secure: SecureAggregationSettings, name: str) -> str | None:
    """Why secure aggregation cannot run with rule `name` (one line), or None."""
    return secure_refused(secure, name, *_reads(name))


def makes_inputs(name: str) -> bool:
    """Whether rule `name` makes model inputs of its own (`Strategy.makes_inputs`): it takes `input_range`."""
    return STRATEGIES.get(name).makes_inputs


def _reads(name: str) -> tuple[BuiltFrom, bool]:
    rule = STRATEGIES.get(name)
    return rule.built_from, rule.reads_more


def make_strategy(
    name: str, device: torch.device | str = "auto", manifest: Manifest | None = None, **options: Any
) -> Strategy:
    """The strategy registered as `name`, built with `options` (e.g. mu=0.1 for fedprox), the torch device and the
    model's manifest (rules that run models need it)."""
    return STRATEGIES.get(name)(device=device, manifest=manifest, **options)


__all__ = ["AggregateResult", "ClientUpdate", "Fold", "RefusedUpdate", "RoundContext", "Strategy", "make_strategy",
           "makes_inputs", "strategy_names", "validate_updates"]
