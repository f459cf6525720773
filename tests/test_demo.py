"""The README's main job, shrunk: the fleet demo runs Re-Fed, random caching and Fixed over the embedded broker,
prints a progress line per round and the comparison, writes each run's results and the plots, and runs again."""
import json
import logging
import re

from edgefil.cli import main
from edgefil.settings import Where
from firmware_sim.demo import DemoSettings, budget_for, next_run_folder
from firmware_sim.scenarios import check_scenario


def test_demo_compares_refed_random_and_fixed_and_runs_again(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)  # what `edgefil` sets: no library may log below WARNING during the demo
    args = ["demo", "--out", str(tmp_path), "--devices", "3", "--tasks", "2", "--rounds-per-task", "1", "--epochs", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    run = tmp_path / "run-1"
    for method in ("refed", "random", "fixed"):
        results = json.loads((run / method / "results.json").read_text())
        assert [len(row) for row in results["accuracy_matrix"]] == [1, 2]
        assert results["strategy"] == {"name": "fedavg", "weighted": False}  # one rule for every run
    fixed = json.loads((run / "fixed" / "results.json").read_text())
    assert [h["received"] != [] for h in fixed["history"]] == [True, False]  # trained on the first task only
    progress = re.findall(r"^\[(\w+)\] round (\d+)/(\d+) \(task \d/2\) accuracy .* \| elapsed \d+:\d\d, ETA \d+:\d\d$",
                          printed, flags=re.MULTILINE)
    assert [(m, int(k), int(n)) for m, k, n in progress] == [
        ("refed", 1, 2), ("refed", 2, 2), ("random", 1, 2), ("random", 2, 2), ("fixed", 1, 2), ("fixed", 2, 2)]
    table = (run / "comparison" / "comparison.md").read_text()
    assert table in printed
    budget = budget_for(DemoSettings(devices=3, tasks=2).scenario)
    # what the runs share is said once; the table's columns name what differs between them
    assert f"Every run: budget M = {budget}, aggregation fedavg (weighted = False), E 2." in table
    for row in ("| refed | refed |", "| random | random |", "| fixed | random (trains 1 task only) |"):
        assert row in table
    assert (run / "comparison" / "comparison.png").stat().st_size > 5000
    assert "Traceback" not in printed
    assert [r.getMessage() for r in caplog.records if not r.name.startswith("edgefil")] == []
    assert [r.getMessage() for r in caplog.records if r.levelno < logging.WARNING] == []

    # a second demo in the same folder goes to a new run folder, the first stays (a whole second demo cost the
    # suite 15 s for this one line of demo.py)
    second = next_run_folder(tmp_path)
    assert second == tmp_path / "run-2" and not second.exists() and (run / "refed" / "results.json").is_file()


def test_the_default_budget_caches_a_quarter_of_the_old_data_at_the_last_task():
    """M = N_task (1 + 0.25 (T - 1)): what is left for old data at the last task, over what a device saw before it."""
    settings = DemoSettings()
    data = check_scenario(settings.scenario, Where("test")).build()
    sizes = [[len(task.client_train(k)[1]) for k in range(settings.devices)] for task in data.tasks]
    new, old = sum(sizes[-1]), sum(sum(s) for s in sizes[:-1])
    cached = settings.devices * budget_for(settings.scenario) - new
    assert 0.2 <= cached / old <= 0.3
