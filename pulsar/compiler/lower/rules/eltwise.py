"""Add / Sub -> QAdd, Mul / Div -> QMul, standalone Relu / Clip -> Requantize (or a table when the
input and output grids differ at 8 bits)."""

from __future__ import annotations

import numpy as np

from pulsar.compiler.lower.qdq_graph import QParams
from pulsar.compiler.lower.rules.base import INT64_LIMIT, LowerCtx, Operand, Unsupported, clamp_of, rule
from pulsar.compiler.lower.rules.lut import LUT_FUNCS, clip_bounds, emit_lut
from pulsar.core.fixedpoint import multiplier_limit


def _act_and_const(ctx: LowerCtx) -> tuple[int, int]:
    """Indices (activation, constant) of a binary op with one constant operand."""
    kinds = [ctx.operand(0).kind, ctx.operand(1).kind]
    if kinds[0] == "act" and ctx.operand(1).is_const:
        return 0, 1
    if kinds[1] == "act" and ctx.operand(0).is_const:
        return 1, 0
    raise Unsupported(f"{ctx.op} operands must be quantized activations or constants")


@rule("Add", "Sub")
def lower_add(ctx: LowerCtx) -> None:
    yq = ctx.out()
    sub = ctx.op == "Sub"
    if ctx.operand(0).kind == "act" and ctx.operand(1).kind == "act":
        aq, bq = ctx.act(0), ctx.act(1)
        ra, rb = aq.s / yq.s, (-1.0 if sub else 1.0) * bq.s / yq.s
        bound = aq.max_centered + bq.max_centered
        n = min(int(ctx.multiplier(abs(ra), bound, "add scale")[1]), int(ctx.multiplier(abs(rb), bound, "add scale")[1]))
        ma, mb = int(np.rint(ra * 2.0**n)), int(np.rint(rb * 2.0**n))
        if max(abs(ma), abs(mb)) > multiplier_limit(bound):
            raise Unsupported(f"{ctx.op} operand scales differ by {max(abs(ra), abs(rb)) / max(min(abs(ra), abs(rb)), 1e-300):.3g}x: "
                              "too far apart for one integer rescale (check the ranges of its inputs)")
        ctx.emit("QAdd", [aq.name, bq.name], [yq.name], a_zp=aq.zp, b_zp=bq.zp, Ma=ma, Mb=mb, N=n, **ctx.common())
        return
    ia, ic = _act_and_const(ctx)
    aq = ctx.act(ia)
    sign_a = -1.0 if (sub and ia == 1) else 1.0
    sign_c = -1.0 if (sub and ic == 1) else 1.0
    ra = sign_a * aq.s / yq.s
    creal = sign_c * ctx.operand(ic).real() / yq.s
    m, n = (int(v) for v in ctx.multiplier(ra, aq.max_centered, "add scale"))
    while True:
        scaled = creal * 2.0**n
        if np.all(np.abs(scaled) < 2.0**61) and abs(m) * aq.max_centered + np.abs(scaled).max(initial=0) < INT64_LIMIT:
            break
        if n == 0:
            raise Unsupported(f"{ctx.op} constant '{ctx.operand(ic).name}' is too large for the output grid")
        n -= 1
        m = int(np.rint(ra * 2.0**n))
    const = ctx.add_init("const", np.rint(scaled).astype(np.int64))
    ctx.emit("QAdd", [aq.name, const], [yq.name], a_zp=aq.zp, b_zp=0, Ma=m, Mb=1, N=n, **ctx.common())


def _mul_by_real(ctx: LowerCtx, aq: QParams, factor: np.ndarray) -> None:
    """y = a * factor (a constant array): the factor lives in per-element (M, N), b is a 1."""
    yq = ctx.out()
    real = aq.s * np.asarray(factor, dtype=np.float64) / yq.s
    if not np.all(np.isfinite(real)):
        raise Unsupported(f"{ctx.op} constant is not finite")
    m, n = ctx.multiplier(real, aq.max_centered, "mul scale")
    one = ctx.add_init("one", np.ones([1] * real.ndim, dtype=np.int8))  # rank of c: a scalar keeps y rank 0
    ctx.emit("QMul", [aq.name, one, ctx.add_init("M", m.reshape(real.shape)), ctx.add_init("N", n.reshape(real.shape))],
             [yq.name], a_zp=aq.zp, b_zp=0, **ctx.common())


