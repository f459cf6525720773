"""A device under aarch64 emulation: Debian's qemu-user-static, an arm64 CPython from Debian's arm64 packages and
the aarch64 wheels of the device install (scripts/aarch64-device sets it up), training a round with the portable
backend against mosquitto and a coordinator on the host, and running secure aggregation's arithmetic. Slow: minutes
under emulation."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from external_device import DEVICE, run_rounds

from edgefil.secagg import MASK, KeyPair, agree, mask

REPO = Path(__file__).resolve().parents[1]
# Under emulation, with the device install alone: a secure session of four devices, the last dropping after it masked,
# and two primitives whose results must be the host's to the bit (a device's masks cancel the coordinator's only so)
SESSION = """
import json
import numpy as np
from secagg_session import SETTINGS, devices_of, expected_mean, run_session
from edgefil.secagg import MASK, KeyPair, agree, mask
devices = devices_of(4, 2000, np.random.default_rng(0))
result = run_session(devices, drop={"dev-3": "masked"})[0].result()
print(json.dumps({
    "survivors": sorted(result.survivors),
    "error": float(np.abs(result.mean_change - expected_mean(devices, set(devices))).max()),
    "bound": len(devices) * result.quantisation_step / (result.samples / SETTINGS.max_weight),
    "mask": mask(bytes(range(32)), 4).tolist(),
    "agreed": agree(KeyPair.from_private(bytes([1] * 32)), KeyPair.from_private(bytes([2] * 32)).public, MASK, "s",
                    "a", "b").hex(),
}))
"""


@pytest.fixture(scope="module")
def aarch64_python() -> Path:
    """The emulated arm64 interpreter with the device install (set up once a run)."""
    if shutil.which("apt-get") is None:
        pytest.skip("scripts/aarch64-device needs a Debian host (apt-get)")
    root = REPO / ".aarch64-device"
    setup = subprocess.run([str(REPO / "scripts/aarch64-device"), str(root)], capture_output=True, text=True)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert setup.stdout.strip().splitlines()[-1].startswith("aarch64 python")
    return root / "python"


@pytest.mark.slow
def test_emulated_aarch64_device_trains_a_round_with_plain_onnxruntime(aarch64_python, export_artifacts, tmp_path,
                                                                       caplog):
    artifacts = export_artifacts("lenet", backends=("portable", "torch"))
    results, output = run_rounds([str(aarch64_python)], artifacts, tmp_path, caplog, rounds=1, samples=200,
                                 deadline_s=900.0)
    assert results["rounds_completed"] == 1, output
    assert f"{DEVICE} registered (portable backend" in caplog.text


@pytest.mark.slow
def test_secure_aggregation_runs_on_the_emulated_aarch64_device_install(aarch64_python):
    """The device install (cryptography's aarch64 wheel) runs a whole session, and its masks and agreed secrets are
    the host's to the bit."""
    run = subprocess.run([str(aarch64_python), "-c", SESSION], capture_output=True, text=True,
                         cwd=REPO / "tests", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["survivors"] == ["dev-0", "dev-1", "dev-2", "dev-3"] and seen["error"] < seen["bound"]
    assert seen["mask"] == mask(bytes(range(32)), 4).tolist()
    assert seen["agreed"] == agree(KeyPair.from_private(bytes([1] * 32)), KeyPair.from_private(bytes([2] * 32)).public,
                                   MASK, "s", "a", "b").hex()
