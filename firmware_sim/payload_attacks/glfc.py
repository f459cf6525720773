"""Attacks on GLFC's prototype gradients (docs/methods/glfc.md; issue 56, item 4): what one device may do to the
proxy, which reconstructs a monitor set from the gradients and picks each task's best model on it.

- `prototype-flood`: the device's prototype gradients sent `MAX_PROTOTYPES` (256) times over, each copy scaled
  by 1 + k / 100 (no two alike): an honest device sends one per new class of its task, so a pool that took
  whatever came would hold the flood's images and few of anyone else's (issue 56: every honest gradient crowded out
  in all 5 tasks).
- `prototype-lie`: each prototype gradient with its label's head row (and bias) swapped with another class's: the
  proxy reads the other label (`models.glfc.infer_label`) and reconstructs the device's image under it, a monitor
  sample labelled wrong, which makes a model with the classes swapped look best (issue 56: 0.64 against 0.36 for
  the right model, in a flood). The other class is the next of the task's classes the device holds, or, holding
  one, the next class of the model.
- `prototype-extreme`: each prototype gradient times 1e10, finite (so it decodes): the reconstruction's matching
  diverges (issue 56: NaN samples came back).

Each sends the device's honest weights and sample count: only the proxy's own bounds (coordinator/strategies/glfc.py:
one gradient per class of the task from a device, once a task; reconstructions checked finite and in range) stand
between these and the monitor set.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path

import numpy as np

from firmware_sim.payload_attacks.base import PayloadAttack, PayloadContext
from models.glfc import MAX_PROTOTYPES, decode_gradient, encode_gradient, infer_label, is_prototype, prototype_name
from models.manifest import ParameterInfo, class_head_positions, load_manifest

EXTREME = 1e10  # `prototype-extreme`: times the honest gradient


@cache
def gamma_parameters(folder: Path) -> tuple[ParameterInfo, ...]:
    """Gamma's parameters as its exported manifest lists them (the policy exports Gamma beside the model)."""
    return load_manifest(folder, check_hashes=False).parameters


def _gradients(attachments: Mapping[str, bytes],
               context: PayloadContext) -> tuple[list[np.ndarray], tuple[ParameterInfo, ...]]:
    """The device's prototype gradients, decoded, and Gamma's parameters."""
    policy = context.policy
    folder = type(policy).gamma_folder({"gamma": policy.gamma, "gamma_seed": policy.gamma_seed}, context.artifacts)
    parameters = gamma_parameters(folder)
    gradients = [decode_gradient(bytes(data), parameters) for name, data in attachments.items() if is_prototype(name)]
    return gradients, parameters


def _others(attachments: Mapping[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in attachments.items() if not is_prototype(name)}


def _attached(attachments: Mapping[str, bytes], gradients: list[np.ndarray]) -> dict[str, bytes]:
    return {**_others(attachments), **{prototype_name(k): encode_gradient(g) for k, g in enumerate(gradients)}}


class PrototypeFlood(PayloadAttack):
    name = "prototype-flood"
    method = "glfc"

    def craft(self, attachments: Mapping[str, bytes], context: PayloadContext) -> dict[str, bytes]:
        gradients, _ = _gradients(attachments, context)
        if not gradients:  # not a round it uploads prototypes in
            return dict(attachments)
        flood = [gradients[k % len(gradients)] * np.float32(1 + k / 100) for k in range(MAX_PROTOTYPES)]
        return _attached(attachments, flood)


class PrototypeLie(PayloadAttack):
    name = "prototype-lie"
    method = "glfc"

    def craft(self, attachments: Mapping[str, bytes], context: PayloadContext) -> dict[str, bytes]:
        gradients, parameters = _gradients(attachments, context)
        held = [int(c) for c in context.classes]
        lies = []
        for gradient in gradients:
            label = infer_label(gradient, parameters)
            if len(held) > 1 and label in held:
                other = held[(held.index(label) + 1) % len(held)]
            else:
                other = (label + 1) % context.manifest.num_classes
            mine, theirs = (class_head_positions(parameters, [c]) for c in (label, other))
            lie = gradient.copy()
            lie[mine], lie[theirs] = gradient[theirs], gradient[mine]
            lies.append(lie)
        return _attached(attachments, lies) if lies else dict(attachments)


class PrototypeExtreme(PayloadAttack):
    name = "prototype-extreme"
    method = "glfc"

    def craft(self, attachments: Mapping[str, bytes], context: PayloadContext) -> dict[str, bytes]:
        gradients, _ = _gradients(attachments, context)
        return _attached(attachments, [g * np.float32(EXTREME) for g in gradients]) if gradients else dict(attachments)
