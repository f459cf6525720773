import numpy as np
import pytest

from edgefil.metrics import (
    accuracy_matrix,
    average_accuracy,
    average_of_iaa,
    backward_transfer,
    forgetting,
    iaa_forgetting,
    instant_average_accuracy,
    last_rounds_accuracy,
    peak_storage,
    rounds_to_best,
    traffic_summary,
)

# After task 0: 0.9 on task 0. After task 1: 0.6 on task 0, 0.8 on task 1.
# After task 2: 0.5 on task 0, 0.7 on task 1, 0.9 on task 2. (Upper triangle is never read.)
ACC = np.array([[0.9, 0.0, 0.0], [0.6, 0.8, 0.0], [0.5, 0.7, 0.9]])


def test_average_accuracy_by_hand():
    assert average_accuracy(ACC) == pytest.approx((0.5 + 0.7 + 0.9) / 3)
    assert average_accuracy(ACC, after=1) == pytest.approx((0.6 + 0.8) / 2)
    assert average_accuracy(ACC, after=0) == pytest.approx(0.9)


def test_forgetting_by_hand():
    # task 0: best 0.9, last 0.5 -> 0.4; task 1: best 0.8, last 0.7 -> 0.1
    assert forgetting(ACC) == pytest.approx((0.4 + 0.1) / 2)


def test_forgetting_uses_the_best_not_the_first_accuracy():
    acc = np.array([[0.5, 0, 0], [0.9, 0.8, 0], [0.6, 0.8, 0.7]])
    assert forgetting(acc) == pytest.approx(((0.9 - 0.6) + (0.8 - 0.8)) / 2)


def test_backward_transfer_by_hand():
    assert backward_transfer(ACC) == pytest.approx(((0.5 - 0.9) + (0.7 - 0.8)) / 2)


def test_single_task_and_bad_shapes():
    assert forgetting(np.array([[0.7]])) == 0.0
    assert backward_transfer(np.array([[0.7]])) == 0.0
    with pytest.raises(ValueError, match="square"):
        forgetting(np.zeros((2, 3)))


# --- the ragged matrix of results.json, NaN above the diagonal ---------------------------------------------------

# After task 0: 0.8. After task 1: 0.9 on task 0 (it improved), 0.7 on task 1. After task 2: 0.6, 0.5, 0.95.
ROWS = [[0.8], [0.9, 0.7], [0.6, 0.5, 0.95]]


def test_accuracy_matrix_fills_the_unread_entries_with_nan():
    acc = accuracy_matrix(ROWS)
    assert acc.dtype == np.float64 and acc.shape == (3, 3)
    assert np.isnan(acc[np.triu_indices(3, k=1)]).all()
    assert acc[np.tril_indices(3)].tolist() == [0.8, 0.9, 0.7, 0.6, 0.5, 0.95]
    assert accuracy_matrix([]).shape == (0, 0)


def test_metrics_of_the_ragged_matrix_by_hand_and_nan_never_leaks():
    acc = accuracy_matrix(ROWS)
    # final accuracy = average after the last task: (0.6 + 0.5 + 0.95) / 3 = 2.05 / 3
    assert average_accuracy(acc) == pytest.approx(2.05 / 3)
    assert average_accuracy(acc, after=1) == pytest.approx((0.9 + 0.7) / 2)
    # task 0: best over rows 0..1 = max(0.8, 0.9) = 0.9, last 0.6 -> 0.3
    # task 1: best over row 1 only = 0.7 (acc[0, 1] is NaN, never read), last 0.5 -> 0.2; mean 0.25
    assert forgetting(acc) == pytest.approx(0.25)
    # (0.6 - 0.8) + (0.5 - 0.7) = -0.4, over 2 tasks -> -0.2
    assert backward_transfer(acc) == pytest.approx(-0.2)
    for value in (average_accuracy(acc), forgetting(acc), backward_transfer(acc)):
        assert np.isfinite(value)


def test_accuracy_matrix_and_check_matrix_refuse_bad_input():
    with pytest.raises(ValueError, match=r"row 1 .*\(2 entries\), got 3"):
        accuracy_matrix([[0.8], [0.9, 0.7, 0.1]])
    with pytest.raises(ValueError, match="finite"):
        forgetting(np.array([[0.8, np.nan], [np.nan, 0.7]]))  # NaN below the diagonal is a hole, not "unused"


# --- Re-Fed's rounds to the best accuracy (CoR) ------------------------------------------------------------------

HISTORY = [
    {"round": 1, "task": 0, "accuracy": [0.5]},
    {"round": 2, "task": 0, "accuracy": [0.8]},        # task 0 best (0.8) first reached in its round 2
    {"round": 3, "task": 0, "accuracy": [0.8]},        # tie: still 2
    {"round": 4, "task": 1, "accuracy": [0.85, 0.4]},  # 0.85 on task 0 is outside task 0's rounds: ignored
    {"round": 5, "task": 1, "accuracy": [0.7, 0.3]},
    {"round": 6, "task": 1, "accuracy": [0.65, 0.6]},  # task 1 best (0.6) in its round 3
]


def test_rounds_to_best_by_hand_with_a_tie_and_a_task_without_rounds():
    assert rounds_to_best(HISTORY, n_tasks=3) == [2, 3, None]
    assert rounds_to_best(HISTORY[:1], n_tasks=1) == [1]
    assert rounds_to_best([], n_tasks=0) == []


# --- pFedGRP's IAA / AA / AFM (spec section 1, Eqs. 9-11) --------------------------------------------------------

