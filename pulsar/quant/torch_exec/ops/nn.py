"""Neural-network layers and the everyday ops: convolution, matrix products, pooling, normalization,
activations, and the shape ops every CNN / transformer carries."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, OpFn, Tensor, _x, onnx_pads, op, torch_pads

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@op("Conv")
def conv(c: Call) -> list[Tensor]:
    x, w = _x(c), _x(c, 1)
    b = c.inputs[2] if len(c.inputs) > 2 else None
    spatial = w.dim() - 2
    pads = onnx_pads(c, x, list(w.shape[2:]))
    padding: list[int] = pads[:spatial]
    if pads[:spatial] != pads[spatial:]:  # asymmetric: padded apart (symmetric pads cost no copy)
        x = F.pad(x, torch_pads(pads))
        padding = [0] * spatial
    return [_CONV[spatial](x, w, b, stride=c.attr("strides", [1] * spatial), padding=padding,
                           dilation=c.attr("dilations", [1] * spatial), groups=c.attr("group", 1))]


@op("Gemm")
def gemm(c: Call) -> list[Tensor]:
    a, b = _x(c), _x(c, 1)
    a = a.t() if c.attr("transA", 0) else a
    b = b.t() if c.attr("transB", 0) else b
    y = c.attr("alpha", 1.0) * (a @ b)
    if len(c.inputs) > 2 and c.inputs[2] is not None:
        y = y + c.attr("beta", 1.0) * c.inputs[2]
    return [y]


@op("MatMul")
def matmul(c: Call) -> list[Tensor]:
    return [torch.matmul(_x(c), _x(c, 1))]


class _Sqrt(torch.autograd.Function):
    """sqrt, whose gradient at 0 is 0 instead of infinity: a magnitude sqrt(re^2 + im^2) of a silent
    input (an STFT of a quiet chunk, more often exactly 0 once quantized) would otherwise turn every
    gradient upstream into NaN (inf x 0)."""

    generate_vmap_rule = True  # runs under torch.func.vmap (blocks written for one sample)

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.sqrt(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch.where(y > 0, g * 0.5 / torch.where(y > 0, y, torch.ones_like(y)), torch.zeros_like(g))


def _sqrt(x: Tensor) -> Tensor:
    out: Tensor = _Sqrt.apply(x)  # type: ignore[no-untyped-call]
    return out


_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
}
_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Sqrt": _sqrt,
    "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs, "Reciprocal": torch.reciprocal,
    "Identity": lambda x: x, "Softplus": F.softplus,
}


def _binary(name: str) -> OpFn:
    return lambda c: [_BINARY[name](_x(c), _x(c, 1))]


def _unary(name: str) -> OpFn:
    return lambda c: [_UNARY[name](_x(c))]


@op("Max", "Min")
def max_min(c: Call) -> list[Tensor]:
    """Variadic, broadcasting (the node's op type is in ``_op``)."""
    fn = torch.maximum if c.attr("_op") == "Max" else torch.minimum
    xs = [t for t in c.inputs if t is not None]
    out = xs[0]
    for t in xs[1:]:
        out = fn(out, t)
    return [out]


for _n in _BINARY:
    op(_n)(_binary(_n))
for _n in _UNARY:
    op(_n)(_unary(_n))


@op("Clip")
def clip(c: Call) -> list[Tensor]:
    lo = c.inputs[1] if len(c.inputs) > 1 else None
    hi = c.inputs[2] if len(c.inputs) > 2 else None
    x = _x(c)
    lo_v = float(lo) if lo is not None else c.attr("min", -math.inf)
    hi_v = float(hi) if hi is not None else c.attr("max", math.inf)
    return [torch.clamp(x, lo_v, hi_v)]


@op("HardSigmoid")
def hard_sigmoid(c: Call) -> list[Tensor]:
    return [torch.clamp(c.attr("alpha", 0.2) * _x(c) + c.attr("beta", 0.5), 0.0, 1.0)]


@op("HardSwish")
def hard_swish(c: Call) -> list[Tensor]:
    return [F.hardswish(_x(c))]  # x * clamp(x / 6 + 1 / 2, 0, 1), fused


@op("LeakyRelu")
def leaky_relu(c: Call) -> list[Tensor]:
    return [F.leaky_relu(_x(c), c.attr("alpha", 0.01))]


@op("PRelu")
def prelu(c: Call) -> list[Tensor]:
    x, slope = _x(c), _x(c, 1)
    return [torch.where(x >= 0, x, x * slope)]


@op("Gelu")
def gelu(c: Call) -> list[Tensor]:
    return [F.gelu(_x(c), approximate="tanh" if c.attr("approximate", "none") == "tanh" else "none")]


@op("Softmax")
def softmax(c: Call) -> list[Tensor]:
    return [torch.softmax(_x(c), dim=c.attr("axis", -1))]


@op("LayerNormalization")
def layer_norm(c: Call) -> list[Tensor]:
    """Y, and where the node asks for them the Mean and InvStdDev over the normalized axes (kept as size 1)."""
    x = _x(c)
    axis = c.attr("axis", -1) % x.dim()
    scale = c.inputs[1]
    bias = c.inputs[2] if len(c.inputs) > 2 else None
    shape = list(x.shape[axis:])
    eps = c.attr("epsilon", 1e-5)
    y = F.layer_norm(x, shape, None if scale is None else scale.expand(shape),
                     None if bias is None else bias.expand(shape), eps=eps)
    if c.n_outputs == 1:
        return [y]
    dims = tuple(range(axis, x.dim()))
    xf = x.float()
    mean = xf.mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(((xf - mean) ** 2).mean(dim=dims, keepdim=True) + eps)
    return [y, mean, inv]


@op("ReduceMean")
def reduce_mean(c: Call) -> list[Tensor]:
    x = _x(c)
    axes = c.attr("axes") or c.ints(1) or list(range(x.dim()))
    return [x.mean(dim=axes, keepdim=bool(c.attr("keepdims", 1)))]


@op("Reshape")
def reshape(c: Call) -> list[Tensor]:
    x, shape = _x(c), c.ints(1) or []
    if not c.attr("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x.reshape(shape)]


@op("Flatten")
def flatten(c: Call) -> list[Tensor]:
    x = _x(c)
    axis = c.attr("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return [x.reshape(math.prod(x.shape[:axis]), -1)]


@op("Transpose")
def transpose(c: Call) -> list[Tensor]:
    x = _x(c)
    return [x.permute(c.attr("perm") or list(reversed(range(x.dim()))))]


@op("Squeeze")
def squeeze(c: Call) -> list[Tensor]:
    x = _x(c)
    axes = c.attr("axes") or c.ints(1)
    if axes is None:
        return [x.squeeze()]
    return [x.squeeze(tuple(a % x.dim() for a in axes))]


@op("Unsqueeze")
def unsqueeze(c: Call) -> list[Tensor]:
    x = _x(c)
    axes = sorted(a % (x.dim() + len(c.attr("axes") or c.ints(1) or []))
                  for a in (c.attr("axes") or c.ints(1) or []))
    for a in axes:
        x = x.unsqueeze(a)
    return [x]


@op("Concat")
def concat(c: Call) -> list[Tensor]:
    return [torch.cat([t for t in c.inputs if t is not None], dim=c.attr("axis"))]


@op("Split")
def split(c: Call) -> list[Tensor]:
    x = _x(c)
    axis = c.attr("axis", 0)
    sizes = c.attr("split") or c.ints(1)
    if sizes is None:
        n = c.attr("num_outputs") or c.attrs["_outputs"]
        size = math.ceil(x.shape[axis] / n)
        sizes = [min(size, x.shape[axis] - i * size) for i in range(n)]
    return list(torch.split(x, sizes, dim=axis))


@op("GlobalAveragePool")
def global_avg_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]


@op("GlobalMaxPool")
def global_max_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]


@op("BatchNormalization")
def batch_norm(c: Call) -> list[Tensor]:
    """Inference form; ``training_mode`` 1: batch statistics, and the updated running mean and
    (population) variance as the 2nd and 3rd outputs."""
    x, scale, bias, mean, var = (_x(c, i) for i in range(5))
    eps = c.attr("epsilon", 1e-5)
    if not c.attr("training_mode", 0):
        return [F.batch_norm(x, mean, var, scale, bias, training=False, eps=eps)]
    dims = [0, *range(2, x.dim())]
    cur_mean, cur_var = x.mean(dim=dims), x.var(dim=dims, unbiased=False)
    y = F.batch_norm(x, cur_mean, cur_var, scale, bias, training=False, eps=eps)
    m = c.attr("momentum", 0.9)
    return [y, mean * m + cur_mean * (1 - m), var * m + cur_var * (1 - m)]
