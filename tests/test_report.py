import argparse
import json

import numpy as np
import pytest

from edgefil import metrics
from firmware_sim.report import add_report_parser, compare_runs, load_run, run_summary, write_report

PNG = b"\x89PNG\r\n\x1a\n"
ROUNDS = [  # (round, task, accuracy on tasks 0..task); two rounds per task
    (1, 0, [0.5]), (2, 0, [0.8]),
    (3, 1, [0.6, 0.7]), (4, 1, [0.5, 0.7]),
    (5, 2, [0.4, 0.6, 0.9]), (6, 2, [0.45, 0.65, 0.85]),
]


def _device(n: int, stored: int, seconds: float | None) -> dict:
    report = {"loss": 1.0, "stored_samples": stored // 1024, "stored_bytes": stored,
              "bytes_sent": 100 * n, "bytes_received": 1000 * n}
    return report if seconds is None else {**report, "device_seconds": seconds}


def results(strategy: str = "fedavg", shift: float = 0.0) -> dict:
    """A hand-written 3-task run: dev-a reports every round (with device time), dev-b misses rounds 4 and 6."""
    history = []
    for rnd, task, acc in ROUNDS:
        devices = {"dev-a": _device(rnd, 8192 * min(rnd, 2), 0.5)}
        if rnd not in (4, 6):
            devices["dev-b"] = _device(rnd - 1, 4096 * (3 - abs(rnd - 3)), None)
        history.append({"round": rnd, "task": task, "selected": sorted(devices), "received": sorted(devices),
                        "samples": 100, "accuracy": [a - shift for a in acc], "aggregate_s": 0.001,
                        "metrics": devices})
    rows = [history[1]["accuracy"], history[3]["accuracy"], history[5]["accuracy"]]
    return {"fleet": "t", "scenario": {"dataset": "digits", "kind": "class", "n_tasks": 3, "n_clients": 2,
                                       "alpha": 1.0},
            "strategy": {"name": strategy}, "rounds_completed": 6, "tasks_completed": 3, "accuracy_matrix": rows,
            "final_accuracy": float(np.mean(rows[-1])), "average_accuracy": 0.0, "forgetting": 0.0,
            "backward_transfer": 0.0, "counters": {"stale": 2}, "bytes_sent": 5000, "bytes_received": 7000,
            "reconnects": 0, "history": history}


def run_folder(tmp_path, name: str, data: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(data))
    return folder


def test_run_summary_matches_the_metrics_and_hand_checked_values():
    data = results()
    s = run_summary(data, budget={"dev-a": 10_000})
    acc = metrics.accuracy_matrix(data["accuracy_matrix"])
    np.testing.assert_array_equal(s["accuracy_matrix"], acc)
    assert s["final_accuracy"] == metrics.average_accuracy(acc) == pytest.approx((0.45 + 0.65 + 0.85) / 3)
    assert s["average_accuracy"] == pytest.approx(np.mean([metrics.average_accuracy(acc, t) for t in range(3)]))
    assert s["forgetting"] == metrics.forgetting(acc)
    assert s["backward_transfer"] == metrics.backward_transfer(acc)
    # the last task's two rounds (no settings: the default 10 asked, 2 there): 0.6333 and 0.65
    assert s["last_rounds"] == metrics.LastRounds(pytest.approx((1.9 / 3 + 0.65) / 2), pytest.approx(0.05 / 6), 2)
    one = run_summary({**data, "settings": {"last_rounds": 1}})["last_rounds"]
    assert (one.mean, one.rounds) == (pytest.approx(0.65), 1)
    # task 0 peaks in its 2nd round; task 1 ties (0.7, 0.7): first; task 2 peaks in its 1st round
    assert s["cor"] == metrics.rounds_to_best(data["history"], 3) == [2, 1, 1]
    # last reports: dev-a in round 6 (600 / 6000), dev-b in round 5 (400 / 4000)
    assert s["traffic"]["devices"] == {"dev-a": {"sent": 600, "received": 6000},
                                       "dev-b": {"sent": 400, "received": 4000}}
    assert (s["traffic"]["sent"], s["traffic"]["received"]) == (1000, 10_000)
    assert s["storage"]["dev-a"] == {"peak": 16384, "budget": 10_000, "within_budget": False}
    assert s["storage"]["dev-b"] == {"peak": 12288, "budget": None, "within_budget": None}
    assert s["device_seconds"] == {"dev-a": pytest.approx(3.0), "dev-b": None}
    assert (s["rounds"], s["tasks_completed"], s["refusals"]) == (6, 3, {"stale": 2})


