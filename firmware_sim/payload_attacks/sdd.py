"""An attack on SDD's feature statistics (docs/methods/sdd.md; issue 56, item 3): what one device may do to the
generator the coordinator trains on the devices' statistics.

- `statistics-extreme`: every layer's mean and variance 3e38, finite and non-negative (so it decodes): a generator
  trained to match them makes no finite step (issue 56: all 60 steps skipped, the untrained generator's samples
  used anyway, 0.693 to 0.279). The device's honest weights and sample count go with it; the rule's own checks (the
  fleet's range of statistics, a generator used only after a finite step: coordinator/strategies/sdd.py) stand
  between it and the generator.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from firmware_sim.payload_attacks.base import PayloadAttack, PayloadContext
from models.feature_stats import STATISTICS, decode_statistics, encode_statistics, layer_sizes

EXTREME = 3e38  # finite in float32 (its largest is 3.4e38)


class StatisticsExtreme(PayloadAttack):
    name = "statistics-extreme"
    method = "sdd"

    def craft(self, attachments: Mapping[str, bytes], context: PayloadContext) -> dict[str, bytes]:
        if STATISTICS not in attachments:  # a round it sends none in
            return dict(attachments)
        sizes = layer_sizes(context.manifest.input_shape, context.manifest.feature_dim)
        honest = decode_statistics(bytes(attachments[STATISTICS]), sizes)
        extreme = [dataclasses.replace(s, mean=np.full_like(s.mean, EXTREME), var=np.full_like(s.var, EXTREME))
                   for s in honest.values()]
        return {**attachments, STATISTICS: encode_statistics(extreme)}
