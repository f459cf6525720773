"""The contract of an attack on a method's payloads (the package docstring says where they come from).

A compromised device that runs one trains honestly, sends its honest weights and sample count, and replaces its
policy's attachments with what `craft` makes of them: what the coordinator's half of the method decodes and uses
(GLFC's prototype gradients, SDD's feature statistics), bounded by the method's own checks and not by the guard,
which judges weights. An attack names the policy it is written for (`method`); a fleet whose devices run another
policy is refused before it starts, because its devices attach nothing the attack could change.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgefil.registry import Registry
from models.manifest import Manifest

PAYLOAD_ATTACKS: Registry[PayloadAttack] = Registry("payload attack")


@dataclass(frozen=True)
class PayloadContext:
    """What an attack on payloads may read: the device's policy (its options: GLFC's Gamma, say), the model's
    manifest and artifacts folder, and the classes the device holds of its current task."""

    policy: Any  # the device's ReplayPolicy (edge_client/policies), as configured
    manifest: Manifest
    artifacts: Path  # the model's artifacts (a method's side networks are exported beside them)
    classes: np.ndarray  # the classes of the device's current task that it holds samples of


class PayloadAttack:
    """One attack on one method's payloads: `craft` the attachments a compromised device sends instead of its
    honest ones."""

    name: ClassVar[str]
    method: ClassVar[str]  # the replay policy whose attachments it changes

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            PAYLOAD_ATTACKS.add(cls.name, cls)

    def craft(self, attachments: Mapping[str, bytes], context: PayloadContext) -> dict[str, bytes]:
        raise NotImplementedError
