"""Shared fixtures: artifact sets are exported once per test session."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_peer_outlives_its_test():
    """A test's MQTT peers are closed when it ends, passed or failed: a peer left running keeps reconnecting to its
    stopped broker from its own thread, into whatever test runs next."""
    yield
    helpers = sys.modules.get("mqtt_helpers")
    if helpers is not None:
        helpers.close_running_peers()


@pytest.fixture(autouse=True)
def _log_levels_as_they_were():
    """The levels of edgefil's loggers (and the root's) as they were before the test: a test that runs the command
    line in this process (`edgefil.cli.main(["--log-level", ...])`) sets them, and a fleet started in this process
    by a later test would pass them on to its workers (`fleet_worker.fleet_log_level`)."""
    from edgefil.logs import OWN_PACKAGES

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in OWN_PACKAGES)]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


@pytest.fixture(scope="session")
def export_artifacts(tmp_path_factory):
    """Export (once) and return the directory of a registered model: export_artifacts(name, classes, shape)."""
    cache: dict[tuple, Path] = {}

    def get(name: str, classes: int = 10, shape: tuple[int, ...] | None = None, nominal: bool = False,
            backends: tuple[str, ...] = ("ort", "torch")) -> Path:
        """The portable graphs take seconds to export (ORT's a fraction): a test that runs them asks for them."""
        from models.export import export_registered

        key = (name, classes, shape, nominal, backends)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"artifacts-{name}")
            export_registered(name, classes, out, input_shape=shape, seed=0, nominal=nominal, backends=backends,
                              cache=True)  # models/cache.py: the same export a fleet or the CLI made is copied
            cache[key] = out
        return cache[key]

    return get


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (minutes each)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes long (resnet18 parity, aarch64 emulation); run with --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
