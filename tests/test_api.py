"""The Python API (edgefil/api.py): a two-value sweep from a dict returns both runs' results as plain Python, the
same ones a finished run's folder gives back, and a mistake in a change is one line before anything runs."""
from __future__ import annotations

import pytest

from coordinator.broker import mosquitto_path
from edgefil import api
from edgefil.settings import ConfigError

BASE = {
    "name": "sweep", "devices": 2, "workers": 1, "seed": 0, "broker": "mosquitto",
    "scenario": {"preset": "digits-class", "n_tasks": 2},
    "policy": {"name": "random"}, "store": {"max_samples": 120},
    "client": {"epochs": 1}, "coordinator": {"rounds_per_task": 1, "min_clients": 2},
}


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_two_value_sweep_returns_both_runs_matrices_and_a_finished_folder_reads_back_the_same(tmp_path):
    runs = api.sweep(BASE, "client.epochs", [1, 3], out=tmp_path)
    assert list(runs) == [1, 3]
    for epochs, run in runs.items():
        assert run.folder == (tmp_path / f"client.epochs={epochs}").resolve()
        assert run.outcome == "complete"
        matrix = run.accuracy_matrix
        assert [len(row) for row in matrix] == [1, 2] and all(0.0 <= a <= 1.0 for row in matrix for a in row)
        assert run.final_accuracy == pytest.approx(sum(matrix[-1]) / 2)
        assert [r["round"] for r in run.rounds] == [1, 2] and all(r["updates"] == 2 for r in run.rounds)
        again = api.load(run.folder)
        assert again.accuracy_matrix == matrix and again.rounds == run.rounds
    # the epochs reached the devices: the two runs learnt differently
    assert runs[1].accuracy_matrix != runs[3].accuracy_matrix
    rows = api.compare(runs)
    assert [row["run"] for row in rows] == [1, 3] and all(row["rounds"] == 2 for row in rows)
    assert rows[0]["final_accuracy"] == runs[1].final_accuracy


def test_a_mistake_in_a_change_is_one_line_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError) as refused:
        api.sweep(BASE, "coordinator.rounds_per_tsk", [1, 2], out=tmp_path)
    assert "rounds_per_tsk" in str(refused.value) and "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())  # no run started
    with pytest.raises(ConfigError, match="not a finished run"):
        api.load(tmp_path)
