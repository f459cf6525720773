"""Attacks on a learning method's own payloads (what a device attaches to its update beside its weights), by name.

Every module of this package is imported once and each `PayloadAttack` subclass that sets a `name` registers
itself, so a method's attacks are a file of their own (the method's name is the file's); firmware_sim/adversary.py
runs them through `[adversary] attack` like every weights attack.
"""
from __future__ import annotations

from edgefil.registry import import_submodules
from firmware_sim.payload_attacks.base import PAYLOAD_ATTACKS, PayloadAttack, PayloadContext

import_submodules(__name__, __path__)

__all__ = ["PAYLOAD_ATTACKS", "PayloadAttack", "PayloadContext"]
