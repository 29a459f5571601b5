"""QMatMul: ``matmul(a - a_zp, (b - b_zp)[^T]) + bias``, requantized per output column.

Like QConv, the products are summed by torch in float32 when every partial sum is provably an integer
below 2**24 (constant b: max over columns of sum|b_col| * max|a - a_zp|; activation b:
K * max|a - a_zp| * max|b - b_zp|, from the dtypes and then from the data), otherwise in float64.
A constant 2-D weight within int8 against 8-bit codes runs on onnxruntime's uint8 ``MatMulInteger``
where the "avx2" path is trusted (exact int32 sums, :mod:`pulsar.runtime.kernels.ort_int`): a
classifier's 1280 x 1000 weights are read as 1.3 MB of bytes instead of 5 MB of float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import (
    FLOAT32_EXACT,
    OutSpec,
    accum_float,
    as_int64,
    centered_bound,
    channel_param,
    data_bound,
    int_attr,
    weight_minus_zero_points,
)
from pulsar.runtime.kernels.conv import centered_float
from pulsar.runtime.kernels.int8 import u8u8_matmul
from pulsar.runtime.kernels.ort_int import INT32_LIMIT, MAX_DEPTH, U8U8Matmul
from pulsar.runtime.kernels.requant import Requant


def _oriented(b: np.ndarray, trans_b: bool) -> np.ndarray:
    return np.swapaxes(b, -1, -2) if trans_b and b.ndim >= 2 else b


class _ConstB:
    """A weight operand converted once: centered, oriented [..., K, Nout], column |.| sums."""

    def __init__(self, b: np.ndarray, b_zp: int, trans_b: bool) -> None:
        centered = _oriented(as_int64(b, "b") - b_zp, trans_b)
        self.b = np.ascontiguousarray(centered)
        absb = np.abs(self.b)
        if self.b.ndim == 1:
            self.colsum = absb.sum(keepdims=True)
        else:
            self.colsum = absb.sum(axis=-2).reshape(-1, absb.shape[-1]).max(axis=0)
        self._torch: dict[str, Any] = {}
        self.int8 = self.b.ndim == 2 and (not self.b.size or (int(self.b.min()) >= -128 and int(self.b.max()) <= 127))
        self._u8u8: dict[int, U8U8Matmul] = {}

    def u8u8(self, a: np.ndarray, a_zp: int) -> Any | None:
        """The exact int32 sums ``(a - a_zp) @ b`` (shape ``[..., Nout]``, torch) on onnxruntime's uint8
        ``MatMulInteger``; int8 codes enter as ``a + 128`` against ``a_zp + 128``. None where that path
        does not apply: a weight that is not 2-D within int8, codes that are not 8-bit, a depth or sums
        that could leave int32, or the path not trusted here (:func:`u8u8_matmul`)."""
        k = self.b.shape[0] if self.b.ndim == 2 else 0
        if not self.int8 or a.dtype.itemsize != 1 or a.dtype.kind not in "iu" or a.ndim < 1 or a.shape[-1] != k \
                or not a.size:
            return None
        zp = a_zp + (128 if a.dtype.kind == "i" else 0)
        top = int(self.colsum.max()) if self.colsum.size else 0
        if (not 0 <= zp <= 255 or k > MAX_DEPTH or top * centered_bound(a.dtype, a_zp) >= INT32_LIMIT
                or not u8u8_matmul()):
            return None
        import torch

        product = self._u8u8.get(zp)
        if product is None:
            product = self._u8u8[zp] = U8U8Matmul(self.b, zp)
        rows = np.ascontiguousarray(a).reshape(-1, k)
        if a.dtype.kind == "i":  # int8 v + 128 is v ^ 0x80 read as uint8
            rows = np.bitwise_xor(rows.view(np.uint8), np.uint8(0x80))
        return torch.from_numpy(product(rows)).reshape(*a.shape[:-1], self.b.shape[1])

    def weight(self, kind: str) -> Any:
        if kind not in self._torch:
            import torch

            self._torch[kind] = torch.from_numpy(self.b.astype(kind))
        return self._torch[kind]


@register("QMatMul", domain=INT_DOMAIN)
def make_qmatmul(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    spec = OutSpec.from_attrs(attrs)
    a_zp, b_zp = int_attr(attrs, "a_zp", 0), int_attr(attrs, "b_zp", 0)
    trans_b = bool(int_attr(attrs, "trans_b", 0))
    consts = list(consts) + [None] * (6 - len(consts))
    raw_b = consts[1]
    if raw_b is not None and consts[5] is not None:  # U4 weights: a zero point per output column, centred once
        consts[1] = weight_minus_zero_points(raw_b, consts[5], -2 if trans_b else -1)
    const_b = _ConstB(consts[1], b_zp, trans_b) if consts[1] is not None else None
    requants: dict[tuple, Requant] = {}

    def requantizer(key: tuple, channels: int, bound: np.ndarray, bias: Any, m: Any, n: Any) -> Requant:
        cacheable = bias is consts[2] and m is consts[3] and n is consts[4]
        if cacheable and key in requants:
            return requants[key]
        rq = Requant(channel_param(m, "M", channels, 0), channel_param(n, "N", channels, 0), spec,
                     channel_param(bias, "bias", channels, 0), bound)
        if cacheable:
            requants[key] = rq
        return rq

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        a, b, bias, m, n = (list(inputs) + [None] * 5)[:5]
        if a is None or b is None or m is None or n is None:
            raise PulsarError("inputs a, b, M and N are required")
        amax = centered_bound(a.dtype, a_zp)
        if const_b is not None and b is raw_b:
            cb = const_b
            sums = cb.u8u8(a, a_zp)
            if sums is not None:
                rq = requantizer(("const", amax), cb.colsum.size, cb.colsum * amax, bias, m, n)
                return [rq.torch(sums)]
            top = int(cb.colsum.max()) if cb.colsum.size else 0
            kind = "float32" if top * amax < FLOAT32_EXACT else accum_float(top * data_bound(a, a_zp),
                                                                            "QMatMul accumulator")
            at = centered_float(a, a_zp, kind)
            bt = cb.weight(kind)
            channels = cb.colsum.size
            rq = requantizer(("const", amax), channels, cb.colsum * amax, bias, m, n)
        else:
            k = b.shape[-1] if (trans_b and b.ndim >= 2) else b.shape[-2] if b.ndim >= 2 else b.shape[0]
            bmax = centered_bound(b.dtype, b_zp)
            bound = k * amax * bmax
            kind = "float32" if bound < FLOAT32_EXACT else accum_float(
                k * data_bound(a, a_zp) * data_bound(b, b_zp), "QMatMul accumulator")
            at = centered_float(a, a_zp, kind)
            bt = centered_float(b, b_zp, kind)
            if trans_b and b.ndim >= 2:
                bt = bt.transpose(-1, -2)
            channels = b.shape[-2] if (trans_b and b.ndim >= 2) else b.shape[-1] if b.ndim >= 2 else 1
            rq = requantizer(("act", k, amax, bmax), channels, np.asarray(bound), bias, m, n)
        import torch  # at run time: preparing a program (the compiler's load check) needs no torch

        with torch.no_grad():
            acc = torch.matmul(at, bt)
        if acc.dim() == 0:  # vector . vector: one column, its (M, N) of shape [1] must not make y 1-D
            return [rq.torch(acc.reshape(1)).reshape(())]
        return [rq.torch(acc)]

    return run
