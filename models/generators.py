"""Per-class generators for pFedGRP's generator replay (spec: shared/specs/pfedgrp.md, sections 2 and 5).

One small unconditional generator per class: the *sampler* maps z ~ N(0, I) to a sample; the *auxiliary* model is
what trains it and is worth keeping for warm starts (the WGAN-GP critic, the VAE encoder).

- `wgan-gp`: the spec's DCGAN-like generator. Linear(z -> 2w * h/4 * w/4) -> BN -> ReLU -> ConvT(2w -> w, k4, s2,
  p1) -> BN -> ReLU -> ConvT(w -> C, k4, s2, p1) -> output, with Conv1d/ConvTranspose1d for 1-D signals (C, L). Its
  critic: Conv(C -> w, k4, s2, p1) -> LReLU(0.2) -> Conv(w -> 2w) -> LReLU -> Linear(-> 1), no normalisation
  (the gradient penalty is per sample). Spatial sizes must be divisible by 4. For (1, 28, 28), z=32, w=32 this is
  the spec's 136,993-parameter generator and 36,513-parameter critic.
- `vae`: an MLP VAE for any input shape, without BatchNorm (ORT training artifacts do not update running
  statistics). Decoder (the sampler): Linear(z -> w) -> ReLU -> Linear(w -> w) -> ReLU -> Linear(w -> D) -> output;
  encoder: Linear(D -> w) -> ReLU -> Linear(w -> w) -> ReLU -> Linear(w -> 2z) split into (mu, logvar).
- `conv-vae`: a convolutional VAE without BatchNorm (for the same ORT reason). Decoder: Linear(z -> 2w * base) ->
  ReLU -> Conv(2w -> w * 2^d, k3, p1) -> SubPixel -> ReLU -> Conv(w -> C * 2^d, k3, p1) -> SubPixel -> output, d the
  spatial dimensions: each SubPixel (sub-pixel convolution's shuffle, a reshape and a transpose) doubles every
  spatial size, as the WGAN-GP's stride-2 ConvTranspose does, but trains on ORT 1.19, which has no gradient
  kernel for ConvTranspose. Encoder: the critic's layers ending in Linear(-> 2z). A pixelwise MLP cannot represent
  MNIST-1D's classes (a shape at a random shift: a real-data classifier recognises ~18 % of the MLP VAE's
  samples); shared convolution kernels can.

Output layer: images (C, H, W) end in a Sigmoid because the datasets scale them to [0, 1] (the spec's Tanh, moved
to that range); 1-D signals (MNIST-1D) are unbounded reals and end linear.

Flat buffers (`flatten_module`) hold every floating-point entry of `state_dict()` in its order: parameters and
BatchNorm running means/variances. BatchNorm's integer `num_batches_tracked` is left out: it matters only for
cumulative averaging (momentum=None), which these modules do not use.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from models.generator_kinds import CONV_KINDS, GENERATOR_KINDS
from models.generator_record import RecordLayout

_LEAK = 0.2


@dataclass(frozen=True)
class GeneratorSpec:
    """What a class generator is: the same spec means the same architecture and flat-buffer layout."""

    kind: str
    input_shape: tuple[int, ...]
    latent_dim: int
    width: int

    def __post_init__(self) -> None:
        if self.kind not in GENERATOR_KINDS:
            raise ValueError(f"unknown generator kind {self.kind!r}; choose one of {GENERATOR_KINDS}")
        shape = tuple(self.input_shape)
        if len(shape) not in (2, 3) or any(not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"input_shape must be (C, L) or (C, H, W) of positive ints, not {self.input_shape}")
        if self.kind in CONV_KINDS and any(d % 4 for d in shape[1:]):
            raise ValueError(f"{self.kind} upsamples twice by 2: spatial sizes of {shape} must be divisible by 4")
        for name in ("latent_dim", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        object.__setattr__(self, "input_shape", shape)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GeneratorSpec:
        if not isinstance(data, Mapping) or set(data) != {"kind", "input_shape", "latent_dim", "width"}:
            raise ValueError(f"a generator spec has exactly kind, input_shape, latent_dim and width: {data!r}")
        shape = data["input_shape"]
        if not isinstance(shape, (list, tuple)):
            raise ValueError(f"input_shape must be a list, not {shape!r}")
        return cls(str(data["kind"]), tuple(shape), data["latent_dim"], data["width"])


def default_spec(kind: str, input_shape: tuple[int, ...]) -> GeneratorSpec:
    """Small defaults: the spec's z=32, w=32 generator for 28x28 and larger inputs, z=16 for small ones; the VAE's
    hidden width grows with the input size (64 up to 256 values, 128 above), the conv VAE's base width too (16 up
    to 256 values, 32 above: ten classes of it, sampler and encoder at int8, fit digits' 320 KiB budget)."""
    size = math.prod(input_shape)
    latent = 16 if size <= 256 else 32
    width = {"wgan-gp": 32, "vae": 64 if size <= 256 else 128, "conv-vae": 16 if size <= 256 else 32}[kind]
    return GeneratorSpec(kind, tuple(input_shape), latent, width)


