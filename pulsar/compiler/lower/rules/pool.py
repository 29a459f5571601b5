"""Averaging pools and reductions -> QAvgPool / QReduceMean (sum of centered integers, then one
requantization whose multiplier includes 1 / count); max pools and ReduceMax are passive."""

from __future__ import annotations

import math

import numpy as np

from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported, rule
from pulsar.compiler.lower.rules.common import check_bound, explicit_pads
from pulsar.compiler.lower.rules.movement import lower_passive
from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.errors import PulsarError


def _shared_shift(ctx: LowerCtx, reals: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, int]:
    """Multipliers for several factors with one shift N: the largest N every factor fits at."""
    n = 62
    for r, b in zip(reals, bounds, strict=True):
        try:
            n = min(n, int(quantize_multiplier(r, int(b), what=f"{ctx.name}: average scale")[1]))
        except PulsarError as exc:
            raise Unsupported(str(exc)) from None
    return np.rint(reals * 2.0**n).astype(np.int64), n


@rule("AveragePool")
def lower_avgpool(ctx: LowerCtx) -> None:
    xq, yq = ctx.act(0), ctx.out()
    kernel = tuple(int(k) for k in ctx.attr("kernel_shape", []))
    if not kernel:
        raise Unsupported("AveragePool without kernel_shape")
    if any(d != 1 for d in ctx.attr("dilations", [1] * len(kernel))):
        raise Unsupported("AveragePool with dilations")
    strides = list(ctx.attr("strides", [1] * len(kernel)))
    pads = explicit_pads(ctx, ctx.in_shape(0)[2:], kernel, strides, [1] * len(kernel))
    size = math.prod(kernel)
    count = np.arange(1, size + 1, dtype=np.float64)
    check_bound(ctx, float(size * xq.max_centered))
    m, n = _shared_shift(ctx, xq.s / (yq.s * count), count * xq.max_centered)
    table = np.concatenate([[0], m]).astype(np.int64)
    ctx.emit("QAvgPool", [xq.name, ctx.add_init("M", table)], [yq.name], x_zp=xq.zp, N=n,
             kernel_shape=list(kernel), strides=strides, pads=pads, ceil_mode=int(ctx.attr("ceil_mode", 0)),
             count_include_pad=int(ctx.attr("count_include_pad", 0)), **ctx.common())


def _reduce(ctx: LowerCtx, axes: list[int], keepdims: int, mean: bool) -> None:
    xq, yq = ctx.act(0), ctx.out()
    shape = ctx.in_shape(0)
    rank = len(shape)
    axes = sorted({a + rank if a < 0 else a for a in axes})
    if any(a < 0 or a >= rank for a in axes):
        raise Unsupported(f"{ctx.op} axes {axes} out of range")
    count = math.prod(shape[a] for a in axes)
    bound = check_bound(ctx, float(count * xq.max_centered))
    real = xq.s / (yq.s * (count if mean else 1))
    m, n = ctx.multiplier(real, bound, "mean scale")
    ctx.emit("QReduceMean", [xq.name], [yq.name], x_zp=xq.zp, axes=axes, keepdims=int(keepdims), M=int(m), N=int(n),
             **ctx.common())


@rule("GlobalAveragePool")
def lower_global_avgpool(ctx: LowerCtx) -> None:
    rank = len(ctx.in_shape(0))
    _reduce(ctx, list(range(2, rank)), 1, mean=True)


@rule("ReduceMean", "ReduceSum")
def lower_reduce(ctx: LowerCtx) -> None:
    axes_from_input = (ctx.op == "ReduceSum" and ctx.g.opset >= 13) or ctx.g.opset >= 18
    if axes_from_input:
        value = ctx.const_value(1, "axes") if len(ctx.node.input) > 1 else None
        axes = [] if value is None else [int(a) for a in np.asarray(value).reshape(-1)]
    else:
        axes = list(ctx.attr("axes", []))
    if not axes:
        if int(ctx.attr("noop_with_empty_axes", 0)):
            raise Unsupported(f"{ctx.op} with empty axes and noop_with_empty_axes")
        axes = list(range(len(ctx.in_shape(0))))
    _reduce(ctx, axes, int(ctx.attr("keepdims", 1)), mean=ctx.op == "ReduceMean")


@rule("MaxPool", "GlobalMaxPool", "ReduceMax")
def lower_maxpool(ctx: LowerCtx) -> None:
    if ctx.op == "MaxPool" and len([o for o in ctx.node.output if o]) > 1:
        raise Unsupported("MaxPool with an Indices output")
    lower_passive(ctx)
