"""Pieces shared by the accumulate-then-requantize rules (Conv, MatMul / Gemm)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx import TensorProto

from pulsar.compiler.lower.qdq_graph import QParams
from pulsar.compiler.lower.rules.base import INT64_LIMIT, LowerCtx, Operand, Unsupported
from pulsar.core.padding import auto_pads

INT8_16 = (np.int8, np.int16)


def symmetric_weight(ctx: LowerCtx, i: int, axis: int, what: str = "weight",
                     packed_zp: bool = False) -> tuple[Operand, np.ndarray]:
    """A quantized constant weight with zero points 0, per tensor or per channel along ``axis``.

    Returns the operand and its per-channel scale along ``axis`` (float64, length of that axis)."""
    op = ctx.operand(i)
    if op.kind == "const":
        raise Unsupported(f"{ctx.op} {what} '{op.name}' is not quantized (float weights stay on the CPU)")
    if op.kind != "qconst" or op.q is None or op.value is None:
        raise Unsupported(f"{ctx.op} {what} '{op.name}' is not a quantized constant")
    if np.any(op.q.zero_point != 0) or op.q.elem_type == TensorProto.UINT4:
        op = _centered(ctx, op, what, packed_zp and op.q.elem_type == TensorProto.UINT4 and not op.q.per_tensor
                       and (op.q.axis if op.q.axis is not None else 1) % op.value.ndim == axis % op.value.ndim)
    if op.value is None or op.value.dtype.type not in INT8_16:
        raise Unsupported(f"{ctx.op} {what} '{op.name}' is {op.q.elem_type if op.value is None else op.value.dtype}; "
                          "the NPU takes int4 / int8 / int16 weights")
    size = op.value.shape[axis] if op.value.ndim else 1
    if op.q.per_tensor:
        return op, np.full(size, op.q.s)
    q_axis = op.q.axis if op.q.axis is not None else 1
    if q_axis % op.value.ndim != axis % op.value.ndim:
        raise Unsupported(f"{ctx.op} {what} '{op.name}' is quantized along axis {q_axis}, not its output-channel "
                          f"axis {axis}")
    return op, op.q.scale.astype(np.float64)


def _centered(ctx: LowerCtx, op: Operand, what: str, packed_zp: bool = False) -> Operand:
    """An affine weight (U4, or any zero point != 0) as the symmetric integers q - zero_point, which
    the kernels multiply: with ``packed_zp`` (a U4 weight per output channel read by an op with a
    zero-point input) the stored UINT4 tensor itself, its zero points given to the op; else a private
    copy, INT4 (two per byte) when it fits, else int8."""
    assert op.q is not None and op.value is not None
    if op.q.bits > 8:
        raise Unsupported(f"{ctx.op} {what} '{op.name}' is asymmetric 16-bit (zero point != 0)")
    shape = [1] * op.value.ndim
    if not op.q.per_tensor:
        shape[op.q.axis if op.q.axis is not None else 1] = -1
    centered = op.value.astype(np.int64) - op.q.zero_point.reshape(shape if not op.q.per_tensor else ())
    lo, hi = int(centered.min(initial=0)), int(centered.max(initial=0))
    narrow = lo >= -8 and hi <= 7
    if not narrow and (lo < -128 or hi > 127):
        raise Unsupported(f"{ctx.op} {what} '{op.name}': q - zero_point spans [{lo}, {hi}], beyond int8")
    if packed_zp and not narrow:
        ctx.weight_zps[op.q.name] = op.q.zero_point.reshape(-1)
        q = QParams(op.q.name, op.q.scale, np.zeros_like(op.q.zero_point), TensorProto.INT8, op.q.axis)
        return Operand(op.q.name, "qconst", q, centered.astype(np.int8))
    elem = TensorProto.INT4 if narrow else TensorProto.INT8
    name = ctx.add_init("w_centered", centered.astype(ml_dtypes.int4 if narrow else np.int8))
    q = QParams(name, op.q.scale, np.zeros_like(op.q.zero_point), elem, op.q.axis)
    return Operand(name, "qconst", q, centered.astype(np.int8))


def bias_on_grid(ctx: LowerCtx, i: int, grid: np.ndarray) -> tuple[str, np.ndarray]:
    """The bias input ``i`` as integers on the accumulator grid ``grid`` (one step per output channel).

    A QDQ int32 bias whose scale already is that grid is used as it is (stored once with the QDQ
    model); any other bias (float, other scale, Gemm alpha) is rounded onto the grid as int64.
    Returns (name or '', |bias| per channel)."""
    op = ctx.operand(i)
    cout = grid.size
    if op.kind == "absent":
        return "", np.zeros(cout)
    if not op.is_const:
        raise Unsupported(f"{ctx.op} bias '{op.name}' is computed at run time")
    if op.kind == "qconst" and op.q is not None and op.value is not None and op.value.ndim == 1 \
            and op.value.size == cout and np.all(op.q.zero_point == 0) and op.value.dtype == np.int32:
        scale = np.broadcast_to(op.q.scale.astype(np.float64).reshape(-1), (cout,))
        if np.allclose(scale, grid, rtol=1e-6, atol=0):
            return ctx.use_init(op.q.name), np.abs(op.value.astype(np.float64))
    real = op.real()
    if real.size not in (1, cout) or (real.ndim and max(real.shape) != real.size):
        raise Unsupported(f"{ctx.op} bias '{op.name}' of shape {list(real.shape)} does not broadcast along the "
                          f"output channels")
    real = np.broadcast_to(real.reshape(-1), (cout,))
    b = np.rint(real / grid)
    if not np.all(np.isfinite(b)) or np.abs(b).max(initial=0) >= 2.0**62:
        raise Unsupported(f"{ctx.op} bias '{op.name}' is too large for the accumulator grid")
    return ctx.add_init("bias", b.astype(np.int64)), np.abs(b)


def channel_multipliers(ctx: LowerCtx, real: np.ndarray, bounds: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) per output channel, each with its own accumulator bound: one channel with a huge bound
    (a bias over near-zero weights) must not cost the others their multiplier precision. Bounds are
    rounded up to powers of two (safe: a larger bound only lowers the limit on M) so channels are
    derived in a few vectorized groups."""
    real = np.asarray(real, dtype=np.float64).reshape(-1)
    bounds = np.broadcast_to(np.asarray(bounds, dtype=np.float64).reshape(-1), real.shape)
    exps = np.ceil(np.log2(np.maximum(bounds, 1.0))).astype(np.int64)
    m = np.zeros(real.shape, dtype=np.int64)
    n = np.zeros(real.shape, dtype=np.int64)
    for e in np.unique(exps):
        idx = exps == e
        m[idx], n[idx] = ctx.multiplier(real[idx], check_bound(ctx, 2.0 ** int(e)), what)
    return m, n


