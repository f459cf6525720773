"""A virtual device: the real device daemon with a simulated surrounding, built here and handed to it.

The device runtime never imports the simulator. A virtual device's config file is a device config whose `[data]`
names a scenario share (`scenario = {...}`, `client = k`) instead of a folder, and which may carry an `[emulation]`
table (profile, host calibration, real time, time scale). This module turns those two into the objects the
daemon takes: a `ClientSource` and an `EmulatedEnvironment`.
"""
from __future__ import annotations

import hashlib

from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.environment import Environment
from edge_client.sources import TaskSource
from edgefil.netloop import NetworkLoop
from firmware_sim.emulation import EmulatedEnvironment
from firmware_sim.limits import HostCalibration
from firmware_sim.profiles import load_profile
from firmware_sim.scenarios import ClientSource


def simulated_source(config: DeviceConfig) -> TaskSource | None:
    """The device's share of the scenario, or None when its data come from a folder."""
    if config.data is None or config.data.scenario is None:
        return None
    return ClientSource(config.data.scenario, config.data.client)


def emulated_environment(config: DeviceConfig) -> Environment | None:
    """The emulated profile's limits, or None for a device that runs at the host's speed."""
    emulation = config.emulation
    if emulation is None:
        return None
    seed = int.from_bytes(hashlib.sha256(config.device_id.encode()).digest()[:4], "little")
    return EmulatedEnvironment(
        load_profile(emulation.profile), HostCalibration(emulation.host_gflops), real_time=emulation.real_time,
        availability_seed=emulation.availability_seed if emulation.availability_seed is not None else seed,
        time_scale=emulation.time_scale,
    )


def virtual_device(config: DeviceConfig, network: NetworkLoop | None = None) -> Device:
    """`network`: the loop the worker's devices share (one network thread for all their connections)."""
    return Device(config, source=simulated_source(config), environment=emulated_environment(config),
                  network=network)
