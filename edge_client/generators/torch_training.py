"""Class generators trained with torch: WGAN-GP (the spec's generator model) and the VAE.

WGAN-GP (Gulrajani et al.): per generator step, `n_critic` critic steps on
    L_D = E[D(G(z))] - E[D(x)] + gp_weight * E[(||grad_x^ D(x^)||_2 - 1)^2],  x^ = a x + (1 - a) G(z), a ~ U(0, 1)
then one generator step on L_G = -E[D(G(z))]; Adam with betas (0.5, 0.9) for both. The VAE uses
`models.generators.vae_loss` (the loss of the ORT training graph) with AdamW as exported (betas 0.9/0.999,
eps 1e-6, no weight decay), and takes its batches and noise from the numpy RNG as the ORT trainer does.
"""
from __future__ import annotations

import numpy as np
import torch

from edge_client.generators.training import GeneratorTrainer, batch_indices
from models.generator_kinds import VAE_KINDS
from models.generators import (
    GeneratorSpec,
    VaeGraph,
    auxiliary_size,
    build_auxiliary,
    build_sampler,
    flatten_module,
    load_module,
    sampler_size,
    vae_loss,
)


class TorchGeneratorTrainer(GeneratorTrainer):
    """Trains class generators of one spec; `lr` defaults to 1e-3 (VAE) or 2e-4 (WGAN-GP)."""

    def __init__(self, spec: GeneratorSpec, batch_size: int = 64, lr: float | None = None, n_critic: int = 5,
                 gp_weight: float = 10.0) -> None:
        super().__init__()
        self.generator_spec = spec
        self.spec = spec.to_dict()
        self.sampler_size, self.auxiliary_size = sampler_size(spec), auxiliary_size(spec)
        self.batch_size = batch_size
        self.lr = lr if lr is not None else (1e-3 if spec.kind in VAE_KINDS else 2e-4)
        self.n_critic, self.gp_weight = n_critic, gp_weight

    def _fit(self, x: np.ndarray, sampler: np.ndarray | None, auxiliary: np.ndarray | None, steps: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        # Draw from the RNG only for what needs it, so that a warm-started VAE consumes the RNG exactly as the
        # ORT trainer does (same batches, same noise: the backends can be compared step by step).
        fresh = sampler is None or auxiliary is None or self.generator_spec.kind == "wgan-gp"
        seed = int(rng.integers(2**31 - 1)) if fresh else 0
        generator, critic = build_sampler(self.generator_spec, seed), build_auxiliary(self.generator_spec, seed + 1)
        if sampler is not None:
            load_module(generator, sampler)
        if auxiliary is not None:
            load_module(critic, auxiliary)
        if self.generator_spec.kind in VAE_KINDS:
            self._vae(VaeGraph(generator, critic), x, steps, rng)
        else:
            self._wgan_gp(generator, critic, torch.from_numpy(x), steps, rng, torch.Generator().manual_seed(seed))
        return flatten_module(generator), flatten_module(critic)

    def _vae(self, graph: VaeGraph, x: np.ndarray, steps: int, rng: np.random.Generator) -> None:
        optimizer = torch.optim.AdamW(graph.parameters(), lr=self.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0)
        for _ in range(steps):
            batch = torch.from_numpy(x[batch_indices(len(x), self.batch_size, rng)])
            eps = torch.from_numpy(rng.standard_normal((len(batch), self.generator_spec.latent_dim))
                                   .astype(np.float32))
            loss = vae_loss(batch, *graph(batch, eps))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            self.losses.append(loss.item())

    def _wgan_gp(self, generator: torch.nn.Module, critic: torch.nn.Module, x: torch.Tensor, steps: int,
                 rng: np.random.Generator, noise: torch.Generator) -> None:
        opt_g = torch.optim.Adam(generator.parameters(), lr=self.lr, betas=(0.5, 0.9))
        opt_d = torch.optim.Adam(critic.parameters(), lr=self.lr, betas=(0.5, 0.9))
        latent = self.generator_spec.latent_dim
        generator.train()
        for _ in range(steps):
            for _ in range(self.n_critic):
                real = x[torch.from_numpy(batch_indices(len(x), self.batch_size, rng))]
                with torch.no_grad():
                    fake = generator(torch.randn(len(real), latent, generator=noise))
                a = torch.rand(len(real), *[1] * (real.dim() - 1), generator=noise)
                mixed = (a * real + (1 - a) * fake).requires_grad_(True)
                grad, = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
                penalty = (grad.flatten(1).norm(dim=1) - 1).pow(2).mean()
                loss_d = critic(fake).mean() - critic(real).mean() + self.gp_weight * penalty
                opt_d.zero_grad()
                loss_d.backward()
                opt_d.step()
            loss_g = -critic(generator(torch.randn(self.batch_size, latent, generator=noise))).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            self.losses.append(loss_d.item())
        generator.eval()
