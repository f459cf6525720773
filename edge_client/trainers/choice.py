"""Which trainer backend a device runs, and building it: the one place that knows every backend.

`backend = "auto"` takes the first of AUTO_ORDER that this Python can run and the artifact set serves.
The order comes from benchmarks/train_throughput.py (docs/platforms.md has the table): ORT Training trains fastest
where it exists (x86_64, CPython <= 3.11; the portable graphs reach 0.65-0.98x of it), so it comes first; the
portable graphs next, the only ONNX backend elsewhere, 1.5-2.8x torch on the small models (0.65-0.83x on
small_cnn and ResNet-18) in a process and an install a fraction of torch's; torch last (the biggest install, and
the only backend for the pFedGRP generators' GAN). A named backend is taken as named, and refused with one line when it
cannot run here or the artifacts do not serve it.
"""
from __future__ import annotations

from pathlib import Path

from edge_client.config import TrainerSettings
from edge_client.trainers.base import Trainer
from models.manifest import ManifestError, load_manifest, require_served, runnable_backends

AUTO_ORDER = ("ort", "portable", "torch")
INSTALL_HINT = {
    "ort": "onnxruntime-training-cpu (CPython <= 3.11, x86_64 Linux)",
    "portable": "onnxruntime",
    "torch": "torch (pip install 'edgefil[torch-device]')",
}


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
