"""A user's own model (models/zoo.py, docs/own-model.md): any nn.Module named by its import path trains in a fleet,
its export records its arguments, an edited one is exported anew, and every mistake is refused in one line before
anything is exported. The worked example is the one docs/own-model.md shows, run from the page."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_harness import CEILING_S

from edgefil.cli import main
from models.export import _own_model_key
from models.zoo import build_model

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "own-model.md").read_text()
BAD_MODELS = '''
import torch
from torch import nn


class Upsampler(nn.Module):  # a transposed convolution: the portable graphs have no gradient for it
    def __init__(self, input_shape):
        super().__init__()
        self.up = nn.ConvTranspose2d(input_shape[0], 4, 2, stride=2)

    def forward(self, x):
        return torch.flatten(torch.relu(self.up(x)), 1)


class Grid(nn.Module):  # no flattening: an image per sample, not a feature vector
    def forward(self, x):
        return x * 2


def not_a_module(input_shape):
    return 3


class Batched(nn.Module):  # BatchNorm's running statistics: state the rounds never aggregate
    def __init__(self, input_shape):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.BatchNorm2d(4), nn.Flatten())

    def forward(self, x):
        return self.body(x)
'''


def block(language: str) -> str:
    """The page's first code block in `language`."""
    found = re.search(rf"```{language}\n(.*?)```", DOC, re.S)
    assert found, language
    return found.group(1)


def test_a_fleet_trains_the_pages_own_model_given_by_import_path(tmp_path):
    """docs/own-model.md's module and fleet file, run as the page says (`PYTHONPATH=. edgefil fleet run`): the
    devices learn each task with the user's trunk under edgefil's head, and the artifacts name the model and its
    arguments."""
    (tmp_path / "my_models.py").write_text(block("python"))
    (tmp_path / "fleet.toml").write_text(block("toml"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "edgefil.cli", "fleet", "run", "fleet.toml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=CEILING_S)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "artifacts" / "manifest.json").read_text())
    assert (manifest["model"], manifest["model_args"]) == ("my_models:GreyNet", {"width": 12})
    assert manifest["feature_dim"] == 12  # the trunk's pooled channels: edgefil's head sits on them
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["outcome"] == "complete" and results["rounds_completed"] == 4
    matrix = results["accuracy_matrix"]
    assert all(matrix[t][t] > 0.5 for t in range(2)), matrix  # each task learnt (chance within a task: 0.5)


def test_the_export_records_the_models_arguments(tmp_path, monkeypatch, capsys):
    (tmp_path / "page_models.py").write_text(block("python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "artifacts"
    assert main(["export", "--model", "page_models:GreyNet", "--model-args", '{"width": 6}', "--classes", "10",
                 "--input-shape", "1,8,8", "--backends", "torch", "--out", str(out), "--no-cache"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_args"] == {"width": 6} and manifest["feature_dim"] == 6
    assert "exported page_models:GreyNet" in capsys.readouterr().out


@pytest.mark.parametrize("model, args, message", [
    ("missing_module_xyz:Net", "{}", "cannot import missing_module_xyz (ModuleNotFoundError: No module named "
                                      "'missing_module_xyz'); is its folder on PYTHONPATH?"),
    ("bad_models:Nothing", "{}", "bad_models has no Nothing"),
    ("bad_models:not_a_module", "{}", "made a int, not a torch nn.Module"),
    ("bad_models:Grid", "{}", "returned (2, 1, 8, 8) for a batch of 2: it must return one feature vector per sample"),
    ("bad_models:Grid", '{"depth": 2}', "its constructor refused the arguments ['depth']"),
    ("bad_models:", "{}", "name your own model as package.module:Name"),
    ("bad_models", "{}", "unknown model 'bad_models'; known models: cnn1d"),
    ("lenet", '{"width": 2}', "model 'lenet' takes no arguments (got width)"),
    ("bad_models:Batched", "{}", "keeps state that is not a parameter (body.1.running_mean, body.1.running_var, "
                                 "body.1.num_batches_tracked: BatchNorm's running statistics?)"),
    ("bad_models:Upsampler", "{}", "cannot be exported for the portable backend: NotImplementedError: "
                                   "convolution_backward of a transposed convolution has no translation"),
])
def test_each_mistake_in_a_model_of_ones_own_is_refused_in_one_line(tmp_path, monkeypatch, capsys, model, args,
                                                                      message):
    (tmp_path / "bad_models.py").write_text(BAD_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "artifacts"
    code = main(["--log-level", "WARNING", "export", "--model", model, "--model-args", args, "--classes", "4",
                 "--input-shape", "1,8,8", "--backends", "portable", "--out", str(out), "--no-cache"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (out / "manifest.json").exists()


def test_an_edited_model_is_exported_anew(tmp_path, monkeypatch):
    """The cache key of a user's model's export holds its arguments and its file's digest: an edit, or other
    arguments, miss the cache; the zoo's keys are as they were."""
    source = tmp_path / "edited_models.py"
    source.write_text(block("python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    first = _own_model_key("edited_models:GreyNet", {"width": 8})
    assert _own_model_key("edited_models:GreyNet", {"width": 8}) == first
    assert _own_model_key("edited_models:GreyNet", {"width": 9}) != first
    source.write_text(block("python").replace("nn.ReLU()", "nn.GELU()"))
    assert _own_model_key("edited_models:GreyNet", {"width": 8}) != first
    assert _own_model_key("lenet", {}) == {}


def test_a_fleet_file_naming_a_model_that_does_not_fit_is_refused_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "bad_models.py").write_text(BAD_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from edgefil.settings import ConfigError
    from firmware_sim.fleet_config import FleetConfig

    config = FleetConfig.from_dict({"name": "x", "devices": 2, "scenario": {"preset": "digits-class"},
                                    "model": "bad_models:Grid"}, base=tmp_path)
    with pytest.raises(ConfigError, match=r"model.*'bad_models:Grid'.*one feature vector per sample"):
        config.check()
    assert build_model("lenet", 10).head.out_features == 10  # the zoo's models as before
