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
    """Each parse waits (up to a timeout) for another thread to enter the parser beside it: without the lock the
    second reader enters and the count reaches 2; with it the waiter times out alone. A slow host can only make the
    second reader late, never make the lock look broken."""
    inside, most = 0, 0
    count = threading.Lock()
    someone_else = threading.Event()
    parse = ast.literal_eval

    def watched_parse(text):
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
            if inside > 1:
                someone_else.set()
        someone_else.wait(timeout=0.5)
        with count:
            inside -= 1
        return parse(text)

    monkeypatch.setattr(ast, "literal_eval", watched_parse)  # numpy imports ast and calls ast.literal_eval
    np.save(tmp_path / "x.npy", np.arange(3))
    data = npz_bytes({"a": np.arange(3)})
    readers = [threading.Thread(target=read_npz, args=(data,)), threading.Thread(target=read_npy,
                                                                                 args=(tmp_path / "x.npy",))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert most == 1
