"""edgefil: on-device federated incremental learning.

This package is the command line (`edgefil.cli`, the one module that may import every side) and the shared floor
both sides speak: topic names (`topics`), the wire codec (`wire`), the MQTT link (`link`), durable files
(`durable`), metrics (`metrics`) and the config checker (`settings`). The floor imports neither the device runtime
(`edge_client`), the coordinator nor the simulator (`firmware_sim`); the import contract in pyproject.toml
enforces it.
"""
from models.manifest import software_version

__version__ = software_version()
