"""Shared fixtures: artifact sets are exported once per test session (export takes about a second each)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def export_artifacts(tmp_path_factory):
    """Export (once) and return the directory of a registered model: export_artifacts(name, classes, shape)."""
    cache: dict[tuple, Path] = {}

    def get(name: str, classes: int = 10, shape: tuple[int, ...] | None = None, nominal: bool = False) -> Path:
        from models.export import export_registered

        key = (name, classes, shape, nominal)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"artifacts-{name}")
            export_registered(name, classes, out, input_shape=shape, seed=0, nominal=nominal)
            cache[key] = out
        return cache[key]

    return get
