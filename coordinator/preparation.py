"""What a run does before its first round, for the dashboard: `preparing.json` in the run folder.

A fleet spends its first minutes on a busy host before any round: building the scenario, exporting the model (the
portable graphs take minutes), calibrating the host, starting the broker and the workers. The page showed "waiting
for the run" throughout. `Preparation` writes the step under way, since when, and the steps done with their
seconds (for whoever reads the file); the dashboard shows the step under way until the coordinator's live.json
takes over. The exporter tells its own steps (`step` as its `progress`).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from edgefil.durable import write_atomically

PREPARING_FILE = "preparing.json"


class Preparation:
    """The steps of one run's preparation, each written to `folder/preparing.json` as it starts (the folder made by
    the first: a fleet's first step, checking its file, comes before the fleet makes its run folder). A step that
    cannot be written (a full disk) is logged once and the run goes on, the next step tried again: the page is a
    view, not the run."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / PREPARING_FILE
        self.done: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None
        self._warned = False

    def step(self, text: str) -> None:
        """`text` is under way from now; the one before it is done."""
        now = time.time()
        if self._current is not None:
            self.done.append((self._current[0], round(now - self._current[1], 1)))
        self._current = (text, now)
        record = {"step": text, "since": now, "done": [{"step": s, "seconds": t} for s, t in self.done]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(record).encode())
        except OSError as err:
            if not self._warned:
                logging.getLogger("edgefil.fleet").warning("%s not written: %s", self.path, err)
            self._warned = True
