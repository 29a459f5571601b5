"""Softmax -> QSoftmax: exp of the (non-negative) distance to the row maximum from a table, then
one rounded division by the row sum onto the output grid.

The table holds ``round(exp(-d * s_x) * 2**E)``. The kernel's result is invariant to E (it divides
by the sum of the same entries); the contract's default is E = 20, but a wide row (a 6625-class
CTC head) loses many small terms to rounding at 2**20, so E is as large as int32 and the int64
bounds of ``round_div(e * Q, s << P)`` allow. P keeps Q = round(2**P / s_y) at >= 24 bits.
"""

from __future__ import annotations

import math

import numpy as np

from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported, rule

E_MAX = 30
P_MAX = 40


def _scales(n: int, s_y: float) -> tuple[int, int, int]:
    """(E, P, Q) such that 2 * e * Q and 2 * (sum << P) stay below 2**62."""
    p = int(min(max(math.ceil(24 + math.log2(s_y)), 0), P_MAX))
    q = int(np.rint(2.0**p / s_y))
    e = min(E_MAX, 60 - math.ceil(math.log2(q + 1)), 60 - math.ceil(math.log2(n)) - p)
    return e, p, q


@rule("Softmax")
def lower_softmax(ctx: LowerCtx) -> None:
    xq, yq = ctx.act(0), ctx.out()
    shape = ctx.in_shape(0)
    rank = len(shape)
    axis = int(ctx.attr("axis", -1 if ctx.g.opset >= 13 else 1))
    axis = axis + rank if axis < 0 else axis
    if ctx.g.opset < 13 and axis != rank - 1:
        raise Unsupported("Softmax before opset 13 over several axes (coerced to 2-D)")
    n = shape[axis]
    e_bits, p, q = _scales(n, yq.s)
    if e_bits < 12 or q <= 0:
        raise Unsupported(f"Softmax over {n} elements with output scale {yq.s:.3g} overflows int64")
    if xq.bits == 8:
        step = 0
        d = np.arange(256, dtype=np.int64)
    else:
        # linear interpolation of exp over a segment of h = 2**step * s_x errs by up to h**2 / 8
        # (relative): knots at least as dense as lut_items_in_bits asks, denser when that error
        # would exceed a quarter of an output step
        step = 16 - int(ctx.lut_items_in_bits)
        needed = int(np.floor(np.log2(np.sqrt(2.0 * yq.s) / xq.s))) if xq.s < np.sqrt(2.0 * yq.s) else 0
        step = max(0, min(step, needed))
        d = np.arange(65536 if step == 0 else (65536 >> step) + 1, dtype=np.int64) << step
    table = np.rint(np.exp(-d.astype(np.float64) * xq.s) * 2.0**e_bits).astype(np.int64)
    ctx.emit("QSoftmax", [xq.name, ctx.add_init("table", table.astype(np.int32))], [yq.name], axis=axis,
             step_bits=step, Q=q, P=p, **ctx.common())
