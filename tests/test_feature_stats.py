"""Feature statistics a device attaches (models/feature_stats.py): the same on every backend, the moments numpy
takes, and an attachment that is not what the run's model has is refused in one line."""
from __future__ import annotations

import numpy as np
import pytest

from edge_client.trainers.ort import OrtTrainer
from edge_client.trainers.portable import PortableTrainer
from edge_client.trainers.pytorch import TorchTrainer
from models.feature_stats import LayerStatistics, decode_statistics, encode_statistics
from models.manifest import load_manifest


def test_every_backend_measures_the_same_moments(export_artifacts):
    # the artifact set test_portable's buffer tests export too (one export for both: the fixture keeps it)
    directory = export_artifacts("lenet", backends=("ort", "portable", "torch"))
    manifest = load_manifest(directory)
    trainers = [PortableTrainer(directory), OrtTrainer(directory), TorchTrainer(manifest)]
    for trainer in trainers[1:]:
        trainer.set_weights(trainers[0].get_weights())
    x = np.random.default_rng(0).random((37, 1, 8, 8), dtype=np.float32)
    stats = [trainer.feature_statistics(x, batch_size=16) for trainer in trainers]
    inputs, features = stats[0]
    assert inputs.name == "input" and inputs.count == 37
    np.testing.assert_allclose(inputs.mean, [x.mean()], rtol=1e-5)
    np.testing.assert_allclose(inputs.var, [x.var()], rtol=1e-4)
    _, reference = trainers[2].outputs(x, np.zeros(37, np.int64))
    np.testing.assert_allclose(features.mean, reference.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(features.var, reference.var(0), rtol=1e-3, atol=1e-6)
    for other in stats[1:]:
        for a, b in zip(stats[0], other):
            np.testing.assert_allclose(a.mean, b.mean, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(a.var, b.var, rtol=1e-3, atol=1e-6)
    sizes = {"input": 1, "features": manifest.feature_dim}
    decoded = decode_statistics(encode_statistics(stats[0]), sizes)
    np.testing.assert_array_equal(decoded["features"].var, features.var)


def _stats(mean=(0.5, 0.2), var=(0.1, 0.3), count=5, name="features"):
    return LayerStatistics(name, np.array(mean, np.float32), np.array(var, np.float32), count)


@pytest.mark.parametrize("layers,message", [
    ([_stats(count=1)], "over 1 samples, at least 2"),
    ([_stats(var=(0.1, -0.3))], "negative variance"),
    ([_stats(mean=(np.nan, 0.0))], "not finite"),
    ([_stats(mean=(0.5,), var=(0.1,))], "mean is not 2 float32 values"),
    ([_stats(name="conv1")], "name layers \\['features'\\] once each"),
    ([_stats(), _stats()], "once each"),
    ([], "once each"),
])
def test_statistics_the_model_does_not_have_are_refused(layers, message):
    with pytest.raises(ValueError, match=message):
        decode_statistics(encode_statistics(layers), {"features": 2})


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa6layers\x05"])
def test_garbage_is_refused(data):
    with pytest.raises(ValueError, match="do not decode|once each"):
        decode_statistics(data, {"features": 2})
