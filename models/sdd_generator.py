"""SDD's conditional generator and its loss terms (Eqs. 5-9), each a small pure function: the coordinator's (torch).

The paper gives no generator architecture; it follows TARGET, whose generator is unconditional. Ours is
conditional, TARGET's layout scaled to the input: Linear(nz + classes -> 2 ngf * (S/4)^d) on [z, one-hot(y)],
BatchNorm, upsample x2, conv 3 (no bias), BatchNorm, LeakyReLU 0.2, upsample x2, conv 3 (no bias), BatchNorm,
LeakyReLU 0.2, conv 3 to the input's channels, then a sigmoid mapped onto `input_range` (d = 2 for images, 1
for 1-D signals; S/4 rounded up, the output cropped to S).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class ConditionalGenerator(nn.Module):
    """G(z, y): the module docstring's layout for inputs (C, H, W) or (C, L)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, nz: int = 32, ngf: int = 16,
                 input_range: tuple[float, float] = (0.0, 1.0)) -> None:
        super().__init__()
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes, self.nz = num_classes, nz
        channels, *spatial = self.input_shape
        if len(spatial) not in (1, 2):
            raise ValueError(f"the generator makes images (C, H, W) or signals (C, L), not {self.input_shape}")
        self.start = tuple(math.ceil(s / 4) for s in spatial)
        conv, norm = (nn.Conv2d, nn.BatchNorm2d) if len(spatial) == 2 else (nn.Conv1d, nn.BatchNorm1d)
        self.project = nn.Linear(nz + num_classes, 2 * ngf * math.prod(self.start))
        self.body = nn.Sequential(
            norm(2 * ngf), nn.Upsample(scale_factor=2),
            conv(2 * ngf, 2 * ngf, 3, padding=1, bias=False), norm(2 * ngf), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            conv(2 * ngf, ngf, 3, padding=1, bias=False), norm(ngf), nn.LeakyReLU(0.2),
            conv(ngf, channels, 3, padding=1),
        )
        self.low, self.high = (float(v) for v in input_range)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.project(torch.cat([z, F.one_hot(y, self.num_classes).float()], dim=1))
        out = self.body(h.reshape(len(z), -1, *self.start))
        crop = tuple(slice(0, s) for s in self.input_shape[1:])
        return self.low + (self.high - self.low) * torch.sigmoid(out[(..., *crop)])

    def parameter_bytes(self) -> int:
        """float32 bytes of the generator's parameters (what sending it instead of samples would cost)."""
        return 4 * sum(p.numel() for p in self.parameters())


# --- the generator's loss terms (Eqs. 5-9), on the ensemble's logits over the session's classes ------------------

def ensemble_logits(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """O(x) (Eq. 4): the plain average of the local models' logits (restricted to the session's classes)."""
    return torch.stack(list(logits)).mean(0)


def information_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H_info (Eq. 6): -(1/c) sum_i p_i log p_i of softmax(logits), averaged over the batch."""
    log_p = F.log_softmax(logits, dim=1)
    return -(log_p.exp() * log_p).sum(1).mean() / logits.shape[1]


def statistics_distance(values: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, channel_axis: int = 1
                        ) -> torch.Tensor:
    """One layer's term of Eq. 8 in DeepInversion's form: ||mu(x) - mu|| + ||sigma^2(x) - sigma^2|| (l2 norms) of
    the batch's per-channel (or per-feature) mean and population variance against the device's statistics."""
    flat = values.transpose(0, channel_axis).reshape(values.shape[channel_axis], -1)
    return torch.linalg.vector_norm(flat.mean(1) - mean) + torch.linalg.vector_norm(flat.var(1, unbiased=False) - var)


def adversarial_mask(teacher: torch.Tensor, student: torch.Tensor, sign: str) -> torch.Tensor:
    """omega of Eq. 9 per sample: "paper" 1 where teacher and student disagree (their argmax differ), "target"
    (TARGET's and DENSE's code) 1 where they agree."""
    differ = teacher.argmax(1) != student.argmax(1)
    if sign not in ADVERSARIAL_SIGNS:
        raise ValueError(f"adversarial sign must be one of {ADVERSARIAL_SIGNS}, got {sign!r}")
    return (differ if sign == "paper" else ~differ).float()


ADVERSARIAL_SIGNS = ("paper", "target")


def distillation_kl(teacher: torch.Tensor, student: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) per sample (Eqs. 9 and 11)."""
    p = F.log_softmax(teacher / temperature, dim=1)
    q = F.log_softmax(student / temperature, dim=1)
    return (p.exp() * (p - q)).sum(1)