def test_run_summary_before_the_first_task_completes():
    data = results()
    data.update(accuracy_matrix=[], history=data["history"][:1], rounds_completed=1)
    s = run_summary(data)
    assert (s["final_accuracy"], s["average_accuracy"], s["forgetting"], s["accuracy_matrix"]) == (None,) * 4
    assert s["cor"] == [1, None, None]


def test_write_report_writes_the_summary_and_three_pngs(tmp_path):
    folder = run_folder(tmp_path, "refed-run", results())
    paths = write_report(folder)
    assert [p.name for p in paths] == ["summary.md", "accuracy_matrix.png", "accuracy_per_task.png",
                                       "storage_traffic.png"]
    assert all(p.parent == folder for p in paths)
    text = paths[0].read_text()
    s = run_summary(results())
    for expected in ("refed-run", f"{s['final_accuracy']:.2%}", f"{s['average_accuracy']:.2%}",
                     f"{s['forgetting']:.2%}", f"{s['backward_transfer']:.2%}", "| task 2 | 45.00% | 65.00% | 85.00% |",
                     "| dev-b | — | — | 12.3 kB | 400 B | 4.0 kB | — |  |", "| stale | 2 |"):
        assert expected in text
    for png in paths[1:]:
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_a_fleet_of_thousands_draws_its_devices_in_a_figure_of_fixed_width(tmp_path):
    """One bar a device drew 10,000 devices' figure 3,500 inches wide (minutes at the end of the run); past
    BARS_UP_TO devices each is a step of one line."""
    from firmware_sim.report import BARS_UP_TO

    many = results()
    devices = {f"dev-{i:05d}": _device(1 + i % 7, 4096 * (1 + i % 3), 0.5) for i in range(BARS_UP_TO * 50)}
    many["history"] = [{**entry, "selected": sorted(devices), "received": sorted(devices), "metrics": devices}
                       for entry in many["history"]]
    plotted = write_report(run_folder(tmp_path, "thousands", many))[-1]
    few = write_report(run_folder(tmp_path, "two", results()))[-1]
    assert plotted.name == few.name == "storage_traffic.png"
    width = int.from_bytes(plotted.read_bytes()[16:20], "big")  # the PNG header's IHDR width, in pixels
    assert width == 16 * 120  # 16 inches at 120 dpi, as for any fleet past BARS_UP_TO
    assert int.from_bytes(few.read_bytes()[16:20], "big") < width


def test_load_run_names_the_file_when_missing_or_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="results.json"):
        load_run(tmp_path)
    (tmp_path / "results.json").write_text('{"history": [')
    with pytest.raises(ValueError, match=f"{tmp_path}.*not valid JSON"):
        load_run(tmp_path)
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a run's results"):
        load_run(tmp_path)


def test_compare_runs_writes_a_table_with_every_run_and_a_plot(tmp_path):
    folders = [run_folder(tmp_path, "a", results()), run_folder(tmp_path, "b", results("fedprox", shift=0.1))]
    md, png = compare_runs(folders, tmp_path / "cmp", labels=["avg", "prox"])
    text = md.read_text()
    assert "| run | aggregation | rounds |" in text  # only what differs between the runs is a column
    assert "| avg | fedavg | 6 | 65.00% |" in text and "| prox | fedprox | 6 | 55.00% |" in text
    assert "| 1.33 | 11.0 kB | 16.4 kB |" in text  # mean CoR (2+1+1)/3, device traffic, max peak stored
    assert png.read_bytes().startswith(PNG)
    with pytest.raises(ValueError, match="2 runs"):
        compare_runs(folders, tmp_path / "cmp", labels=["only-one"])


