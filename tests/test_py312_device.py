"""The device install on CPython 3.12 (no onnxruntime-training wheel exists for it): a fresh virtual environment
with only `pip install edgefil`, in which neither torch nor onnxruntime-training can be imported, runs a device
daemon through real rounds against mosquitto and a coordinator, training with the portable backend."""
from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from external_device import DEVICE, run_rounds

REPO = Path(__file__).resolve().parents[1]


def _python312() -> str | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted(root.glob("versions/3.12*/bin/python3.12")):  # not pyenv's shim: it may be inactive
        return str(candidate)
    found = shutil.which("python3.12")
    return found if found and "shims" not in found else None


@pytest.fixture(scope="module")
def device_venv(tmp_path_factory) -> Path:
    python = _python312()
    if python is None:
        pytest.skip("no CPython 3.12 on this machine (pyenv install 3.12)")
    venv = tmp_path_factory.mktemp("py312") / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    # The device install: the package and its base dependencies, nothing else.
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", str(REPO)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return venv


def test_device_install_on_python_312_has_no_torch_and_no_ort_training(device_venv):
    probe = textwrap.dedent("""
        import importlib.util, sys
        import onnxruntime
        print(sys.version_info[:2], onnxruntime.__version__)
        for name in ("torch", "onnx", "onnxruntime.training"):
            assert importlib.util.find_spec(name) is None, name
        from models.manifest import runnable_backends
        assert runnable_backends() == ("portable",), runnable_backends()
    """)
    done = subprocess.run([str(device_venv / "bin/python"), "-c", probe], capture_output=True, text=True,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("(3, 12)")


def test_python_312_device_trains_rounds_with_the_portable_backend(device_venv, export_artifacts, tmp_path,
                                                                     caplog):
    artifacts = export_artifacts("lenet", backends=("portable", "torch"))
    results, output = run_rounds([str(device_venv / "bin/python")], artifacts, tmp_path, caplog, rounds=3,
                                 samples=300, deadline_s=120.0)
    assert results["rounds_completed"] == 3, output
    assert f"{DEVICE} registered (portable backend" in caplog.text
    accuracy = [r["accuracy"][0] for r in results["history"]]
    assert accuracy[-1] > accuracy[0] + 0.05, accuracy  # the device's updates teach the global model
