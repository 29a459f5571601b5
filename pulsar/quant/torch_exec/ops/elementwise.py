"""Elementwise ops and their integer / quantized relatives: casts, comparisons and logic, bit ops,
rounding, activations, trigonometry, variadic sums, and the integer-domain ops (QuantizeLinear,
QLinearConv, MatMulInteger ...).

Dtypes follow numpy's except unsigned types wider than 8 bits, which the executor holds as int64
(see ``to_torch``): an op producing one yields int64 holding the unsigned value (masked to the width,
wrap-around as the unsigned type would), and the final ``astype`` restores the ONNX type. Likewise
bfloat16 and float8 (no numpy dtype: torch cannot hand them over) are held as float32 holding values
rounded to the narrow type.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, OpFn, Tensor, _x, onnx_pads, op, torch_pads

__all__: list[str] = []

# ---- dtypes ---------------------------------------------------------------------------------------

# ONNX TensorProto element type -> the torch dtype the executor holds it as
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 4: torch.int64, 5: torch.int16, 6: torch.int32,
    7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 12: torch.int64, 13: torch.int64,
    16: torch.float32, 17: torch.float8_e4m3fn, 18: torch.float8_e4m3fnuz, 19: torch.float8_e5m2,
    20: torch.float8_e5m2fnuz,
}
# unsigned types held as int64: their width
_WIDE_UNSIGNED = {4: 16, 12: 32, 13: 64}
# the types a float8 value is rounded to (and then held as float32)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
# integer ranges of the quantized types (ONNX element type -> (qmin, qmax))
_QRANGE = {2: (0, 255), 3: (-128, 127), 4: (0, 65535), 5: (-32768, 32767), 6: (-(2**31), 2**31 - 1)}


def _dtype(to: int) -> torch.dtype:
    if to not in _DTYPES:
        raise NotImplementedError(f"element type {to} in torch")
    return _DTYPES[to]


def _mask(x: Tensor, bits: int) -> Tensor:
    """An int64 tensor wrapped to an unsigned ``bits``-wide value (held as int64)."""
    return x if bits >= 64 else torch.bitwise_and(x, (1 << bits) - 1)


def _to_float8(x: Tensor, dt: torch.dtype, saturate: bool) -> Tensor:
    """The spec's float8 conversion: saturate clamps to the largest finite value (inf too); without
    it out-of-range values become inf (E5M2) or NaN of their sign."""
    f = x.to(torch.float32)
    fmax = float(torch.finfo(dt).max)
    if saturate:
        f = f.clamp(-fmax, fmax)
    else:
        over = f.abs() > fmax
        f = torch.where(over, torch.copysign(torch.full_like(f, math.inf if dt == torch.float8_e5m2 else math.nan), f), f)
    return f.to(dt).to(torch.float32)


def cast(x: Tensor, to: int, saturate: bool = True) -> Tensor:
    """x as ONNX element type ``to``: float -> narrow int goes through int32 (C's static_cast on the
    usual hardware wraps), unsigned wide types are masked to their width."""
    if to in _WIDE_UNSIGNED:
        return _mask(x.to(torch.int64), _WIDE_UNSIGNED[to])
    if to == 16:  # bfloat16, held as float32
        return x.to(torch.bfloat16).to(torch.float32)
    dt = _dtype(to)
    if x.dtype == dt:
        return x
    if dt in _FLOAT8:
        return _to_float8(x, dt, saturate)
    if x.is_floating_point() and dt in (torch.int8, torch.int16, torch.uint8):
        return x.to(torch.int32).to(dt)
    return x.to(dt)


@op("Cast")
def cast_op(c: Call) -> list[Tensor]:
    return [cast(_x(c), int(c.attr("to")), bool(c.attr("saturate", 1)))]


@op("CastLike")
def cast_like(c: Call) -> list[Tensor]:
    """To the dtype of the second input (an int64 target can stand for a wide unsigned type: kept int64)."""
    x, like = _x(c), _x(c, 1)
    if x.is_floating_point() and like.dtype in (torch.int8, torch.int16, torch.uint8):
        return [x.to(torch.int32).to(like.dtype)]
    return [x.to(like.dtype)]


@op("BitCast")
def bit_cast(c: Call) -> list[Tensor]:
    """The same bits read as type ``to`` (of the same width): an int64 holding a narrower unsigned
    value is narrowed to that width first."""
    x, to = _x(c), int(c.attr("to"))
    target = torch.bfloat16 if to == 16 else _dtype(to)
    bits = _WIDE_UNSIGNED.get(to, 0) or torch.empty((), dtype=target).element_size() * 8
    same = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    if x.element_size() * 8 != bits:
        x = x.to(same)
    if to in _WIDE_UNSIGNED:
        return [_mask(x.view(same).to(torch.int64), bits)]
    y = x.view(target)
    return [y.to(torch.float32) if target == torch.bfloat16 or target in _FLOAT8 else y]


# ---- comparisons, logic, bits ---------------------------------------------------------------------

_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "BitwiseXor": torch.bitwise_xor,
}


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    return lambda c: [fn(_x(c), _x(c, 1))]


for _n, _f in _BINARY.items():
    op(_n)(_binary(_f))


@op("Not")
def not_(c: Call) -> list[Tensor]:
    return [torch.logical_not(_x(c))]


@op("BitwiseNot")
def bitwise_not(c: Call) -> list[Tensor]:
    """~x; a wide unsigned type held as int64 comes out negative and wraps at the final astype."""
    return [torch.bitwise_not(_x(c))]


@op("Where")
def where(c: Call) -> list[Tensor]:
    return [torch.where(_x(c).to(torch.bool), _x(c, 1), _x(c, 2))]


@op("BitShift")
def bit_shift(c: Call) -> list[Tensor]:
    """A shift by a negative amount or at least the width gives the full-width result (0, or -1 for
    a right shift of a negative value), as numpy and the spec say, never C's masked count."""
    x, y = _x(c), _x(c, 1).to(torch.int64)
    width = x.element_size() * 8
    out_of_range = (y < 0) | (y >= width)
    yc = y.clamp(0, width - 1).to(x.dtype)
    if c.attr("direction") == "LEFT":
        return [torch.where(out_of_range, torch.zeros_like(x), x << yc)]
    fill = torch.where(x < 0, -1, 0).to(x.dtype)
    return [torch.where(out_of_range, fill, x >> yc)]


