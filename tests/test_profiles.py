"""Device profiles: the shipped files load and are sourced, user files are read strictly."""
from __future__ import annotations

import dataclasses
from importlib.resources import files
from pathlib import Path

import pytest

from firmware_sim.profiles import (
    NUMERIC_FIELDS,
    Availability,
    DeviceProfile,
    list_profiles,
    load_profile,
)

REQUIRED = ("raspberry-pi-4-4gb", "raspberry-pi-zero-2w", "jetson-nano", "jetson-orin-nano", "generic")
MINIMAL = """
name = "test-board"
description = "a board for tests"
disk_bytes = 1_000_000_000
ram_bytes = 536_870_912
cpu_gflops = 4
threads = 2
up_mbps = 10
down_mbps = 20
latency_ms = 5
"""


def write(tmp_path: Path, text: str, name: str = "board.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_required_profiles_ship_with_the_package():
    assert set(REQUIRED) <= set(list_profiles())
    shipped = files("firmware_sim") / "profiles"
    assert all((shipped / f"{name}.toml").is_file() for name in list_profiles())
    assert (shipped / "example-trace.csv").is_file()


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_loads_with_sane_sourced_numbers(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description
    assert set(profile.sources) == {*NUMERIC_FIELDS, "availability"}
    assert all(len(source) > 20 for source in profile.sources.values())
    assert 2**26 <= profile.ram_bytes <= 2**36  # 64 MiB .. 64 GiB
    assert 10**8 <= profile.disk_bytes <= 10**12
    assert 0.1 <= profile.cpu_gflops <= 1000
    assert 1 <= profile.threads <= 64
    assert 0.01 <= profile.up_mbps <= 10_000 and 0.01 <= profile.down_mbps <= 10_000
    assert 0 <= profile.latency_ms <= 1000


def test_the_shipped_fleet_is_heterogeneous():
    profiles = {name: load_profile(name) for name in REQUIRED}
    zero, pi4 = profiles["raspberry-pi-zero-2w"], profiles["raspberry-pi-4-4gb"]
    assert zero.ram_bytes < pi4.ram_bytes and zero.cpu_gflops < pi4.cpu_gflops
    assert zero.availability.mode == "on-off"
    for name in ("generic", "jetson-nano", "jetson-orin-nano"):
        assert profiles[name].availability.mode == "always"


def test_a_profile_loads_from_a_path(tmp_path):
    path = write(tmp_path, MINIMAL)
    profile = load_profile(str(path))
    assert profile.name == "test-board"
    assert profile.ram_bytes == 536_870_912 and profile.cpu_gflops == 4.0
    assert isinstance(profile.cpu_gflops, float)  # TOML integers become floats where floats are meant
    assert profile.availability == Availability("always")
    assert dict(profile.sources) == {}
    assert load_profile(path) == profile  # a Path works as well as a str


def test_a_shipped_profile_copied_to_a_path_loads_the_same(tmp_path):
    source = (files("firmware_sim") / "profiles" / "jetson-nano.toml").read_text()
    assert load_profile(write(tmp_path, source)) == load_profile("jetson-nano")


def test_an_unknown_key_is_named(tmp_path):
    with pytest.raises(ValueError, match="gpu_tflops"):
        load_profile(write(tmp_path, MINIMAL + "gpu_tflops = 1.0\n"))
    with pytest.raises(ValueError, match="mean_up_s"):
        load_profile(write(tmp_path, MINIMAL + '[availability]\nmode = "on-off"\nmean_up_s = 1\n'))
    with pytest.raises(ValueError, match="cpu_ghz"):
        load_profile(write(tmp_path, MINIMAL + '[sources]\ncpu_ghz = "datasheet"\n'))


def test_a_missing_field_is_named(tmp_path):
    text = "\n".join(line for line in MINIMAL.splitlines() if not line.startswith("ram_bytes"))
    with pytest.raises(ValueError, match="ram_bytes"):
        load_profile(write(tmp_path, text))
    with pytest.raises(ValueError, match="mode"):
        load_profile(write(tmp_path, MINIMAL + "[availability]\nmean_on_s = 1\n"))


@pytest.mark.parametrize(
    "line",
    ['ram_bytes = -1', 'ram_bytes = 1.5', 'threads = 0', 'cpu_gflops = "fast"', 'cpu_gflops = 0',
     'up_mbps = inf', 'latency_ms = -1', 'latency_ms = nan', 'disk_bytes = true'],
)
def test_bad_values_are_refused(tmp_path, line):
    key = line.split(" ")[0]
    text = "\n".join(l for l in MINIMAL.splitlines() if not l.startswith(key + " ")) + "\n" + line + "\n"
    with pytest.raises(ValueError, match=key):
        load_profile(write(tmp_path, text))


def test_zero_latency_is_allowed(tmp_path):
    text = MINIMAL.replace("latency_ms = 5", "latency_ms = 0")
    assert load_profile(write(tmp_path, text)).latency_ms == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="sometimes"), dict(mode="on-off"), dict(mode="on-off", mean_on_s=10, mean_off_s=0),
     dict(mode="always", mean_on_s=10), dict(mode="trace"), dict(mode="always", trace="x.csv")],
)
def test_inconsistent_availability_is_refused(kwargs):
    with pytest.raises(ValueError):
        Availability(**kwargs)


def test_a_relative_trace_path_is_taken_from_the_profile_folder(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "dev.csv").write_text("0,10\n")
    profile = load_profile(write(tmp_path, MINIMAL + '[availability]\nmode = "trace"\ntrace = "traces/dev.csv"\n'))
    assert Path(profile.availability.trace) == (tmp_path / "traces" / "dev.csv").resolve()
    with pytest.raises(ValueError, match="missing.csv"):
        load_profile(write(tmp_path, MINIMAL + '[availability]\nmode = "trace"\ntrace = "missing.csv"\n'))


def test_an_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(ValueError, match="raspberry-pi-4-4gb"):
        load_profile("raspberry-pi-9")


def test_profiles_are_frozen_and_hashable():
    profile = load_profile("generic")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.ram_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.sources["ram_bytes"] = "x"  # type: ignore[index]
    assert hash(profile) == hash(dataclasses.replace(profile))


def test_a_profile_built_in_code_is_validated():
    profile = load_profile("generic")
    with pytest.raises(ValueError, match="threads"):
        dataclasses.replace(profile, threads=0)
    assert isinstance(dataclasses.replace(profile, name="other"), DeviceProfile)
