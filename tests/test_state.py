import json

import numpy as np
import pytest

from edge_client.state import STATE_FILE, ClientState, StateError, load_state, save_state
from edgefil import durable


def test_state_round_trips_and_replaces_the_old_weights(tmp_path):
    assert load_state(tmp_path) is None
    first = ClientState(task=1, round=3, seen_classes=[0, 4], n_seen=90, weights=np.arange(5, dtype=np.float32))
    save_state(tmp_path, first)
    second = ClientState(task=2, round=4, seen_classes=[0, 4, 7], n_seen=120, weights=np.ones(5, dtype=np.float32))
    save_state(tmp_path, second)
    loaded = load_state(tmp_path)
    assert (loaded.task, loaded.round, loaded.seen_classes, loaded.n_seen) == (2, 4, [0, 4, 7], 120)
    assert np.array_equal(loaded.weights, second.weights) and loaded.weights.dtype == np.float32
    assert len(list(tmp_path.glob("weights-*.f32"))) == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_damaged_weights_or_state_are_refused(tmp_path):
    save_state(tmp_path, ClientState(task=0, weights=np.zeros(8, dtype=np.float32)))
    weights_file = next(tmp_path.glob("weights-*.f32"))
    weights_file.write_bytes(b"\x00" * 31)
    with pytest.raises(StateError, match="sha256"):
        load_state(tmp_path)
    (tmp_path / STATE_FILE).write_text("{broken")
    with pytest.raises(StateError, match="unreadable"):
        load_state(tmp_path)
    (tmp_path / STATE_FILE).write_text(json.dumps({"task": 0}))
    with pytest.raises(StateError, match="unreadable"):
        load_state(tmp_path)


@pytest.mark.parametrize("safe", [True, False])
def test_a_save_syncs_to_the_disk_only_where_the_process_s_writes_are_to_survive_a_power_cut(tmp_path, monkeypatch,
                                                                                              safe):
    """With power-loss safety (a device's own process) a save fsyncs its files and their folder; without it (a
    simulated fleet's worker) it fsyncs nothing, and still leaves one whole state, the old weights gone."""
    synced: list[int] = []
    monkeypatch.setattr(durable.os, "fsync", synced.append)
    monkeypatch.setattr(durable, "_power_loss_safe", durable.power_loss_safe())  # restored after the test
    durable.set_power_loss_safe(safe)
    for k in range(2):
        save_state(tmp_path, ClientState(task=k, round=k, weights=np.full(5, k, dtype=np.float32)))
    assert (len(synced) > 0) == safe
    loaded = load_state(tmp_path)
    assert loaded.round == 1 and np.array_equal(loaded.weights, np.ones(5, np.float32))
    assert len(list(tmp_path.glob("weights-*.f32"))) == 1 and not list(tmp_path.glob("*.tmp"))
