"""How edgefil's processes log: the levels the command line takes (`edgefil --log-level`), the packages whose
loggers follow it, and setting them; and how a line stays one line (`error_line`) and a short one in a large fleet
(`names_line`, `LineQuota`). Its own module, beneath the command line and the simulator both: a fleet
passes its level on to the site aggregators it starts (firmware_sim/sites.py), as a level the command line takes,
without importing the command line (which imports the simulator's commands)."""
from __future__ import annotations

import logging
from collections.abc import Iterable

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
OWN_PACKAGES = ("edgefil", "edge_client", "coordinator", "firmware_sim", "models")  # their loggers follow --log-level


def configure_logging(level: str) -> None:
    """edgefil's loggers at `level`; every other library's (onnxscript's optimizer alone logs hundreds of INFO lines
    per export) at WARNING, unless `level` is DEBUG, which shows everything."""
    logging.basicConfig(level=level if level == "DEBUG" else "WARNING",
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for package in OWN_PACKAGES:
        logging.getLogger(package).setLevel(level)
    # onnxruntime.training imports torch's cpp_extension, which warns about a missing CUDA runtime on CPU hosts.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def error_line(err: BaseException) -> str:
    """An exception as one line of a log or of a message to another process: its type and its message's first line
    (a traceback's text, or a library's multi-line message, would break the line-per-event logs)."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


# A log line names this many devices (of a round, of a fleet) at most, and counts the rest; a kind of line said once
# a device (a registration) is said this many times at its level, the rest at DEBUG (`LineQuota`). A fleet of 10,000
# devices put each of them on its console at its start, and every round a line of 95,000 characters naming them.
NAMES_SHOWN = 10


def names_line(names: Iterable[str], shown: int = NAMES_SHOWN) -> str:
    """`names` for one log line: all of them where they are at most `shown`, else the first `shown` and how many
    more (results.json and the history keep every name)."""
    names = list(names)
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


class LineQuota:
    """The first `limit` lines of one kind at their own level, the rest at DEBUG (`--log-level DEBUG` shows them all):
    a line a device reads well in a fleet of ten and floods the console of a fleet of ten thousand. `renew` counts
    afresh (a round's lines, from each round's start)."""

    def __init__(self, limit: int = NAMES_SHOWN) -> None:
        self.limit = limit
        self.said = 0

    def level(self, level: int) -> int:
        """The level of the next line of this kind: `level` within the quota, DEBUG past it."""
        self.said += 1
        return level if self.said <= self.limit else logging.DEBUG

    @property
    def just_spent(self) -> bool:
        """Whether the line last asked about (`level`) is the first past the quota: its caller then says, once, where
        the others are."""
        return self.said == self.limit + 1

    def renew(self) -> None:
        self.said = 0
