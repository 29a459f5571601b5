"""Unary element-wise ops -> QLut: a table of the op evaluated in float64 on the input grid.

8-bit inputs: one entry per input integer (exact up to the float reference's own rounding).
16-bit inputs: ``2**lut_items_in_bits + 1`` knots, linearly interpolated between them by the NPU;
the knots are not clamped to the output range (only kept inside int32), so the interpolation of a
segment that crosses the saturation level stays close to the function before the final clamp. With
an 8-bit output the knots live on a finer int32 grid and a Requantize rounds once (see emit_lut).
A chain of element-wise ops without quantization in between (the quantizer's lookup-table chains)
is one table of the composed function.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from pulsar.compiler.lower.qdq_graph import QParams
from pulsar.compiler.lower.rules.base import (
    INT64_LIMIT,
    LowerCtx,
    Unsupported,
    clamp_of,
    relu_clip_bounds,
    rule,
)
from pulsar.core.opdefs import fused_activations, scalar_arithmetic_ops

Fn = Callable[[np.ndarray], np.ndarray]
FRACTION_BITS = 8  # an interpolated table's grid is 2**8 times finer than an 8-bit output's
_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _scalar(ctx: LowerCtx, i: int, what: str, default: float | None) -> float | None:
    v = ctx.const_value(i, what)
    if v is None:
        return default
    v = np.asarray(v, dtype=np.float64)
    if v.size == 0:
        return default
    if np.any(v != v.reshape(-1)[0]):
        raise Unsupported(f"{ctx.op} {what} varies per element (the NPU table takes one function)")
    return float(v.reshape(-1)[0])


def clip_bounds(ctx: LowerCtx) -> tuple[float, float]:
    return relu_clip_bounds(ctx.g, ctx.node)


def _a(c: LowerCtx, name: str, default: float) -> float:
    return float(c.attr(name, default))


# (domain, op) -> f(x, ctx): the op in float64; ctx gives its attributes and constant operands.
LUT_FUNCS: dict[tuple[str, str], Callable[[np.ndarray, LowerCtx], np.ndarray]] = {
    ("", "Sigmoid"): lambda x, c: sigmoid(x),
    ("", "Tanh"): lambda x, c: np.tanh(x),
    ("", "HardSigmoid"): lambda x, c: np.clip(_a(c, "alpha", 0.2) * x + _a(c, "beta", 0.5), 0.0, 1.0),
    ("", "HardSwish"): lambda x, c: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0),
    ("", "LeakyRelu"): lambda x, c: np.where(x >= 0, x, _a(c, "alpha", 0.01) * x),
    ("", "Elu"): lambda x, c: np.where(x > 0, x, _a(c, "alpha", 1.0) * np.expm1(x)),
    ("", "Selu"): lambda x, c: _a(c, "gamma", 1.05070102214813232421875) * np.where(
        x > 0, x, _a(c, "alpha", 1.67326319217681884765625) * np.expm1(x)),
    ("", "Celu"): lambda x, c: np.maximum(x, 0) + np.minimum(0, _a(c, "alpha", 1.0) * np.expm1(x / _a(c, "alpha", 1.0))),
    ("", "Softplus"): lambda x, c: softplus(x),
    ("", "Softsign"): lambda x, c: x / (1.0 + np.abs(x)),
    ("", "ThresholdedRelu"): lambda x, c: np.where(x > _a(c, "alpha", 1.0), x, 0.0),
    ("", "Shrink"): lambda x, c: np.where(x < -_a(c, "lambd", 0.5), x + _a(c, "bias", 0.0),
                                          np.where(x > _a(c, "lambd", 0.5), x - _a(c, "bias", 0.0), 0.0)),
    ("", "Mish"): lambda x, c: x * np.tanh(softplus(x)),
    ("", "Gelu"): lambda x, c: gelu_tanh(x) if c.attr_str("approximate", "none") == "tanh" else gelu_erf(x),
    ("com.microsoft", "Gelu"): lambda x, c: gelu_erf(x),
    ("com.microsoft", "FastGelu"): lambda x, c: gelu_tanh(x),
    ("com.microsoft", "QuickGelu"): lambda x, c: x * sigmoid(_a(c, "alpha", 1.702) * x),
    ("", "Erf"): lambda x, c: erf(x),
    ("", "Exp"): lambda x, c: np.exp(x),
    ("", "Log"): lambda x, c: np.log(x),
    ("", "Sqrt"): lambda x, c: np.sqrt(x),
    ("", "Reciprocal"): lambda x, c: 1.0 / x,
    ("", "Neg"): lambda x, c: -x,
    ("", "Abs"): lambda x, c: np.abs(x),
    ("", "Sin"): lambda x, c: np.sin(x),
    ("", "Cos"): lambda x, c: np.cos(x),
    ("", "Atan"): lambda x, c: np.arctan(x),
    ("", "Floor"): lambda x, c: np.floor(x),
    ("", "Ceil"): lambda x, c: np.ceil(x),
    ("", "Round"): lambda x, c: np.rint(x),
    ("", "Sign"): lambda x, c: np.sign(x),
    ("", "Relu"): lambda x, c: np.maximum(x, 0.0),
    ("", "Clip"): lambda x, c: np.clip(x, *clip_bounds(c)),
    ("", "PRelu"): lambda x, c: np.where(x >= 0, x, _scalar(c, 1, "slope", 0.0) * x),
    ("", "Pow"): lambda x, c: np.power(x, _scalar(c, 1, "exponent", 1.0)),
}


def lut_table(ctx: LowerCtx, xq: QParams, yq: QParams, f: Fn, clamp: tuple[int, int]) -> tuple[np.ndarray, int]:
    """(int32 table, step_bits) of ``f`` from grid ``xq`` to grid ``yq``."""
    if xq.bits == 8:
        step = 0
        u = np.arange(256, dtype=np.int64)
    else:
        bits = int(ctx.lut_items_in_bits)
        step = 16 - bits
        u = np.arange(65536 if step == 0 else (65536 >> step) + 1, dtype=np.int64) << step
    x = (u + xq.qmin - xq.zp).astype(np.float64) * xq.s
    with np.errstate(all="ignore"):
        y = np.asarray(f(x), dtype=np.float64) / yq.s
    y = np.nan_to_num(y, nan=0.0, posinf=2.0**40, neginf=-(2.0**40))
    q = np.rint(y) + yq.zp
    lo, hi = clamp
    if step:
        span = hi - lo
        lo, hi = lo - span, hi + span
    return np.clip(q, lo, hi).astype(np.int32), step


def emit_lut(ctx: LowerCtx, f: Fn, *, x_index: int = 0) -> None:
    """A QLut node computing ``f`` from input ``x_index`` into output 0.

    An interpolated table (16-bit input) whose knots are rounded to the output grid errs by up to
    half a step between knots, which on an 8-bit output is a one-step error on a good fraction of
    the elements (the QDQ reference rounds f(x) once). Such a table is therefore built on an int32
    grid 2**FRACTION_BITS finer than the output's, and a Requantize rounds once onto the output."""
    xq, yq = ctx.act(x_index), ctx.out()
    if xq.bits == 8 or yq.bits == 16 or ctx.lut_items_in_bits >= 16:
        table, step = lut_table(ctx, xq, yq, f, ctx.clamps[0])
        ctx.emit("QLut", [xq.name, ctx.add_init("table", table)], [yq.name], step_bits=step, **ctx.common())
        return
    lo, hi = ctx.clamps[0]
    mid_name = f"{ctx.name}/fine"
    mid = QParams(mid_name, np.asarray(yq.s / 2.0**FRACTION_BITS), np.asarray(0), TensorProto.INT32, None)
    clamp = ((lo - yq.zp) << FRACTION_BITS, (hi - yq.zp) << FRACTION_BITS)
    table, step = lut_table(ctx, xq, mid, f, clamp)
    ctx.declare(mid_name, TensorProto.INT32, ctx.shape(ctx.node.input[x_index]))
    ctx.emit("QLut", [xq.name, ctx.add_init("table", table)], [mid_name], step_bits=step, out_zp=0,
             out_min=-(2**31), out_max=2**31 - 1, to=TensorProto.INT32)
    ctx.emit("Requantize", [mid_name], [yq.name], suffix="round", x_zp=0, M=1, N=FRACTION_BITS, **ctx.common())


