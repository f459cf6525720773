"""edgefil: on-device federated incremental learning.

This package is the command line (`edgefil.cli`, the one module that may import every side) and the shared floor
both sides speak: topic names (`topics`), the wire codec (`wire`), the MQTT link (`link`), durable files
(`durable`), metrics (`metrics`) and the config checker (`settings`). The floor imports neither the device runtime
(`edge_client`), the coordinator nor the simulator (`firmware_sim`); the import contract in pyproject.toml
enforces it.
"""
from typing import Any


def __getattr__(name: str) -> Any:
    """`edgefil.__version__`, looked up only when asked for (models.manifest.software_version)."""
    if name == "__version__":
        from models.manifest import software_version

        return software_version()
    raise AttributeError(f"module 'edgefil' has no attribute {name!r}")