def test_the_last_rounds_mean_covers_the_last_tasks_last_rounds_by_hand():
    history = [{"task": 0, "accuracy": [0.9]}, {"task": 1, "accuracy": [0.2, 0.4]},
               {"task": 1, "accuracy": [0.6, 0.8]}, {"task": 1, "accuracy": [0.5, 0.9]}]
    last = last_rounds_accuracy(history, rounds=2)  # rounds 0.7 and 0.7
    assert (last.mean, last.std, last.rounds) == (pytest.approx(0.7), pytest.approx(0.0), 2)
    last = last_rounds_accuracy(history, rounds=10)  # the last task's three rounds, never task 0's (one task only)
    assert last.rounds == 3
    assert last.mean == pytest.approx((0.3 + 0.7 + 0.7) / 3)
    assert last.std == pytest.approx(np.std([0.3, 0.7, 0.7]))
    assert last_rounds_accuracy(history, rounds=1).mean == pytest.approx(0.7)
    with pytest.raises(ValueError, match="at least one round"):
        last_rounds_accuracy(history, rounds=0)
    with pytest.raises(ValueError, match="at least one round"):
        last_rounds_accuracy([])


def test_instant_average_accuracy_weights_by_samples_seen():
    # (100 * 0.9 + 300 * 0.6 + 600 * 0.3) / (100 + 300 + 600) = (90 + 180 + 180) / 1000 = 0.45 (plain mean: 0.6)
    assert instant_average_accuracy([0.9, 0.6, 0.3], [100, 300, 600]) == pytest.approx(0.45)
    # a client that has seen nothing yet weighs nothing: (0 * 0.2 + 50 * 0.9) / 50
    assert instant_average_accuracy([0.2, 0.9], [0, 50]) == pytest.approx(0.9)


def test_aa_and_afm_over_four_rounds_clip_the_rise():
    iaa = [0.8, 0.6, 0.7, 0.4]
    # AA = (0.8 + 0.6 + 0.7 + 0.4) / 4 = 2.5 / 4
    assert average_of_iaa(iaa) == pytest.approx(0.625)
    # drops: 0.8-0.6 = 0.2; 0.6-0.7 = -0.1 -> clipped to 0; 0.7-0.4 = 0.3; (0.2 + 0 + 0.3) / 3  (unclipped: 0.4 / 3)
    assert iaa_forgetting(iaa) == pytest.approx(0.5 / 3)
    assert iaa_forgetting([0.7]) == 0.0
    assert average_of_iaa([0.7]) == pytest.approx(0.7)


@pytest.mark.parametrize("accuracies, counts, message", [
    ([0.5, 0.5], [10], "one sample count per client"),
    ([0.5, 0.5], [10, -1], "non-negative"),
    ([0.5, 0.5], [0, 0], "at least one client"),
    ([], [], "at least one client"),
])
def test_instant_average_accuracy_refuses_bad_input(accuracies, counts, message):
    with pytest.raises(ValueError, match=message):
        instant_average_accuracy(accuracies, counts)


def test_aa_and_afm_refuse_no_rounds():
    with pytest.raises(ValueError, match="AA needs"):
        average_of_iaa([])
    with pytest.raises(ValueError, match="AFM needs"):
        iaa_forgetting([])


# --- per-device resources ----------------------------------------------------------------------------------------

def test_traffic_summary_per_device_and_totals():
    summary = traffic_summary({"a": 100, "b": 50}, {"a": 10, "c": 5})
    assert summary == {
        "devices": {"a": {"sent": 100, "received": 10}, "b": {"sent": 50, "received": 0},
                    "c": {"sent": 0, "received": 5}},
        "sent": 150,     # 100 + 50 + 0
        "received": 15,  # 10 + 0 + 5
    }


def test_peak_storage_reports_going_over_the_budget_without_raising():
    summary = peak_storage({"a": [10, 40, 30], "b": [10, 60], "c": []}, {"a": 40, "b": 50, "c": 1})
    assert summary == {
        "a": {"peak": 40, "budget": 40, "within_budget": True},   # exactly the budget is within it
        "b": {"peak": 60, "budget": 50, "within_budget": False},
        "c": {"peak": 0, "budget": 1, "within_budget": True},     # no readings: nothing stored
    }


def test_task_detection_counts_boundaries_caught_at_once_later_missed_and_false_starts():
    """Two devices' rounds: a's boundaries into tasks 1 and 2 are caught at once; b misses each at its first round
    there and catches it one round later. Then a device that starts a task where none began (a false start) and
    misses both boundaries."""
    from edgefil.metrics import task_detection

    def entry(task, **started):
        return {"task": task, "metrics": {d: {"task_started": float(s)} for d, s in started.items()}}

    history = [entry(0, a=1, b=1), entry(1, a=1, b=0), entry(1, b=1), entry(1, a=0), entry(2, a=1, b=0),
               entry(2, b=1), entry(2, a=0)]
    found = task_detection(history)
    assert (found.boundaries, found.at_once, found.later, found.missed, found.false_starts) == (4, 2, 2, 0, 0)
    assert found.delay_rounds == pytest.approx(0.5) and found.rate == 0.5
    history = [entry(0, a=1), entry(0, a=1), entry(1, a=0), entry(2, a=0)]
    found = task_detection(history)
    assert (found.boundaries, found.at_once, found.later, found.missed, found.false_starts) == (2, 0, 0, 2, 1)
    assert task_detection([]).rate == 1.0
