import json

from edgefil.cli import main


def test_demo_trains_the_embedded_digits_through_ort_and_writes_results(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--epochs", "3"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    history = results["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["test_accuracy"] > 0.5  # ten classes: chance is 0.1
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert f"{history[-1]['test_accuracy']:.2%}" in printed
    assert (tmp_path / "artifacts" / "manifest.json").is_file()
