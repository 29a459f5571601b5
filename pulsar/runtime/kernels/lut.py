"""QLut: any unary elementwise function as a table the compiler built from the scales.

8-bit input: ``y = table[x - qmin]`` (256 entries). 16-bit input with ``step_bits = s``: knots every
``2**s`` codes, ``y = T[i] + rshift_round((T[i+1] - T[i]) * f, s)`` with ``i = u >> s``,
``f = u & (2**s - 1)``. Either way the result only depends on the input code, so the kernel expands
the table once per input dtype to one entry per code and each call is a single gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.core.fixedpoint import rshift_round
from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import OutSpec, array0, as_int64, int_attr


def expand_table(table: np.ndarray, step_bits: int, codes: int) -> np.ndarray:
    """int64 value of the (interpolated) table at every code u in [0, codes)."""
    t = as_int64(table, "table").reshape(-1)
    if not 0 <= step_bits <= 16:
        raise PulsarError(f"step_bits = {step_bits} must be in [0, 16]")
    need = codes if step_bits == 0 else ((codes - 1) >> step_bits) + 2
    if t.size < need:
        raise PulsarError(f"table has {t.size} entries; a {codes}-code input with step_bits {step_bits} needs {need}")
    u = np.arange(codes, dtype=np.int64)
    if step_bits == 0:
        return t[u]
    i = u >> step_bits
    f = u & ((1 << step_bits) - 1)
    return t[i] + rshift_round((t[i + 1] - t[i]) * f, step_bits)


def code_index(x: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(unsigned view of x, number of codes, roll) so that ``rolled[view] == table[x - qmin]``."""
    if x.dtype.kind not in "iu" or x.dtype.itemsize > 2:
        raise PulsarError(f"input has dtype {x.dtype}; table lookups take 8- or 16-bit integer tensors")
    codes = 1 << (8 * x.dtype.itemsize)
    if x.dtype.kind == "u":
        return x, codes, 0
    # a signed code v sits at u = v + codes/2; its unsigned view is v mod codes
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}")), codes, codes // 2


class CodeTable:
    """A table expanded per input dtype into a gather indexed by the unsigned view of the input."""

    def __init__(self, table: np.ndarray, step_bits: int, post: Any) -> None:
        self.table, self.step_bits, self.post = table, step_bits, post
        self._by_dtype: dict[str, np.ndarray] = {}

    def lookup(self, x: np.ndarray) -> np.ndarray:
        view, codes, roll = code_index(x)
        key = x.dtype.name
        if key not in self._by_dtype:
            full = self.post(expand_table(self.table, self.step_bits, codes))
            self._by_dtype[key] = np.roll(full, -roll) if roll else full
        return lookup(self._by_dtype[key], view)


def lookup(table: np.ndarray, view: np.ndarray) -> np.ndarray:
    """``table[view]`` for the unsigned codes ``view``, in ``view``'s memory layout."""
    perm = memory_order(view)
    if perm is None:
        return array0(gather(table, view))  # a rank-0 x gives a scalar
    # gather in memory order (a channels-last input stays channels-last): sequential reads
    return gather(table, view.transpose(perm)).transpose(np.argsort(perm))


class ChainTable:
    """A chain of elementwise kernels on 8- / 16-bit codes (a QLut and the Requantize after it) as one
    table per input dtype: the chain runs once on every code, then each call is a single gather.
    Exact by construction: each kernel's output element depends on its input element alone."""

    def __init__(self, kernels: list[Any]) -> None:
        self.kernels = kernels
        self._by_dtype: dict[str, np.ndarray] = {}

    def __call__(self, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        if x is None:
            raise PulsarError("input x is required")
        view, codes, _ = code_index(x)
        key = x.dtype.name
        if key not in self._by_dtype:
            # every value of the dtype, ordered by its unsigned view: index u holds the code viewed as u
            values = np.arange(codes, dtype=view.dtype).view(x.dtype)
            for kernel in self.kernels:
                values = kernel([values])[0]
            self._by_dtype[key] = np.ascontiguousarray(values)
        return [lookup(self._by_dtype[key], view)]


# below this many codes numpy's take is as fast; above, torch's int32-indexed gather is about twice it
_TORCH_GATHER = 1 << 14
_SIGNED = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


def gather(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``table[codes]`` for unsigned 8- / 16-bit ``codes`` (C-contiguous, or any layout when small):
    numpy's take converts the codes to 64-bit indices first; torch's ``index_select`` takes int32
    ones, half the memory traffic. Tables are read through the signed type of their width (a bit
    pattern view: the gathered bits are the same)."""
    if codes.size < _TORCH_GATHER or not codes.flags.c_contiguous:
        return np.take(table, codes)
    import torch

    signed = _SIGNED[table.dtype.itemsize]
    idx = torch.from_numpy(codes.reshape(-1).astype(np.int32))
    out = torch.index_select(torch.from_numpy(table.view(signed)), 0, idx).numpy()
    return out.view(table.dtype).reshape(codes.shape)


def memory_order(x: np.ndarray) -> list[int] | None:
    """The axis order that makes a dense, non-C-contiguous ``x`` C-contiguous (channels-last
    activations: N, H, W, C); None when ``x`` is C-contiguous already or not dense."""
    if x.flags.c_contiguous or x.ndim < 2:
        return None
    perm = sorted(range(x.ndim), key=lambda a: -abs(x.strides[a]))
    return perm if x.transpose(perm).flags.c_contiguous else None


@register("QLut", domain=INT_DOMAIN)
def make_qlut(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """y = clamp(table lookup of x - qmin, out_min, out_max); the table already holds out_zp."""
    spec = OutSpec.from_attrs(attrs)
    step_bits = int_attr(attrs, "step_bits", 0)

    def post(values: np.ndarray) -> np.ndarray:
        return np.clip(values, spec.lo, spec.hi).astype(spec.dtype)

    table_const = consts[1] if len(consts) > 1 else None
    prepared = CodeTable(table_const, step_bits, post) if table_const is not None else None

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x, table = inputs[0], inputs[1] if len(inputs) > 1 else None
        if x is None or table is None:
            raise PulsarError("inputs x and table are required")
        lut = prepared if prepared is not None and table is table_const else CodeTable(table, step_bits, post)
        return [lut.lookup(x)]

    return run
