"""A process's threads carry their names where the operating system shows them (edgefil/thread_names.py)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edge_client.environment import Turns
from edgefil.netloop import NetworkLoop
from edgefil.thread_names import OS_NAME_BYTES, NamedThread, name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from Linux's /proc")


def os_name(native_id: int | None) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_named_thread_is_known_by_its_name_cut_to_the_kernels_length_and_the_main_thread_keeps_the_process_name():
    process_name = os_name(threading.main_thread().native_id)
    seen: dict[str, str] = {}

    def note() -> None:
        seen[threading.current_thread().name] = os_name(threading.get_native_id())

    for name in ("device", "a-name-longer-than-fifteen-bytes"):
        thread = NamedThread(target=note, name=name)
        thread.start()
        thread.join()
    assert seen == {"device": "device", "a-name-longer-than-fifteen-bytes": "a-name-longer-than-fifteen-bytes"[
        :OS_NAME_BYTES]}
    assert not name_this_thread("renamed")  # the main thread: its name is the process's, which pgrep and pkill match
    assert os_name(threading.main_thread().native_id) == process_name


def test_a_fleet_workers_network_loop_and_turns_threads_are_named():
    network = NetworkLoop(name="fleet-mqtt")
    turns = Turns(name="device-turns")
    try:
        assert turns.run(lambda: os_name(threading.get_native_id())) == "device-turns"
        # a close of a client it never opened is answered by the loop's thread: it has named itself by then
        network.close(mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="never-opened"), wait_s=60.0)
        assert os_name(network._thread.native_id) == "fleet-mqtt"
    finally:
        network.stop()
