"""Client state that must survive a restart of the device process: task, round, seen classes, weights.

Written atomically: the weights go to a new file named after their sha256, then `state.json` is replaced with
rename(2) and the old weight file removed. A crash at any point leaves the previous or the new state, whole.
The replay store persists itself; it is not part of this file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

STATE_FILE = "state.json"


class StateError(ValueError):
    """The saved state cannot be trusted (corrupt file or weights that do not match their hash)."""


@dataclass
class ClientState:
    task: int = -1
    round: int = 0
    seen_classes: list[int] = field(default_factory=list)
    n_seen: int = 0  # samples seen since the start (reservoir sampling needs it)
    weights: np.ndarray | None = None


def save_state(directory: str | Path, state: ClientState) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {k: v for k, v in asdict(state).items() if k != "weights"}
    record["weights_file"] = None
    if state.weights is not None:
        blob = np.ascontiguousarray(state.weights, dtype="<f4").tobytes()
        digest = hashlib.sha256(blob).hexdigest()
        record["weights_file"] = f"weights-{digest[:16]}.f32"
        record["weights_sha256"] = digest
        _write_durably(directory / record["weights_file"], blob)
    _write_durably(directory / STATE_FILE, json.dumps(record).encode())
    for stale in directory.glob("weights-*.f32"):
        if stale.name != record["weights_file"]:
            stale.unlink()


def load_state(directory: str | Path) -> ClientState | None:
    """The last saved state, or None when the device has never saved one."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        state = ClientState(
            task=int(record["task"]),
            round=int(record["round"]),
            seen_classes=[int(c) for c in record["seen_classes"]],
            n_seen=int(record["n_seen"]),
        )
        weights_file = record["weights_file"]
        blob = None if weights_file is None else (Path(directory) / weights_file).read_bytes()
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise StateError(f"client state in {directory} is unreadable: {err!r}") from err
    if blob is not None:
        if hashlib.sha256(blob).hexdigest() != record.get("weights_sha256"):
            raise StateError(f"{weights_file} in {directory} does not match its sha256")
        state.weights = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    return state


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
