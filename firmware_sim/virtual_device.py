"""A virtual device: the real device daemon with a simulated surrounding, built here and handed to it.

The device runtime never imports the simulator. A virtual device's config file is a device config whose `[data]`
names a scenario share (`scenario = {...}`, `client = k`) instead of a folder, and which may carry an `[emulation]`
table (profile, host calibration, real time, time scale). This module turns those two into the objects the
daemon takes: a `ClientSource` and an `EmulatedEnvironment`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from edge_client.config import DeviceConfig
from edge_client.device import STOP_POLL_S, Device
from edge_client.environment import Environment, RealEnvironment, Turns
from edge_client.sources import TaskSource
from edgefil.netloop import NetworkLoop
from firmware_sim.adversary import AdversarialDevice
from firmware_sim.client_shares import ClientSource
from firmware_sim.emulation import EmulatedEnvironment
from firmware_sim.limits import HostCalibration
from firmware_sim.profiles import load_profile


def simulated_source(config: DeviceConfig) -> TaskSource | None:
    """The device's share of the scenario, or None when its data come from a folder."""
    if config.data is None or config.data.scenario is None:
        return None
    return ClientSource(config.data.scenario, config.data.client, config.data.shares)


def hosted_environment(config: DeviceConfig, turns: Turns | None = None) -> Environment:
    """The emulated profile's limits, or the host's own for a device that runs at the host's speed; `turns`: the
    worker's, shared by the devices it hosts (they take turns at CPU work)."""
    emulation = config.emulation
    if emulation is None:
        return RealEnvironment(turns)
    seed = int.from_bytes(hashlib.sha256(config.device_id.encode()).digest()[:4], "little")
    return EmulatedEnvironment(
        load_profile(emulation.profile), HostCalibration(emulation.host_gflops), real_time=emulation.real_time,
        availability_seed=emulation.availability_seed if emulation.availability_seed is not None else seed,
        time_scale=emulation.time_scale, turns=turns, availability_clock=emulation.availability_clock,
        compute=emulation.compute,
    )


def virtual_device(
    config: DeviceConfig, network: NetworkLoop | None = None, turns: Turns | None = None,
    adversary: Mapping[str, Any] | None = None, stop_poll_s: float | None = STOP_POLL_S,
) -> Device:
    """`network` and `turns`: a worker's, shared by the devices it hosts (one network thread for all their
    connections; one device at a time doing CPU work). `adversary`: a compromised device's attack, its fleet's
    size, the compromised devices' count and the honest ones' state folders (firmware_sim/adversary.py).
    `stop_poll_s`: the daemon's (None: stopped with `Device.request_stop` only)."""
    parts: dict[str, Any] = {"source": simulated_source(config), "environment": hosted_environment(config, turns),
                             "network": network, "stop_poll_s": stop_poll_s}
    if adversary is not None:
        return AdversarialDevice(config, **adversary, **parts)
    return Device(config, **parts)
