"""Kernels of FP16 / BF16 layers (docs/integer_semantics.md, "Float layers").

A float op reads tensors of its format (float16, or bfloat16 as ml_dtypes' type), computes in float32
and rounds each output once to the format of its first float input (round to nearest, ties to even:
numpy's and ml_dtypes' casts). ``Dequantize`` and ``Quantize`` convert at the layer's border.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pulsar.core.float_ops import FLOAT_FORMATS, FORMAT_OF_ELEM
from pulsar.core.int_ops import INT_DOMAIN
from pulsar.errors import PulsarError
from pulsar.runtime.kernels import Kernel, register

F32 = np.float32


_FORMATS = {np.dtype(t) for _, t in FLOAT_FORMATS.values()}


def _fmt(inputs: list[np.ndarray | None]) -> np.dtype:
    """The float format of the op: that of its first FP16 / BF16 input."""
    for x in inputs:
        if x is not None and np.asarray(x).dtype in _FORMATS:
            return np.asarray(x).dtype
    raise PulsarError("a float-layer op without an FP16 / BF16 input")


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(F32)


def _elementwise(fn: Callable[..., np.ndarray]) -> Callable[[dict[str, Any], list[np.ndarray | None]], Kernel]:
    def factory(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
        def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
            fmt = _fmt(inputs)
            args = [_f32(x) for x in inputs if x is not None]
            return [np.asarray(fn(*args, **_kw(attrs)), dtype=F32).astype(fmt)]
        return run
    return factory


def _kw(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}


def _torch_unary(name: str) -> Callable[..., np.ndarray]:
    """A torch elementwise function by name, imported at the first call: importing torch costs every
    build seconds, and most models have no float layer."""
    def run(x: np.ndarray, **_: Any) -> np.ndarray:
        import torch

        return getattr(torch, name)(torch.from_numpy(np.ascontiguousarray(x))).numpy()  # type: ignore[no-any-return]
    return run


def _gelu(x: np.ndarray, approximate: str = "none", **_: Any) -> np.ndarray:
    import torch

    return torch.nn.functional.gelu(torch.from_numpy(np.ascontiguousarray(x)), approximate=approximate).numpy()


def _sigmoid(x: np.ndarray, **_: Any) -> np.ndarray:
    import torch

    return torch.sigmoid(torch.from_numpy(np.ascontiguousarray(x))).numpy()


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": lambda a, b, **_: a + b,
    "Sub": lambda a, b, **_: a - b,
    "Mul": lambda a, b, **_: a * b,
    "Div": lambda a, b, **_: a / b,
    "Pow": lambda a, b, **_: np.power(a, b),
    "Exp": lambda x, **_: np.exp(x),
    "Sqrt": lambda x, **_: np.sqrt(x),
    "Tanh": lambda x, **_: np.tanh(x),
    "Relu": lambda x, **_: np.maximum(x, F32(0)),
    "Neg": lambda x, **_: -x,
    "Abs": lambda x, **_: np.abs(x),
    "Erf": _torch_unary("erf"),
    "Sigmoid": _sigmoid,
    "Gelu": _gelu,
    "MatMul": lambda a, b, **_: np.matmul(a, b),
}
for _op, _fn in _ELEMENTWISE.items():
    register(_op)(_elementwise(_fn))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """float32 softmax: exp(x - max) / sum along ``axis``."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@register("Softmax")
