"""The device install: a fresh virtual environment with only `pip install edgefil` (the base dependencies), on CPython
3.11 and 3.12, takes current onnxruntime (not ONNX Runtime Training, which had its last release in 2024 and has no
wheels past CPython 3.11), imports neither torch nor onnx, and runs a device daemon through real rounds against
mosquitto and a coordinator, training with the portable backend. `pip install 'edgefil[ort-training]'` on CPython
3.11 still runs the ORT backend."""
from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from external_device import DEVICE, run_rounds

REPO = Path(__file__).resolve().parents[1]
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _python(version: str) -> str | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted(root.glob(f"versions/{version}*/bin/python{version}")):  # not pyenv's shim: it may be
        return str(candidate)  # inactive
    found = shutil.which(f"python{version}")
    return found if found and "shims" not in found else None


def _fresh_install(tmp_path_factory: pytest.TempPathFactory, version: str, requirement: str) -> Path:
    """A new virtual environment of CPython `version` with `requirement` (the checkout, with or without an extra)
    installed and nothing else."""
    python = _python(version)
    if python is None:
        pytest.skip(f"no CPython {version} on this machine (pyenv install {version})")
    venv = tmp_path_factory.mktemp(f"py{version.replace('.', '')}") / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", requirement], check=True,
                   env=PIP_ENV)
    return venv


@pytest.fixture(scope="module", params=["3.11", "3.12"])
def device_venv(request, tmp_path_factory) -> Path:
    return _fresh_install(tmp_path_factory, request.param, str(REPO))


def test_the_device_install_takes_current_onnxruntime_and_no_torch_and_no_ort_training(device_venv):
    probe = textwrap.dedent("""
        import importlib.util, sys
        import onnxruntime
        print(sys.version_info[:2], onnxruntime.__version__)
        assert tuple(map(int, onnxruntime.__version__.split(".")[:2])) >= (1, 20), onnxruntime.__version__
        for name in ("torch", "onnx", "onnxruntime.training"):
            assert importlib.util.find_spec(name) is None, name
        from models.manifest import runnable_backends
        assert runnable_backends() == ("portable",), runnable_backends()
    """)
    done = subprocess.run([str(device_venv / "bin/python"), "-c", probe], capture_output=True, text=True,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    size = sum(p.stat().st_size for p in device_venv.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"device install ({done.stdout.strip()}, from the checkout): {size / 2**20:.0f} MiB")  # device_install.py
    assert size < 400 * 2**20  # torch alone is several times this


def test_the_ort_training_extra_runs_the_ort_backend_beside_the_portable_one(tmp_path_factory, export_artifacts):
    """`edgefil[ort-training]` on CPython 3.11: ONNX Runtime Training's files are the `onnxruntime` package in place
    (the base install's onnxruntime comes too), and a device trains with `backend = "ort"` as with "auto"."""
    from models.export import exportable_backends

    if "ort" not in exportable_backends():
        pytest.skip("this host exports no ORT Training artifacts (its onnxruntime is not the training build)")
    venv = _fresh_install(tmp_path_factory, "3.11", f"{REPO}[ort-training]")
    artifacts = export_artifacts("lenet", backends=("ort", "portable"))
    probe = textwrap.dedent(f"""
        import numpy as np
        from edge_client.config import TrainerSettings
        from edge_client.trainers.choice import make_trainer
        from models.manifest import runnable_backends
        assert runnable_backends() == ("ort", "portable"), runnable_backends()
        x = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
        y = np.arange(64) % 10
        for backend in ("ort", "auto"):
            trainer = make_trainer(TrainerSettings(backend=backend), {str(artifacts)!r})
            before = trainer.get_weights()
            trainer.fit(x, y, epochs=1, batch_size=32)
            assert not np.array_equal(before, trainer.get_weights())
            print(backend, trainer.backend)
    """)
    done = subprocess.run([str(venv / "bin/python"), "-c", probe], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ort", "ort", "auto", "portable"]


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


def test_the_device_install_trains_rounds_with_the_portable_backend(device_venv, export_artifacts, tmp_path, caplog):
    artifacts = export_artifacts("lenet", backends=("portable", "torch"))
    results, output = run_rounds([str(device_venv / "bin/python")], artifacts, tmp_path, caplog, rounds=3,
                                 samples=300, deadline_s=120.0)
    assert results["rounds_completed"] == 3, output
    assert f"{DEVICE} registered (portable backend" in caplog.text
    accuracy = [r["accuracy"][0] for r in results["history"]]
    assert accuracy[-1] > accuracy[0] + 0.05, accuracy  # the device's updates teach the global model
