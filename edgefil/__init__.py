"""edgefil: on-device federated incremental learning. The command line lives in `edgefil.cli`."""

__version__ = "0.1.0"
