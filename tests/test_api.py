"""The Python API (edgefil/api.py): the docs' two-value sweep runs as written and returns both runs' results as plain
Python, the same ones a finished run's folder gives back, and a mistake in a change is one line before anything
runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgefil import api
from edgefil.settings import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "name": "sweep", "devices": 2, "seed": 0,
    "scenario": {"preset": "digits-class", "n_tasks": 2},
    "policy": {"name": "random"}, "store": {"max_samples": 120},
    "client": {"epochs": 1}, "coordinator": {"rounds_per_task": 1, "min_clients": 2},
}


def docs_sweep() -> str:
    """The python block of docs/python-api.md's "A sweep in a few lines"."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    section = text[text.index("## A sweep in a few lines"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```", section.index("```python\n") + 9)]


def test_the_docs_sweep_runs_as_written_and_returns_both_runs_as_a_finished_folder_reads_back(tmp_path, monkeypatch,
                                                                                              capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(docs_sweep(), "docs/python-api.md", "exec"), namespace)  # noqa: S102 (the docs' own example)
    runs = namespace["runs"]
    assert list(runs) == [1, 3]
    for epochs, run in runs.items():
        assert run.folder == (tmp_path / "runs" / "epochs" / f"client.epochs={epochs}").resolve()
        assert run.outcome == "complete"
        matrix = run.accuracy_matrix
        assert [len(row) for row in matrix] == [1, 2] and all(0.0 <= a <= 1.0 for row in matrix for a in row)
        assert run.final_accuracy == pytest.approx(sum(matrix[-1]) / 2)
        assert [r["round"] for r in run.rounds] == [1, 2] and all(r["updates"] == 2 for r in run.rounds)
        again = api.load(run.folder)
        assert again.accuracy_matrix == matrix and again.rounds == run.rounds
    assert runs[1].accuracy_matrix != runs[3].accuracy_matrix  # the epochs reached the devices
    rows = api.compare(runs)
    assert [row["run"] for row in rows] == [1, 3] and rows[0]["final_accuracy"] == runs[1].final_accuracy
    printed = capsys.readouterr().out
    assert "'run': 1" in printed and str(runs[3].accuracy_matrix) in printed


def test_a_mistake_in_a_change_is_one_line_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError) as refused:
        api.sweep(BASE, "coordinator.rounds_per_tsk", [1, 2], out=tmp_path)
    assert "rounds_per_tsk" in str(refused.value) and "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())  # no run started
    with pytest.raises(ConfigError, match="not a finished run"):
        api.load(tmp_path)