def check_bound(ctx: LowerCtx, bound: float) -> int:
    if not math.isfinite(bound) or bound >= INT64_LIMIT:
        raise Unsupported(f"{ctx.op} accumulator may overflow int64 (bound 2^{math.log2(max(bound, 1)):.0f})")
    return int(math.ceil(bound))


def explicit_pads(ctx: LowerCtx, in_spatial: tuple[int, ...], kernel: tuple[int, ...], strides: list[int],
                  dilations: list[int]) -> list[int]:
    """ONNX ``pads`` (begin..., end...) with ``auto_pad`` resolved from the static shapes."""
    rank = len(kernel)
    auto = ctx.attr_str("auto_pad", "NOTSET")
    if auto == "NOTSET":
        pads = list(ctx.attr("pads", [0] * 2 * rank))
        if len(pads) != 2 * rank:
            raise Unsupported(f"{ctx.op} pads {pads} do not match a {rank}-D kernel")
        return pads
    return auto_pads(auto, in_spatial, kernel, strides, dilations)


# Above this accumulator bound M keeps fewer than 18 bits, too few for a 16-bit output.
PRECISE_BOUND = 2.0**44


def weights_and_bias(ctx: LowerCtx, w_name: str, w: np.ndarray, axis: int, grid: np.ndarray, x_max: int,
                     y_scale: float, bias_index: int | None) -> tuple[str, np.ndarray, str, np.ndarray]:
    """(weight, accumulator grid, bias, accumulator bound) per output channel (along ``axis``).

    The QDQ weights are used as they are, except in two cases where the accumulator grid itself
    would cost accuracy; those channels then get integer weights scaled by 2**shift in a private
    copy of the tensor (the grid becomes grid / 2**shift):
    - a float bias (kept float by the QDQ model) on a grid coarser than the output step is rounded
      by up to half an accumulator step, many output steps for a 16-bit output: int8 weights are
      widened (shift up to 8, into int16) until the grid is below a quarter output step;
    - a channel whose bias dwarfs its weights (a near-zero channel whose weight scale was refined to
      a tiny value) needs ~2**53 accumulator steps for its bias and leaves M ~10 bits: its weights
      are divided by 2**k (they contribute far less than an output step)."""
    w64 = w.astype(np.int64)
    if w.shape[axis] != grid.size:
        raise Unsupported(f"{ctx.op} weight scales ({grid.size}) do not match its {w.shape[axis]} output channels")
    w_sum = np.moveaxis(np.abs(w64), axis, 0).reshape(grid.size, -1).sum(axis=1)
    if bias_index is None:
        bias, bias_abs = "", np.zeros(grid.size)
    else:
        bias, bias_abs = bias_on_grid(ctx, bias_index, grid)
    shift = np.zeros(grid.size, dtype=np.int64)
    if bias in ctx.inits and w.dtype == np.int8:
        shift = np.clip(np.ceil(np.log2(np.maximum(4.0 * np.abs(grid) / y_scale, 1.0))), 0, 8).astype(np.int64)
    bound = (w_sum * float(x_max) + bias_abs) * np.exp2(shift.astype(np.float64))
    shift -= np.ceil(np.log2(np.maximum(bound / PRECISE_BOUND, 1.0))).astype(np.int64)
    if not np.any(shift):
        return (w_name if w_name in ctx.inits else ctx.use_init(w_name)), grid, bias, w_sum * float(x_max) + bias_abs
    shape = [1] * w.ndim
    shape[axis] = -1
    factor = np.exp2(shift.astype(np.float64))
    scaled = np.rint(w64 * factor.reshape(shape)).astype(np.int64)
    dtype = np.int16 if np.any(shift > 0) else w.dtype
    info = np.iinfo(dtype)
    if scaled.size and (scaled.min() < info.min or scaled.max() > info.max):
        raise Unsupported(f"{ctx.op} weights do not fit {np.dtype(dtype).name} after rescaling")
    grid = grid / factor
    if bias_index is not None:
        bias, bias_abs = bias_on_grid(ctx, bias_index, grid)
    w_sum = np.moveaxis(np.abs(scaled), axis, 0).reshape(grid.size, -1).sum(axis=1)
    return ctx.add_init("w", scaled.astype(dtype)), grid, bias, w_sum * float(x_max) + bias_abs
