"""The backward-op translations (models/onnx_backward.py), op by op against torch's autograd.

Each case traces a convolution or a max-pool and its gradients w.r.t. every input into ATen ops, exports them the
way the portable training graphs are exported, runs the graph on ONNX Runtime at two batch sizes (the batch is
dynamic), and compares the values and the gradients with torch's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import grad
from torch.nn import functional as F

from edge_client.trainers.ort_capi import ORT
from models import onnx_backward
from models.portable_export import _export_graph


class ConvGradients(torch.nn.Module):
    """(y, dL/dx, dL/dw, dL/db) of L = sum(conv(x, w, b) * upstream)."""

    def __init__(self, stride, padding, dilation, groups):
        super().__init__()
        self.options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)

    def conv(self, x, w, b):
        op = F.conv1d if x.dim() == 3 else F.conv2d
        return op(x, w, b, **self.options)

    def forward(self, x, w, b, upstream):
        def loss(x, w, b):
            return (self.conv(x, w, b) * upstream).sum()

        gx, gw, gb = grad(loss, argnums=(0, 1, 2))(x, w, b)
        return self.conv(x, w, b), gx, gw, gb


class PoolGradients(torch.nn.Module):
    def __init__(self, kernel, stride, padding):
        super().__init__()
        self.options = dict(kernel_size=kernel, stride=stride, padding=padding)

    def forward(self, x, upstream):
        def loss(x):
            return (F.max_pool2d(x, **self.options) * upstream).sum()

        return F.max_pool2d(x, **self.options), grad(loss)(x)


def _run(module, make_inputs, names, outputs, batched, path):
    """Export with the batch of `make_inputs(17)` (a size no other dimension has: the tracer would tie them), run
    at batches 2 and 5, compare with torch."""
    _export_graph(module, make_inputs(17), names, outputs, batched, True, path)
    session = ORT.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (2, 5):
        inputs = make_inputs(n)
        expected = [t.detach().numpy() for t in module(*inputs)]
        got = session.run(None, {name: t.numpy() for name, t in zip(names, inputs)})
        for name, e, g in zip(outputs, expected, got):
            assert g.shape == e.shape, name
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(e).max()), err_msg=name)


CONV_CASES = [  # (input size without batch, out channels, kernel, stride, padding, dilation, groups)
    ((3, 9, 7), 4, (3, 3), 1, 1, 1, 1),
    ((3, 9, 8), 4, (3, 3), 2, 0, 1, 1),  # stride 2 over even and odd sizes: the output padding differs
    ((2, 11, 10), 3, (3, 3), 2, 2, 2, 1),  # dilation
    ((4, 8, 8), 6, (3, 3), 1, 1, 1, 2),  # groups
    ((1, 12, 12), 6, (5, 5), 3, 2, 1, 1),  # LeNet's kernel, stride 3
    ((2, 10, 9), 3, (3, 2), (2, 1), (1, 0), 1, 1),  # non-square kernel, per-dimension stride and padding
    ((1, 40), 5, (5,), 2, 1, 1, 1),  # cnn1d's first layer
    ((25, 11), 25, (3,), 2, 1, 1, 1),  # cnn1d's later layers
    ((4, 13), 4, (3,), 1, 2, 2, 4),  # 1-D, dilated, depthwise
]


@pytest.mark.parametrize("shape, c_out, kernel, stride, padding, dilation, groups, by_convolution", [
    pytest.param(*case, by_convolution, id=f"{i}-{'convolution' if by_convolution else 'patches'}")
    for i, case in enumerate(CONV_CASES) for by_convolution in (False, True) if case[-1] == 1 or by_convolution
])
def test_convolution_backward_matches_autograd(shape, c_out, kernel, stride, padding, dilation, groups,
                                               by_convolution, tmp_path, monkeypatch):
    """Each case with its weight gradient made either way the export may choose (a grouped one has one way)."""
    monkeypatch.setattr(onnx_backward, "weight_gradient_by_convolution", lambda *shapes: by_convolution)
    module = ConvGradients(stride, padding, dilation, groups)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(c_out, shape[0] // groups, *kernel, generator=gen)
    bias = torch.randn(c_out, generator=gen)
    out_shape = module.conv(torch.zeros(1, *shape), weight, bias).shape[1:]

    def inputs(n):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, *shape, generator=g), weight, bias, torch.randn(n, *out_shape, generator=g)

    _run(module, inputs, ("x", "w", "b", "upstream"), ("y", "gx", "gw", "gb"), (0, 3), tmp_path / "conv.onnx")


def test_a_small_plain_layer_s_weight_gradient_is_one_convolution_a_large_strided_or_dilated_one_by_patches():
    """The export's choice (measured: models/onnx_backward.py), on the zoo's layers and past its bounds."""
    by_convolution = onnx_backward.weight_gradient_by_convolution
    assert by_convolution(1, 6, [12, 12], [1, 1], [1, 1]) and by_convolution(6, 16, [6, 6], [1, 1], [1, 1])  # LeNet
    assert by_convolution(6, 16, [10, 10], [1, 1], [1, 1])  # LeNet's second layer on 28x28 images
    assert not by_convolution(1, 6, [28, 28], [1, 1], [1, 1])  # its first: little work, but 784 positions
    assert not by_convolution(32, 64, [16, 16], [1, 1], [1, 1])  # small_cnn's second layer
    assert not by_convolution(1, 25, [20], [2], [1]) and not by_convolution(25, 25, [5], [2], [1])  # cnn1d: strided
    assert not by_convolution(2, 3, [5, 5], [1, 1], [2, 2])  # dilated


@pytest.mark.parametrize("size, kernel, stride, padding", [
    ((3, 8, 8), 2, 2, 0),  # LeNet's and small_cnn's pooling: tiled windows (ArgMax indices, MaxUnpool)
    ((2, 9, 7), (3, 2), (3, 2), 0),  # tiled, non-square, sizes the windows do not divide (floor mode)
    ((2, 9, 9), 2, 3, 0),  # windows apart: gaps between them, MaxUnpool without ArgMax
    ((2, 9, 9), 3, 2, 1),  # overlapping windows with padding: gradients add up where windows share a maximum
    ((2, 7, 6), 2, 1, 0),  # stride 1
    ((1, 9, 7), (3, 2), (2, 1), (1, 0)),  # per-dimension kernel, stride and padding
])
def test_max_pool_backward_matches_autograd(size, kernel, stride, padding, tmp_path):
    module = PoolGradients(kernel, stride, padding)
    out_shape = F.max_pool2d(torch.zeros(1, *size), kernel, stride, padding).shape[1:]

    def inputs(n):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, *size, generator=g)
        x[:, 0, :4, :4] = 1.0  # ties in the first windows: torch takes each window's first maximum
        return x, torch.randn(n, *out_shape, generator=g)

    _run(module, inputs, ("x", "upstream"), ("y", "gx"), (0, 1), tmp_path / "pool.onnx")


class ThresholdGradients(torch.nn.Module):
    """(y, dL/dx) of L = sum(threshold(x) * upstream): ReLU at threshold 0."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold

    def act(self, x):
        return F.relu(x) if self.threshold == 0 else F.threshold(x, self.threshold, 0.0)

    def forward(self, x, upstream):
        return self.act(x), grad(lambda x: (self.act(x) * upstream).sum())(x)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_threshold_backward_matches_autograd(threshold, tmp_path):
    def inputs(n):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 3, 5, generator=g)
        x[:, 0, :2] = threshold  # at the threshold exactly: inactive, as in torch
        return x, torch.randn(n, 3, 5, generator=g)

    _run(ThresholdGradients(threshold), inputs, ("x", "upstream"), ("y", "gx"), (0, 1), tmp_path / "relu.onnx")