def _domain(ctx: LowerCtx) -> str:
    return "" if ctx.node.domain in ("", "ai.onnx") else ctx.node.domain


def unary_function(ctx: LowerCtx, x_index: int) -> Fn | None:
    """The node as a function of its input ``x_index`` when it is one: a table op reading it as
    input 0, or Mul / Add / Sub / Div of it and a constant scalar. None otherwise."""
    key = (_domain(ctx), ctx.op)
    if key in LUT_FUNCS:
        if x_index != 0 or any(o.kind not in ("const", "qconst", "absent") for o in ctx.inputs[1:]):
            return None
        if key == ("com.microsoft", "FastGelu") and ctx.operand(1).kind != "absent":
            return None
        fn = LUT_FUNCS[key]
        return lambda x: fn(x, ctx)
    if key[0] or ctx.op not in SCALAR_OPS or len(ctx.inputs) != 2:
        return None
    other = ctx.operand(1 - x_index)
    if not other.is_const or other.real().size != 1:
        return None
    c = float(other.real().reshape(-1)[0])
    first = x_index == 0
    return {"Mul": lambda x: x * c, "Add": lambda x: x + c,
            "Sub": (lambda x: x - c) if first else (lambda x: c - x),
            "Div": (lambda x: x / c) if first else (lambda x: c / x)}[ctx.op]


