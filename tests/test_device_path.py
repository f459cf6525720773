"""The device path (edge_client with the ORT backend, every method's device half) imports and trains with torch,
torchvision and onnx absent."""
import json
import subprocess
import sys
import textwrap

DEVICE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, sys

    HOST_ONLY = tuple(sys.argv[2].split(","))

    class HidePackages(importlib.abc.MetaPathFinder):
        # Stands in for the path finder and finds nothing for the hidden packages: as if not installed.

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HOST_ONLY:
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)

    sys.meta_path = [
        HidePackages() if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path
    ]

    import numpy as np
    from edgefil.cli import build_parser
    from models.manifest import load_manifest

    build_parser()  # the command line itself must load on a device
    from edge_client.policies import policy_names  # every method's device half registers without host packages

    assert "refed" in policy_names()
    if "onnxruntime" in HOST_ONLY:
        from edge_client.trainers.pytorch import TorchTrainer
        trainer = TorchTrainer(load_manifest(sys.argv[1]), optimizer="adamw", lr=3e-3)
    else:
        from edge_client.trainers.ort import OrtTrainer
        trainer = OrtTrainer(sys.argv[1], optimizer="adamw", lr=3e-3)
    rng = np.random.default_rng(0)
    centers = rng.random((10, *trainer.manifest.input_shape), dtype=np.float32)
    y = rng.integers(0, 10, 400)
    x = (centers[y] + 0.05 * rng.standard_normal((400, *trainer.manifest.input_shape))).astype(np.float32)
    before = trainer.evaluate(x, y).accuracy
    trainer.fit(x, y, epochs=15, batch_size=32, rng=rng)
    after = trainer.evaluate(x, y).accuracy
    weights = trainer.get_weights()
    trainer.set_weights(weights)
    print(json.dumps({
        "before": before,
        "after": after,
        "round_trip": bool(np.array_equal(trainer.get_weights(), weights)),
        "host_modules": sorted(m for m in sys.modules if m.split(".")[0] in HOST_ONLY),
    }))
    """
)


def _run_device(artifacts, blocked: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", DEVICE_SCRIPT, str(artifacts), blocked], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ort_device_path_trains_without_torch_torchvision_or_onnx(export_artifacts):
    report = _run_device(export_artifacts("lenet"), "torch,torchvision,onnx")
    assert report["host_modules"] == []
    assert report["round_trip"]
    assert report["after"] > max(0.8, report["before"] + 0.3)


def test_torch_device_path_trains_without_onnxruntime_or_onnx(export_artifacts):
    """Where no ORT training build exists (aarch64, Python >= 3.12) the torch backend needs only the manifest."""
    report = _run_device(export_artifacts("lenet"), "onnxruntime,onnx,torchvision")
    assert report["host_modules"] == []
    assert report["round_trip"]
    assert report["after"] > max(0.8, report["before"] + 0.3)


def test_blocking_really_blocks_torch():
    """The guard above must be able to fail: importing the torch backend under it raises."""
    script = DEVICE_SCRIPT.split("import numpy as np")[0] + "import edge_client.trainers.pytorch\n"
    done = subprocess.run(
        [sys.executable, "-c", script, "-", "torch,torchvision,onnx"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "No module named 'torch'" in done.stderr
