"""Array files read by the runtime (edgefil/durable.py `read_npz`, `read_npy`): whole, never pickled, a foreign file
refused in one line, and numpy's header parse never entered by two threads at once (CPython 3.11, 3.11.7 here,
can fail such a parse with "SystemError: AST constructor recursion depth mismatch": a simulated device once lost a
round to it)."""
from __future__ import annotations

import ast
import io
import threading

import numpy as np
import pytest

from edgefil import durable
from edgefil.durable import npz_bytes, read_npy, read_npz


def test_an_npz_file_is_read_whole_from_a_path_or_its_bytes(tmp_path):
    arrays = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.array([0, 1])}
    (tmp_path / "a.npz").write_bytes(npz_bytes(arrays))
    for source in (tmp_path / "a.npz", npz_bytes(arrays)):
        read = read_npz(source)
        assert sorted(read) == ["x", "y"]
        for name, array in arrays.items():
            np.testing.assert_array_equal(read[name], array)


def test_a_foreign_or_pickled_file_is_refused():
    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    with pytest.raises(ValueError, match="not an .npz file"):
        read_npz(npy.getvalue())
    pickled = io.BytesIO()
    np.savez(pickled, o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        read_npz(pickled.getvalue())
    with pytest.raises(ValueError):
        read_npz(b"not a zip file")


def test_no_two_threads_parse_an_array_header_at_once(tmp_path, monkeypatch):
    """Every header parse runs while the process-wide lock is held, so two readers (an .npz and an .npy, on two
    threads) never parse at once. Checked by the lock's state at each parse, not by timing: a busy host cannot make
    it fail, and without the lock it fails on every run."""
    inside, most = 0, 0
    held_while_parsing: list[bool] = []
    count = threading.Lock()
    parse = ast.literal_eval

    def watched_parse(text):
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
            held_while_parsing.append(durable._ARRAY_HEADERS.locked())
        try:
            return parse(text)
        finally:
            with count:
                inside -= 1

    monkeypatch.setattr(ast, "literal_eval", watched_parse)  # numpy imports ast and calls ast.literal_eval
    np.save(tmp_path / "x.npy", np.arange(3))
    data = npz_bytes({"a": np.arange(3), "b": np.arange(4)})
    readers = [threading.Thread(target=read_npz, args=(data,)), threading.Thread(target=read_npy,
                                                                                 args=(tmp_path / "x.npy",))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert len(held_while_parsing) == 3 and all(held_while_parsing)
    assert most == 1
