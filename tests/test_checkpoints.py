"""The checkpoint's generations (coordinator/checkpoint.py `Checkpoints`): where a run starts from, the devices'
deliveries kept with each round, pruning to `keep`. (The run state's own round trip and refusals: test_coordinator.)"""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from coordinator.checkpoint import (
    HISTORY_FILE,
    CheckpointPolicy,
    Checkpoints,
    DeviceDeliveries,
    HistoryFile,
    RoundEntry,
    RunSchedule,
    RunState,
    generations,
    load_latest,
    load_run_state,
)
from edgefil.durable import StateError, write_atomically


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
    assert len(generations(tmp_path)) == 2  # keep = 2
    found = checkpoints.deliveries(resumed_from, 3)
    np.testing.assert_array_equal(found.models["a"], np.full(3, 3, dtype=np.float32))
    assert (found.payloads, found.broadcast, found.broadcast_round) == ({"a": {"old": b"xxx"}}, {"best": b"b"}, 3)
    assert not checkpoints.deliveries(resumed_from, 2)  # another round's are not this state's
    assert load_latest(tmp_path, 3)[0].round == 3


@pytest.mark.parametrize("field, value, reason", [
    ("task", 10**9, "its task 1000000000 is past this run's 5 tasks"),
    ("round_in_task", 8, "its round_in_task 8 is not below rounds_per_task 8"),
    ("accuracy_matrix", [[0.5]] * 6, "its accuracy_matrix has 6 rows, this run 5 tasks"),
    ("history", [{"round": 1, "task": 3, "accuracy": [0.5] * 4}], "its history holds task 3, after its own task 2"),
])
def test_a_checkpoint_outside_the_runs_schedule_is_not_resumed(tmp_path, field, value, reason):
    """A generation that loads but lies outside the run's task schedule (a hand edit, another run's folder) would end
    the run at once as complete, or index past its test sets: resume falls back to the generation before, and
    refuses in one line naming why when none fits."""
    checkpoints = Checkpoints(tmp_path, CheckpointPolicy(keep=3), num_parameters=3, schedule=RunSchedule(5, 8))
    state = RunState(weights=np.zeros(3, dtype=np.float32), task=2, round_in_task=1,
                     rng=dict(np.random.default_rng(0).bit_generator.state))
    for number in (1, 2):
        state.round = number
        checkpoints.save(state, DeviceDeliveries(), lambda folder: None)
    assert checkpoints.start(resume=True, fresh=state)[0].round == 2
    newest = tmp_path / "round-000002" / "state.json"
    newest.write_text(json.dumps({**json.loads(newest.read_text()), field: value}))
    resumed, folder = checkpoints.start(resume=True, fresh=state)
    assert resumed.round == 1 and folder == tmp_path / "round-000001"
    oldest = tmp_path / "round-000001" / "state.json"
    oldest.write_text(json.dumps({**json.loads(oldest.read_text()), field: value}))
    with pytest.raises(StateError, match=f"^no checkpoint in .* can be resumed: round-000002: .*does not fit this "
                                         f"run: {re.escape(reason)}; round-000001"):
        checkpoints.start(resume=True, fresh=state)