def test_a_fleets_runs_are_compared_with_their_policy_budget_and_rule(tmp_path):
    """A simulated fleet's run folder holds fleet.json: the table names what its devices ran."""
    folders = [run_folder(tmp_path, "a", {**results(), "strategy": {"name": "fedavg", "weighted": False}}),
               run_folder(tmp_path, "b", results())]
    (folders[0] / "fleet.json").write_text(json.dumps({
        "policy": {"name": "refed", "group_by": "class", "lam": 0.5}, "store": {"max_samples": 48},
        "coordinator": {"rounds_per_task": 3}}))
    (folders[1] / "fleet.json").write_text(json.dumps({
        "policy": {"name": "random"}, "store": {"max_samples": 48, "max_bytes": 65536},
        "coordinator": {"train_tasks": 1}}))
    text = compare_runs(folders, tmp_path / "cmp", labels=["quotas", "fixed"])[0].read_text()
    assert "| quotas | refed by class | M = 48 | fedavg (weighted = False) | 6 |" in text
    assert "| fixed | random (trains 1 task only) | M = 48, 65.5 kB | fedavg | 6 |" in text
    same = compare_runs([folders[0], folders[0]], tmp_path / "same", labels=["x", "y"])[0].read_text()
    assert "Every run: policy refed by class, budget M = 48, aggregation fedavg (weighted = False)." in same
    assert "| x | 6 |" in same  # nothing differs: no setting column


