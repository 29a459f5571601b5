"""LayerNormalization -> QLayerNorm: exact integer mean / variance, integer square root, the
normalized value in 2**F units, then gamma folded into a per-channel (M, N) and beta on the
output grid. F grows with the output precision (16-bit outputs need finer z than F = 12); a bias
is added by a QAdd on a finer int32 grid so the result is rounded once."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from pulsar.compiler.lower.rules.base import INT64_LIMIT, LowerCtx, Unsupported, rule

F_MIN, F_MAX = 12, 30
FINE_BITS = 8  # the normalized term's grid is 2**8 times finer than the output's when beta is added  # fraction bits of the normalized value z (the kernel takes 0..30)


def _fraction_bits(n: int, span: int, gamma_max: float, s_y: float) -> int:
    """Bits of z: enough that one z step is <= 1/8 output step, few enough that |d| << F and the
    rounded division (2a + b) stay below 2**62."""
    want = math.ceil(math.log2(max(8.0 * math.sqrt(n) * gamma_max / s_y, 1.0)))
    limit = 60 - math.ceil(math.log2(n * span + 1))
    return max(0, min(max(want, F_MIN), F_MAX, limit))


def _prescale_bits(n: int, xq_bits: int, out_bits: int, max_centered: int, span: int) -> int:
    """Bits to widen the centered input by so that the floored r = isqrt(v) errs by at most ~1/4
    of an output step over the full output range. r ~ n**1.5 * std: a row's std is assumed to be
    at least half a step of an 8-bit input grid (16 steps of a 16-bit one). Bounded by the
    container (int16 for 8-bit inputs, int32 for 16-bit ones) and the int64 variance bound."""
    std_bits = -1 if xq_bits == 8 else 4
    want = math.ceil(out_bits + 2 - std_bits - 1.5 * math.log2(n))
    container = 15 if xq_bits == 8 else 31
    fit = math.floor(container - math.log2(max(max_centered, 1) + 1))
    fit64 = math.floor((61 - 3 * math.log2(n)) / 2 - math.log2(span))
    return max(0, min(want, fit, fit64))


def _per_channel(ctx: LowerCtx, i: int, what: str, n: int, default: float) -> np.ndarray:
    value = ctx.const_value(i, what) if len(ctx.node.input) > i else None
    if value is None:
        return np.full(n, default)
    value = np.asarray(value, dtype=np.float64)
    if value.size not in (1, n) or (value.ndim and max(value.shape) != value.size):
        raise Unsupported(f"LayerNormalization {what} of shape {list(value.shape)} is not per channel")
    return np.broadcast_to(value.reshape(-1), (n,)).copy()


@rule("LayerNormalization")
def lower_layernorm(ctx: LowerCtx) -> None:
    xq, yq = ctx.act(0), ctx.out()
    shape = ctx.in_shape(0)
    rank = len(shape)
    axis = int(ctx.attr("axis", -1))
    if (axis + rank if axis < 0 else axis) != rank - 1:
        raise Unsupported("LayerNormalization over more than the last axis")
    n = shape[-1]
    span = xq.qmax - xq.qmin
    if n**3 * span**2 >= INT64_LIMIT:
        raise Unsupported(f"LayerNorm too wide for int64 variance ({n} channels at {xq.bits} bits; "
                          "use 8-bit input for it or keep it on the CPU)")
    x_name, x_zp, s_x = xq.name, xq.zp, xq.s
    j = _prescale_bits(n, xq.bits, yq.bits, xq.max_centered, span)
    if j:
        # r = isqrt(v) is floored: a short row on a coarse grid (small v) would lose part of its
        # scale, so the centered input is first widened by 2**j (int16 / int32)
        to = TensorProto.INT16 if xq.bits == 8 else TensorProto.INT32
        lo, hi = (-(2**15), 2**15 - 1) if xq.bits == 8 else (-(2**31), 2**31 - 1)
        x_name = ctx.declare(f"{ctx.name}/prescaled", to, shape)
        ctx.emit("Requantize", [xq.name], [x_name], suffix="prescale", x_zp=xq.zp, M=2**j, N=0, out_zp=0,
                 out_min=lo, out_max=hi, to=to)
        x_zp, s_x, span = 0, xq.s / 2.0**j, span * 2**j
    eps = float(ctx.attr("epsilon", 1e-5))
    eps_q = int(np.rint(eps * n**3 / s_x**2))
    if n**3 * span**2 + eps_q >= INT64_LIMIT:
        raise Unsupported(f"LayerNorm epsilon {eps:g} is too large for int64 variance on this input grid")
    gamma = _per_channel(ctx, 1, "scale", n, 1.0)
    beta = _per_channel(ctx, 2, "bias", n, 0.0)
    g_max = float(np.abs(gamma).max(initial=0))
    # With a bias, the normalized term goes to an int32 grid 2**k finer than the output's and a
    # QAdd adds beta there before the one rounding onto the output grid: beta added after the
    # kernel's own rounding would round twice (a 1-step error on a quarter of the elements).
    k = 0
    if np.any(beta):
        k = int(min(FINE_BITS, math.floor(30 - math.log2(max(g_max * math.sqrt(n) / yq.s, 1.0)))))
        k = max(k, 0)
    s_mid = yq.s / 2.0**k
    f = _fraction_bits(n, span, g_max, s_mid)
    m, nn = ctx.multiplier(gamma * math.sqrt(n) / (s_mid * 2.0**f), 2**f + 1, "normalization scale")
    attrs = {"axis": -1, "x_zp": x_zp, "eps_q": eps_q, "F": f}
    inputs = [x_name, "", "", ctx.add_init("M", m), ctx.add_init("N", nn)]
    if k == 0:
        beta_q = np.rint(beta / yq.s)
        if np.any(beta_q):
            inputs[2] = ctx.add_init("beta", beta_q.astype(np.int64))
        ctx.emit("QLayerNorm", inputs, [yq.name], **attrs, **ctx.common())
        return
    mid = ctx.declare(f"{ctx.name}/normalized", TensorProto.INT32, ctx.out_shape())
    ctx.emit("QLayerNorm", inputs, [mid], **attrs, out_zp=0, out_min=-(2**31), out_max=2**31 - 1,
             to=TensorProto.INT32)
    beta_q = np.rint(beta * 2.0**k / yq.s).astype(np.int64)
    ctx.emit("QAdd", [mid, ctx.add_init("beta", beta_q)], [yq.name], suffix="beta", a_zp=0, b_zp=0, Ma=1, Mb=1, N=k,
             **ctx.common())
