"""The checkpoint's generations (coordinator/checkpoint.py `Checkpoints`): where a run starts from, the devices'
deliveries kept with each round, pruning to `keep`. (The run state's own round trip and refusals: test_coordinator.)"""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.checkpoint import CheckpointPolicy, Checkpoints, DeviceDeliveries, RunState, load_latest


def test_a_generation_keeps_the_devices_deliveries_and_a_resume_finds_them(tmp_path):
    checkpoints = Checkpoints(tmp_path, CheckpointPolicy(keep=2), num_parameters=3)
    fresh = RunState(weights=np.zeros(3, dtype=np.float32), rng=dict(np.random.default_rng(0).bit_generator.state))
    state, resumed_from = checkpoints.start(resume=False, fresh=fresh)
    assert state is fresh and resumed_from is None
    saved_rules = []
    for number in (1, 2, 3):
        state.round = number
        deliveries = DeviceDeliveries(models={"a": np.full(3, number, dtype=np.float32)},
                                      payloads={"a": {"old": b"x" * number}}, broadcast={"best": b"b"},
                                      broadcast_round=number)
        checkpoints.save(state, deliveries, saved_rules.append)
    assert [p.name for p in saved_rules] == ["round-000001", "round-000002", "round-000003"]
    with pytest.raises(FileExistsError, match="--resume"):
        checkpoints.start(resume=False, fresh=fresh)
    state, resumed_from = checkpoints.start(resume=True, fresh=fresh)
    assert state.round == 3 and resumed_from == tmp_path / "round-000003"
    assert len(list(tmp_path.iterdir())) == 2  # keep = 2
    found = checkpoints.deliveries(resumed_from, 3)
    np.testing.assert_array_equal(found.models["a"], np.full(3, 3, dtype=np.float32))
    assert (found.payloads, found.broadcast, found.broadcast_round) == ({"a": {"old": b"xxx"}}, {"best": b"b"}, 3)
    assert not checkpoints.deliveries(resumed_from, 2)  # another round's are not this state's
    assert load_latest(tmp_path, 3)[0].round == 3
