import numpy as np
import pytest

from firmware_sim.metrics import average_accuracy, backward_transfer, forgetting

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
