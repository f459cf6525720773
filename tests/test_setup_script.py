"""`scripts/setup` says how far it is: pip's own line for each package, and at least every 10 s (here 1 s,
EDGEFIL_SETUP_TICK_S) how long the step has taken and how large .venv has grown, so that a first run's minutes of
downloading are never silent. Run for real on a project of its own whose build lasts until the script has said how
far it is (its in-tree build backend waits for the test's word, given when the first progress line comes, then
writes the wheel by hand), offline: nothing is fetched. No clock decides the outcome: a busy host only makes the
wait longer."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_harness import CEILING_S

ROOT = Path(__file__).resolve().parents[1]
TICK = re.compile(r"scripts/setup: \.\.\. \d+ s, \.venv now \d+ MB")  # the line the script prints every tick
# A PEP 517 backend that needs nothing installed: it waits for the file `release` (at most `ceiling` s), then zips
# the wheel's three metadata files.
SLOW_BACKEND = """
import base64, hashlib, os, time, zipfile

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    deadline = time.monotonic() + {ceiling}
    while not os.path.exists({release!r}) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist = "slowpkg-1.0.dist-info"
    files = {{dist + "/METADATA": "Metadata-Version: 2.1\\nName: slowpkg\\nVersion: 1.0\\nProvides-Extra: host\\n",
             dist + "/WHEEL": "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
    name = "slowpkg-1.0-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, text in files.items():
            data = text.encode()
            wheel.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{{path}},sha256={{digest}},{{len(data)}}")
        wheel.writestr(dist + "/RECORD", "\\n".join([*record, dist + "/RECORD,,"]) + "\\n")
    return name

build_editable = build_wheel
"""


@pytest.mark.skipif(shutil.which("python3.11") is None and sys.version_info[:2] != (3, 11),
                    reason="the setup script's default interpreter, python3.11, is not here")
def test_setup_prints_how_far_it_is_while_a_long_install_runs(tmp_path):
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup", project / "scripts" / "setup")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "slow_backend"\nbackend-path = ["."]\n\n'
        '[project]\nname = "slowpkg"\nversion = "1.0"\n\n[project.optional-dependencies]\nhost = []\n')
    release = tmp_path / "release"
    (project / "slow_backend.py").write_text(SLOW_BACKEND.format(ceiling=CEILING_S, release=str(release)))
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHON": shutil.which("python3.11") or sys.executable,
           "EDGEFIL_SETUP_TICK_S": "1"}
    env.pop("EDGEFIL_TORCH_INDEX", None)
    proc = subprocess.Popen(["bash", "scripts/setup", "host"], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if TICK.match(lines[-1]):
            release.touch()  # the long step said how far it is: the build may end
    assert proc.wait(CEILING_S) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "scripts/setup: pip install -e .[host]" in text and "Successfully installed slowpkg" in text
    ticks = [line for line in lines if TICK.match(line)]
    assert ticks and release.exists(), text  # the build ended on the word the first progress line gave
    assert re.search(r"scripts/setup: done in \d+ s, \.venv \d+ MB", text)
    if not shutil.which("nvidia-smi") and not os.path.exists("/dev/nvidiactl"):
        assert "no NVIDIA GPU here, but torch from the package index comes with its CUDA libraries" in text
