"""Standard-op ONNX translations for the ATen ops a traced training step holds that torch's ONNX exporter lacks.

A training step traced into core ATen ops (`models/portable_export.py`) keeps two backward ops whole:
`convolution_backward` and `max_pool2d_with_indices_backward`. torch's exporter has no translation for either;
these are written once here, in ONNX opset 18 ops every ONNX Runtime build runs, with two that replace slow stock
translations, and tested op by op against torch's autograd (tests/test_onnx_backward.py):

- `convolution_backward` (1-D and 2-D, any stride, padding, dilation and groups):
  grad_input = ConvTranspose(grad_output, weight) with the output padding that restores the input's size;
  grad_weight = one convolution of the input, batch and channels swapped, by grad_output used as the kernel
  (batch as channels; stride and dilation trade places), cropped to the kernel size, for a grouped layer and a
  small one (`weight_gradient_by_convolution`: fewer nodes, each a fixed cost); else per kernel position, one
  MatMul of grad_output by a strided Slice of the channels-last input; grad_bias = ReduceSum.
- `max_pool2d_with_indices` is translated too, so that its indices are flat over the whole tensor (ONNX's
  convention) instead of torch's per-plane ones, and only the backward below reads them. Tiled pooling (kernel ==
  stride, no padding, no dilation: every zoo model's) takes the maximum with the fast MaxPool and finds each
  window's first maximum, as torch does, with one ArgMax over the windows laid out side by side; ONNX Runtime's
  MaxPool that also returns indices runs a slow generic kernel (~8x the plain one on LeNet's shapes). Other
  pooling uses that MaxPool. The backward puts grad_output back at those indices: MaxUnpool where windows do not
  overlap (each input has one window), else ScatterElements with reduction add into zeros, so gradients of
  overlapping windows that share a maximum add up as in torch.
- `threshold_backward` (ReLU's backward) is kept whole when tracing and becomes a product with a 0/1 mask instead
  of the decomposition's Where (see the function for the speed and the one difference).

Each function is traced by onnxscript: it receives the node's inputs as graph values (static shapes everywhere
but the batch) and its ATen arguments as Python values.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from onnxscript import opset18

op: Any = opset18  # traced, not type-checked: onnxscript's per-op type stubs do not follow values built here


def _per_dim(values: Sequence[int], rank: int) -> list[int]:
    values = [int(v) for v in values]
    return values * rank if len(values) == 1 else values


def _unused() -> Any:
    """A placeholder for an output the node's output_mask says nobody reads (the exporter needs a value)."""
    return op.Constant(value_float=0.0)


