"""A simulated fleet's sites (`sites = N` in the fleet file): what a deployment runs at each site, on this machine.

Each site is a mosquitto of its own on the loopback interface, bridged to the fleet's broker as the site's account
(coordinator/broker.py: `Site`, `Bridge`), and an aggregator process (`edgefil site`, coordinator/
site_aggregator.py) with the site broker's coordinator account. Device k is at site `k mod N` (FleetConfig.site_of)
and connects to its site's broker; the coordinator learns the sites from its `[[sites]]` (CoordinatorConfig.sites)
and speaks to them across the bridges (coordinator/sites.py). The aggregators' logs are `logs/site-<k>.log`; their
brokers' files `sites/site-<k>/`.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.broker import Bridge, Credentials, MosquittoBroker, Site, generate_password
from coordinator.config import SiteDevices
from edgefil.durable import write_private
from edgefil.lifetime import die_with_parent
from edgefil.logs import LOG_LEVELS
from edgefil.settings import dump_toml
from firmware_sim.fleet_worker import fleet_log_level

log = logging.getLogger("edgefil.fleet")
STOP_GRACE_S = 10.0  # the aggregators' time to say they are gone and exit after SIGTERM


class SimulatedSites:
    """The sites of a simulated fleet: `accounts` for the fleet broker's ACL before it starts, `start` once it runs,
    `address` for each device's table, `stop` at the end."""

    def __init__(self, out: Path, fleet: str, members: Mapping[str, tuple[str, ...]],
                 passwords: Mapping[str, str]) -> None:
        """`members`: each site's devices; `passwords`: the devices' (their accounts at their site's broker)."""
        self.out = out
        self.fleet = fleet
        self.members = dict(members)
        self.passwords = passwords
        self.accounts = {name: Credentials(name, generate_password()) for name in self.members}  # at the fleet's
        self.aggregators = {name: Credentials("coordinator", generate_password()) for name in self.members}
        self.brokers: dict[str, MosquittoBroker] = {}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.site_of = {device: name for name, devices in self.members.items() for device in devices}

    def sites(self) -> list[Site]:
        """The sites as the fleet's broker's ACL takes them."""
        return [Site(name, self.accounts[name]) for name in self.members]

    def for_coordinator(self) -> tuple[SiteDevices, ...]:
        return tuple(SiteDevices(name, devices) for name, devices in self.members.items())

    def start(self, central: MosquittoBroker, artifacts: Path, logs: Path, keepalive: int | None) -> None:
        """Each site's broker, bridged to `central`, and its aggregator, logging at the fleet's level
        (`fleet_log_level`, where the command line has a name for it; else at its default, INFO)."""
        address = central.address
        named = logging.getLevelName(fleet_log_level())
        level = ["--log-level", named] if named in LOG_LEVELS else []
        for name, devices in self.members.items():
            folder = self.out / "sites" / name
            broker = MosquittoBroker(folder, self.fleet, {d: self.passwords[d] for d in devices},
                                     self.aggregators[name],
                                     bridge=Bridge(name, address.host, address.port, self.accounts[name],
                                                   address.cafile))
            broker.start()
            self.brokers[name] = broker
            account = self.aggregators[name]
            config = folder / "site.toml"
            write_private(config, dump_toml({"fleet": self.fleet, "site": name, "artifacts": str(artifacts),
                                             "broker": self.settings(name, account.username, account.password,
                                                                     keepalive)}))
            with open(logs / f"{name}.log", "ab") as out:
                self.processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "edgefil.cli", *level, "site", "--config", str(config)], stdout=out,
                    stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    # as the brokers: gone with the fleet, even a SIGKILLed one (an aggregator outlived it, retrying
                    # its dead broker for good); the kernel ties the child to the thread that forks it
                    preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None)
        log.info("%d sites: their brokers bridged to the fleet's, an aggregator at each", len(self.members))

    def settings(self, name: str, username: str, password: str, keepalive: int | None) -> dict[str, Any]:
        """A [broker] table for site `name`'s broker."""
        address = self.brokers[name].address
        return {"host": address.host, "port": address.port, "username": username, "password": password,
                **({} if keepalive is None else {"keepalive": keepalive})}

    def stop(self) -> None:
        """Every aggregator told at once, within STOP_GRACE_S for all of them together (then killed: a grace each,
        waited one after another, took 100 s at 10 sites on a host too busy for them to exit), then the brokers."""
        for process in self.processes.values():
            process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for name, process in self.processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("site %s's aggregator did not exit in %.0f s: killed", name, STOP_GRACE_S)
                process.kill()
                process.wait()
        for broker in self.brokers.values():
            broker.stop()
        self.processes, self.brokers = {}, {}
