"""The device path (edge_client with the ORT backend) imports and trains with torch, torchvision and onnx absent."""
import json
import subprocess
import sys
import textwrap

DEVICE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    HOST_ONLY = ("torch", "torchvision", "onnx")

    class BlockHostPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HOST_ONLY:
                raise ImportError(f"{name} is not installed on this device")
            return None

    sys.meta_path.insert(0, BlockHostPackages())

    import numpy as np
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


def test_ort_device_path_trains_without_torch_torchvision_or_onnx(export_artifacts):
    artifacts = export_artifacts("lenet")
    done = subprocess.run(
        [sys.executable, "-c", DEVICE_SCRIPT, str(artifacts)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["host_modules"] == []
    assert report["round_trip"]
    assert report["after"] > max(0.8, report["before"] + 0.3)


def test_blocking_really_blocks_torch():
    """The guard above must be able to fail: importing the torch backend under it raises."""
    script = DEVICE_SCRIPT.split("import numpy as np")[0] + "import edge_client.trainers.pytorch\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "torch is not installed on this device" in done.stderr