class _Reshape(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)


class _SubPixel(nn.Module):
    """(N, C * 2^d, *S) -> (N, C, *2S) for d = len(S) in (1, 2): each output position takes its value from one of
    the 2^d channel groups (Shi et al.'s pixel shuffle, written as reshape and transpose for any d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, channels, *spatial = x.shape
        if len(spatial) == 1:
            (length,) = spatial
            x = x.reshape(n, channels // 2, 2, length).permute(0, 1, 3, 2)
            return x.reshape(n, channels // 2, 2 * length)
        height, width = spatial
        x = x.reshape(n, channels // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
        return x.reshape(n, channels // 4, 2 * height, 2 * width)


class VaeEncoder(nn.Module):
    """x -> (mu, logvar) of q(z | x): the MLP's layers (`vae`), or the critic's convolutions (`conv-vae`)."""

    def __init__(self, spec: GeneratorSpec) -> None:
        super().__init__()
        self.latent_dim = spec.latent_dim
        self.net = dcgan_critic(spec, 2 * spec.latent_dim) if spec.kind == "conv-vae" else nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(spec.input_shape), spec.width), nn.ReLU(),
            nn.Linear(spec.width, spec.width), nn.ReLU(), nn.Linear(spec.width, 2 * spec.latent_dim),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out[:, : self.latent_dim], out[:, self.latent_dim :]


def _output_layer(spec: GeneratorSpec) -> nn.Module:
    return nn.Sigmoid() if len(spec.input_shape) == 3 else nn.Identity()


def dcgan_generator(spec: GeneratorSpec) -> nn.Sequential:
    """The WGAN-GP sampler's layers (module docstring): z (N, latent) -> x (N, *input_shape)."""
    channels, *spatial = spec.input_shape
    image = len(spatial) == 2
    bn, convt = (nn.BatchNorm2d, nn.ConvTranspose2d) if image else (nn.BatchNorm1d, nn.ConvTranspose1d)
    base = tuple(d // 4 for d in spatial)
    w = spec.width
    return nn.Sequential(
        nn.Linear(spec.latent_dim, 2 * w * math.prod(base)), _Reshape((2 * w, *base)), bn(2 * w), nn.ReLU(),
        convt(2 * w, w, 4, 2, 1), bn(w), nn.ReLU(),
        convt(w, channels, 4, 2, 1), _output_layer(spec),
    )


def _subpixel_decoder(spec: GeneratorSpec) -> nn.Sequential:
    """The conv VAE's decoder (module docstring): z (N, latent) -> x (N, *input_shape)."""
    channels, *spatial = spec.input_shape
    conv = nn.Conv2d if len(spatial) == 2 else nn.Conv1d
    base = tuple(d // 4 for d in spatial)
    w, up = spec.width, 2 ** len(spatial)
    return nn.Sequential(
        nn.Linear(spec.latent_dim, 2 * w * math.prod(base)), _Reshape((2 * w, *base)), nn.ReLU(),
        conv(2 * w, w * up, 3, 1, 1), _SubPixel(), nn.ReLU(),
        conv(w, channels * up, 3, 1, 1), _SubPixel(), _output_layer(spec),
    )


def dcgan_critic(spec: GeneratorSpec, outputs: int = 1) -> nn.Sequential:
    """The WGAN-GP critic's layers (module docstring): x -> (N,) scores, or (N, outputs) with more than one."""
    channels, *spatial = spec.input_shape
    conv = nn.Conv2d if len(spatial) == 2 else nn.Conv1d
    w = spec.width
    return nn.Sequential(
        conv(channels, w, 4, 2, 1), nn.LeakyReLU(_LEAK), conv(w, 2 * w, 4, 2, 1), nn.LeakyReLU(_LEAK),
        nn.Flatten(), nn.Linear(2 * w * math.prod(d // 4 for d in spatial), outputs),
        *([nn.Flatten(0)] if outputs == 1 else []),
    )


def _vae_decoder(spec: GeneratorSpec) -> nn.Sequential:
    w = spec.width
    return nn.Sequential(
        nn.Linear(spec.latent_dim, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
        nn.Linear(w, math.prod(spec.input_shape)), _output_layer(spec), _Reshape(spec.input_shape),
    )


def build_sampler(spec: GeneratorSpec, seed: int | None = None) -> nn.Module:
    """The generator: forward(z (N, latent)) -> x (N, *input_shape). Seeded without touching the global RNG."""
    with seeded(seed):
        builder = {"wgan-gp": dcgan_generator, "vae": _vae_decoder, "conv-vae": _subpixel_decoder}[spec.kind]
        return builder(spec)


def build_auxiliary(spec: GeneratorSpec, seed: int | None = None) -> nn.Module:
    """The WGAN-GP critic (forward(x) -> (N,) scores) or the VAE encoder (forward(x) -> (mu, logvar))."""
    with seeded(seed):
        return dcgan_critic(spec) if spec.kind == "wgan-gp" else VaeEncoder(spec)


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Seed module construction without changing the caller's global torch RNG."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def flat_entries(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The entries a flat buffer holds, in order: the floating-point `state_dict()` entries."""
    return [(k, v) for k, v in module.state_dict(keep_vars=True).items() if v.is_floating_point()]


def flatten_module(module: nn.Module) -> np.ndarray:
    """Parameters and floating-point buffers (BN running stats) as one float32 array, `state_dict()` order."""
    return np.concatenate([v.detach().cpu().numpy().astype(np.float32).ravel() for _, v in flat_entries(module)])


def load_module(module: nn.Module, flat: np.ndarray) -> None:
    """Copy a `flatten_module` buffer into `module`; refuses a wrong dtype, length or non-finite values first."""
    entries = flat_entries(module)
    size = sum(v.numel() for _, v in entries)
    if not isinstance(flat, np.ndarray) or flat.dtype != np.float32 or flat.shape != (size,):
        raise ValueError(f"expected a float32 array of {size} values, got "
                         f"{getattr(flat, 'dtype', type(flat))} {getattr(flat, 'shape', '')}")
    if not np.isfinite(flat).all():
        raise ValueError("the flat buffer holds NaN or Inf")
    offset = 0
    with torch.no_grad():
        for _, value in entries:
            value.copy_(torch.from_numpy(flat[offset : offset + value.numel()].reshape(value.shape)))
            offset += value.numel()


def sampler_size(spec: GeneratorSpec) -> int:
    return sum(v.numel() for _, v in flat_entries(build_sampler(spec, seed=0)))


def auxiliary_size(spec: GeneratorSpec) -> int:
    return sum(v.numel() for _, v in flat_entries(build_auxiliary(spec, seed=0)))


def exported_layouts(input_shape: tuple[int, ...]) -> tuple[RecordLayout, ...]:
    """The generators exported for a model of `input_shape` (`default_spec` of every kind that fits the shape: what
    `edgefil export --generator` and a fleet's export write), with their buffer lengths: the records a coordinator
    can expect its devices to send."""
    layouts = []
    for kind in GENERATOR_KINDS:
        try:
            spec = default_spec(kind, tuple(input_shape))
        except ValueError:  # a convolutional kind on sizes it cannot upsample to
            continue
        layouts.append(RecordLayout(spec.to_dict(), sampler_size(spec), auxiliary_size(spec)))
    return tuple(layouts)


class VaeGraph(nn.Module):
    """The whole VAE for training: forward(input, eps) -> (recon, mu, logvar, exp(logvar)).

    `eps` (N, latent) is the reparameterisation noise, fed by the caller so that both backends can use the
    device's numpy RNG; exp(logvar) is an output because ORT's loss blocks have no Exp."""

    def __init__(self, sampler: nn.Module, auxiliary: nn.Module) -> None:
        super().__init__()
        self.sampler = sampler
        self.auxiliary = auxiliary

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.auxiliary(x)
        recon = self.sampler(mu + torch.exp(0.5 * logvar) * eps)
        return recon, mu, logvar, torch.exp(logvar)


def vae_loss(x: torch.Tensor, recon: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
             var: torch.Tensor) -> torch.Tensor:
    """Per-sample squared reconstruction error plus KL(q(z|x) || N(0, I)), each summed over a sample and
    averaged over the batch (the ORT training graph computes the same, see models/generator_export.py)."""
    batch = x.shape[0]
    reconstruction = (recon - x).pow(2).sum() / batch
    kl = 0.5 * (mu.pow(2) + var - logvar - 1).sum() / batch
    return reconstruction + kl