def convolution_backward(
    grad_output: Any, input: Any, weight: Any, bias_sizes: Sequence[int] | None, stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
    groups: int, output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    """aten.convolution_backward for a forward (not transposed) 1-D or 2-D convolution."""
    if transposed:
        raise NotImplementedError("convolution_backward of a transposed convolution has no translation")
    rank = len(weight.shape) - 2
    stride, padding, dilation = (_per_dim(v, rank) for v in (stride, padding, dilation))
    kernel = [int(d) for d in weight.shape[2:]]
    size_in, size_out = [int(d) for d in input.shape[2:]], [int(d) for d in grad_output.shape[2:]]
    spatial = list(range(2, rank + 2))
    grad_input = grad_weight = grad_bias = _unused()
    if output_mask[0]:
        # A strided convolution maps several input sizes to one output size: pad the transposed one back.
        restored = [(size_out[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1
                    for i in range(rank)]
        grad_input = op.ConvTranspose(
            grad_output, weight, strides=stride, pads=[*padding, *padding], dilations=dilation,
            output_padding=[size_in[i] - restored[i] for i in range(rank)], group=groups,
        )
    if output_mask[1]:
        c_in, c_out = int(input.shape[1]), int(grad_output.shape[1])
        if groups == 1 and not weight_gradient_by_convolution(c_in, c_out, size_out, stride, dilation):
            grad_weight = _weight_gradient_by_patches(grad_output, input, kernel, stride, padding, dilation)
        else:
            grad_weight = _weight_gradient_by_convolution(grad_output, input, kernel, stride, padding, dilation,
                                                          groups)
    if output_mask[2]:
        grad_bias = op.ReduceSum(grad_output, op.Constant(value_ints=[0, *spatial]), keepdims=0)
    return grad_input, grad_weight, grad_bias


# A layer's weight gradient is made as one convolution (below) where its output has at most this many positions a
# sample and its work a sample and kernel position (c_in * c_out * output positions multiply-adds) is at most this
# much; by matrix products per kernel position otherwise. The products cost a few nodes per kernel position (Slice,
# Reshape, MatMul, Unsqueeze), each a few microseconds of ONNX Runtime's dispatch whatever its size; the convolution
# costs four nodes, but ONNX Runtime runs its kernel, as large as the output, slower than those products as the
# output and the work grow. Measured on the zoo's layers, the fused step of each way alternated in one process
# (docs/results.md, "The weight gradient of a small convolution as one convolution"): LeNet's two layers on 8x8
# digits (144 and 36 positions; 864 and 3,456 multiply-adds) and its second on 28x28 images (100; 9,600) step
# faster by convolution (1.51x and 1.14x at one sample, 1.25x and 1.06x at seven, level at 32 and 64); with its
# first on 28x28 images (784 positions) by convolution too, the step is 0.94x and 0.93x at 32 and 64 samples;
# small_cnn's second (256; 524,288) 0.84-0.89x at 1, 7 and 32. The bounds lie between what gained and what lost.
CONVOLUTION_MAX_POSITIONS = 256
CONVOLUTION_MAX_WORK = 16384


def weight_gradient_by_convolution(c_in: int, c_out: int, size_out: list[int], stride: list[int],
                                   dilation: list[int]) -> bool:
    """Whether an ungrouped convolution's weight gradient is made as one convolution over the batch rather than by
    patches: a small layer (CONVOLUTION_MAX_POSITIONS, CONVOLUTION_MAX_WORK) neither strided nor dilated (a strided
    one's convolution is dilated by its stride, which ONNX Runtime runs slower: cnn1d's strided layers step
    0.83-0.95x by it). Shapes only, never the batch (dynamic in the graph): one graph at every batch size."""
    positions = math.prod(size_out)
    plain = all(s == 1 for s in stride) and all(d == 1 for d in dilation)
    return plain and positions <= CONVOLUTION_MAX_POSITIONS and c_in * c_out * positions <= CONVOLUTION_MAX_WORK


def _weight_gradient_by_convolution(grad_output: Any, input: Any, kernel: list[int], stride: list[int],
                                    padding: list[int], dilation: list[int], groups: int) -> Any:
    """grad_weight as one convolution over the batch: the input with batch and channels swapped, convolved by
    grad_output used as the kernel (batch as channels; stride and dilation trade places), cropped to the kernel size.
    With groups, each group's output channels read that group's N input channels. Four nodes (six with groups)."""
    rank = len(kernel)
    spatial = list(range(2, rank + 2))
    size_in = [int(d) for d in input.shape[2:]]
    c_in, g = int(input.shape[1]), int(groups)
    if g == 1:
        x = op.Transpose(input, perm=[1, 0, *spatial])  # (N, Cin, *) -> (Cin, N, *)
    else:  # (N, Cin, *) -> (N, G, Cin/G, *) -> (Cin/G, G, N, *) -> (Cin/G, G*N, *): channel g*N + n of group g
        x = op.Reshape(input, op.Constant(value_ints=[-1, g, c_in // g, *size_in]))
        x = op.Transpose(x, perm=[2, 1, 0, *range(3, rank + 3)])
        x = op.Reshape(x, op.Constant(value_ints=[c_in // g, -1, *size_in]))
    kernel_from_grad = op.Transpose(grad_output, perm=[1, 0, *spatial])  # (N, Cout, *) -> (Cout, N, *)
    full = op.Conv(x, kernel_from_grad, strides=dilation, dilations=stride, pads=[*padding, *padding], group=g)
    cropped = op.Slice(full, op.Constant(value_ints=[0] * rank), op.Constant(value_ints=kernel),
                       op.Constant(value_ints=spatial))
    return op.Transpose(cropped, perm=[1, 0, *spatial])


def _weight_gradient_by_patches(grad_output: Any, input: Any, kernel: list[int], stride: list[int],
                                padding: list[int], dilation: list[int]) -> Any:
    """grad_weight of an ungrouped convolution as matrix products, one per kernel position:
    (Cout, N*out) x (N*out, Cin), the right factor a strided Slice of the padded, channels-last input (contiguous
    as sliced, so no patch matrix is ever assembled). A large layer's way: the convolution above needs a kernel as
    large as the output, which ONNX Runtime runs slower as the layer grows (CONVOLUTION_MAX_WORK)."""
    rank = len(kernel)
    spatial = list(range(1, rank + 1))
    c_in, c_out = int(input.shape[1]), int(grad_output.shape[1])
    size_out = [int(d) for d in grad_output.shape[2:]]
    x = input
    if any(padding):
        x = op.Pad(x, op.Constant(value_ints=[0, 0, *padding, 0, 0, *padding]))
    x = op.Transpose(x, perm=[0, *range(2, rank + 2), 1])
    rows = op.Reshape(op.Transpose(grad_output, perm=[1, 0, *range(2, rank + 2)]),
                      op.Constant(value_ints=[c_out, -1]))
    to_matrix, leading = op.Constant(value_ints=[-1, c_in]), op.Constant(value_ints=[0])
    products = []
    for position in itertools.product(*(range(k) for k in kernel)):
        starts = [p * d for p, d in zip(position, dilation)]
        ends = [start + s * (n - 1) + 1 for start, s, n in zip(starts, stride, size_out)]
        patch = op.Slice(x, op.Constant(value_ints=starts), op.Constant(value_ints=ends),
                         op.Constant(value_ints=spatial), op.Constant(value_ints=stride))
        products.append(op.Unsqueeze(op.MatMul(rows, op.Reshape(patch, to_matrix)), leading))
    stacked = op.Concat(*products, axis=0) if len(products) > 1 else products[0]  # (kernel positions, Cout, Cin)
    grad = op.Transpose(stacked, perm=[1, 2, 0])
    return op.Reshape(grad, op.Constant(value_ints=[c_out, c_in, *kernel]))


def max_pool2d_with_indices(
    self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0, 0),
    dilation: Sequence[int] = (1, 1), ceil_mode: bool = False,
) -> tuple[Any, Any]:
    """aten.max_pool2d_with_indices with indices flat over N*C*H*W, which only the backward below reads."""
    kernel = _per_dim(kernel_size, 2)
    strides = _per_dim(stride, 2) if len(stride) else kernel
    pads, dilations = _per_dim(padding, 2), _per_dim(dilation, 2)
    if strides == kernel and pads == [0, 0] and dilations == [1, 1] and not ceil_mode:
        return _tiled_max_pool(self, kernel)
    return op.MaxPool(self, kernel_shape=kernel, strides=strides, pads=[*pads, *pads], dilations=dilations,
                      ceil_mode=int(ceil_mode))


def _tiled_max_pool(self: Any, kernel: list[int]) -> tuple[Any, Any]:
    """Non-overlapping k_h x k_w windows: the plain MaxPool for the values; for the indices, the windows' elements
    side by side in row-major order, ArgMax (its first maximum, torch's tie rule) and a table from position in
    the window to offset in the plane, plus each window's origin and each sample's start."""
    (kh, kw), (c, h, w) = kernel, [int(d) for d in self.shape[1:]]
    oh, ow = h // kh, w // kw
    x = self
    if (oh * kh, ow * kw) != (h, w):  # floor mode drops the rows and columns no window covers
        x = op.Slice(x, op.Constant(value_ints=[0, 0]), op.Constant(value_ints=[oh * kh, ow * kw]),
                     op.Constant(value_ints=[2, 3]))
    windows = op.Reshape(x, op.Constant(value_ints=[-1, c, oh, kh, ow, kw]))
    windows = op.Transpose(windows, perm=[0, 1, 2, 4, 3, 5])
    position = op.ArgMax(op.Reshape(windows, op.Constant(value_ints=[-1, c, oh, ow, kh * kw])), axis=-1,
                         keepdims=0)
    in_window = op.Gather(op.Constant(value_ints=[a * w + b for a in range(kh) for b in range(kw)]), position)
    origins = op.Constant(value_ints=[ci * h * w + i * kh * w + j * kw
                                      for ci in range(c) for i in range(oh) for j in range(ow)])
    batch = op.Shape(self, start=0, end=1)
    sample_start = op.Mul(op.Range(op.Constant(value_int=0), op.Squeeze(batch), op.Constant(value_int=1)),
                          op.Constant(value_int=c * h * w))
    sample_start = op.Reshape(sample_start, op.Constant(value_ints=[-1, 1, 1, 1]))
    origins = op.Reshape(origins, op.Constant(value_ints=[c, oh, ow]))
    indices = op.Add(op.Add(in_window, origins), sample_start)
    values, _ = op.MaxPool(self, kernel_shape=kernel, strides=kernel)
    return values, indices


def max_pool2d_with_indices_backward(
    grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], ceil_mode: bool, indices: Any,
) -> Any:
    """grad_output put back at the flat indices of the pooled input: MaxUnpool where windows do not overlap,
    else a scatter-add into zeros."""
    kernel = _per_dim(kernel_size, 2)
    strides = _per_dim(stride, 2) if len(stride) else kernel
    spans = [d * (k - 1) + 1 for d, k in zip(_per_dim(dilation, 2), kernel)]
    if all(span <= s for span, s in zip(spans, strides)):
        return op.MaxUnpool(grad_output, indices, op.Shape(self), kernel_shape=kernel, strides=strides)
    flat = op.Constant(value_ints=[-1])
    zeros = op.Reshape(op.ConstantOfShape(op.Shape(self)), flat)
    summed = op.ScatterElements(zeros, op.Reshape(indices, flat), op.Reshape(grad_output, flat), axis=0,
                                reduction="add")
    return op.Reshape(summed, op.Shape(self))


def threshold_backward(grad_output: Any, self: Any, threshold: float) -> Any:
    """aten.threshold_backward (ReLU's backward): grad_output where self > threshold, else 0, as a product with
    the 0/1 mask. The decomposition's Where runs ~7x slower than Greater, Cast and Mul together in ONNX Runtime
    (1M elements: 5.7 ms against 0.8 ms), a tenth of small_cnn's step. The product differs from Where only where
    grad_output is NaN or infinite at an inactive unit (0 * inf is NaN, not 0)."""
    mask = op.Cast(op.Greater(self, op.CastLike(op.Constant(value_float=float(threshold)), self)), to=1)
    return op.Mul(grad_output, op.CastLike(mask, grad_output))


TRANSLATIONS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.convolution_backward.default: convolution_backward,
    torch.ops.aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
    torch.ops.aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
    torch.ops.aten.threshold_backward.default: threshold_backward,
}
KEPT_WHOLE = (torch.ops.aten.threshold_backward.default,)  # translated above, so not decomposed when traced