@op("Mod")
def mod(c: Call) -> list[Tensor]:
    """fmod=1: C fmod (sign of the dividend); fmod=0: the sign of the divisor (numpy's mod), a zero
    result taking the divisor's sign for floats."""
    a, b = _x(c), _x(c, 1)
    if c.attr("fmod", 0):
        return [torch.fmod(a, b)]
    if not a.is_floating_point():
        return [torch.remainder(a, b)]
    r = torch.fmod(a, b)
    r = torch.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return [torch.where(r == 0, torch.copysign(torch.zeros_like(r), b), r)]


@op("Div")
def div(c: Call) -> list[Tensor]:
    """Integers divide truncating toward zero (C, onnxruntime), floats exactly."""
    a, b = _x(c), _x(c, 1)
    if a.is_floating_point() or b.is_floating_point():
        return [torch.div(a, b)]
    return [torch.div(a, b, rounding_mode="trunc")]


@op("Pow")
def pow_(c: Call) -> list[Tensor]:
    """The base's type: integer bases with a float (or negative) exponent go through float64 and
    truncate back, as onnxruntime's std::pow + cast does."""
    a, b = _x(c), _x(c, 1)
    if a.is_floating_point():
        return [torch.pow(a, b.to(a.dtype) if b.is_floating_point() else b).to(a.dtype)]
    if b.is_floating_point() or bool((b < 0).any()):
        return [torch.pow(a.to(torch.float64), b.to(torch.float64)).to(a.dtype)]
    return [torch.pow(a, b.to(a.dtype))]


# ---- rounding, tests on values ----------------------------------------------------------------------

_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Ceil": torch.ceil, "Floor": torch.floor, "Round": torch.round, "Sign": torch.sign, "IsNaN": torch.isnan,
    "Sin": torch.sin, "Cos": torch.cos, "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos,
    "Atan": torch.atan, "Sinh": torch.sinh, "Cosh": torch.cosh, "Asinh": torch.asinh, "Acosh": torch.acosh,
    "Atanh": torch.atanh, "Softsign": F.softsign, "Mish": F.mish,
}


def _unary(fn: Callable[[Tensor], Tensor]) -> OpFn:
    return lambda c: [fn(_x(c))]


