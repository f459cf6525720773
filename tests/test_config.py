"""One config language: every file kind is checked by one mechanism, table by table, before anything starts.

A typo in any table of any file kind, an unknown policy or strategy, a value of the wrong type: one line naming
the file, the table and the key, from the loaders and from the command line (exit 2, nothing started; how long a
refusal takes is measured by benchmarks/config_refusal.py). And every TOML example in the README and the docs
loads and checks as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from edge_client.config import DeviceConfig
from edgefil.settings import ConfigError, Where
from firmware_sim.fleet_config import FleetConfig
from firmware_sim.scenarios import check_scenario

ROOT = Path(__file__).resolve().parents[1]

DEVICE = '''device_id = "pi-1"
fleet = "lab"
artifacts = "artifacts/lenet"
state_dir = "state"
[broker]
host = "127.0.0.1"
[trainer]
backend = "ort"
[learner]
epochs = 2
[store]
max_samples = 200
[policy]
name = "refed"
lam = 0.5
[data]
folder = "incoming"
'''
COORDINATOR = '''fleet = "lab"
out = "run"
artifacts = "artifacts/lenet"
devices = ["pi-1", "pi-2"]
scenario = {preset = "digits-class", n_clients = 2}
[broker]
port = 1883
[strategy]
name = "fedprox"
mu = 0.01
[client]
epochs = 2
'''
FLEET = '''name = "lab"
devices = 4
scenario = {preset = "digits-class"}
trainer = {backend = "ort"}
[policy]
name = "refed"
pim_epochs = 2
[store]
max_samples = 100
[client]
epochs = 2
[strategy]
name = "fedavg"
[coordinator]
rounds_per_task = 2
'''
LOADERS = {"device": DeviceConfig.load, "coordinator": CoordinatorConfig.load, "fleet": FleetConfig.load}
# (file kind, line to replace, its replacement, the table and key the message must name)
TYPOS = [
    ("device", 'device_id = "pi-1"', 'device_id = "pi-1"\ndevice_name = "x"', "", "device_name"),
    ("device", 'host = "127.0.0.1"', 'hots = "127.0.0.1"', "[broker]", "hots"),
    ("device", 'backend = "ort"', 'backnd = "ort"', "[trainer]", "backnd"),
    ("device", "epochs = 2", "epoch = 2", "[learner]", "epoch"),
    ("device", "max_samples = 200", "max_sample = 200", "[store]", "max_sample"),
    ("device", "lam = 0.5", "lamda = 0.5", "[policy]", "lamda"),
    ("device", 'folder = "incoming"', 'fodler = "incoming"', "[data]", "fodler"),
    ("coordinator", "devices = [", "devics = [", "", "devics"),
    ("coordinator", "port = 1883", "prt = 1883", "[broker]", "prt"),
    ("coordinator", "mu = 0.01", "muu = 0.01", "[strategy]", "muu"),
    ("coordinator", "epochs = 2", "epoch = 2", "[client]", "epoch"),
    ("fleet", "devices = 4", "devices = 4\nworkrs = 2", "", "workrs"),
    ("fleet", 'trainer = {backend = "ort"}', 'trainer = {backed = "ort"}', "[trainer]", "backed"),
    ("fleet", "pim_epochs = 2", "pim_epoch = 2", "[policy]", "pim_epoch"),
    ("fleet", "max_samples = 100", "max_sample = 100", "[store]", "max_sample"),
    ("fleet", "[client]\nepochs = 2", "[client]\nepoch = 2", "[client]", "epoch"),
    ("fleet", 'name = "fedavg"', 'name = "fedavg"\nweighed = false', "[strategy]", "weighed"),
    ("fleet", "rounds_per_task = 2", "rounds_per_tsk = 2", "[coordinator]", "rounds_per_tsk"),
    ("fleet", 'scenario = {preset = "digits-class"}', 'scenario = {preset = "digits-class", n_task = 3}',
     "[scenario]", "n_task"),
    ("fleet", "rounds_per_task = 2", "rounds_per_task = 2\n[coordinator.guard]\nnorm_bond = 'clip'",
     "[coordinator.guard]", "norm_bond"),
    ("fleet", "[client]", "[adversary]\nattak = 'lazy'\n[client]", "[adversary]", "attak"),
]
TEXT = {"device": DEVICE, "coordinator": COORDINATOR, "fleet": FLEET}


def load(kind: str, text: str, tmp_path: Path):
    path = tmp_path / f"{kind}.toml"
    path.write_text(text)
    config = LOADERS[kind](path)
    if kind == "fleet":
        config.check(str(path))
    return config


@pytest.mark.parametrize("kind", sorted(TEXT))
def test_the_examples_here_are_valid(kind, tmp_path):
    load(kind, TEXT[kind], tmp_path)


@pytest.mark.parametrize("kind, line, replacement, table, key", TYPOS)
def test_a_typo_in_any_table_names_the_file_the_table_and_the_key(kind, line, replacement, table, key, tmp_path):
    assert line in TEXT[kind]
    with pytest.raises(ConfigError) as refused:
        load(kind, TEXT[kind].replace(line, replacement, 1), tmp_path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(str(tmp_path / f"{kind}.toml"))
    assert f"{table} {key}: unknown key; valid keys: " in message if table else f": {key}: unknown key" in message


@pytest.mark.parametrize("kind, line, replacement, expected", [
    ("device", 'name = "refed"', 'name = "reffed"', "[policy] name: unknown replay policy 'reffed'; choose one of"),
    ("fleet", 'name = "refed"', 'name = "reffed"', "[policy] name: unknown replay policy 'reffed'; choose one of"),
    ("coordinator", 'name = "fedprox"', 'name = "fedprx"', "[strategy] name: unknown strategy 'fedprx'"),
    ("device", "max_samples = 200", 'max_samples = "200"', "[store] max_samples: expected an integer, got str"),
    ("device", "lam = 0.5", "lam = 2.0", "[policy] lambda must lie in (0, 1), got 2.0"),
    ("coordinator", "mu = 0.01", 'mu = "small"', "[strategy] mu: expected a number, got str 'small'"),
    ("fleet", "devices = 4", 'devices = "4"', "devices: expected an integer, got str '4'"),
    ("fleet", 'backend = "ort"', 'backend = "onnx"', "[trainer] backend: expected one of 'auto', 'ort', 'portable', 'torch'"),
    ("fleet", 'preset = "digits-class"', 'preset = "digit-class"', "[scenario] preset: unknown preset"),
    ("fleet", "devices = 4", "devices = 4\nmodel = \"cnn1d\"", "model: 'cnn1d' on scenario 'digits'"),
    ("fleet", 'name = "lab"', 'name = "lab+1"', "name must match [A-Za-z0-9_-]{1,64}, got 'lab+1'"),
    ("fleet", "[client]", "[adversary]\nattack = 'bribe'\ndevices = 1\n[client]", "unknown attack 'bribe'"),
    ("fleet", "[client]", "[adversary]\nattack = 'lazy'\ndevices = 4\n[client]", "at least one honest device"),
    ("fleet", "[client]", "[adversary]\nattack = 'prototype-flood'\ndevices = 1\n[client]",
     "[adversary] attack: prototype-flood changes the glfc policy's payloads, and the devices run 'refed'"),
    ("fleet", 'preset = "digits-class"', 'preset = "digits-class", n_clients = 3',
     "[scenario] n_clients: 3 shares for 4 devices"),
    ("device", "max_samples = 200", "max_samples = 0", "[store] max_samples (the budget M) must be at least 1"),
    ("fleet", "max_samples = 100", "max_samples = 0", "[store] max_samples (the budget M) must be at least 1"),
])
def test_unknown_names_wrong_types_and_refused_values_are_one_line(kind, line, replacement, expected, tmp_path):
    with pytest.raises(ConfigError) as refused:
        load(kind, TEXT[kind].replace(line, replacement, 1), tmp_path)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("kind, command", [
    ("device", ["client", "--config"]), ("coordinator", ["coordinator", "--config"]), ("fleet", ["fleet", "run"]),
])
def test_the_command_line_prints_one_line_and_starts_nothing(kind, command, tmp_path):
    text = {"device": DEVICE.replace("max_samples", "max_sample"), "fleet": FLEET.replace("[policy]", "[replay]"),
            "coordinator": COORDINATOR.replace("devices = [", "devics = [")}[kind]
    path = tmp_path / f"{kind}.toml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", *command, str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgefil {command[0]}: {path}"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no run folder, state or broker files


@pytest.mark.parametrize("kind, line, replacement, key", [
    ("coordinator", "devices = [", "devics = [", "devics"), ("coordinator", "port = 1883", "prt = 1883", "[broker] prt"),
    ("coordinator", "epochs = 2", "epoch = 2", "[client] epoch"),
    ("coordinator", "[client]", "[guard]\nnorm_bond = 'clip'\n[client]", "[guard] norm_bond"),
    ("coordinator", "[client]", "[host]\nepoch = 3\n[client]", "[host] epoch"),
    ("fleet", "devices = 4", "devices = 4\nworkrs = 2", "workrs"), ("fleet", "pim_epochs = 2", "pim_epoch = 2",
                                                                    "[policy] pim_epoch"),
    ("fleet", "[client]\nepochs = 2", "[client]\nepoch = 2", "[client] epoch"),
    ("fleet", "rounds_per_task = 2", "rounds_per_task = 2\n[coordinator.guard]\nnorm_bond = 'clip'",
     "[coordinator.guard] norm_bond"),
    ("fleet", 'scenario = {preset = "digits-class"}', 'scenario = {preset = "digits-class", n_task = 3}',
     "[scenario] n_task"),
])
def test_a_typo_is_refused_before_torch_or_the_rules_are_imported(kind, line, replacement, key, tmp_path):
    """A coordinator's or a fleet's file is checked before the heavy imports (issue 58: a typo took seconds to be
    refused, the time torch takes to import): every table but the rule's own options, whose names are its
    constructor's. benchmarks/config_refusal.py measures how long a refusal takes."""
    path = tmp_path / f"{kind}.toml"
    path.write_text(TEXT[kind].replace(line, replacement, 1))
    command = ["coordinator", "--config"] if kind == "coordinator" else ["fleet", "run"]
    heavy = ("torch", "onnx", "onnxruntime", "sklearn", "coordinator.strategies", "coordinator.guard")
    done = subprocess.run([sys.executable, "-c", "import sys; from edgefil.cli import main\n"
                           f"code = main({[*command, str(path)]!r})\n"
                           f"print(code, [m for m in {heavy!r} if m in sys.modules])"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[0] == "2 []", done.stdout + done.stderr
    assert f"{key}: unknown key" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("missing", ["artifacts", "data folder"])
def test_a_device_whose_model_or_data_folder_is_not_there_is_refused_in_one_line_before_it_starts(missing, tmp_path):
    """What the file points at is checked when the daemon starts: one line naming the key and the path, exit 2
    (which the systemd unit does not restart), rather than a traceback at start-up or at round 1."""
    (tmp_path / "artifacts" / "lenet").mkdir(parents=True)
    (tmp_path / "incoming").mkdir()
    if missing == "artifacts":
        expected = f"artifacts: {tmp_path / 'artifacts' / 'lenet'} holds no model (manifest.json)"
    else:
        (tmp_path / "artifacts" / "lenet" / "manifest.json").write_text("{}")
        (tmp_path / "incoming").rmdir()
        expected = f"[data] folder: {tmp_path / 'incoming'} is not a folder"
    path = tmp_path / "device.toml"
    path.write_text(DEVICE)
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "client", "--config", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgefil client: {path}: {expected}"), done.stderr
    assert not (tmp_path / "state").exists()  # nothing started


def _toml_examples() -> list[tuple[str, int, str]]:
    examples = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in re.finditer(r"```toml\n(.*?)```", doc.read_text(), re.S):
            examples.append((doc.name, doc.read_text()[:match.start()].count("\n") + 1, match.group(1)))
    return examples


@pytest.mark.parametrize("doc, line, text", _toml_examples(), ids=lambda v: str(v)[:20])
def test_every_toml_example_in_the_docs_loads_and_checks(doc, line, text, tmp_path, monkeypatch):
    """Each example is a whole file of one kind (by its keys), or a scenario table; it must pass every check. An
    example naming a model of one's own (package.module:Name) finds that module in its page's Python block."""
    import tomllib

    raw = tomllib.loads(text)
    if ":" in str(raw.get("model", "")):
        page = next(p for p in (ROOT / "README.md", *(ROOT / "docs").rglob("*.md")) if p.name == doc).read_text()
        module = raw["model"].split(":")[0]
        (tmp_path / f"{module}.py").write_text(re.search(r"```python\n(.*?)```", page, re.S).group(1))
        monkeypatch.syspath_prepend(str(tmp_path))
    if "device_id" in raw:
        load("device", text, tmp_path)
    elif isinstance(raw.get("devices"), list):
        load("coordinator", text, tmp_path)
    elif "devices" in raw:
        load("fleet", text, tmp_path)
    else:
        assert set(raw) == {"scenario"}, f"{doc}:{line}: an example of no known file kind"
        check_scenario(raw["scenario"], Where(f"{doc}:{line}", "scenario")).build()


def test_every_doc_with_a_toml_example_is_covered():
    assert {doc for doc, _, _ in _toml_examples()} >= {"README.md", "flowing-data.md", "deploy.md"}
    assert len(_toml_examples()) >= 5  # (the README's by-hand files are now edgefil init's: test_first_federation)


def test_a_fleets_coordinator_tables_reach_the_coordinator_as_their_settings(tmp_path):
    """[coordinator.guard] in a fleet file is the coordinator's [guard] (it reached the coordinator as a plain
    table, before), and [adversary] names the devices it makes compromised: the last ones."""
    from coordinator.guard_settings import GuardSettings

    text = FLEET + "[coordinator.guard]\nnorm_bound = 'clip'\n[adversary]\nattack = 'lazy'\ndevices = 1\n"
    config = load("fleet", text, tmp_path)
    assert config.coordinator_options()["guard"] == GuardSettings(norm_bound="clip")
    assert [config.adversary.of(k, config.devices) for k in range(4)] == [None, None, None, "lazy"]
