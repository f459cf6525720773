"""`dann`: the "DANN+FL" baseline of Re-Fed's Table 1 (supplement B): FedAvg with a random cache whose local
training is domain-adversarial (DANN, Ganin et al. 2016, "Domain-adversarial training of neural networks").

A small discriminator D (features -> hidden -> 1 logit) learns to tell which domain a sample's trunk features come
from; between the trunk and D sits a gradient reversal layer, so the same backward pass that trains D to separate
the domains trains the trunk to make them inseparable:

    loss = CE(head(f), y) + BCE(D(R_lambda(f)), d),   f = trunk(x),   R_lambda: identity forward, -lambda backward

D steps with its own Adam (`discriminator_lr`) on its gradient, the task model with the device's optimiser.

Choices the papers leave open (documented here and in docs/architecture.md):
- the domains are the current task (d = 0) and the earlier tasks (d = 1, the cached samples): in incremental
  learning the shift to adapt across is the one between the new task and the old; while the store holds one
  domain only (the first task) the term is left out;
- `domain_weight` (lambda) is constant: DANN ramps it from 0 to 1 over one training run, and a federated run has
  no single run (10 rounds of E epochs per task); 0.1 by default;
- D is the device's own, never aggregated, and lives in memory: a restarted device starts a fresh one (it
  re-learns within a round; it holds no knowledge the model needs);
- it needs the torch backend (`[trainer] backend = "torch"`): the ONNX training graphs have no second model on
  the features. The device refuses any other backend with one line when it opens the policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.policies.base import PolicyContext, RoundView, TrainingSet
from edge_client.policies.random_cache import RandomCache
from edge_client.trainers.base import Proximal, iterate_batches

if TYPE_CHECKING:
    import torch

    from edge_client.trainers.pytorch import TorchTrainer


def reverse_gradient(features: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient reversal layer: `features` exactly, forward; `-scale` times the gradient, backward."""
    frozen = features.detach()
    return frozen + scale * (frozen - features)


@dataclass
class DomainAdversarial(RandomCache):
    name = "dann"

    domain_weight: float = 0.1  # lambda: how strongly the trunk is pushed to hide the domain
    hidden: int = 64  # the discriminator's hidden width
    discriminator_lr: float = 1e-3
    seed: int = 0  # the discriminator's initial weights
    _trainer: Any = field(default=None, init=False, repr=False)
    _discriminator: Any = field(default=None, init=False, repr=False)
    _optimizer: Any = field(default=None, init=False, repr=False)
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.domain_weight) and self.domain_weight >= 0):
            raise ValueError(f"domain_weight must be finite and >= 0, got {self.domain_weight}")
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if not (np.isfinite(self.discriminator_lr) and self.discriminator_lr > 0):
            raise ValueError(f"discriminator_lr must be finite and > 0, got {self.discriminator_lr}")

    def open(self, ctx: PolicyContext) -> None:
        if ctx.trainer.backend != "torch":
            raise ValueError(f"policy dann trains an adversary on the model's features and needs [trainer] "
                             f"backend = \"torch\"; this device trains with {ctx.trainer.backend!r}")
        import torch

        self._trainer = ctx.trainer
        features = self._trainer.model.head.in_features
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self._discriminator = torch.nn.Sequential(
                torch.nn.Linear(features, self.hidden), torch.nn.ReLU(), torch.nn.Linear(self.hidden, 1),
            ).to(self._trainer.device)
        self._optimizer = torch.optim.Adam(self._discriminator.parameters(), lr=self.discriminator_lr)

    def fit(self, view: RoundView, batch: TrainingSet, epochs: int, proximal: Proximal | None) -> float:
        """E epochs of DANN steps over the store's samples; plain steps while the store holds one domain."""
        import torch
        from torch.nn import functional as F

        trainer: TorchTrainer = self._require_trainer()
        tasks = view.stored_tasks()
        if len(tasks) != len(batch.y):
            raise ValueError("the dann baseline trains on the store's samples as they are (no extra samples)")
        domains = (tasks != view.task).astype(np.float32)
        adversarial = self.domain_weight > 0 and 0 < domains.sum() < len(domains)
        x, y, mask, proximal, loss = trainer.fit_inputs(batch.x, batch.y, view.class_mask, proximal, batch.loss)
        last = domain_total = 0.0
        for _ in range(epochs):
            total = domain_total = 0.0
            for idx in iterate_batches(len(y), view.batch_size, view.rng):
                target = torch.from_numpy(domains[idx]).to(trainer.device)

                def domain_loss(features: torch.Tensor, target: torch.Tensor = target) -> torch.Tensor:
                    logits = self._discriminator(reverse_gradient(features, self.domain_weight)).squeeze(1)
                    return F.binary_cross_entropy_with_logits(logits, target)

                before = trainer.get_weights() if proximal is not None or trainer.rate_scale is not None else None
                self._optimizer.zero_grad(set_to_none=True)
                value, term = trainer.train_step_with(
                    x[idx], y[idx], mask, None if loss is None else loss.batch(idx),
                    extra=domain_loss if adversarial else None,
                )
                if adversarial:
                    self._optimizer.step()
                if before is not None:
                    trainer.settle_step(before, proximal)
                total += value * len(idx)
                domain_total += term * len(idx)
            last = total / max(len(y), 1)
        self._round = {"domain_loss": domain_total / max(len(y), 1)} if adversarial else {}
        return last

    def metrics(self) -> dict[str, float]:
        return dict(self._round)

    def _require_trainer(self) -> TorchTrainer:
        if self._trainer is None:
            raise RuntimeError("the dann policy is not open: the learner calls open() with its trainer")
        return self._trainer