def test_the_history_is_a_file_of_lines_each_generation_naming_its_own(tmp_path):
    """The history grows with rounds x devices: it is one file of the checkpoint folder, an entry a line, appended as
    rounds close (each entry encoded once), and each generation names its own lines, which it loads; a crash between
    the append and the state leaves a tail the next save cuts; a damaged line refuses the generations that name it,
    and --resume falls back to one that does not; a resumed process takes the lines its generation names and
    appends after them (the damaged line cut); a file removed mid-run is written whole again. The entries kept in memory let their values per device go once a newer
    one is in the file, which gives them back (`whole`)."""
    checkpoints = Checkpoints(tmp_path, CheckpointPolicy(keep=5), num_parameters=3)
    state = RunState(weights=np.zeros(3, dtype=np.float32), rng=dict(np.random.default_rng(0).bit_generator.state))
    history_file = tmp_path / HISTORY_FILE
    written: list[str] = []

    def whole() -> list[RoundEntry]:
        return checkpoints.history.whole(state.history)

    def close(number: int) -> None:
        state.round = number
        state.history.append({"round": number, "task": 0, "accuracy": [0.5],
                              "metrics": {f"d{k}": {"loss": number + k / 10} for k in range(4)}})
        written.append(json.dumps(state.history[-1]))
        checkpoints.save(state, DeviceDeliveries(), lambda folder: None)

    for number in (1, 2, 3):
        close(number)
        record = json.loads((tmp_path / f"round-{number:06d}" / "state.json").read_text())
        assert "history" not in record and record["history_lines"] == number
        assert history_file.read_text().splitlines() == written
        assert ["metrics" in entry for entry in state.history] == [False] * (number - 1) + [True]
        assert [json.dumps(entry) for entry in whole()] == written
    assert [load_run_state(tmp_path / f"round-{n:06d}").history for n in (1, 2, 3)] == [
        whole()[:1], whole()[:2], whole()]
    state.history[0]["accuracy"][0] = -1.0  # no code changes an entry once it is history: made visible
    close(4)  # appended: round 1's line as it was written
    assert load_latest(tmp_path, 3)[0].history[0]["accuracy"] == [0.5]
    state.history = [dict(entry) for entry in state.history]  # the same entries, new objects: written again
    state.history.pop()
    close(4)
    assert load_latest(tmp_path, 3)[0].history[0]["accuracy"] == [-1.0]
    with history_file.open("ab") as handle:  # a crash after the next round's append, before its state
        handle.write(b'{"round": 5, "ta')
    assert load_latest(tmp_path, 3)[0].round == 4
    close(5)
    assert history_file.read_text().count("\n") == 5 and load_latest(tmp_path, 3)[0].history == whole()
    lines = history_file.read_bytes().splitlines(keepends=True)
    history_file.write_bytes(b"".join(lines[:4]) + lines[4].replace(b"0.5", b"0.6"))  # round 5's line damaged
    resumed, folder = load_latest(tmp_path, 3)
    assert folder.name == "round-000004" and resumed.history == whole()[:4]
    with pytest.raises(StateError, match="round-000005 is unreadable: its history's 5 lines .* sha256"):
        load_run_state(tmp_path / "round-000005")
    again = Checkpoints(tmp_path, CheckpointPolicy(keep=5), num_parameters=3)  # a resumed process
    state, _ = again.start(resume=True, fresh=state)
    checkpoints = again
    close(5)  # round 5's line anew, after the 4 lines round 4 named
    assert load_latest(tmp_path, 3)[0].history == whole() and len(state.history) == 5
    history_file.unlink()  # removed by hand mid-run: the next save writes it whole
    close(6)
    assert load_latest(tmp_path, 3)[0].history == whole() and len(state.history) == 6


def test_a_file_written_in_parts_replaces_the_old_one_whole_or_not_at_all(tmp_path):
    """results.json is written in parts as they are made (a long run's is too large to make whole first): the file
    then holds all of them; where making a part fails, the old file stays as it was and no partial one is left."""
    path = tmp_path / "results.json"
    write_atomically(path, b"old")

    def parts(fail: bool):
        yield b"{"
        if fail:
            raise ValueError("a part could not be made")
        yield b"}"

    with pytest.raises(ValueError):
        write_atomically(path, parts(fail=True))
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    write_atomically(path, parts(fail=False))
    assert path.read_bytes() == b"{}"


def test_a_history_file_read_back_names_why_it_is_refused(tmp_path):
    """A resume reads the history's first lines a line at a time: fewer whole lines than the state names, lines that
    do not match its sha256, or one that is not JSON, each refused with its reason; lines past the count (a newer
    generation's) are not its history."""
    path = tmp_path / HISTORY_FILE
    lines = [b'{"round": 1, "task": 0, "accuracy": [0.5]}\n', b'{"round": 2, "task": 0, "accuracy": [0.6]}\n']
    path.write_bytes(b"".join(lines) + b'{"round": 3, "ta')  # a tail a crash left

    def sha(*parts: bytes) -> str:
        return hashlib.sha256(b"".join(parts)).hexdigest()

    assert [e["round"] for e in HistoryFile.read(path, 2, sha(*lines))] == [1, 2]
    assert [e["round"] for e in HistoryFile.read(path, 1, sha(lines[0]))] == [1]
    assert HistoryFile.read(tmp_path / "none.jsonl", 0, sha()) == []
    with pytest.raises(StateError, match="holds 2 whole lines, the state names 3"):
        HistoryFile.read(path, 3, sha(*lines))
    with pytest.raises(StateError, match="2 lines .* do not match their sha256"):
        HistoryFile.read(path, 2, sha(lines[0]))
    path.write_bytes(lines[0] + b"not json\n")
    with pytest.raises(StateError, match="a line that is not JSON"):
        HistoryFile.read(path, 2, sha(lines[0], b"not json\n"))
