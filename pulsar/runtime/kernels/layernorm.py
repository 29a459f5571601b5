"""QLayerNorm: exact integer mean / variance over the last axis, floor integer square root.

``xc = x - x_zp``, ``d = n * xc - sum(xc)`` (n times the centered value, exact), ``v = sum(d^2) + eps_q``,
``r = max(isqrt(v), 1)``, ``z = sign(d) * round_div(|d| << F, r)`` (ties away from zero),
``y = clamp(rshift_round(z * g * M[c], N[c]) + beta[c] + out_zp)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.core.fixedpoint import rshift_round
from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import OutSpec, as_int64, check_shift, int_attr, round_div


def isqrt(v: np.ndarray) -> np.ndarray:
    """Floor integer square root of int64 values in [0, 2**62], exact (float guess, integer fix-up)."""
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(np.int64)
    for _ in range(2):  # the float64 guess is within one of the answer
        r = np.where(r * r > v, r - 1, r)
        r = np.where((r + 1) * (r + 1) <= v, r + 1, r)
    return r


def _per_channel(value: np.ndarray | None, what: str, n: int) -> np.ndarray | None:
    if value is None:
        return None
    arr = as_int64(value, what).reshape(-1)
    if arr.size not in (1, n):
        raise PulsarError(f"{what} has {arr.size} values; expected 1 or {n} (the normalized axis)")
    return arr


@register("QLayerNorm", domain=INT_DOMAIN)
def make_qlayernorm(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    spec = OutSpec.from_attrs(attrs)
    if int_attr(attrs, "axis", -1) != -1:
        raise PulsarError(f"axis = {attrs['axis']}: QLayerNorm normalizes the last axis only (axis -1)")
    x_zp = int_attr(attrs, "x_zp", 0)
    eps_q = int_attr(attrs, "eps_q", 0)
    f_bits = int_attr(attrs, "F", 12)
    if eps_q < 0 or not 0 <= f_bits <= 30:
        raise PulsarError(f"eps_q = {eps_q}, F = {f_bits}: expected eps_q >= 0 and 0 <= F <= 30")

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x, gamma, beta, m, n = (list(inputs) + [None] * 5)[:5]
        if x is None or m is None or n is None:
            raise PulsarError("inputs x, M and N are required")
        width = x.shape[-1]
        g = _per_channel(gamma, "gamma", width)
        b = _per_channel(beta, "beta", width)
        mm = _per_channel(m, "M", width)
        nn = check_shift(_per_channel(n, "N", width))
        xc = x.astype(np.int64)
        if x_zp:
            xc -= x_zp
        d = width * xc - xc.sum(axis=-1, keepdims=True)
        r = np.maximum(isqrt((d * d).sum(axis=-1, keepdims=True) + eps_q), 1)
        z = round_div(np.abs(d) << f_bits, r)
        z = np.where(d < 0, -z, z)
        if g is not None:
            z *= g
        y = rshift_round(z * mm, nn)
        if b is not None:
            y += b
        return [spec.finish(y)]

    return run
