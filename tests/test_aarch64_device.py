"""A device under aarch64 emulation: Debian's qemu-user-static, an arm64 CPython from Debian's arm64 packages and
the aarch64 wheels of onnxruntime, numpy, paho-mqtt and msgpack (scripts/aarch64-device sets it up), training a
round with the portable backend against mosquitto and a coordinator on the host. Slow: minutes under emulation."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from external_device import DEVICE, run_rounds

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_emulated_aarch64_device_trains_a_round_with_plain_onnxruntime(export_artifacts, tmp_path, caplog):
    if shutil.which("apt-get") is None:
        pytest.skip("scripts/aarch64-device needs a Debian host (apt-get)")
    root = REPO / ".aarch64-device"
    setup = subprocess.run([str(REPO / "scripts/aarch64-device"), str(root)], capture_output=True, text=True)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert setup.stdout.strip().splitlines()[-1].startswith("aarch64 python")
    artifacts = export_artifacts("lenet", backends=("portable", "torch"))
    results, output = run_rounds([str(root / "python")], artifacts, tmp_path, caplog, rounds=1, samples=200,
                                 deadline_s=900.0)
    assert results["rounds_completed"] == 1, output
    assert f"{DEVICE} registered (portable backend" in caplog.text