for _n, _g in _UNARY.items():
    op(_n)(_unary(_g))


@op("IsInf")
def is_inf(c: Call) -> list[Tensor]:
    x = _x(c)
    pos = torch.isposinf(x) if c.attr("detect_positive", 1) else torch.zeros_like(x, dtype=torch.bool)
    neg = torch.isneginf(x) if c.attr("detect_negative", 1) else torch.zeros_like(x, dtype=torch.bool)
    return [pos | neg]


# ---- activations ------------------------------------------------------------------------------------

@op("Elu")
def elu(c: Call) -> list[Tensor]:
    x, alpha = _x(c), float(c.attr("alpha", 1.0))
    return [torch.where(x > 0, x, alpha * torch.expm1(x))]


@op("Selu")
def selu(c: Call) -> list[Tensor]:
    x = _x(c)
    alpha = float(c.attr("alpha", 1.67326319217681884765625))
    gamma = float(c.attr("gamma", 1.05070102214813232421875))
    return [gamma * torch.where(x > 0, x, alpha * torch.expm1(x))]


@op("Celu")
def celu(c: Call) -> list[Tensor]:
    x, alpha = _x(c), float(c.attr("alpha", 1.0))
    return [torch.clamp(x, min=0) + torch.clamp(alpha * torch.expm1(x / alpha), max=0)]


@op("ThresholdedRelu")
def thresholded_relu(c: Call) -> list[Tensor]:
    x = _x(c)
    return [torch.where(x > float(c.attr("alpha", 1.0)), x, torch.zeros_like(x))]


@op("Shrink")
def shrink(c: Call) -> list[Tensor]:
    """Integer inputs stay integers (the constants cast to the input's type)."""
    x = _x(c)
    lambd, bias = float(c.attr("lambd", 0.5)), float(c.attr("bias", 0.0))
    if not x.is_floating_point():
        y = torch.where(x < -lambd, x.to(torch.float64) + bias,
                        torch.where(x > lambd, x.to(torch.float64) - bias, torch.zeros_like(x, dtype=torch.float64)))
        return [y.to(x.dtype)]
    return [torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))]


@op("Swish")
def swish(c: Call) -> list[Tensor]:
    x = _x(c)
    return [x * torch.sigmoid(float(c.attr("alpha", 1.0)) * x)]


@op("Binarizer")
def binarizer(c: Call) -> list[Tensor]:
    x = _x(c)
    return [(x > float(c.attr("threshold", 0.0))).to(x.dtype)]


