"""Requantization of integer accumulators: ``clamp(rshift_round((acc + bias) * M, N) + zp, lo, hi)``,
evaluated in the fastest form the accumulator bound proves exact (see :class:`Requant`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pulsar.runtime.kernels.common import (
    FLOAT64_EXACT,
    INT64_LIMIT,
    OutSpec,
    array0,
    blocked_shifted,
    check_shift,
    finish_float,
    in_memory_order,
    requant,
    scratch_like,
    shifted_codes,
    shifts,
)


class Requant:
    """``clamp(rshift_round((acc + bias) * M, N) + zp, lo, hi)`` with M, N, bias broadcast to acc.

    ``bound`` bounds |acc| (bias excluded; an int or an array broadcastable like M). Two faster forms
    of the same integer function are prepared when the bound proves them exact:

    - float64 (torch accumulators): ``y = floor(acc * r + c)`` with ``r = M * 2**-N`` and
      ``c = (bias*M + 2**(N-1) + ((zp - base) << N)) * 2**-N``. Both terms are integers times
      ``2**-N``; when ``|M| * bound + |bias*M + 2**(N-1) + ((zp - base) << N)| < 2**53`` every product
      and sum is exactly representable, so the float operations are exact and the floor is the
      rounding shift. For 8- / 16-bit outputs ``base`` is ``out_min`` when that keeps the bound, and
      the form runs in cache-sized blocks that end in an unsigned cast (:func:`blocked_shifted`);
      otherwise ``base`` is 0 and :func:`finish_float` floors and clamps.
    - folded int64: ``(acc * M' + off) >> S`` with ``S = max N``, ``M' = M << (S - N)``,
      ``off = bias * M' + 2**(S-1) + (zp << S)``: shifting numerator and divisor by the same power of
      two leaves the floor unchanged, and an integer added before ``>> S`` as ``k << S`` comes out
      as ``+ k``. Used when ``|acc * M'| + |off| < 2**63``.

    - split float64 (when neither applies to the static bound, typically a large bias or a wide
      spread of N across channels): the offset ``bias*M + 2**(N-1) + (zp << N)`` is split per
      channel into ``Q * 2**N + R`` with ``0 <= R < 2**N``, so ``y = floor((acc*M + R) * 2**-N) + Q``;
      the float64 evaluation of ``acc * r + R * 2**-N`` is exact when ``|M| * bound + R < 2**53``,
      here with ``bound`` the largest ``|acc|`` of the data (one pass), and a ``Q`` beyond the
      output range by more than the product's reach saturates, so it is clipped to a small integer
      without changing the clamped result (:meth:`_split_form`).

    Otherwise the literal form runs.
    """

    def __init__(self, m: np.ndarray, n: np.ndarray, spec: OutSpec, bias: np.ndarray | None = None,
                 bound: np.ndarray | int | None = None) -> None:
        self.m = np.asarray(m, dtype=np.int64)
        self.n = check_shift(n)
        self.bias = None if bias is None else np.asarray(bias, dtype=np.int64)
        self.spec = spec
        self.fast: tuple[np.ndarray, np.ndarray, int] | None = None
        self.exact64: tuple[np.ndarray, np.ndarray] | None = None
        self.shifted = False  # the float64 form gives the result minus out_min (blocked_shifted)
        self.safe32 = False  # ... and each of those values lies inside int32
        if bound is not None:
            b = np.asarray(bound)
            self.fast = self._fold(b)
            form = self._float_form(b, spec.lo) if shifts(spec) else None
            self.shifted = form is not None
            form = form or self._float_form(b, 0)
            if form is not None:
                self.exact64 = form[:2]
                self.safe32 = self.shifted and form[2]
        self._torch: tuple[Any, Any] | None = None
        self._torch64: tuple[Any, Any, tuple[int, ...]] | None = None
        self._layouts: dict[tuple[int, bool], tuple[int, Any, Any]] = {}
        self._shape_ok: dict[tuple[int, ...], bool] = {}
        self._split: dict[int, tuple[Any, Any, Any] | None] = {}

    def _fold(self, bound: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
        s = int(self.n.max()) if self.n.size else 0
        mo = self.m.astype(object)
        mp = mo * 2 ** (s - self.n).astype(object)
        off = np.asarray(((1 << (s - 1)) if s else 0) + (self.spec.zp << s), dtype=object)
        if self.bias is not None:
            off = off + self.bias.astype(object) * mp
        worst = np.abs(mp) * bound.astype(object) + np.abs(off)
        if worst.size == 0 or int(np.max(worst)) >= INT64_LIMIT or int(np.max(np.abs(off))) >= INT64_LIMIT:
            return None
        return np.asarray(mp, dtype=np.int64), np.asarray(off, dtype=np.int64), s

    def _float_form(self, bound: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """(r, c, every value inside int32): float64 arrays of the exact float64 form giving the result
        minus ``base``, or None when the bound does not prove it exact."""
        mo, no = self.m.astype(object), self.n.astype(object)
        off = np.where(self.n > 0, 2 ** np.maximum(no - 1, 0), 0) + (self.spec.zp - base) * 2 ** no
        if self.bias is not None:
            off = off + self.bias.astype(object) * mo
        off = np.asarray(off, dtype=object)
        worst = np.abs(mo) * bound.astype(object) + np.abs(off)
        if (worst.size == 0 or int(np.max(worst)) >= FLOAT64_EXACT or int(np.max(np.abs(mo))) >= FLOAT64_EXACT
                or int(np.max(np.abs(off))) >= FLOAT64_EXACT):
            return None
        # per element |value| <= worst * 2**-N, below 2**31 when floor(worst * 2**-N) < 2**31 - 1
        shape = np.broadcast_shapes(worst.shape, self.n.shape)
        safe32 = int(np.max(np.broadcast_to(worst, shape) // np.broadcast_to(2 ** no, shape))) < (1 << 31) - 1
        # integers below 2**53 convert exactly; scaling by 2**-N (N <= 62) is exact
        r = np.asarray(np.ldexp(self.m.astype(np.float64), -self.n))
        c = np.asarray(np.ldexp(off.astype(np.float64), -self.n))
        return r, c, safe32

    def __call__(self, acc: np.ndarray) -> np.ndarray:
        """Requantize an int64 numpy accumulator (modified in place when the folded form runs)."""
        if self.fast is not None:
            mp, off, s = self.fast
            v = array0(np.multiply(acc, mp, dtype=np.int64))  # rank 0: numpy gives a scalar
            v += off
            if s:
                v >>= s
            np.clip(v, self.spec.lo, self.spec.hi, out=v)
            return v.astype(self.spec.dtype)
        if acc.dtype.kind in "iu" and acc.size:
            import torch

            out = self._split_torch(torch.from_numpy(np.ascontiguousarray(acc)), int(acc.min()), int(acc.max()))
            if out is not None:
                return out
        if self.bias is not None:
            acc = acc + self.bias
        return requant(acc, self.m, self.n, self.spec)

    def torch(self, acc: Any) -> np.ndarray:
        """Requantize a torch accumulator holding exact integers (float32 / float64 / int32 / int64).

        The result keeps ``acc``'s memory layout (channels-last stays channels-last)."""
        import torch

        if self.exact64 is not None and self._exact_shape(tuple(acc.shape)):
            return self._torch_float(acc)
        if self.fast is None:
            if acc.numel():
                lo, hi = torch.aminmax(acc)
                out = self._split_torch(acc, int(lo), int(hi))
                if out is not None:
                    return out
            return self(acc.to(torch.int64).numpy())
        if self._torch is None:
            mp, off, _ = self.fast
            self._torch = (torch.from_numpy(mp.copy()), torch.from_numpy(off.copy()))
        mp_t, off_t = self._torch
        s = self.fast[2]
        t = acc.to(torch.int64, copy=True)
        t.mul_(mp_t)
        t.add_(off_t)
        if s:
            t.bitwise_right_shift_(s)
        t.clamp_(self.spec.lo, self.spec.hi)
        return self._cast(t)

    def _exact_shape(self, shape: tuple[int, ...]) -> bool:
        """The float form runs in place on acc: M / N / bias must not broadcast it to a larger shape."""
        if self._torch64 is None:
            import torch

            r, c = self.exact64  # type: ignore[misc]
            scalar = r.size == 1 and c.size == 1
            rt = float(r.reshape(-1)[0]) if scalar else torch.from_numpy(r.copy())
            ct = float(c.reshape(-1)[0]) if scalar else torch.from_numpy(c.copy())
            self._torch64 = (rt, ct, np.broadcast_shapes(r.shape, c.shape))
        ok = self._shape_ok.get(shape)
        if ok is None:
            try:
                ok = np.broadcast_shapes(shape, self._torch64[2]) == shape
            except ValueError:
                ok = False
            self._shape_ok[shape] = ok
        return ok

    def _layout(self, ndim: int, cl: bool) -> tuple[int, Any, Any]:
        """How the blocks walk an accumulator of rank ``ndim`` in memory order (NHWC when ``cl``): the
        number k of leading axes neither r nor c varies along (flattened into the rows), and r, c
        shaped for the remaining axes (floats when scalar)."""
        layout = self._layouts.get((ndim, cl))
        if layout is None:
            import torch

            r, c = self.exact64  # type: ignore[misc]
            perm = (0, 2, 3, 1) if cl else tuple(range(ndim))

            def aligned(a: np.ndarray) -> np.ndarray:
                return a.reshape((1,) * (ndim - a.ndim) + a.shape).transpose(perm)

            shape = np.broadcast_shapes(aligned(r).shape, aligned(c).shape)
            k = next((i for i, d in enumerate(shape) if d != 1), ndim)

            def tail(a: np.ndarray) -> Any:
                return torch.from_numpy(np.ascontiguousarray(aligned(a).reshape(aligned(a).shape[k:])))

            if r.size == 1 and c.size == 1:
                layout = (k, float(r.reshape(-1)[0]), float(c.reshape(-1)[0]))
            else:
                layout = (k, tail(r), tail(c))
            self._layouts[(ndim, cl)] = layout
        return layout

    def by_rows(self, shape: tuple[int, ...], cl: bool, produce: Callable[[int, int], Any]) -> np.ndarray | None:
        """Requantize an accumulator of logical ``shape`` that ``produce(i, j)`` delivers as rows
        ``[i, j)`` of its memory order (NHWC when ``cl``; a row is the last memory axis), so a kernel
        can compute its sums block by block into cache-resident scratch (any dtype holding the exact
        integers). None when the blocked float form does not apply: 8- / 16-bit outputs only, and
        M / N / bias must not vary along the rows' axes."""
        if not self.shifted or not self._exact_shape(shape):
            return None
        k, r, c = self._layout(len(shape), cl)
        if k < len(shape) - 1:
            return None
        mem = (shape[0], *shape[2:], shape[1]) if cl else shape
        out = self._blocks(math.prod(mem[:-1]), mem[-1:], produce, r, c)
        return shifted_codes(out, self.spec, mem, cl)

    def _blocks(self, count: int, tail: tuple[int, ...], produce: Callable[[int, int], Any], r: Any,
                c: Any) -> Any:
        import torch

        def fill(t: Any, i: int, j: int) -> None:
            t.copy_(produce(i, j))
            if isinstance(r, float):
                t.mul_(r).add_(c)
            else:
                torch.addcmul(c, t, r, out=t)

        return blocked_shifted(count, tail, self.spec, fill, self.safe32)

    def _torch_float(self, acc: Any) -> np.ndarray:
        import torch

        if self.shifted:
            mem, cl = in_memory_order(acc)
            k, r, c = self._layout(acc.dim(), cl)
            rows = mem.reshape(-1, *mem.shape[k:])
            out = self._blocks(rows.shape[0], tuple(rows.shape[1:]), lambda i, j: rows[i:j], r, c)
            return shifted_codes(out, self.spec, tuple(mem.shape), cl)
        r, c, _ = self._torch64  # type: ignore[misc]
        t = scratch_like("requant", acc, torch.float64)
        t.copy_(acc)
        if isinstance(r, float) or t.is_contiguous():
            t.mul_(r).add_(c)  # channel-major: each channel's r and c broadcast over a contiguous run
        else:
            torch.addcmul(c, t, r, out=t)  # channels-last: c + t * r in one pass (both terms exact)
        return finish_float(t, self.spec)

    def _split_form(self, bound: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(r, c, q) float64 arrays with ``y = clamp(floor(acc * r + c) + q, lo, hi)`` exact for every
        ``|acc| <= bound``, or None when ``|M| * bound + R`` reaches 2**53 (class docstring)."""
        mo, no = self.m.astype(object), self.n.astype(object)
        off = np.where(self.n > 0, 2 ** np.maximum(no - 1, 0), 0) + self.spec.zp * 2 ** no
        if self.bias is not None:
            off = off + self.bias.astype(object) * mo
        off = np.asarray(off, dtype=object)
        shape = np.broadcast_shapes(off.shape, self.n.shape, self.m.shape)
        off, den = np.broadcast_to(off, shape), np.broadcast_to(2 ** no, shape)
        q, rem = off // den, off % den  # off = q * 2**N + rem, 0 <= rem < 2**N
        worst = np.abs(np.broadcast_to(mo, shape)) * bound + rem
        if worst.size == 0 or int(np.max(worst)) >= FLOAT64_EXACT or int(np.max(np.abs(mo))) >= FLOAT64_EXACT:
            return None
        # |floor(acc * r + c)| <= reach; a q past the range by more than reach gives lo / hi anyway
        reach = worst // den + 1
        q = np.minimum(np.maximum(q, self.spec.lo - reach - 1), self.spec.hi + reach + 1)
        r = np.ldexp(np.broadcast_to(self.m, shape).astype(np.float64), -np.broadcast_to(self.n, shape))
        c = np.ldexp(rem.astype(np.float64), -np.broadcast_to(self.n, shape))  # rem < 2**53: exact
        return np.asarray(r), np.asarray(c), np.asarray(q.astype(np.float64))

    def _split_torch(self, acc: Any, lo: int, hi: int) -> np.ndarray | None:
        """The split float64 form on a torch accumulator of exact integers whose values lie in
        ``[lo, hi]`` (the data bound), or None when it does not apply."""
        import torch

        k = max(abs(lo), abs(hi)).bit_length()
        if k not in self._split:
            arrays = self._split_form((1 << k) - 1)
            self._split[k] = None if arrays is None else (
                torch.from_numpy(arrays[0].copy()), torch.from_numpy(arrays[1].copy()),
                torch.from_numpy(arrays[2].copy()))
        form = self._split[k]
        if form is None:
            return None
        r, c, q = form
        shape = tuple(acc.shape)
        try:
            if np.broadcast_shapes(shape, tuple(r.shape)) != shape:
                return None
        except ValueError:
            return None
        t = scratch_like("requant", acc, torch.float64)
        t.copy_(acc)
        torch.addcmul(c, t, r, out=t)  # exact: |acc * M + R| < 2**53, scaled by 2**-N
        t.floor_()
        t.add_(q)
        t.clamp_(self.spec.lo, self.spec.hi)
        out: np.ndarray = t.numpy().astype(self.spec.dtype)
        return out

    def _cast(self, t: Any) -> np.ndarray:
        """Cast a clamped integer torch tensor to the output dtype (numpy's casts are the fast ones)."""
        return t.numpy().astype(self.spec.dtype)
