"""Export class-generator artifacts (host side: torch, onnx, onnxruntime-training).

`sampler.onnx` takes the latent `z` (N, latent) and the sampler's flat buffer `weights` (`flatten_module` order)
and returns `x` (N, *input_shape): the graph slices its weights out of that input, so one file serves every class
of a spec (a device keeps one sampler per class as a flat buffer in its bank, not one ONNX file each).
BatchNorm runs in eval mode, on the running statistics stored in the buffer.

For kind "vae" the folder also holds ONNX Runtime Training artifacts for the whole VAE (encoder and decoder
trainable): `training_model.onnx` and `eval_model.onnx` (inputs `input`, `eps`; outputs the loss), the AdamW
`optimizer_adamw.onnx` (PyTorch mode, no weight decay, like the task model's) and a full `checkpoint` holding
the seeded initial weights. The loss is an onnxblock custom block over the torch graph's outputs (recon, mu,
logvar, exp(logvar)) and its `input`, equal to `models.generators.vae_loss`:
    D * mean((recon - input)^2) + 0.5 * L * mean(mu^2 + exp(logvar) - logvar - 1)
with D values per sample and L latent dimensions: a mean over all elements times the per-sample element count is
the per-sample sum averaged over the batch, without the batch size as a graph value.

WGAN-GP gets no training artifacts. Its critic loss carries a gradient penalty, the norm of dD/dx at points
between real and fake samples: training it needs the gradient of that gradient (double backward), and ORT's
training graph builder differentiates a forward graph once — it cannot take a gradient graph as its input. WGAN
training also alternates two optimisers over two parameter sets (n_critic critic steps per generator step, each
loss through the other network), while an ORT artifact set has one loss and one optimizer over one parameter
set. WGAN-GP generators are trained with torch (`edge_client.generators.torch_training`).

generator.json (`models.generator_artifacts`) records the spec, the sampler and auxiliary buffer sizes,
the ORT buffer layout and the sha256 of every file. Artifacts are deterministic given the spec and the seed.
"""
from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import onnx
import torch
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.onnxblock import _graph_utils
from torch import nn
from torch.nn import functional as F

from models.export import OPSET, native_stderr_captured, ort_flat_order, readable_by_devices, use_torch_adamw
from models.generator_artifacts import GENERATOR_JSON, SAMPLER_MODEL, GeneratorArtifacts, OrtSegment
from models.generator_kinds import VAE_KINDS
from models.generators import (
    GeneratorSpec,
    VaeGraph,
    auxiliary_size,
    build_auxiliary,
    build_sampler,
    flat_entries,
    sampler_size,
)
from models.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    OPTIMIZER_MODELS,
    TRAINING_MODEL,
    ManifestError,
    sha256_file,
)

ADAMW_MODEL = OPTIMIZER_MODELS["adamw"]


