"""What a device's surroundings impose on a round: whether training fits in memory, how long the compute and the
transfers take in the device's own time. A real device runs in `RealEnvironment` (nothing emulated: its clock is
the wall clock); a virtual device in a simulated fleet gets `firmware_sim.emulation.EmulatedEnvironment`, which
applies its profile's RAM, speed, link and availability.

Devices hosted together in one process (a fleet worker's) take turns at a round's CPU work (`turn`): trained all at
once, hundreds of device threads starve the process's network thread of the GIL, keepalives lapse and the broker
drops the connections; one at a time, the worker still keeps a core busy, as the GIL allows it no more anyway.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol

from models.manifest import Manifest


class Environment(Protocol):
    def check_training(self, manifest: Manifest, batch_size: int, optimizer: str) -> None:
        """Raise MemoryError when a training step would not fit (as an out-of-memory kill would end it)."""

    def compute(self, host_seconds: float) -> float:
        """Device seconds that `host_seconds` of this host's CPU work take on the device."""

    def transfer(self, nbytes: int, messages: int, upload: bool) -> float:
        """Device seconds to move `nbytes` in `messages` messages over the device's link."""

    def offline_for(self) -> float:
        """Wall seconds until the device is back online: 0 while it is online, inf when it never comes back."""

    def online_for(self) -> float:
        """Wall seconds the device stays online for sure (inf: for good): how long an idle device may sleep."""

    def turn(self) -> AbstractContextManager[Any]:
        """Held while the device starts a task or trains: its turn among the devices its process hosts."""


class RealEnvironment:
    """The device itself: no emulated limits; compute is what it measured, transfers are real (0 extra).
    `turns`: shared by devices hosted in one process (a simulated fleet's unemulated devices); None: alone."""

    def __init__(self, turns: AbstractContextManager[Any] | None = None) -> None:
        self._turns = turns

    def check_training(self, manifest: Manifest, batch_size: int, optimizer: str) -> None:
        return None

    def compute(self, host_seconds: float) -> float:
        return host_seconds

    def transfer(self, nbytes: int, messages: int, upload: bool) -> float:
        return 0.0

    def offline_for(self) -> float:
        return 0.0

    def online_for(self) -> float:
        return float("inf")

    def turn(self) -> AbstractContextManager[Any]:
        return self._turns if self._turns is not None else contextlib.nullcontext()
