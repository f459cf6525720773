"""Named architectures, and a user's own. Every model splits into a feature trunk and a linear classifier head.

The head is sized to the scenario's total number of classes, so the graph never changes across tasks
(class-incremental learning on a fixed ONNX graph). `forward(x, class_mask)` returns `(logits, features)`:
the features feed importance scoring (Re-Fed's last-layer gradient norm) and the mask hides classes a device
has not seen yet. A mask of ones changes nothing, bit for bit.

A user's own model is named by its import path, `package.module:Name` (`edgefil export --model`, a fleet file's
`model`), with its constructor's keyword arguments (`--model-args`, `model_args`). `Name` is an `nn.Module` class (or
any callable returning one) that maps a batch of inputs to one feature vector per sample, (N, *input_shape) ->
(N, F): the trunk, with parameters and no other state (no BatchNorm running statistics: rounds aggregate
parameters only). It gets `input_shape` too where its signature names that parameter. edgefil puts the linear head
over the run's classes on it, as on every zoo model: class-incremental learning keeps one graph with a head over
every class from the start, and the methods read the features (Re-Fed's importance, GLFC's prototypes, SDD's
statistics). A module that is already a classifier is used by leaving its last layer out.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

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

    # a partial, not a lambda: the export's helper processes take the model pickled (models/portable_export.py)
    net = resnet18(num_classes=10, norm_layer=functools.partial(GroupNorm, 2))
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


IMPORT_PATH = ":"  # what separates a user's module from the model's name in it: "package.module:Name"


def is_import_path(name: str) -> bool:
    """Whether `name` names a user's model (`package.module:Name`) rather than one of the zoo's."""
    return IMPORT_PATH in name


def model_fits(name: str, num_classes: int, input_shape: tuple[int, ...], args: Mapping[str, Any] | None = None
               ) -> None:
    """ValueError unless the model builds for these classes and runs on inputs of this shape."""
    model = build_model(name, num_classes, input_shape, seed=0, args=args)
    try:
        with torch.no_grad():
            model(torch.zeros(2, *input_shape))
    except RuntimeError as err:
        raise ValueError(f"model {name!r} does not take inputs of shape {tuple(input_shape)}: "
                         f"{str(err).splitlines()[0]}") from None


def build_model(
    name: str, num_classes: int, input_shape: tuple[int, ...] | None = None, seed: int | None = None,
    args: Mapping[str, Any] | None = None,
) -> ClassifierModel:
    """Build a zoo model, or a user's (`package.module:Name` with its constructor's keyword `args`); `seed` makes
    the initial weights reproducible. ValueError in one line for what cannot be built."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if is_import_path(name):
        if input_shape is None:
            raise ValueError(f"model {name!r}: a model of your own needs its input shape (--input-shape)")
        shape = tuple(input_shape)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            trunk, feature_dim = _user_trunk(name, shape, dict(args or {}))
            return ClassifierModel(trunk, feature_dim, num_classes)
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}, or one of your own "
                         f"as package.module:Name")
    if args:
        raise ValueError(f"model {name!r} takes no arguments (got {', '.join(sorted(args))}): the zoo's models are "
                         f"built for their input shape alone")
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


def build_for(manifest: Any, seed: int | None = None) -> ClassifierModel:
    """The torch model of an artifact set (a `models.manifest.Manifest`): its model, classes, input shape and
    model arguments."""
    return build_model(manifest.model, manifest.num_classes, tuple(manifest.input_shape), seed=seed,
                       args=manifest.model_args)


def model_source_digest(name: str) -> str | None:
    """The sha256 of the file that defines a user's model (None for the zoo's): an export cache key includes it,
    so that a model edited since is exported anew."""
    if not is_import_path(name):
        return None
    source = inspect.getsourcefile(_user_factory(name))
    return hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else None


def _user_factory(name: str) -> Callable[..., Any]:
    """What `package.module:Name` names, imported; ValueError in one line for a path that names nothing."""
    module_name, _, attribute = name.partition(IMPORT_PATH)
    if not module_name or not attribute:
        raise ValueError(f"model {name!r}: name your own model as package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 (the user's module may raise anything while importing)
        raise ValueError(f"model {name!r}: cannot import {module_name} ({type(err).__name__}: {err}); is its "
                         f"folder on PYTHONPATH?") from None
    factory: Any = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model {name!r}: {module_name} has no {attribute}")
    if not callable(factory):
        raise ValueError(f"model {name!r}: {attribute} is not a class or a function that makes an nn.Module")
    return factory


def _user_trunk(name: str, shape: tuple[int, ...], args: dict[str, Any]) -> tuple[nn.Module, int]:
    """A user's trunk and its feature size, checked on a batch of zeros of `shape`."""
    factory = _user_factory(name)
    try:
        wants_shape = "input_shape" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        wants_shape = False
    if wants_shape and "input_shape" not in args:
        args = {**args, "input_shape": shape}
    try:
        trunk = factory(**args)
    except TypeError as err:
        raise ValueError(f"model {name!r}: its constructor refused the arguments {sorted(args)}: {err}") from None
    if not isinstance(trunk, nn.Module):
        raise ValueError(f"model {name!r}: made a {type(trunk).__name__}, not a torch nn.Module")
    buffers = [n for n, _ in trunk.named_buffers()]
    if buffers:  # a device trains and sends its parameters only: state beside them would never be aggregated
        raise ValueError(f"model {name!r} keeps state that is not a parameter ({', '.join(buffers[:3])}"
                         f"{', ...' if len(buffers) > 3 else ''}: BatchNorm's running statistics?), which federated "
                         f"rounds neither train nor aggregate: use GroupNorm or LayerNorm")
    try:
        with torch.no_grad():
            out = trunk(torch.zeros(2, *shape))
    except Exception as err:  # noqa: BLE001 (the user's forward may raise anything)
        raise ValueError(f"model {name!r} does not take inputs of shape {shape}: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 2:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {name!r} returned {got} for a batch of 2: it must return one feature vector per "
                         f"sample, (N, F) (end it with nn.Flatten(); edgefil adds the classifier head)")
    return trunk, int(out.shape[1])
