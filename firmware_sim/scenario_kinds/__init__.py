"""Scenario kinds, one class per module, registered by the name a scenario's `kind` gives (base.py)."""
from edgefil.registry import import_submodules
from firmware_sim.scenario_kinds.base import KINDS, ScenarioKind, Task

import_submodules(__name__, __path__)

__all__ = ["KINDS", "ScenarioKind", "Task"]
