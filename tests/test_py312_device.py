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
    size = sum(p.stat().st_size for p in device_venv.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"device install (CPython 3.12, from the checkout): {size / 2**20:.0f} MiB")  # benchmarks/device_install.py
    assert size < 400 * 2**20  # torch alone is several times this


@pytest.mark.parametrize("command, missing", [
    ("export --model lenet --classes 10 --out x", "torch"), ("demo", "torch"),
    ("coordinator --config coordinator.toml", "torch"), ("fleet run fleet.toml", "torch"),
    ("init lab --devices a,b", "sklearn"), ("data split --devices a,b --out data", "sklearn"),
])
def test_a_host_command_on_the_device_install_says_which_extra_in_one_line(device_venv, tmp_path, command, missing):
    done = subprocess.run([str(device_venv / "bin/edgefil"), *command.split()], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    name = command.split()[0]
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"edgefil {name}: needs {missing}, which a device install leaves out: install the host extra (in the "
        f"edgefil checkout: pip install '.[host]')"], done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_the_device_install_serves_a_dashboard_and_decodes_traffic_without_the_host_extra(device_venv, tmp_path):
    """What a person on the device itself may want: the dashboard of a copied run folder, and `edgefil watch`."""
    done = subprocess.run([str(device_venv / "bin/edgefil"), "watch", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--config" in done.stdout
    probe = "from coordinator.dashboard import Dashboard; d = Dashboard('.', '127.0.0.1', 0); print(d.url)"
    done = subprocess.run([str(device_venv / "bin/python"), "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("http://127.0.0.1:"), done.stderr


def test_python_312_device_trains_rounds_with_the_portable_backend(device_venv, export_artifacts, tmp_path,
                                                                     caplog):
    artifacts = export_artifacts("lenet", backends=("portable", "torch"))
    results, output = run_rounds([str(device_venv / "bin/python")], artifacts, tmp_path, caplog, rounds=3,
                                 samples=300, deadline_s=120.0)
    assert results["rounds_completed"] == 3, output
    assert f"{DEVICE} registered (portable backend" in caplog.text
    accuracy = [r["accuracy"][0] for r in results["history"]]
    assert accuracy[-1] > accuracy[0] + 0.05, accuracy  # the device's updates teach the global model
