"""The README's main job, shrunk: the fleet demo runs Re-Fed, random caching and Fixed over the embedded broker
and prints the comparison, writing each run's results and the plots."""
import json

from edgefil.cli import main


def test_demo_compares_refed_random_and_fixed_on_a_small_fleet(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--devices", "3", "--tasks", "2", "--rounds-per-task", "1"]) == 0
    printed = capsys.readouterr().out
    for method in ("refed", "random", "fixed"):
        results = json.loads((tmp_path / method / "results.json").read_text())
        assert [len(row) for row in results["accuracy_matrix"]] == [1, 2]
        assert method in printed
    fixed = json.loads((tmp_path / "fixed" / "results.json").read_text())
    assert [h["received"] != [] for h in fixed["history"]] == [True, False]  # trained on the first task only
    assert (tmp_path / "comparison" / "comparison.md").read_text() in printed
    assert (tmp_path / "comparison" / "comparison.png").stat().st_size > 5000