def _mul_by_qconst(ctx: LowerCtx, aq: QParams, c: Operand) -> bool:
    """y = a * c with c a quantized constant on one zero point: c keeps its QDQ name (stored once)."""
    q, v = c.q, c.value
    if q is None or v is None or np.any(q.zero_point != q.zero_point.reshape(-1)[0]) or v.dtype.kind not in "iu":
        return False
    yq = ctx.out()
    scale = q.scale.astype(np.float64)
    if not q.per_tensor:
        shape = [1] * v.ndim
        shape[q.axis if q.axis is not None else 1] = -1
        scale = scale.reshape(shape)
    else:  # rank 0: a per-tensor (M, N) must not raise the rank of y (a scalar product stays a scalar)
        scale = scale.reshape(())
    zc = int(q.zero_point.reshape(-1)[0])
    bound = aq.max_centered * int(np.abs(v.astype(np.int64) - zc).max(initial=1))
    m, n = ctx.multiplier(aq.s * scale / yq.s, bound, "mul scale")
    ctx.emit("QMul", [aq.name, ctx.use_init(q.name), ctx.add_init("M", m), ctx.add_init("N", n)], [yq.name],
             a_zp=aq.zp, b_zp=zc, **ctx.common())
    return True


@rule("Mul")
def lower_mul(ctx: LowerCtx) -> None:
    yq = ctx.out()
    if ctx.operand(0).kind == "act" and ctx.operand(1).kind == "act":
        aq, bq = ctx.act(0), ctx.act(1)
        m, n = ctx.multiplier(aq.s * bq.s / yq.s, aq.max_centered * bq.max_centered, "mul scale")
        ctx.emit("QMul", [aq.name, bq.name, ctx.add_init("M", m.reshape(())), ctx.add_init("N", n.reshape(()))],
                 [yq.name], a_zp=aq.zp, b_zp=bq.zp, **ctx.common())
        return
    ia, ic = _act_and_const(ctx)
    aq, c = ctx.act(ia), ctx.operand(ic)
    if c.kind == "qconst" and _mul_by_qconst(ctx, aq, c):
        return
    _mul_by_real(ctx, aq, c.real())


@rule("Div")
def lower_div(ctx: LowerCtx) -> None:
    a, b = ctx.operand(0), ctx.operand(1)
    if a.kind == "act" and b.is_const:
        c = b.real()
        if np.any(c == 0):
            raise Unsupported("Div by a constant holding zeros")
        _mul_by_real(ctx, ctx.act(0), 1.0 / c)
        return
    if a.is_const and b.kind == "act":
        num = a.real()
        if num.size != 1 and np.any(num != num.reshape(-1)[0]):
            raise Unsupported("Div of a varying constant by an activation")
        k = float(num.reshape(-1)[0])
        emit_lut(ctx, lambda x: k / x, x_index=1)
        return
    raise Unsupported("Div of two activations is not supported by the NPU (it runs in float on the CPU)")


@rule("Relu", "Clip")
def lower_relu_clip(ctx: LowerCtx) -> None:
    xq, yq = ctx.act(0), ctx.out()
    lo, hi = clip_bounds(ctx)
    if lo > hi:
        raise Unsupported("Clip with min > max")
    if xq.same_grid(yq) or xq.bits == 16:
        own = clamp_of(yq, lo, hi)
        clamp = (max(ctx.clamps[0][0], own[0]), min(ctx.clamps[0][1], own[1]))
        ctx.requantize(xq, yq, clamp, xq.name, yq.name, None, None)
        return
    fn = LUT_FUNCS[("", ctx.op)]
    emit_lut(ctx, lambda x: fn(x, ctx))
