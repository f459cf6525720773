"""Which backend trains a class's generator, and building its trainer: the one place that knows both (their
interface: edge_client/generators/training.py).

- `torch` (`torch_training.TorchGeneratorTrainer`): WGAN-GP and VAE.
- `ort` (`ort_training.OrtVaeTrainer`): the VAE only, on the exported ORT training artifacts, without torch.
  WGAN-GP has no ORT path: its gradient penalty needs a gradient of a gradient (see models/generator_export.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_client.generators.training import GeneratorTrainer
from models.generator_kinds import VAE_KINDS

BACKENDS = ("torch", "ort")


def make_generator_trainer(spec: Mapping[str, Any], backend: str, artifact_dir: str | Path | None = None,
                           **options: Any) -> GeneratorTrainer:
    """The trainer for `spec` (a GeneratorSpec or its dict) on `backend`; `ort` needs the artifact folder."""
    spec = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
    if backend == "torch":
        from edge_client.generators.torch_training import TorchGeneratorTrainer
        from models.generators import GeneratorSpec

        return TorchGeneratorTrainer(GeneratorSpec.from_dict(spec), **options)
    if backend == "ort":
        if spec.get("kind") not in VAE_KINDS:
            raise ValueError(f"no ORT training for {spec.get('kind')!r} generators (only {VAE_KINDS}): the WGAN-GP "
                             "gradient penalty needs a double backward that ORT's training graphs cannot express; "
                             "use backend='torch'")
        if artifact_dir is None:
            raise ValueError("the ort backend trains the exported artifacts: pass artifact_dir")
        from edge_client.generators.ort_training import OrtVaeTrainer

        trainer = OrtVaeTrainer(artifact_dir, **options)
        if trainer.spec != spec:
            raise ValueError(f"{artifact_dir} holds artifacts for {trainer.spec}, not {spec}")
        return trainer
    raise ValueError(f"unknown generator backend {backend!r}; choose one of {BACKENDS}")
