"""Neural-network layers and the everyday ops: convolution, matrix products, pooling, normalization,
activations, and the shape ops every CNN / transformer carries."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, OpFn, Tensor, _pads, _x, op

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@op("Conv")
def conv(c: Call) -> list[Tensor]:
    x, w = _x(c), _x(c, 1)
    b = c.inputs[2] if len(c.inputs) > 2 else None
    spatial = w.dim() - 2
    pads = _pads(c, spatial)
    if any(pads):
        x = F.pad(x, pads)
    return [_CONV[spatial](x, w, b, stride=c.attr("strides", [1] * spatial),
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


_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
    "Max": torch.maximum, "Min": torch.minimum,
}
_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Sqrt": torch.sqrt,
    "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs, "Reciprocal": torch.reciprocal,
    "Identity": lambda x: x, "Softplus": F.softplus,
}


def _binary(name: str) -> OpFn:
    return lambda c: [_BINARY[name](_x(c), _x(c, 1))]


def _unary(name: str) -> OpFn:
    return lambda c: [_UNARY[name](_x(c))]


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
    x = _x(c)
    return [x * torch.clamp(x / 6.0 + 0.5, 0.0, 1.0)]


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
    x = _x(c)
    axis = c.attr("axis", -1) % x.dim()
    scale = c.inputs[1]
    bias = c.inputs[2] if len(c.inputs) > 2 else None
    shape = list(x.shape[axis:])
    return [F.layer_norm(x, shape, None if scale is None else scale.expand(shape),
                         None if bias is None else bias.expand(shape), eps=c.attr("epsilon", 1e-5))]


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
    axis = c.attr("axis", 1) % (x.dim() + 1) if x.dim() else 0
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


def _pool(c: Call, kind: str) -> list[Tensor]:
    x = _x(c)
    kernel = c.attr("kernel_shape")
    spatial = len(kernel)
    strides = c.attr("strides", [1] * spatial)
    pads = list(c.attr("pads", [0] * (2 * spatial)))
    begin, end = pads[:spatial], pads[spatial:]
    ceil = bool(c.attr("ceil_mode", 0))
    if c.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"auto_pad {c.attr('auto_pad')}")
    if kind == "max":
        if begin != end:
            x = F.pad(x, _pads(c, spatial), value=-math.inf)
            begin = [0] * spatial
        fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[spatial]
        return [fn(x, kernel, strides, begin, dilation=c.attr("dilations", [1] * spatial), ceil_mode=ceil)]
    include = bool(c.attr("count_include_pad", 0))
    if begin != end:
        if not include:
            raise NotImplementedError("AveragePool with asymmetric pads excluded from the count")
        x = F.pad(x, _pads(c, spatial))
        begin = [0] * spatial
    afn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[spatial]
    return [afn(x, kernel, strides, begin, ceil_mode=ceil, count_include_pad=include)]


@op("MaxPool")
def max_pool(c: Call) -> list[Tensor]:
    return _pool(c, "max")


@op("AveragePool")
def avg_pool(c: Call) -> list[Tensor]:
    return _pool(c, "avg")


@op("BatchNormalization")
def batch_norm(c: Call) -> list[Tensor]:
    x, scale, bias, mean, var = (_x(c, i) for i in range(5))
    return [F.batch_norm(x, mean, var, scale, bias, training=False, eps=c.attr("epsilon", 1e-5))]
