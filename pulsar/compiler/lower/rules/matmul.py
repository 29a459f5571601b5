"""MatMul / Gemm -> QMatMul: weights (symmetric, per output column) or a second activation; Gemm's
alpha folds into M, its bias into the accumulator (beta must be 1)."""

from __future__ import annotations

import numpy as np

from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported, rule
from pulsar.compiler.lower.rules.common import (
    bias_on_grid,
    channel_multipliers,
    symmetric_weight,
    weights_and_bias,
)


def _qmatmul(ctx: LowerCtx, *, trans_b: int, alpha: float, bias_index: int | None) -> None:
    aq = ctx.act(0)
    a_shape = ctx.in_shape(0)
    b_op = ctx.operand(1)
    if len(a_shape) < 2 or len(ctx.in_shape(1)) < 2:
        raise Unsupported(f"{ctx.op} of a 1-D operand (the NPU multiplies matrices of rank >= 2)")
    if ctx.operand(0).kind != "act":
        raise Unsupported(f"{ctx.op} with a constant first operand")
    yq = ctx.out()
    nout = ctx.out_shape()[-1]
    k = a_shape[-1]
    if b_op.kind == "act":
        bq = ctx.act(1)
        grid = np.array([alpha * aq.s * bq.s])
        b_name, b_zp = bq.name, bq.zp
        full_grid = np.broadcast_to(grid, (nout,))
        bias, bias_abs = ("", np.zeros(1)) if bias_index is None else bias_on_grid(ctx, bias_index, full_grid)
        bounds = np.broadcast_to(float(k) * bq.max_centered * float(aq.max_centered) + bias_abs, (nout,))
    else:
        rank = b_op.value.ndim if b_op.value is not None else 2
        axis = (rank - 2 if trans_b else rank - 1)
        w_op, w_scale = symmetric_weight(ctx, 1, axis, packed_zp=True)
        assert w_op.value is not None and w_op.q is not None
        if w_scale.size != nout:
            raise Unsupported(f"{ctx.op} weight scales ({w_scale.size}) do not match the {nout} output columns")
        b_zp = 0
        b_name, full_grid, bias, bounds = weights_and_bias(ctx, w_op.q.name, w_op.value, axis, alpha * aq.s * w_scale,
                                                           aq.max_centered, yq.s, bias_index)
        grid = full_grid
    if grid.size == 1 and not bias:  # one multiplier for every column
        m, n = channel_multipliers(ctx, grid / yq.s, np.array([bounds.max()]), "matmul output scale")
    else:
        m, n = channel_multipliers(ctx, full_grid / yq.s, bounds, "matmul output scale")
    ctx.emit("QMatMul", [aq.name, b_name, bias, ctx.add_init("M", m.reshape(-1)), ctx.add_init("N", n.reshape(-1)),
                         *ctx.weight_zp_inputs(b_name)],
             [yq.name], a_zp=aq.zp, b_zp=b_zp, trans_b=int(trans_b), **ctx.common())


@rule("MatMul")
def lower_matmul(ctx: LowerCtx) -> None:
    _qmatmul(ctx, trans_b=0, alpha=1.0, bias_index=None)


@rule("Gemm")
def lower_gemm(ctx: LowerCtx) -> None:
    if int(ctx.attr("transA", 0)):
        raise Unsupported("Gemm transA = 1 (transpose the first operand in the float model)")
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    if ctx.operand(2).kind != "absent" and beta != 1.0:
        raise Unsupported("Gemm beta != 1 (fold beta into the bias of the float model)")
    if alpha == 0.0:
        raise Unsupported("Gemm alpha = 0")
    _qmatmul(ctx, trans_b=int(ctx.attr("transB", 0)), alpha=alpha, bias_index=2)