def _over_axis(c: Call, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
    """``fn`` along ``axis``: from opset 13 one axis (default -1); before, x flattened to 2-D at
    ``axis`` (default 1) and ``fn`` along the second dimension."""
    x = _x(c)
    if int(c.attr("_opset", 13)) >= 13:
        return fn(x, int(c.attr("axis", -1)) % max(1, x.dim()))
    axis = int(c.attr("axis", 1)) % (x.dim() or 1) if x.dim() else 0
    return fn(x.reshape(math.prod(x.shape[:axis]), -1), 1).reshape(x.shape)


def _hardmax(x: Tensor, axis: int) -> Tensor:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    return torch.zeros_like(x).scatter_(axis, torch.argmax(x, dim=axis, keepdim=True), 1)


@op("LogSoftmax")
def log_softmax(c: Call) -> list[Tensor]:
    return [_over_axis(c, lambda x, a: torch.log_softmax(x, dim=a))]


@op("Hardmax")
def hardmax(c: Call) -> list[Tensor]:
    return [_over_axis(c, _hardmax)]


# ---- variadic, dropout -------------------------------------------------------------------------------

@op("Sum")
def sum_(c: Call) -> list[Tensor]:
    ts = [t for t in c.inputs if t is not None]
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return [out]


@op("Mean")
def mean(c: Call) -> list[Tensor]:
    ts = [t for t in c.inputs if t is not None]
    return [sum_(c)[0] / len(ts)]


@op("Dropout")
def dropout(c: Call) -> list[Tensor]:
    """Inference: identity and an all-true mask. training_mode (opset 12+) with a non-zero ratio
    draws a random mask and scales the kept values by 1 / (1 - ratio)."""
    x = _x(c)
    ratio_t, train_t = c.input(1), c.input(2)
    ratio = float(ratio_t) if ratio_t is not None else float(c.attr("ratio", 0.5))
    training = bool(train_t) if train_t is not None else False
    if not training or ratio == 0.0:  # before opset 10 the mask has the input's type
        y, mask = x, torch.ones_like(x, dtype=torch.bool if int(c.attr("_opset", 13)) >= 10 else x.dtype)
    else:
        mask = torch.rand(x.shape, device=x.device) >= ratio
        y = torch.where(mask, x / (1.0 - ratio), torch.zeros_like(x))
    return [y, mask][: c.n_outputs]


# ---- quantization -----------------------------------------------------------------------------------

def _along(p: Tensor, x: Tensor, axis: int, block: int) -> Tensor:
    """A scale / zero point shaped to broadcast against x: scalar, per-axis (1-D along ``axis``) or
    blocked (same rank as x, ``block`` consecutive elements along ``axis`` sharing one)."""
    if p.dim() == 0 or p.numel() == 1 and block == 0:
        return p.reshape(())
    axis %= x.dim()
    if block:
        p = torch.repeat_interleave(p, block, dim=axis)
        return p.narrow(axis, 0, x.shape[axis])
    shape = [1] * x.dim()
    shape[axis] = -1
    return p.reshape(shape)


def _quantize(x: Tensor, scale: Tensor, zp: Tensor | float, lo: int, hi: int) -> Tensor:
    """clamp(round_half_even(x / scale) + zp): division in float32 (float64 for double), as onnxruntime."""
    ft = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = torch.round(x.to(ft) / scale.to(ft))
    zf = zp.to(ft) if isinstance(zp, Tensor) else float(zp)
    return torch.clamp(q + zf, lo, hi)


def _qtype(zp: Tensor | None, output_dtype: int) -> int:
    """The ONNX element type of a quantized tensor: output_dtype, else the zero point's, else uint8."""
    if output_dtype:
        return output_dtype
    if zp is None:
        return 2
    # an int64 zero point is a uint16 one (the executor holds uint16 as int64)
    types = {torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 4}
    if zp.dtype not in types:
        raise NotImplementedError(f"QuantizeLinear to {zp.dtype}")
    return types[zp.dtype]


@op("QuantizeLinear")
def quantize_linear(c: Call) -> list[Tensor]:
    x, scale, zp = _x(c), _x(c, 1), c.input(2)
    axis, block = int(c.attr("axis", 1)), int(c.attr("block_size", 0))
    qt = _qtype(zp, int(c.attr("output_dtype", 0)))
    if qt not in _QRANGE:
        raise NotImplementedError(f"QuantizeLinear to element type {qt}")
    lo, hi = _QRANGE[qt]
    s = _along(scale, x, axis, block)
    z = _along(zp, x, axis, block) if zp is not None else 0.0
    return [_quantize(x, s, z, lo, hi).to(_dtype(qt))]


@op("DequantizeLinear")
def dequantize_linear(c: Call) -> list[Tensor]:
    """(x - zp) * scale: the subtraction in integers, the product in the scale's type (or
    output_dtype)."""
    x, scale, zp = _x(c), _x(c, 1), c.input(2)
    if x.is_floating_point():
        raise NotImplementedError(f"DequantizeLinear from {x.dtype}")
    axis, block = int(c.attr("axis", 1)), int(c.attr("block_size", 0))
    out_type = int(c.attr("output_dtype", 0))
    out_t = torch.bfloat16 if out_type == 16 else _dtype(out_type) if out_type else scale.dtype
    d = x.to(torch.int64)
    if zp is not None:
        d = d - _along(zp, x, axis, block).to(torch.int64)
    ft = torch.float64 if out_t == torch.float64 else torch.float32
    y = (d.to(ft) * _along(scale, x, axis, block).to(ft)).to(out_t)
    return [y.to(torch.float32) if out_t == torch.bfloat16 else y]


@op("DynamicQuantizeLinear")
def dynamic_quantize_linear(c: Call) -> list[Tensor]:
    """uint8 over [min(x, 0), max(x, 0)], as onnxruntime computes it (scale 1 for an all-zero range,
    the zero point clamped then rounded)."""
    x = _x(c).to(torch.float32)
    lo = torch.clamp(x.min(), max=0.0) if x.numel() else torch.zeros(())
    hi = torch.clamp(x.max(), min=0.0) if x.numel() else torch.zeros(())
    scale = torch.where(hi == lo, torch.ones(()), (hi - lo) / 255.0)
    zp = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    y = _quantize(x, scale, zp, 0, 255).to(torch.uint8)
    return [y, scale.to(torch.float32), zp.to(torch.uint8)]


def _requantize(acc: Tensor, multiplier: Tensor, zp: Tensor, out: torch.dtype) -> Tensor:
    lo, hi = (0, 255) if out == torch.uint8 else (-128, 127)
    return torch.clamp(torch.round(acc.to(torch.float32) * multiplier) + zp.to(torch.float32), lo, hi).to(out)


def _zp_or_zero(t: Tensor | None) -> Tensor:
    return torch.zeros((), dtype=torch.int64) if t is None else t.to(torch.int64)


def _rows(p: Tensor) -> Tensor:
    """A per-row parameter of a matrix product's left operand ([M] -> [M, 1])."""
    return p.reshape(-1, 1) if p.dim() == 1 and p.numel() > 1 else p


@op("QLinearMatMul")
def qlinear_matmul(c: Call) -> list[Tensor]:
    """Integer accumulation (exact in float64) rescaled by a_scale * b_scale / y_scale in float32."""
    a, a_s, a_z, b, b_s, b_z, y_s, y_z = (c.input(i) for i in range(8))
    assert a is not None and b is not None and a_s is not None and b_s is not None and y_s is not None
    assert y_z is not None
    acc = torch.matmul((a.to(torch.int64) - _rows(_zp_or_zero(a_z))).to(torch.float64),
                       (b.to(torch.int64) - _zp_or_zero(b_z)).to(torch.float64))
    m = _rows(a_s.to(torch.float32)) * b_s.to(torch.float32) / y_s.to(torch.float32)
    return [_requantize(acc, m, y_z, y_z.dtype)]


@op("MatMulInteger")
def matmul_integer(c: Call) -> list[Tensor]:
    a, b = _x(c), _x(c, 1)
    acc = torch.matmul((a.to(torch.int64) - _rows(_zp_or_zero(c.input(2)))).to(torch.float64),
                       (b.to(torch.int64) - _zp_or_zero(c.input(3))).to(torch.float64))
    return [acc.to(torch.int32)]


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _int_conv(c: Call, x: Tensor, w: Tensor, x_zp: Tensor | None, w_zp: Tensor | None) -> Tensor:
    """The integer convolution of (x - x_zp) and (w - w_zp), exact in float64."""
    spatial = w.dim() - 2
    xf = (x.to(torch.int64) - _zp_or_zero(x_zp)).to(torch.float64)
    wz = _zp_or_zero(w_zp)
    if wz.dim() == 1 and wz.numel() > 1:
        wz = wz.reshape([-1] + [1] * (w.dim() - 1))
    wf = (w.to(torch.int64) - wz).to(torch.float64)
    kernel = c.attr("kernel_shape") or list(w.shape[2:])
    pads = torch_pads(onnx_pads(c, x, kernel))
    if any(pads):
        xf = F.pad(xf, pads)
    return _CONV[spatial](xf, wf, None, stride=c.attr("strides", [1] * spatial),
                          dilation=c.attr("dilations", [1] * spatial), groups=c.attr("group", 1))


@op("ConvInteger")
def conv_integer(c: Call) -> list[Tensor]:
    return [_int_conv(c, _x(c), _x(c, 1), c.input(2), c.input(3)).to(torch.int32)]


@op("QLinearConv")
def qlinear_conv(c: Call) -> list[Tensor]:
    """Integer convolution plus the int32 bias, rescaled by x_scale * w_scale (per output channel) / y_scale."""
    x, x_s, x_z, w, w_s, w_z, y_s, y_z, bias = (c.input(i) for i in range(9))
    assert x is not None and w is not None and x_s is not None and w_s is not None and y_s is not None
    assert y_z is not None
    acc = _int_conv(c, x, w, x_z, w_z)
    shape = [1, -1] + [1] * (acc.dim() - 2)
    if bias is not None:
        acc = acc + bias.to(torch.float64).reshape(shape)
    ws = w_s.to(torch.float32)
    m = x_s.to(torch.float32) * (ws.reshape(shape) if ws.numel() > 1 else ws) / y_s.to(torch.float32)
    return [_requantize(acc, m, y_z, y_z.dtype)]
