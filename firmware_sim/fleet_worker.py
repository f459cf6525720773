"""A fleet's worker process. Kept apart from firmware_sim/fleet.py so that a worker imports only the device side
(not the coordinator, which pulls in torch: about 285 MB of memory and 2 s of start-up per worker)."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any


def host_devices(configs: list[dict[str, Any]], stop: Any, log_file: str) -> None:
    """A worker process: one thread per virtual device (each device's store belongs to the thread that opens
    it), until the fleet says stop. Ctrl-C is the parent's to handle."""
    from edge_client.config import DeviceConfig
    from edge_client.device import Device
    from firmware_sim.virtual_device import virtual_device

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(filename=log_file, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    devices: list[Device] = []
    lock = threading.Lock()

    def run(raw: dict[str, Any]) -> None:
        try:
            device = virtual_device(DeviceConfig.from_dict(raw))
        except Exception:
            logging.getLogger("edgefil.fleet").exception("device %s failed to start", raw["device_id"])
            return
        with lock:
            devices.append(device)
        device.run()

    threads = [threading.Thread(target=run, args=(raw,), daemon=True) for raw in configs]
    for thread in threads:
        thread.start()
    stop.wait()
    with lock:
        for device in devices:
            device.stop_requested.set()
    for thread in threads:
        thread.join(30)
