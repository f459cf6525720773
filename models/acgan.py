"""The ACGAN of FedCIL (Qi et al., ICLR 2023, "Better generative replay for continual federated learning"; ACGAN:
Odena et al. 2017), on the DCGAN layers of models/generators.py.

- generator G(z, y): the WGAN-GP sampler's layers fed [z, onehot(y)], so one generator serves every class;
- discriminator D(x): the WGAN-GP critic's conv layers ending in 1 + classes outputs: a real/fake logit and the
  auxiliary classifier's class logits.

Losses (Odena et al.), with BCE on the real/fake logit and CE on the class logits:

    L_D = BCE(D(x), 1) + BCE(D(G(z, c)), 0) + CE(D(x), y) + CE(D(G(z, c)), c)
    L_G = BCE(D(G(z, c)), 1) + CE(D(G(z, c)), c)

`train_acgan` is the steps of one round as FedCIL's clients take them (Deep Generative Replay's form): each step a
batch of real samples, as many of the earlier classes drawn from a frozen replay generator counted as real, and
the ACGAN step on them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models.generators import GeneratorSpec, dcgan_critic, dcgan_generator, seeded


@dataclass(frozen=True)
class AcganSpec:
    """What an ACGAN is: the same spec, the same architecture and flat-buffer layout."""

    input_shape: tuple[int, ...]
    num_classes: int
    latent_dim: int = 16
    width: int = 16

    def layers(self) -> GeneratorSpec:
        """The DCGAN spec of its layers (checks the shape: spatial sizes divisible by 4)."""
        return GeneratorSpec("wgan-gp", tuple(self.input_shape), self.latent_dim + self.num_classes, self.width)


class ConditionalGenerator(nn.Module):
    """forward(z (N, latent), y (N,) int64) -> x (N, *input_shape)."""

    def __init__(self, spec: AcganSpec) -> None:
        super().__init__()
        self.num_classes = spec.num_classes
        self.latent_dim = spec.latent_dim
        self.net = dcgan_generator(spec.layers())

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, F.one_hot(y, self.num_classes).to(z.dtype)], dim=1))


def build_acgan(spec: AcganSpec, seed: int | None = None) -> tuple[ConditionalGenerator, nn.Sequential]:
    """(generator, discriminator); the discriminator's forward(x) -> (N, 1 + classes) logits."""
    with seeded(seed):
        return ConditionalGenerator(spec), dcgan_critic(spec.layers(), outputs=1 + spec.num_classes)


def discriminator_loss(real: torch.Tensor, real_y: torch.Tensor, fake: torch.Tensor,
                       fake_y: torch.Tensor) -> torch.Tensor:
    """L_D of the module docstring from the discriminator's outputs on real and on generated samples."""
    return (F.binary_cross_entropy_with_logits(real[:, 0], torch.ones_like(real[:, 0]))
            + F.binary_cross_entropy_with_logits(fake[:, 0], torch.zeros_like(fake[:, 0]))
            + F.cross_entropy(real[:, 1:], real_y) + F.cross_entropy(fake[:, 1:], fake_y))


def acgan_step(generator: ConditionalGenerator, discriminator: nn.Module, opt_g: torch.optim.Optimizer,
               opt_d: torch.optim.Optimizer, real_x: torch.Tensor, real_y: torch.Tensor, z: torch.Tensor,
               fake_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ACGAN step: the discriminator on `real_x` and on G(z, fake_y), then the generator; (L_D, L_G)."""
    fake = generator(z, fake_y)
    loss_d = discriminator_loss(discriminator(real_x), real_y, discriminator(fake.detach()), fake_y)
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    loss_g = generator_loss(discriminator(fake), fake_y)
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
    return loss_d, loss_g


def generator_loss(fake: torch.Tensor, fake_y: torch.Tensor) -> torch.Tensor:
    """L_G of the module docstring from the discriminator's outputs on generated samples."""
    return F.binary_cross_entropy_with_logits(fake[:, 0], torch.ones_like(fake[:, 0])) + F.cross_entropy(
        fake[:, 1:], fake_y)


def train_acgan(generator: ConditionalGenerator, discriminator: nn.Module, x: np.ndarray, y: np.ndarray,
                classes: np.ndarray, steps: int, batch: int, lr: float, rng: np.random.Generator,
                noise: torch.Generator, replay: ConditionalGenerator | None = None,
                replay_classes: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` ACGAN steps with fresh Adam optimisers (`lr`, betas (0.5, 0.999), as DCGAN and ACGAN), each on
    `batch` real samples of (x, y) (fewer when y holds fewer) and, with a `replay` generator, as many samples of
    `replay_classes` from it, labelled with their class and counted as real; the generated side draws its classes
    from `classes`. Draws from `rng` (picks, labels) and `noise` (latents) in a fixed order; (L_D, L_G) of the last
    step (zeros without steps)."""
    opt_g = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
    old = np.asarray(replay_classes, dtype=np.int64)
    latent = generator.latent_dim
    generator.train()
    loss_d = loss_g = torch.zeros(())
    for _ in range(steps):
        pick = rng.choice(len(y), size=min(batch, len(y)), replace=False)
        real_x, real_y = torch.from_numpy(np.ascontiguousarray(x[pick])), torch.from_numpy(y[pick])
        if replay is not None:
            replay_y = torch.from_numpy(rng.choice(old, size=len(pick)))
            with torch.no_grad():
                replay_x = replay(torch.randn(len(pick), latent, generator=noise), replay_y)
            real_x, real_y = torch.cat([real_x, replay_x]), torch.cat([real_y, replay_y])
        fake_y = torch.from_numpy(rng.choice(classes, size=len(real_y)))
        z = torch.randn(len(real_y), latent, generator=noise)
        loss_d, loss_g = acgan_step(generator, discriminator, opt_g, opt_d, real_x, real_y, z, fake_y)
    generator.eval()
    return loss_d, loss_g
