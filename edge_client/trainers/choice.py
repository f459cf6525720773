"""Which trainer backend a device runs, and building it: the one place that knows every backend.

`backend = "auto"` takes the first of AUTO_ORDER that this Python can run and the artifact set serves. The portable
graphs come first: they run on current onnxruntime on every platform and Python (the base install), while ONNX
Runtime Training had its last release in 2024 (1.19.2: CPython <= 3.11 on x86_64 Linux only, an optional extra,
`edgefil[ort-training]`), where it trains up to 1.4x faster on some models (benchmarks/train_throughput.py;
docs/platforms.md has the table): a device that wants it names it. torch last (the biggest install, and the only
backend for the pFedGRP generators' GAN). A named backend is taken as named, and refused with one line when it
cannot run here or the artifacts do not serve it.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edge_client.trainers.base import Trainer
from models.manifest import ManifestError, load_manifest, require_served, runnable_backends

Backend = Literal["auto", "ort", "portable", "torch"]
AUTO_ORDER = ("portable", "ort", "torch")
INSTALL_HINT = {
    "ort": "pip install 'edgefil[ort-training]' (CPython <= 3.11, x86_64 Linux)",
    "portable": "onnxruntime",
    "torch": "torch (pip install 'edgefil[torch-device]')",
}


@dataclass(frozen=True)
class TrainerSettings:
    """A device's [trainer] table (edge_client/config.py reads it into this): here, with the trainers it builds,
    so that a trainer's user (a policy that trains a network of its own, GLFC's Gamma) builds one without the
    device's config, which imports the policies."""

    backend: Backend = "auto"
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = 1e-3
    threads: int = 1
    momentum: float = 0.0  # SGD momentum (portable and torch backends; ORT Training's SGD has none)


# The optional graphs a backend runs from another's artifacts: ORT Training's give no input gradient, the portable
# set's graph does (OrtTrainer's input_gradient runs it in an inference session)
LENT_GRAPHS: dict[str, dict[str, str]] = {"ort": {"input_gradient": "portable"}}


def artifact_backends(backend: str, graphs: Collection[str]) -> tuple[str, ...]:
    """The backends whose artifacts a device on `backend` needs to run the optional `graphs` (its policy's
    `trainer_graphs`): its own, and those that lend it a graph it lacks."""
    lent = LENT_GRAPHS.get(backend, {})
    return tuple(dict.fromkeys([backend, *(lent[graph] for graph in sorted(graphs) if graph in lent)]))


def resolve_backend(requested: str, served: tuple[str, ...]) -> str:
    """The backend a device with `requested` ("auto" or a name) runs for artifacts serving `served`."""
    runnable = runnable_backends()
    if requested == "auto":
        for backend in AUTO_ORDER:
            if backend in runnable and backend in served:
                return backend
        raise ManifestError(f"no trainer backend can run here: the artifacts serve {', '.join(served)}, this "
                            f"Python runs {', '.join(runnable) or 'none'}; install "
                            f"{' or '.join(INSTALL_HINT[b] for b in served)}")
    if requested not in INSTALL_HINT:
        raise ValueError(f"unknown trainer backend {requested!r}; choose auto, {', '.join(INSTALL_HINT)}")
    if requested not in runnable:
        raise ManifestError(f"trainer backend {requested!r} is not installed here: install {INSTALL_HINT[requested]}")
    require_served(requested, served)
    return requested


def make_trainer(settings: TrainerSettings, artifacts: str | Path) -> Trainer:
    """The trainer the settings ask for, on the artifact set in `artifacts`."""
    manifest = load_manifest(artifacts)
    backend = resolve_backend(settings.backend, manifest.backends)
    if settings.momentum and backend == "ort":
        raise ValueError("momentum needs the portable or torch backend: ORT Training's SGD has none")
    if backend == "ort":
        from edge_client.trainers.ort import OrtTrainer

        return OrtTrainer(artifacts, optimizer=settings.optimizer, lr=settings.lr, threads=settings.threads)
    if backend == "portable":
        from edge_client.trainers.portable import PortableTrainer

        return PortableTrainer(artifacts, optimizer=settings.optimizer, lr=settings.lr, threads=settings.threads,
                               momentum=settings.momentum)
    from edge_client.trainers.pytorch import TorchTrainer

    return TorchTrainer(manifest, optimizer=settings.optimizer, lr=settings.lr, momentum=settings.momentum,
                        threads=settings.threads)
