"""benchmarks/poisoning.py's cells: the fleet a cell runs is one whose rounds can close."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from firmware_sim.client_shares import ClientSource

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("poisoning_benchmark", ROOT / "benchmarks" / "poisoning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_round_quorum_leaves_out_honest_devices_with_no_data_of_the_first_task(tmp_path):
    """An honest device with no sample of the first task says it has no data and is not waited for: counted in the
    quorum, round 1 could never close (4 of 20 on digits, seed 0, never did). Every other honest device is."""
    poisoning = load_benchmark()
    short = 0
    for devices, seed in ((4, 0), (8, 0), (20, 0), (20, 1)):
        cell = poisoning.Cell("digits-class-cal", "fedavg", devices, "clean", seed)
        fleet = cell.fleet(tmp_path)
        holding = sum(len(ClientSource(fleet["scenario"], k).task_data(0)[1]) > 0 for k in range(cell.honest))
        assert fleet["coordinator"]["min_clients"] == holding
        short += holding < cell.honest
    assert short  # the case arises in these cells: the test is not vacuous


def test_a_few_shot_fleet_holds_a_session_sample_a_device_at_every_size():
    """A few-shot session's N K samples must cover the fleet (the kind refuses fewer): digits' 2-way 5-shot sessions
    hold 10, so the fleet of 20 runs 2-way 10-shot sessions, and the smaller fleets the preset's."""
    poisoning = load_benchmark()
    for devices, shots in ((4, None), (8, None), (20, 10)):
        scenario = poisoning.Cell("digits-sdd", "default", devices, "all-honest", 0).fleet(Path("."))["scenario"]
        assert scenario.get("shots") == shots
        assert all(len(ClientSource(scenario, k).task_data(1)[1]) > 0 for k in range(devices))


def test_the_runs_without_attack_are_compared_with_fedavg_on_final_and_average_incremental_accuracy():
    """The clean-vs-FedAvg line reads both: the final accuracy, which one round's weights swing by several points in
    these fleets, and the average incremental accuracy (the mean over tasks of the accuracy on the tasks seen so far,
    edgefil.metrics), which is steadier. Here the setting's final accuracy is FedAvg's and its first task was learnt
    worse: only the second reads the difference."""
    poisoning = load_benchmark()
    results = {}
    for seed in (0, 1):
        for kind in ("clean", "all-honest"):
            for setting, first in (("default", 0.5), ("fedavg", 0.9)):
                results[poisoning.Cell("digits-class-cal", setting, 4, kind, seed)] = {
                    "final_accuracy": 0.8, "accuracy_matrix": [[first], [0.7, 0.9]]}
    line = poisoning.paired(results, "digits-class-cal", "default", [0, 1], [4])
    assert "plain FedAvg  +0.0 ± 0.0 points over 4 pairs" in line, line
    assert "average incremental accuracy -20.0 ± 0.0" in line, line  # (0.5 + 0.8) / 2 against (0.9 + 0.8) / 2


def test_an_attack_is_read_against_the_clean_fleet_and_against_the_all_honest_fleet():
    """Against the clean run an attack's change counts what the compromised devices' own data add; against the
    all-honest run, what the attack itself does (the comparison for a payload attack with honest weights). Here the
    attack run ends where the all-honest run does, 10 points above the clean run."""
    poisoning = load_benchmark()
    results = {}
    for seed in (0, 1):
        for kind, accuracy in (("clean", 0.6), ("all-honest", 0.7), ("prototype-flood", 0.7)):
            for setting in ("default", "fedavg"):
                results[poisoning.Cell("digits-glfc-cal", setting, 20, kind, seed)] = {"final_accuracy": accuracy}
    against_clean = poisoning.by_attack(results, "digits-glfc-cal", ["default"], ["prototype-flood"], [0, 1], 20)
    against_everyone = poisoning.by_attack(results, "digits-glfc-cal", ["default"], ["prototype-flood"], [0, 1], 20,
                                           "all-honest")
    flood = next(line for line in against_clean.splitlines() if line.startswith("prototype-flood"))
    assert "+10.0 ± 0.0" in flood and "!" in flood, against_clean
    assert "all-honest" in against_clean  # its first row: the all-honest fleet against plain FedAvg
    flood = next(line for line in against_everyone.splitlines() if line.startswith("prototype-flood"))
    assert "+0.0 ± 0.0" in flood and "!" not in flood, against_everyone
    assert [row.split()[0] for row in against_everyone.splitlines()[1:]] == ["prototype-flood"]
