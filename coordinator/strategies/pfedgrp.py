"""pFedGRP's personalized aggregation (spec: shared/specs/pfedgrp.md, Eq. 8).

The server caches every device's latest generator of each class and its label counts. For each device it samples
a replay set from that device's generators (class mix proportional to the device's cumulative counts), then finds
simplex weights w_i over this round's device models that minimise the cross-entropy of the mixed model
sum_j w_ij theta_j on that replay set; the device's personalized model is that mixture. The global model is the
mean of the local models (Sec. 4.2, the default) or of the personalized models (Algorithm 1, line 23):
`global_model = "mean-local" | "mean-personalized"`.

Choices the paper leaves open (configurable): w = softmax(alpha), alpha = 0 at the start (the plain mean), Adam
with `weight_lr` for `weight_steps` steps (the paper's 20 "rounds"); `replay_per_class` samples per seen class; each
step on a seeded minibatch of `weight_batch` of them (0: the whole set; minibatches make a step's cost independent
of how many classes a device has seen); the device's seen classes unmasked, as devices train. A device with no
cached generator yet gets the global model as its personalized one. Which cached generator answers another
device's request for a class: the latest uploaded that the quality check serves (below).

Quality check (`quality_check`, on by default; not in the paper): a generated sample that a reference model does not
classify as the class it was generated for is left out of the replay set, so a generator that has not learnt its
class (too few steps, a warm start from another device's drifted one) cannot steer the weights towards models that
fit its noise. The reference is the plain mean of this round's local models: every one of them was just trained on
its device's real data, while the previous global model has not seen this round's classes. A device none of whose
samples pass gets the plain mean as its weights, as one without generators does. The share that passed in its last
round is kept per device (`recognised`, checkpointed with the rule's state, and in each round's `rule_metrics`).
The same check decides what is served to other devices (issue 56): a generator joins the served ones only when the
reference classifies at least `serve_share` (half) of `SERVE_PROBE` of its samples as its class, among the fleet's
classes so far (the round's `seen_classes`; every class outside a run), not among those its device claims, which a
device names itself. Otherwise the class's earlier served generator stays served (each device's `not_served` round
metric counts its generators not served). An honest generator passes: pFedGRP's were recognised 95 % at 28x28
(docs/results.md); one that makes another class's images under its label (a label lie, well-formed) or noise does
not reach another device's replay. Its own device still replays it, as before: a device can only mislead its own
model.

On the wire (the method's own names, opaque to the coordinator): updates attach `generator/<class>` records
(`models.generator_record`), checked in `inspect`; the round config lists the cached classes
(`generator_classes`); a device asks for `generator/<class>` payloads and `answer` gives the cached records.

What a device sends cannot cost more than the fleet's own generators: `inspect` takes only records of the specs
the coordinator's own export makes for this model (`models.generators.exported_layouts`: each kind's
`default_spec` for the model's input shape), with exactly those specs' buffer lengths, and refuses any other from
the record's fixed header, before an array is decoded or a module built (an unknown kind, a negative latent size,
a sampler shorter than its spec, a width of 30,000 that would first cost 3.6 GB). Samples a cached generator
makes that are not finite are left out of its replay set; a device whose personalization still fails (its
generators' samples make the fit fail, or give weights that are not finite) gets the plain mean, its cached
generators are forgotten, and the round names it in `AggregateResult.refused` (`generator`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
from torch.func import functional_call
from torch.nn import functional as F

from coordinator.compute import as_tensor
from coordinator.strategies.base import (
    OUTSIDE_A_RUN,
    AggregateResult,
    ClientUpdate,
    RefusedUpdate,
    RoundContext,
    Strategy,
    validate_updates,
)
from edgefil.durable import write_atomically
from models.generator_record import (
    GeneratorFormatError,
    GeneratorRecord,
    attachment_label,
    attachment_name,
    decode_record,
    encode_record,
)
from models.generators import GeneratorSpec, build_sampler, exported_layouts, load_module
from models.manifest import Manifest
from models.zoo import MASK_FILL, build_for

GLOBAL_MODELS = ("mean-local", "mean-personalized")
STATE_FILE = "pfedgrp.msgpack"
SERVE_PROBE = 64  # samples a generator makes for the check that decides whether it is served


def simplex_weights(
    models: torch.Tensor, loss_of: Callable[[torch.Tensor, int], torch.Tensor], steps: int = 20, lr: float = 0.1
) -> torch.Tensor:
    """argmin over the simplex of loss_of(w @ models, step), with w = softmax(alpha) from alpha = 0 (Adam on alpha).

    `models` is (n, P): one flat model per row. The softmax keeps w on the simplex at every step (w >= 0, sum 1)."""
    alpha = torch.zeros(models.shape[0], device=models.device, requires_grad=True)
    optimizer = torch.optim.Adam([alpha], lr=lr)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(torch.softmax(alpha, 0) @ models, step).backward()
        optimizer.step()
    return torch.softmax(alpha.detach(), 0)


class PFedGRP(Strategy):
    name = "pfedgrp"

    def __init__(
        self,
        manifest: Manifest | None = None,
        global_model: str = "mean-local",
        weight_steps: int = 20,
        weight_lr: float = 0.1,
        replay_per_class: int = 100,
        weight_batch: int = 256,
        quality_check: bool = True,
        serve_share: float = 0.5,
        seed: int = 0,
        device: torch.device | str = "auto",
    ) -> None:
        if manifest is None:
            raise ValueError("strategy 'pfedgrp' needs the model's manifest (it runs the model on replay samples)")
        super().__init__(device, manifest)
        self.manifest: Manifest = manifest
        if global_model not in GLOBAL_MODELS:
            raise ValueError(f"global_model must be one of {GLOBAL_MODELS}, got {global_model!r}")
        if weight_steps < 0 or replay_per_class < 1 or weight_batch < 0:
            raise ValueError("weight_steps and weight_batch must be >= 0 and replay_per_class >= 1")
        self.global_model = global_model
        self.weight_steps = weight_steps
        self.weight_lr = weight_lr
        self.replay_per_class = replay_per_class
        self.weight_batch = weight_batch
        self.quality_check = quality_check
        if not 0 <= serve_share <= 1:
            raise ValueError(f"serve_share must lie in [0, 1], got {serve_share}")
        self.serve_share = serve_share
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.layouts = exported_layouts(manifest.input_shape)  # the generators a device of this fleet may send
        self.model = build_for(manifest).to(self.device)
        self.generators: dict[str, dict[int, GeneratorRecord]] = {}  # device -> class -> its latest generator
        self.label_counts: dict[str, list[int]] = {}
        self.served: dict[int, tuple[str, GeneratorRecord]] = {}  # class -> (device, generator) answering requests
        self.weights_used: dict[str, list[float]] = {}  # device -> its simplex weights of the last round
        self.recognised: dict[str, float] = {}  # device -> the share of its replay set the quality check kept

    # --- the round ----------------------------------------------------------------------------------

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Tell each device which classes the coordinator can send a cached generator of (on request)."""
        return {device: {"generator_classes": sorted(self.served)} for device in devices}

    def answer(self, device: str, names: Sequence[str]) -> dict[str, bytes]:
        """The served generator of each `generator/<class>` asked for that the coordinator has."""
        labels = [label for label in map(attachment_label, names) if label is not None]
        return {attachment_name(c): encode_record(self.served[c][1]) for c in labels if c in self.served}

    def inspect(self, update: ClientUpdate) -> None:
        """Every attachment must be a `generator/<class>` record of that class, for a class the model has."""
        self._records(update)

    def _records(self, update: ClientUpdate) -> dict[int, GeneratorRecord]:
        records = {}
        for name, data in update.attachments.items():
            label = attachment_label(name)
            if label is None or label >= self.manifest.num_classes:
                raise RefusedUpdate("attachments", f"unknown attachment {name!r}")
            try:
                record = decode_record(bytes(data), self.layouts)
            except GeneratorFormatError as err:
                raise RefusedUpdate("generator", f"{name}: {err}") from None
            if record.label != label:
                raise RefusedUpdate("generator", f"{name} holds the generator of class {record.label}")
            records[label] = record
        return records

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        validate_updates(global_weights, updates)
        models = torch.stack([as_tensor(u.weights, self.device) for u in updates])
        reference = models.mean(0) if self.quality_check else None
        fleet = torch.zeros(self.manifest.num_classes, device=self.device)
        fleet[list(ctx.seen_classes or range(self.manifest.num_classes))] = 1.0
        not_served = {update.device: self._cache(update, reference, fleet) for update in updates}
        personalized, refused = {}, {}
        for update in updates:
            self.recognised.pop(update.device, None)  # a device without a replay set this round has no share
            weights = self._contained_weights_for(update.device, models, reference)
            if weights is None:
                refused[update.device] = "generator"
                weights = torch.full((models.shape[0],), 1.0 / models.shape[0], device=self.device)
            self.weights_used[update.device] = weights.tolist()
            personalized[update.device] = weights @ models
        mean_of = models if self.global_model == "mean-local" else torch.stack(list(personalized.values()))
        checked: dict[str, dict[str, float]] = {}
        for update in updates:
            if update.device in self.recognised:
                checked.setdefault(update.device, {})["recognised"] = self.recognised[update.device]
            if reference is not None and update.attachments:
                checked.setdefault(update.device, {})["not_served"] = float(not_served[update.device])
        return AggregateResult(mean_of.mean(0), personalized, metrics=checked, refused=refused)

    def _contained_weights_for(self, device: str, models: torch.Tensor, reference: torch.Tensor | None
                               ) -> torch.Tensor | None:
        """The device's simplex weights; None when its generators make the fit fail (they are forgotten)."""
        try:
            weights = self._weights_for(device, models, reference)
            if bool(torch.isfinite(weights).all()):
                return weights
        except Exception:  # its generators' samples broke the fit: its personalization alone fails
            pass
        self._forget(device)
        return None

    def _forget(self, device: str) -> None:
        """Drop a device's cached generators (and, where its were the latest of a class, that class's cache)."""
        self.generators.pop(device, None)
        self.recognised.pop(device, None)
        self.served = {c: served for c, served in self.served.items() if served[0] != device}

    def _cache(self, update: ClientUpdate, reference: torch.Tensor | None, fleet: torch.Tensor) -> int:
        """Keep the update's generators for its device; serve each the check passes (all without it). Returns how
        many were not served."""
        not_served = 0
        for label, record in self._records(update).items():
            self.generators.setdefault(update.device, {})[label] = record
            if reference is None or self._passes(record, label, reference, fleet):
                self.served[label] = (update.device, record)
            else:
                not_served += 1
        if update.label_counts:
            self.label_counts[update.device] = list(update.label_counts)
        return not_served

    def _passes(self, record: GeneratorRecord, label: int, reference: torch.Tensor, fleet: torch.Tensor) -> bool:
        """Whether the reference classifies `serve_share` of SERVE_PROBE of the generator's finite samples as its
        class, among the fleet's classes."""
        x = self._sample(record, SERVE_PROBE)
        x = x[torch.isfinite(x).flatten(1).all(1)]
        if not len(x):
            return False
        recognised = self.recognised_by(reference, x, torch.full((len(x),), label, device=self.device), fleet)
        return float(recognised.float().sum()) >= self.serve_share * SERVE_PROBE

    def _weights_for(self, device: str, models: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
        replay = self.replay_set(device, reference)
        if replay is None:
            return torch.full((models.shape[0],), 1.0 / models.shape[0], device=self.device)
        x, y, mask = replay
        batches = self._batches(len(y))
        return simplex_weights(models, lambda theta, step: self._loss(theta, x[batches[step]], y[batches[step]], mask),
                               self.weight_steps, self.weight_lr)

    def _batches(self, n: int) -> list[torch.Tensor]:
        """One index set per weight step: a seeded random minibatch, or everything."""
        if not self.weight_batch or self.weight_batch >= n:
            return [torch.arange(n, device=self.device)] * self.weight_steps
        return [torch.randperm(n, generator=self.generator)[:self.weight_batch].to(self.device)
                for _ in range(self.weight_steps)]

    def replay_set(self, device: str, reference: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Samples of the device's classes from its cached generators, in proportion to its cumulative counts
        (replay_per_class per class on average, at least one each), less those the `reference` model (flat
        weights) does not classify as their class; None without any generator or sample left."""
        cached, counts = self.generators.get(device, {}), self.label_counts.get(device, [])
        classes = [c for c in sorted(cached) if c < len(counts) and counts[c] > 0]
        if not classes:
            return None
        total = sum(counts[c] for c in classes)
        xs, ys = [], []
        for c in classes:
            n = max(1, round(self.replay_per_class * len(classes) * counts[c] / total))
            xs.append(self._sample(cached[c], n))
            ys.append(torch.full((n,), c, dtype=torch.int64, device=self.device))
        mask = torch.zeros(self.manifest.num_classes, device=self.device)
        mask[[c for c, n in enumerate(counts) if n > 0]] = 1.0
        x, y = torch.cat(xs), torch.cat(ys)
        finite = torch.isfinite(x).flatten(1).all(1)  # a generator's weights are finite, its outputs need not be
        x, y = x[finite], y[finite]
        if len(y) == 0:
            return None
        if reference is not None:
            kept = self.recognised_by(reference, x, y, mask)
            self.recognised[device] = float(kept.float().mean())
            x, y = x[kept], y[kept]
            if len(y) == 0:
                return None
        return x, y, mask

    @torch.no_grad()
    def recognised_by(self, reference: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """Which samples the model with flat weights `reference` classifies as their label, among the classes of
        `mask` (as devices train)."""
        return self._logits(reference, x, mask).argmax(1) == y

    @torch.no_grad()
    def _sample(self, record: GeneratorRecord, n: int) -> torch.Tensor:
        spec = GeneratorSpec.from_dict(record.spec)
        sampler = build_sampler(spec).to(self.device).eval()
        load_module(sampler, record.sampler)
        z = torch.randn(n, spec.latent_dim, generator=self.generator).to(self.device)
        return sampler(z)

    def _loss(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._logits(theta, x, mask), y)

    def _logits(self, theta: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model with flat weights `theta` on x, the classes outside `mask` filled out."""
        params, offset = {}, 0
        for info in self.manifest.parameters:
            params[info.name] = theta[offset:offset + info.size].view(info.shape)
            offset += info.size
        logits, _ = functional_call(self.model, params, (x,))
        return logits + (mask - 1.0) * MASK_FILL

    # --- checkpoint ---------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        state = {
            "generators": {d: {str(c): encode_record(r) for c, r in g.items()} for d, g in self.generators.items()},
            "label_counts": self.label_counts,
            "served": {str(c): [d, encode_record(r)] for c, (d, r) in self.served.items()},
            "weights_used": self.weights_used, "recognised": self.recognised,
            "rng": self.generator.get_state().numpy().tobytes(),
        }
        write_atomically(Path(directory) / STATE_FILE, msgpack.packb(state, use_bin_type=True))

    def load(self, directory: Path) -> None:
        path = Path(directory) / STATE_FILE
        if not path.exists():
            return
        state = msgpack.unpackb(path.read_bytes(), raw=False)
        self.generators = {d: {int(c): decode_record(b, self.layouts) for c, b in g.items()}
                           for d, g in state["generators"].items()}
        self.label_counts = {d: list(v) for d, v in state["label_counts"].items()}
        if "served" in state:
            self.served = {int(c): (d, decode_record(b, self.layouts)) for c, (d, b) in state["served"].items()}
        else:  # written before the served check: the latest generator of each class
            self.served = {int(c): (d, self.generators[d][int(c)]) for c, d in state["latest"].items()}
        self.weights_used = dict(state["weights_used"])
        self.recognised = dict(state.get("recognised", {}))  # absent in checkpoints written before the check
        self.generator.set_state(torch.from_numpy(np.frombuffer(state["rng"], dtype=np.uint8).copy()))