SCALAR_OPS = scalar_arithmetic_ops()  # Mul / Add / Sub / Div, of a tensor and a scalar constant


def lower_lut_chain(ctx: LowerCtx, chain: list[LowerCtx]) -> None:
    """The op and the element-wise ops that follow it without a quantization in between (the
    quantizer's lookup-table chains, e.g. HardSwish -> Mul by a scalar -> Add a scalar) as one table."""
    x_index = next((i for i, o in enumerate(ctx.inputs) if o.kind == "act"), 0)
    head = unary_function(ctx, x_index)
    if head is None:
        raise Unsupported(f"output '{ctx.node.output[0]}' feeds float element-wise ops without being quantized")
    links = []
    for link in chain:
        fn = unary_function(link, next(i for i, o in enumerate(link.inputs) if o.kind == "chain"))
        if fn is None:
            raise Unsupported(f"{link.op} '{link.name}' in the element-wise chain is not a function of one tensor")
        links.append(fn)

    def composed(x: np.ndarray) -> np.ndarray:
        y = head(x)
        for fn in links:
            y = fn(y)
        return y

    emit_lut(ctx, composed, x_index=x_index)


def _affine_clip(ctx: LowerCtx, a: float, b: float, lo: float, hi: float) -> None:
    """clip(a * x + b, lo, hi) exactly, as one QAdd of x and a constant (no table, no knots)."""
    xq, yq = ctx.act(0), ctx.out()
    ra, const = a * xq.s / yq.s, b / yq.s
    m, n = (int(v) for v in ctx.multiplier(ra, xq.max_centered, "affine scale"))
    while n and abs(m) * xq.max_centered + abs(const) * 2.0**n >= INT64_LIMIT:
        n -= 1
        m = int(np.rint(ra * 2.0**n))
    own = clamp_of(yq, lo, hi)
    common = ctx.common()
    common["out_min"], common["out_max"] = max(common["out_min"], own[0]), min(common["out_max"], own[1])
    ctx.emit("QAdd", [xq.name, ctx.add_init("const", np.array([np.rint(const * 2.0**n)], dtype=np.int64))],
             [yq.name], a_zp=xq.zp, b_zp=0, Ma=m, Mb=1, N=n, **common)


def _lower_lut(ctx: LowerCtx) -> None:
    if _domain(ctx) == "com.microsoft" and ctx.op == "FastGelu" and ctx.operand(1).kind != "absent":
        raise Unsupported("FastGelu with a bias input")
    if ctx.op == "HardSigmoid" and ctx.act(0).bits == 16 and float(ctx.attr("alpha", 0.2)) > 0:
        # piecewise linear: a 16-bit table would blur its two corners over a whole knot segment
        _affine_clip(ctx, float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5)), 0.0, 1.0)
        return
    fn = LUT_FUNCS[(_domain(ctx), ctx.op)]
    emit_lut(ctx, lambda x: fn(x, ctx))


for (_domain_name, _op) in LUT_FUNCS:
    if _op not in fused_activations():  # Relu / Clip, eltwise.py: Requantize on one grid, a table across grids
        rule(_op, domain=_domain_name)(_lower_lut)