def parser():
    parser = argparse.ArgumentParser(prog="edgefil")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_report_command_compares_several_folders(tmp_path, capsys):
    one, two = run_folder(tmp_path, "r1", results()), run_folder(tmp_path, "r2", results(shift=0.2))
    args = parser().parse_args(["report", str(one), str(two), "--labels", "a,b"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "Every run: aggregation fedavg." in out and "| a | 6 |" in out and "| b | 6 |" in out
    assert (tmp_path / "comparison" / "comparison.md").exists()
    assert (tmp_path / "comparison" / "comparison.png").exists()


def test_report_command_on_one_folder_prints_its_summary(tmp_path, capsys):
    folder = run_folder(tmp_path, "r1", results())
    args = parser().parse_args(["report", str(folder)])
    assert args.run(args) == 0
    assert "# Run report: r1" in capsys.readouterr().out
    assert (folder / "accuracy_matrix.png").exists()
    args = parser().parse_args(["report", str(tmp_path)])
    assert args.run(args) == 2
    assert "results.json" in capsys.readouterr().err


IAA = [0.5, 0.7, 0.6, 0.8, 0.75, 0.9]


def flowing_results() -> dict:
    """The hand-written run as a flowing one: IAA per round, and each round's client accuracies."""
    data = results()
    data["scenario"] = {"dataset": "digits", "kind": "flowing", "sequence": "gradual", "n_tasks": 3,
                        "n_clients": 2, "samples_per_class": 30}
    for entry, iaa in zip(data["history"], IAA):
        entry.update(iaa=iaa, client_accuracy={"dev-a": iaa + 0.05, "dev-b": iaa - 0.05})
    data.update(iaa=IAA, aa=metrics.average_of_iaa(IAA), afm=metrics.iaa_forgetting(IAA))
    return data


def test_run_summary_has_aa_and_afm_only_for_runs_with_iaa():
    s = run_summary(flowing_results())
    assert s["iaa"] == IAA
    assert s["aa"] == metrics.average_of_iaa(IAA) == pytest.approx(0.708333, abs=1e-6)
    assert s["afm"] == metrics.iaa_forgetting(IAA) == pytest.approx((0.1 + 0.05) / 5)
    assert (run_summary(results())["aa"], run_summary(results())["afm"]) == (None, None)


def test_write_report_of_a_flowing_run_adds_the_iaa_plot_and_rows(tmp_path):
    folder = run_folder(tmp_path, "flow", flowing_results())
    paths = write_report(folder)
    assert [p.name for p in paths] == ["summary.md", "accuracy_matrix.png", "accuracy_per_task.png",
                                       "storage_traffic.png", "iaa.png"]
    assert paths[-1].read_bytes().startswith(PNG) and paths[-1].stat().st_size > 5000
    text = paths[0].read_text()
    assert "| AA (IAA averaged over rounds) | 70.83% |" in text and "| AFM (mean IAA drop per round) | 3.00% |" in text
    assert "flowing data (gradual), 3 rounds, 2 clients, 30 samples per class per round" in text
    assert "AA (" not in write_report(run_folder(tmp_path, "plain", results()))[0].read_text()


def test_compare_runs_adds_aa_and_afm_columns_when_a_run_has_iaa(tmp_path):
    folders = [run_folder(tmp_path, "a", flowing_results()), run_folder(tmp_path, "b", results())]
    md, png = compare_runs(folders, tmp_path / "cmp", labels=["flow", "plain"])
    text = md.read_text()
    assert "| BWT | AA | AFM | mean CoR |" in text
    assert "| 70.83% | 3.00% | 1.33 |" in text and "| — | — | 1.33 |" in text
    assert png.read_bytes().startswith(PNG)
    md, _ = compare_runs(folders[1:], tmp_path / "cmp-plain")
    assert "AA" not in md.read_text()


def test_a_fixed_runs_evaluation_only_tasks_go_where_their_rounds_would_be_not_on_one_vertical_line():
    from firmware_sim.report import _round_axis

    history = [{"round": 1, "task": 0}, {"round": 2, "task": 0},
               {"round": 2, "task": 1, "trained": False}, {"round": 2, "task": 2, "trained": False}]
    assert _round_axis(history, rounds_per_task=2) == [1.0, 2.0, 4.0, 6.0]


def test_a_summary_says_what_was_run_and_lists_every_device_with_profile_budget_and_last_reason(tmp_path):
    data = results()
    for entry in data["history"]:
        for metrics_ in entry["metrics"].values():
            metrics_.update(stored_samples=30, store_budget_samples=48)
    data["settings"] = {"rounds_per_task": 2, "min_clients": 2, "fraction": 1.0, "devices": 3,
                        "client": {"epochs": 4}}
    data["devices"] = [
        {"device": "dev-a", "profile": "jetson-nano", "state": "idle", "error": "", "error_round": None},
        {"device": "dev-b", "profile": "raspberry-pi-4-4gb", "state": "error", "error": "no room on the disk",
         "error_round": 5},
        {"device": "dev-c", "profile": "raspberry-pi-4-4gb", "state": "offline", "error": "", "error_round": None},
    ]
    folder = run_folder(tmp_path, "run", data)
    (folder / "fleet.json").write_text(json.dumps({"policy": {"name": "refed"}, "store": {"max_samples": 48}}))
    text = write_report(folder)[0].read_text()
    for expected in ("| replay policy | refed |", "| budget M | M = 48 |", "| local epochs E | 4 |",
                     "| aggregation rule | fedavg |", "| rounds per task | 2 |",
                     "| devices | 1 jetson-nano, 2 raspberry-pi-4-4gb |",
                     "| dev-a | jetson-nano | idle | 30 / M = 48 |",
                     "| dev-b | raspberry-pi-4-4gb | error | 30 / M = 48 |", "round 5: no room on the disk |",
                     "Never delivered an update: dev-c."):
        assert expected in text, expected
    by_hand = {**results(), "scenario": {"test_data": "tests", "n_tasks": 3}}
    text = write_report(run_folder(tmp_path, "by-hand", by_hand))[0].read_text()
    assert "test sets from `tests`, 3 tasks" in text and "?" not in text.splitlines()[2]