def _softmax(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    axis = int(attrs.get("axis", -1))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        fmt = _fmt(inputs)
        assert inputs[0] is not None
        return [softmax(_f32(inputs[0]), axis).astype(fmt)]
    return run


def layer_norm(x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, axis: int = -1,
               epsilon: float = 1e-5) -> np.ndarray:
    """float32 layer normalization over the axes from ``axis`` on."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=axes, keepdims=True)
    y = d / np.sqrt(var + F32(epsilon))
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


@register("LayerNormalization")
def _layer_norm(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    axis, eps = int(attrs.get("axis", -1)), float(attrs.get("epsilon", 1e-5))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        fmt = _fmt(inputs)
        x, scale, bias = (None if v is None else _f32(v) for v in (list(inputs) + [None, None])[:3])
        assert x is not None
        return [layer_norm(x, scale, bias, axis, eps).astype(fmt)]
    return run


@register("Gemm")
def _gemm(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    alpha, beta = F32(attrs.get("alpha", 1.0)), F32(attrs.get("beta", 1.0))
    ta, tb = int(attrs.get("transA", 0)), int(attrs.get("transB", 0))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        fmt = _fmt(inputs)
        a, b = _f32(inputs[0]), _f32(inputs[1])  # type: ignore[arg-type]
        y = np.matmul(a.T if ta else a, b.T if tb else b) * alpha
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + beta * _f32(inputs[2])
        return [y.astype(fmt)]
    return run


@register("ReduceMean")
def _reduce_mean(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    keep = bool(attrs.get("keepdims", 1))
    axes_attr = attrs.get("axes")

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        fmt = _fmt(inputs)
        x = _f32(inputs[0])  # type: ignore[arg-type]
        axes = axes_attr if axes_attr is not None else (inputs[1] if len(inputs) > 1 else None)
        ax = tuple(int(a) % x.ndim for a in np.asarray(axes).reshape(-1)) if axes is not None else None
        return [x.mean(axis=ax, keepdims=keep).astype(fmt)]
    return run


# ------------------------------------------------------------------------------------- borders
def float_type(elem: int) -> type:
    fmt = FORMAT_OF_ELEM.get(elem)
    if fmt is None:
        raise PulsarError(f"'to' = {elem} is not a float format (FP16 / BF16)")
    return FLOAT_FORMATS[fmt][1]


@register("Dequantize", domain=INT_DOMAIN)
def _dequantize(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    to = float_type(int(attrs["to"]))
    scales = consts[1] if len(consts) > 1 else None
    if scales is None:  # per tensor: an activation entering the layer
        if "scale" not in attrs:
            raise PulsarError("Dequantize needs the attribute 'scale' or a constant input 'scales'")
        zp, scale = F32(int(attrs.get("x_zp", 0))), F32(attrs["scale"])

        def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
            return [((np.asarray(inputs[0]).astype(F32) - zp) * scale).astype(to)]
        return run
    # per channel: a weight of a weight-only layer, dequantized once (it is a constant)
    axis, block = int(attrs.get("axis", 0)), int(attrs.get("block_size", 0))
    zps = consts[2] if len(consts) > 2 and consts[2] is not None else np.zeros(np.shape(scales), np.int32)

    def run_channels(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = np.asarray(inputs[0]).astype(F32)
        if block:  # a scale per block of `block` along `axis` (scales: x's shape with that axis / block)
            s = np.repeat(np.asarray(scales, F32), block, axis=axis % x.ndim)
            z = np.repeat(np.asarray(zps).astype(F32), block, axis=axis % x.ndim)
        else:
            shape = [1] * x.ndim
            shape[axis % x.ndim] = -1
            s, z = np.asarray(scales, F32).reshape(shape), np.asarray(zps).astype(F32).reshape(shape)
        return [((x - z) * s).astype(to)]
    return run_channels


@register("Quantize", domain=INT_DOMAIN)
def _quantize(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    from onnx import helper

    scale, zp = F32(attrs["scale"]), int(attrs.get("out_zp", 0))
    out = np.dtype(helper.tensor_dtype_to_np_dtype(int(attrs["to"])))
    info = np.iinfo(out)
    lo, hi = int(attrs.get("out_min", info.min)), int(attrs.get("out_max", info.max))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        v = np.asarray(inputs[0]).astype(F32) / scale
        v = np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=2.0**40, neginf=-(2.0**40))
        return [np.clip(np.rint(v) + zp, lo, hi).astype(out)]
    return run
