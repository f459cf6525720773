"""How edgefil's processes log: the levels the command line takes (`edgefil --log-level`), the packages whose
loggers follow it, and setting them. Its own module, beneath the command line and the simulator both: a fleet
passes its level on to the site aggregators it starts (firmware_sim/sites.py), as a level the command line takes,
without importing the command line (which imports the simulator's commands)."""
from __future__ import annotations

import logging

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
