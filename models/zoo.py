"""Named architectures. Every model splits into a feature trunk and a linear classifier head.

The head is sized to the scenario's total number of classes, so the graph never changes across tasks
(class-incremental learning on a fixed ONNX graph). `forward(x, class_mask)` returns `(logits, features)`:
the features feed importance scoring (Re-Fed's last-layer gradient norm) and the mask hides classes a device
has not seen yet. A mask of ones changes nothing, bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

MASK_FILL = 1e9  # added as -(1 - mask) * MASK_FILL: exp underflows to 0 for hidden classes


class ClassifierModel(nn.Module):
    """A feature trunk followed by a linear head over all of the scenario's classes."""

    def __init__(self, trunk: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)

    def forward(
        self, x: torch.Tensor, class_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        logits = self.head(features)
        if class_mask is not None:
            logits = logits + (class_mask - 1.0) * MASK_FILL
        return logits, features


def _lenet(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """LeNet-5 style; pads small inputs (8x8 digits) so both 8x8 and 28x28 keep two conv/pool stages."""
    channels, height, width = input_shape
    pad = 2 if min(height, width) < 16 else 0
    trunk = nn.Sequential(
        nn.Conv2d(channels, 6, 5, padding=2 + pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _probe_dim(trunk, input_shape)
    trunk.append(nn.Linear(flat, 120))
    trunk.append(nn.ReLU())
    trunk.append(nn.Linear(120, 84))
    trunk.append(nn.ReLU())
    return trunk, 84


def _cnn1d(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """The 1-D CNN used with MNIST-1D: three strided convolutions over a (channels, length) signal."""
    channels, _ = input_shape
    trunk = nn.Sequential(
        nn.Conv1d(channels, 25, 5, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
    )
    return trunk, _probe_dim(trunk, input_shape)


def _small_cnn(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """Two conv blocks and a hidden layer, the usual small CNN of federated CIFAR experiments."""
    channels = input_shape[0]
    trunk = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    trunk.append(nn.Linear(_probe_dim(trunk, input_shape), 128))
    trunk.append(nn.ReLU())
    return trunk, 128


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm written in elementwise ops. torch exports GroupNorm as InstanceNormalization, for which ONNX
    Runtime Training has no gradient; these ops all have one. Same parameters, same numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.reshape(x.shape[0], self.num_groups, -1)
        mean = grouped.mean(-1, keepdim=True)
        var = (grouped - mean).pow(2).mean(-1, keepdim=True)
        normed = ((grouped - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        affine_shape = (1, -1) + (1,) * (x.dim() - 2)
        return normed * self.weight.reshape(affine_shape) + self.bias.reshape(affine_shape)


def _resnet18_cifar(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """torchvision's ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool).

    BatchNorm is replaced by GroupNorm(2 groups): ORT training artifacts do not update BatchNorm running
    statistics, and batch statistics are known to hurt federated training on non-IID data.
    """
    from torchvision.models import resnet18

    net = resnet18(num_classes=10, norm_layer=lambda c: GroupNorm(2, c))
    net.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    feature_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net, feature_dim


def _mlp(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """Two hidden layers over the flattened input; works for any input shape."""
    trunk = nn.Sequential(
        nn.Flatten(), nn.Linear(prod(input_shape), 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU()
    )
    return trunk, 200


def _uniform_init(trunk: nn.Module, bound: float = 0.5) -> None:
    """U(-bound, bound) for every weight and bias of the trunk (GLFC's encoding network, as its authors' code)."""
    with torch.no_grad():
        for parameter in trunk.parameters():
            parameter.uniform_(-bound, bound)


def _glfc_lenet(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """GLFC's gradient-encoding network Gamma (its authors' code: a LeNet of sigmoid convolutions, 12 channels,
    kernels of 5, strides 2, 2, 1, weights U(-0.5, 0.5), never trained), for any image shape (C, H, W)."""
    trunk = nn.Sequential(
        nn.Conv2d(input_shape[0], 12, 5, stride=2, padding=2), nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, stride=2, padding=2), nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, stride=1, padding=2), nn.Sigmoid(),
        nn.Flatten(),
    )
    _uniform_init(trunk)
    return trunk, _probe_dim(trunk, input_shape)


def _glfc_mlp(input_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """A small Gamma for any input shape (the spec's edge suggestion): one sigmoid layer of 32, U(-0.5, 0.5)."""
    trunk = nn.Sequential(nn.Flatten(), nn.Linear(prod(input_shape), 32), nn.Sigmoid())
    _uniform_init(trunk)
    return trunk, 32


def _probe_dim(trunk: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return int(trunk(torch.zeros(1, *input_shape)).shape[1])


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: how to build the trunk, and the input shape it is usually fed."""

    build_trunk: Callable[[tuple[int, ...]], tuple[nn.Module, int]]
    default_input_shape: tuple[int, ...]
    input_rank: int  # number of non-batch input dimensions the trunk accepts
    summary: str


REGISTRY: dict[str, ModelSpec] = {
    "lenet": ModelSpec(_lenet, (1, 8, 8), 3, "LeNet-style CNN for grey digits (8x8 or 28x28)"),
    "cnn1d": ModelSpec(_cnn1d, (1, 40), 2, "1-D CNN for MNIST-1D signals"),
    "small_cnn": ModelSpec(_small_cnn, (3, 32, 32), 3, "small CNN for 32x32 RGB images"),
    "resnet18_cifar": ModelSpec(
        _resnet18_cifar, (3, 32, 32), 3, "ResNet-18, CIFAR stem, GroupNorm (32x32 RGB)"
    ),
    "mlp": ModelSpec(_mlp, (1, 8, 8), 0, "two-hidden-layer MLP over any flattened input"),
    "glfc_lenet": ModelSpec(_glfc_lenet, (1, 8, 8), 3, "GLFC's fixed gradient-encoding LeNet (sigmoid)"),
    "glfc_mlp": ModelSpec(_glfc_mlp, (1, 8, 8), 0, "a small fixed gradient-encoding network for any input"),
}


def model_fits(name: str, num_classes: int, input_shape: tuple[int, ...]) -> None:
    """ValueError unless the registered model builds for these classes and runs on inputs of this shape."""
    model = build_model(name, num_classes, input_shape, seed=0)
    try:
        with torch.no_grad():
            model(torch.zeros(2, *input_shape))
    except RuntimeError as err:
        raise ValueError(f"model {name!r} does not take inputs of shape {tuple(input_shape)}: "
                         f"{str(err).splitlines()[0]}") from None


def build_model(
    name: str, num_classes: int, input_shape: tuple[int, ...] | None = None, seed: int | None = None
) -> ClassifierModel:
    """Build a registered model; `seed` makes the initial weights reproducible."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    spec = REGISTRY[name]
    shape = tuple(input_shape) if input_shape is not None else spec.default_input_shape
    if spec.input_rank and len(shape) != spec.input_rank:
        raise ValueError(
            f"model {name!r} takes inputs of rank {spec.input_rank} (e.g. {spec.default_input_shape}), "
            f"got {shape}"
        )
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        trunk, feature_dim = spec.build_trunk(shape)
        return ClassifierModel(trunk, feature_dim, num_classes)
