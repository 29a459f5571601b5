"""QSoftmax: max-subtracted exponent table, integer sum, one rounded division per element.

``d = max(x, axis) - x`` (0 <= d < 2**bits), ``e = table(d)`` (direct for 8-bit x, interpolated with
step_bits for 16-bit x; ``table[d] = round(exp(-d * s_x) * 2**20)``), ``s = sum(e, axis)``,
``y = clamp(round_div(e * Q, s << P) + out_zp)`` with ``Q = round(2**P / s_y)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import OutSpec, int_attr, round_div
from pulsar.runtime.kernels.lut import expand_table


@register("QSoftmax", domain=INT_DOMAIN)
def make_qsoftmax(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    spec = OutSpec.from_attrs(attrs)
    axis = int_attr(attrs, "axis", -1)
    step_bits = int_attr(attrs, "step_bits", 0)
    q, p = int_attr(attrs, "Q"), int_attr(attrs, "P", 16)
    if not 0 <= p <= 40 or q < 0:
        raise PulsarError(f"Q = {q}, P = {p}: expected Q >= 0 and 0 <= P <= 40")
    table_const = consts[1] if len(consts) > 1 else None
    expanded: dict[int, np.ndarray] = {}

    def exp_table(table: np.ndarray, codes: int) -> np.ndarray:
        if table is table_const and codes in expanded:
            return expanded[codes]
        e = expand_table(table, step_bits, codes)
        if e[0] <= 0 or e.min() < 0:
            raise PulsarError("exponent table must be >= 0 with table[0] > 0 (exp(0) * 2**20)")
        if table is table_const:
            expanded[codes] = e
        return e

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x, table = inputs[0], inputs[1] if len(inputs) > 1 else None
        if x is None or table is None:
            raise PulsarError("inputs x and table are required")
        if x.dtype.kind not in "iu" or x.dtype.itemsize > 2:
            raise PulsarError(f"input has dtype {x.dtype}; QSoftmax takes 8- or 16-bit integer tensors")
        e_of_d = exp_table(table, 1 << (8 * x.dtype.itemsize))
        xi = x.astype(np.int64)
        d = xi.max(axis=axis, keepdims=True) - xi
        e = np.take(e_of_d, d)
        s = e.sum(axis=axis, keepdims=True)
        y = round_div(e * q, s << p)
        return [spec.finish(y)]

    return run
