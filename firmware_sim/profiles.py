"""Device profiles: what an emulated device has (disk, RAM, compute, network, availability), read from TOML.

The shipped profiles live in `firmware_sim/profiles/*.toml`; each number carries its source in a `[sources]`
table (summarised in docs/profiles.md). A user's own profile is the same format at any path:

    name = "my-board"
    description = "..."
    disk_bytes = 4_000_000_000    # storage the runtime may use (replay store + state + model files)
    ram_bytes = 1_073_741_824     # RAM left to the training process: the out-of-memory threshold
    cpu_gflops = 9.6              # sustained single-thread float32 matmul throughput
    threads = 4                   # cores the runtime may train with
    up_mbps = 80.0
    down_mbps = 100.0
    latency_ms = 3.0              # one-way, per message
    [availability]                # optional, default always on
    mode = "on-off"               # "always" | "on-off" (mean_on_s, mean_off_s) | "trace" (trace = "file.csv")
    mean_on_s = 1800.0
    mean_off_s = 600.0
    [sources]                     # optional: field -> where its number comes from
    cpu_gflops = "..."

Unknown keys are errors, as in every config file of the project: a typo must not pass silently. A relative
trace path is taken relative to the profile's folder.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tomllib

AVAILABILITY_MODES: tuple[str, ...] = ("always", "on-off", "trace")
_INT_FIELDS: tuple[str, ...] = ("disk_bytes", "ram_bytes", "threads")
_FLOAT_FIELDS: tuple[str, ...] = ("cpu_gflops", "up_mbps", "down_mbps", "latency_ms")
NUMERIC_FIELDS: tuple[str, ...] = (*_INT_FIELDS, *_FLOAT_FIELDS)
# What a [sources] entry may describe: every measured or assumed quantity.
SOURCED_FIELDS: tuple[str, ...] = (*NUMERIC_FIELDS, "availability")


@dataclass(frozen=True)
class Availability:
    """When a device is reachable. "on-off": exponential on and off durations with these means, drawn from a
    per-device seed; "trace": online intervals read from a file (format in docs/profiles.md)."""

    mode: str
    mean_on_s: float | None = None
    mean_off_s: float | None = None
    trace: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in AVAILABILITY_MODES:
            raise ValueError(f"availability mode must be one of {AVAILABILITY_MODES}, got {self.mode!r}")
        means = (self.mean_on_s, self.mean_off_s)
        if self.mode == "on-off":
            for name in ("mean_on_s", "mean_off_s"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"on-off availability needs a positive finite {name}, got {value!r}")
                object.__setattr__(self, name, float(value))  # TOML writes `600` as an integer
        elif means != (None, None):
            raise ValueError(f"mean_on_s and mean_off_s belong to on-off availability, not {self.mode!r}")
        if (self.mode == "trace") != (self.trace is not None):
            raise ValueError("a trace file is given exactly when the availability mode is 'trace'")


@dataclass(frozen=True)
class DeviceProfile:
    """One kind of device. `cpu_gflops` is in the unit the host is calibrated in (limits.calibrate_host), so
    host training time scales to device time by the ratio of the two."""

    name: str
    description: str
    disk_bytes: int
    ram_bytes: int
    cpu_gflops: float
    threads: int
    up_mbps: float
    down_mbps: float
    latency_ms: float
    availability: Availability = Availability("always")
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("name", "description"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"profile {name} must be a non-empty string")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be a positive integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float))
            allowed = number and value < math.inf and (value > 0 or (name == "latency_ms" and value == 0))
            if not allowed:
                raise ValueError(f"profile {self.name!r}: {name} must be a finite positive number, got {value!r}")
            object.__setattr__(self, name, float(value))  # TOML writes `100` as an integer
        if not isinstance(self.availability, Availability):
            raise ValueError(f"profile {self.name!r}: availability must be an Availability")
        unknown = sorted(set(self.sources) - set(SOURCED_FIELDS))
        if unknown:
            raise ValueError(f"profile {self.name!r}: [sources] names unknown field(s) {unknown}")
        if not all(isinstance(v, str) and v for v in self.sources.values()):
            raise ValueError(f"profile {self.name!r}: every source must be a non-empty string")
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))


def list_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(entry.name[: -len(".toml")] for entry in _shipped().iterdir() if entry.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A shipped profile by name ("raspberry-pi-4-4gb") or a profile file by path."""
    text = str(name_or_path)
    if text in list_profiles():
        resource = _shipped() / f"{text}.toml"
        return _from_toml(resource.read_text(encoding="utf-8"), where=text, base=Path(str(resource)).parent)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown profile {text!r}: neither a shipped profile ({', '.join(list_profiles())}) nor a file"
        )
    return _from_toml(path.read_text(encoding="utf-8"), where=str(path), base=path.parent)


def _shipped() -> Traversable:
    return files("firmware_sim") / "profiles"


def _from_toml(text: str, where: str, base: Path) -> DeviceProfile:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{where}: not valid TOML: {error}") from error
    availability = dict(raw.pop("availability", {"mode": "always"}))
    _check_keys(availability, {f.name for f in fields(Availability)}, {"mode"}, f"{where} [availability]")
    if isinstance(availability.get("trace"), str):
        trace = (base / availability["trace"]).resolve()
        if not trace.is_file():
            raise ValueError(f"{where}: availability trace {str(trace)!r} is not a file")
        availability["trace"] = str(trace)
    known = {f.name for f in fields(DeviceProfile)}
    required = known - {"availability", "sources"}
    _check_keys(raw, known, required, where)
    return DeviceProfile(**raw, availability=Availability(**availability))


def _check_keys(values: Mapping[str, Any], known: set[str], required: set[str], where: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