class FlatWeightsSampler(nn.Module):
    """forward(z, weights) -> x: the sampler in eval mode, its parameters and buffers sliced out of one flat input.

    Layer by layer through torch.nn.functional (`torch.func.functional_call` cannot be traced for export); the
    sampler itself is held in a plain list so that its weights do not become initializers of the graph."""

    def __init__(self, sampler: nn.Module) -> None:
        super().__init__()
        self._layers = [(layer, [(name, tuple(value.shape)) for name, value in flat_entries(layer)])
                        for layer in sampler.children()]

    def forward(self, z: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, offset = z, 0
        for layer, entries in self._layers:
            tensors = {}
            for name, shape in entries:
                tensors[name] = weights[offset : offset + math.prod(shape)].reshape(shape)
                offset += math.prod(shape)
            x = _apply(layer, x, tensors)
        return x


def _apply(layer: nn.Module, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    if not p:
        return layer(x)
    if isinstance(layer, nn.Linear):
        return F.linear(x, p["weight"], p["bias"])
    if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return F.batch_norm(x, p["running_mean"], p["running_var"], p["weight"], p["bias"], False, 0.0, layer.eps)
    if isinstance(layer, (nn.ConvTranspose1d, nn.ConvTranspose2d)):
        conv = F.conv_transpose1d if isinstance(layer, nn.ConvTranspose1d) else F.conv_transpose2d
        return conv(x, p["weight"], p["bias"], layer.stride, layer.padding,  # type: ignore[arg-type]
                    layer.output_padding, layer.groups, layer.dilation)
    if isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        convolve = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
        return convolve(x, p["weight"], p["bias"], layer.stride, layer.padding,
                        layer.dilation, layer.groups)
    raise TypeError(f"no functional form for {type(layer).__name__}")


def export_generator_artifacts(spec: GeneratorSpec, out_dir: str | Path, seed: int = 0) -> Path:
    """Write sampler.onnx (+ the VAE's training artifacts) and generator.json to `out_dir`; return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sampler = build_sampler(spec, seed)
    auxiliary = build_auxiliary(spec, seed + 1)
    _export_sampler(spec, sampler, out_dir / SAMPLER_MODEL)
    layout: tuple[OrtSegment, ...] = ()
    if spec.kind in VAE_KINDS:
        layout = _export_vae_training(spec, VaeGraph(sampler, auxiliary), out_dir)
    names = [SAMPLER_MODEL] + ([TRAINING_MODEL, EVAL_MODEL, ADAMW_MODEL, CHECKPOINT] if layout else [])
    info = GeneratorArtifacts(
        spec=spec.to_dict(), sampler_size=sampler_size(spec), auxiliary_size=auxiliary_size(spec), opset=OPSET,
        ir_version=onnx.load(str(out_dir / SAMPLER_MODEL), load_external_data=False).ir_version,
        ort_layout=layout, files={name: sha256_file(out_dir / name) for name in names},
    )
    (out_dir / GENERATOR_JSON).write_text(info.to_json())
    return out_dir


def _export(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str], outputs: list[str],
            batched: list[str], training: bool) -> onnx.ModelProto:
    torch.onnx.export(
        module, args, str(path), input_names=inputs, output_names=outputs,
        dynamic_axes={name: {0: "batch"} for name in batched}, opset_version=OPSET,
        training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL,
        do_constant_folding=False, export_params=True, dynamo=False,
    )
    model = onnx.load(str(path))
    stamped = model.ir_version
    if readable_by_devices(model).ir_version != stamped:  # the file is what a device loads
        onnx.save(model, str(path))
    return model


def _export_sampler(spec: GeneratorSpec, sampler: nn.Module, path: Path) -> None:
    flat = torch.cat([v.detach().reshape(-1) for _, v in flat_entries(sampler)])
    _export(FlatWeightsSampler(sampler), (torch.zeros(2, spec.latent_dim), flat), path, ["z", "weights"], ["x"],
            ["z", "x"], training=False)


class _VaeLoss(onnxblock.Block):
    """The VAE loss over the training graph's outputs (see the module docstring); built from onnxblock's
    elementwise blocks, which ORT differentiates."""

    def __init__(self, sample_values: int, latent_dim: int) -> None:
        super().__init__()
        self._sample_values = float(sample_values)
        self._latent_dim = float(latent_dim)

    def build(self, recon: str, mu: str, logvar: str, var: str) -> str:
        b = onnxblock.blocks
        squared = b.Pow(2.0)(b.Sub()(recon, "input"))
        reconstruction = b.Mul()(b.Constant(self._sample_values)(), b.ReduceMean(keepdims=False)(squared))
        kl_terms = b.Sub()(b.Sub()(b.Add()(b.Pow(2.0)(mu), var), logvar), b.Constant(1.0)())
        kl = b.Mul()(b.Constant(0.5 * self._latent_dim)(), b.ReduceMean(keepdims=False)(kl_terms))
        return b.ReduceSum(keepdims=False)(b.Add()(reconstruction, kl))  # shape [1] -> a scalar loss


def _export_vae_training(spec: GeneratorSpec, graph: VaeGraph, out_dir: Path) -> tuple[OrtSegment, ...]:
    example = (torch.zeros(2, *spec.input_shape), torch.zeros(2, spec.latent_dim))
    with tempfile.TemporaryDirectory(prefix="edgefil-generator-") as tmp:
        tmp_dir = Path(tmp)
        base = _export(graph, example, tmp_dir / "vae.onnx", ["input", "eps"], ["recon", "mu", "logvar", "var"],
                       ["input", "eps", "recon", "mu", "logvar", "var"], training=True)
        trainable = [p.name for p in base.graph.initializer if p.name in dict(graph.named_parameters())]
        _graph_utils._GRAPH_TOKEN = 0  # onnxblock names nodes from a process-wide counter: restart it
        with native_stderr_captured():
            artifacts.generate_artifacts(
                base, requires_grad=trainable, loss=_VaeLoss(math.prod(spec.input_shape), spec.latent_dim),
                optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_dir, nominal_checkpoint=False,
            )
        optimizer = onnx.load(str(tmp_dir / "optimizer_model.onnx"))
        use_torch_adamw(optimizer)
        onnx.save(readable_by_devices(optimizer), str(out_dir / ADAMW_MODEL))
        order = ort_flat_order(graph, tmp_dir)
        for name in (TRAINING_MODEL, EVAL_MODEL, CHECKPOINT):
            shutil.move(tmp_dir / name, out_dir / name)
    offsets = {}
    for part in ("sampler", "auxiliary"):
        offset = 0
        for name, value in flat_entries(getattr(graph, part)):
            offsets[f"{part}.{name}"] = (part, offset)
            offset += value.numel()
    if {p.name for p in order} != set(offsets):
        raise ManifestError("the VAE's ORT parameters are not exactly the sampler's and the encoder's entries")
    return tuple(OrtSegment(p.name, p.shape, *offsets[p.name]) for p in order)
