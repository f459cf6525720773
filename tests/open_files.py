"""What this process holds open under a folder, read from /proc/self/fd (Linux): how the tests see whether a
replay store holds its SQLite database open (tests/test_store.py, tests/test_learner.py)."""
from __future__ import annotations

import os
from pathlib import Path


def open_files_under(directory: Path) -> list[str]:
    """The files under `directory` this process holds open (the directory's own lock descriptor aside)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{directory}/"):
            names.append(target)
    return names
