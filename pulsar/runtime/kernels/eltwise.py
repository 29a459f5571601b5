"""QAdd / QMul / Requantize: elementwise integer arithmetic with numpy broadcasting.

QAdd and Requantize are affine in their integer operands: ``floor(sum x_i * M_i / 2**N + c)``. When
every partial sum is an integer times ``2**-N`` below ``2**53`` (checked from the operand dtypes),
:class:`Affine64` evaluates them in float64 with torch, exactly; otherwise, and for QMul, int64
numpy runs the literal formula.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import (
    FLOAT64_EXACT,
    OutSpec,
    as_int64,
    blocked_shifted,
    check_shift,
    dtype_range,
    finish_float,
    in_memory_order,
    int_attr,
    requant,
    scratch_like,
    shifted_codes,
    shifts,
    to_torch,
)

_FLOAT_OPERANDS = frozenset(np.dtype(n) for n in ("uint8", "int8", "uint16", "int16", "int32"))


class Affine64:
    """``clamp(floor((sum x_i * M_i + off) / 2**N))`` in float64, ``off`` an integer (rounding half,
    zero points, ``out_zp << N``). Each product ``x_i * M_i * 2**-N`` and each partial sum is an
    integer times ``2**-N``; below ``2**53`` in magnitude every float64 operation is exact.

    8- / 16-bit outputs subtract ``out_min`` inside the offset (when the bound still holds) and run
    in cache-sized blocks ending in an unsigned cast (:func:`blocked_shifted`)."""

    def __init__(self, ms: list[int], off: int, n: int, spec: OutSpec) -> None:
        self.ms, self.off, self.n, self.spec = ms, off, n, spec
        self.scales = [float(np.ldexp(float(m), -n)) for m in ms]
        self.const = float(np.ldexp(float(off), -n))
        self.shifted_const = float(np.ldexp(float(off - (spec.lo << n)), -n))
        self._modes: dict[tuple[np.dtype, ...], tuple[str, bool] | None] = {}

    def _worst(self, off: int, dtypes: tuple[np.dtype, ...]) -> int | None:
        """``|off| + sum |M_i| * max |x_i|`` when it and every term are below 2**53, else None."""
        if abs(off) >= FLOAT64_EXACT or any(abs(m) >= FLOAT64_EXACT for m in self.ms):
            return None
        worst = abs(off) + sum(abs(m) * max(abs(v) for v in dtype_range(d)) for m, d in zip(self.ms, dtypes,
                                                                                          strict=True))
        return worst if worst < FLOAT64_EXACT else None

    def mode(self, xs: list[np.ndarray]) -> tuple[str, bool] | None:
        """("shifted", values inside int32) or ("plain", False) when the dtypes of ``xs`` prove the
        float64 evaluation exact, else None."""
        key = tuple(x.dtype for x in xs)
        if key not in self._modes:
            mode: tuple[str, bool] | None = None
            if all(k in _FLOAT_OPERANDS for k in key):
                worst = self._worst(self.off - (self.spec.lo << self.n), key) if shifts(self.spec) else None
                if worst is not None:
                    mode = ("shifted", worst >> self.n < (1 << 31) - 1)
                elif self._worst(self.off, key) is not None:
                    mode = ("plain", False)
            self._modes[key] = mode
        return self._modes[key]

    def exact_for(self, xs: list[np.ndarray]) -> bool:
        """Whether the dtypes of ``xs`` (same shape) prove the float64 evaluation exact."""
        return self.mode(xs) is not None and all(x.shape == xs[0].shape for x in xs)

    def __call__(self, xs: list[np.ndarray]) -> np.ndarray:
        import torch

        mode = self.mode(xs)
        ts = [to_torch(x) for x in xs]
        if mode is not None and mode[0] == "shifted":
            mem, cl = in_memory_order(ts[0])
            fmt = torch.channels_last if cl else torch.contiguous_format
            rows = [mem.reshape(-1)] + [in_memory_order(t.contiguous(memory_format=fmt))[0].reshape(-1)
                                        for t in ts[1:]]

            def fill(t: Any, i: int, j: int) -> None:
                t.copy_(rows[0][i:j])
                t.mul_(self.scales[0])
                for row, scale in zip(rows[1:], self.scales[1:], strict=True):
                    t.add_(row[i:j], alpha=scale)
                if self.shifted_const:
                    t.add_(self.shifted_const)

            out = blocked_shifted(rows[0].shape[0], (), self.spec, fill, mode[1])
            return shifted_codes(out, self.spec, tuple(mem.shape), cl)
        first = ts[0]
        t = scratch_like("affine", first, torch.float64)
        t.copy_(first)
        t.mul_(self.scales[0])
        for x, scale in zip(ts[1:], self.scales[1:], strict=True):
            t.add_(x, alpha=scale)
        if self.const:
            t.add_(self.const)
        return finish_float(t, self.spec)


def _half(n: int) -> int:
    return (1 << (n - 1)) if n else 0


def _scaled(x: np.ndarray, zp: int, m: int) -> np.ndarray:
    """``(x - zp) * m`` in a fresh int64 array."""
    v = as_int64(x, "operand").astype(np.int64, copy=True)
    if zp:
        v -= zp
    if m != 1:
        v *= m
    return v


@register("QAdd", domain=INT_DOMAIN)
def make_qadd(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """y = clamp(rshift_round((a - a_zp) * Ma + (b - b_zp) * Mb, N) + out_zp); Mb < 0 is a Sub."""
    spec = OutSpec.from_attrs(attrs)
    a_zp, b_zp = int_attr(attrs, "a_zp", 0), int_attr(attrs, "b_zp", 0)
    ma, mb = int_attr(attrs, "Ma"), int_attr(attrs, "Mb")
    n = int(check_shift(int_attr(attrs, "N")))
    consts = list(consts) + [None] * (2 - len(consts))
    pre = [None if c is None else _scaled(c, zp, mm) for c, zp, mm in zip(consts[:2], (a_zp, b_zp), (ma, mb), strict=True)]
    fast = Affine64([ma, mb], _half(n) - a_zp * ma - b_zp * mb + (spec.zp << n), n, spec)

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        if a is None or b is None:
            raise PulsarError("inputs a and b are required")
        if pre[0] is None and pre[1] is None and fast.exact_for([a, b]):
            return [fast([a, b])]
        va = pre[0] if pre[0] is not None and a is consts[0] else _scaled(a, a_zp, ma)
        vb = pre[1] if pre[1] is not None and b is consts[1] else _scaled(b, b_zp, mb)
        if va is pre[0] or va.shape != np.broadcast_shapes(va.shape, vb.shape):
            v = va + vb
        else:
            va += vb
            v = va
        if n:
            v += 1 << (n - 1)
            v >>= n
        return [spec.finish(v)]

    return run


@register("QMul", domain=INT_DOMAIN)
def make_qmul(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """y = requant((a - a_zp) * (b - b_zp), M, N) with M, N broadcast to y."""
    spec = OutSpec.from_attrs(attrs)
    a_zp, b_zp = int_attr(attrs, "a_zp", 0), int_attr(attrs, "b_zp", 0)
    consts = list(consts) + [None] * (4 - len(consts))
    pre_b = _scaled(consts[1], b_zp, 1) if consts[1] is not None else None
    if consts[3] is not None:
        check_shift(consts[3])

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        a, b, m, n = (list(inputs) + [None] * 4)[:4]
        if a is None or b is None or m is None or n is None:
            raise PulsarError("inputs a, b, M and N are required")
        vb = pre_b if pre_b is not None and b is consts[1] else _scaled(b, b_zp, 1)
        acc = _scaled(a, a_zp, 1)
        acc = acc * vb if acc.shape != np.broadcast_shapes(acc.shape, vb.shape) else np.multiply(acc, vb, out=acc)
        return [requant(acc, as_int64(m, "M"), check_shift(n), spec)]

    return run


@register("Requantize", domain=INT_DOMAIN)
def make_requantize(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """y = requant(x - x_zp, M, N): dtype changes, grid alignment, standalone Relu / Clip."""
    spec = OutSpec.from_attrs(attrs)
    x_zp = int_attr(attrs, "x_zp", 0)
    m = int_attr(attrs, "M", 1)
    n = int(check_shift(int_attr(attrs, "N", 0)))
    fast = Affine64([m], _half(n) - x_zp * m + (spec.zp << n), n, spec)

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        if x is None:
            raise PulsarError("input x is required")
        if fast.exact_for([x]):
            return [fast([x])]
        return [requant(_scaled(x, x_zp, 1), m, n, spec)]

    return run
