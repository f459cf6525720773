"""A stop signal never splits a round's commit: results.json is never ahead of the checkpoint a resume starts from.

Before, Ctrl-C landing between a round's history entry and its checkpoint left results.json with a round the
checkpoint lacked; the resumed run trained that round again and its history disagreed with the one kept.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
from thread_fleet import run_federation

from coordinator import checkpoint, server
from coordinator.broker import mosquitto_path
from coordinator.checkpoint import load_latest
from coordinator.run_logs import RESULTS_FILE
from edgefil.lifetime import uninterrupted


@pytest.fixture(autouse=True)
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt in this process while a test runs, as at an interactive prompt, whatever the
    test run inherited: a suite started in the background (`nohup scripts/test &`) runs with SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_stop_signal_inside_is_held_and_delivered_on_leaving():
    before = signal.getsignal(signal.SIGINT)
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the interpreter runs a pending handler within a few bytecodes
                pass
            reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is before


def test_a_block_without_a_signal_raises_nothing():
    with uninterrupted():
        pass


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_ctrl_c_during_a_checkpoint_leaves_results_and_checkpoint_at_the_same_round(tmp_path, export_artifacts,
                                                                                   monkeypatch):
    real_save = checkpoint.save_run_state
    interrupted = []

    def save_interrupted(directory, state, history=None):  # Ctrl-C as the second round's checkpoint is being written
        if state.round == 2 and not interrupted:
            interrupted.append(state.round)
            signal.raise_signal(signal.SIGINT)
        real_save(directory, state, history)

    monkeypatch.setattr(checkpoint, "save_run_state", save_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_federation(tmp_path, export_artifacts("lenet", 10, (1, 8, 8)), {"store": {"max_samples": 100}},
                       {"name": "fedavg"}, rounds_per_task=3)
    assert interrupted == [2]
    results = json.loads((tmp_path / "run" / RESULTS_FILE).read_text())
    latest = load_latest(tmp_path / "run" / server.CHECKPOINT_DIR)
    assert latest is not None
    state, _ = latest
    assert results["outcome"] == "stopped"
    assert [r["round"] for r in results["history"]] == [r["round"] for r in state.history] == [1, 2]
