"""Shared pieces of the integer kernels: output spec, requantization, exact float accumulation.

Requantization is ``clamp(rshift_round(acc * M, N) + out_zp, out_min, out_max)`` in int64. The
generic form follows that text literally; :class:`Requant` evaluates the same integer function
faster when the accumulator bound proves it safe: in float64 when every intermediate is an integer
(times a power of two) below 2**53, else folded into one int64 multiply, add and shift.

8- and 16-bit results leave float64 through :func:`blocked_shifted`: the value is computed minus
``out_min`` (so it is >= 0 once clamped), and the float -> integer cast, which truncates, is then
the floor; adding ``out_min`` back wraps modulo 2**bits, which is the signed code's bit pattern.
Those passes run over cache-sized blocks, so the float64 temporaries never go out to memory.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pulsar.core.fixedpoint import MAX_SHIFT, rshift_round
from pulsar.errors import PulsarError

# ONNX TensorProto element types allowed as integer outputs (the ``to`` attribute).
ELEM_DTYPES: dict[int, np.dtype] = {
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
}

FLOAT32_EXACT = 1 << 24  # every integer of magnitude <= 2**24 is a float32
FLOAT64_EXACT = 1 << 53
INT64_LIMIT = 1 << 63

# numpy dtypes torch.from_numpy can share (no copy) and convert with .to()
_TORCH_SHARED = frozenset(np.dtype(n) for n in ("uint8", "int8", "uint16", "int16", "int32", "int64", "float32",
                                               "float64"))


def to_torch(x: np.ndarray) -> Any:
    """A torch tensor sharing ``x``'s memory (and strides) when torch can, a contiguous copy otherwise.

    The kernels never write into their inputs, so sharing a read-only array is safe; it is copied
    anyway to keep torch from warning about it."""
    import torch

    shared = x.dtype in _TORCH_SHARED
    if shared and x.flags.writeable and min(x.strides, default=0) >= 0:
        try:
            return torch.from_numpy(x)
        except ValueError:  # strides torch cannot express (not a multiple of the item size)
            pass
    return torch.from_numpy(np.array(x, dtype=x.dtype if shared else np.int64))


_SCRATCH = threading.local()


def scratch(key: str, shape: tuple[int, ...], dtype: Any, channels_last: bool = False) -> Any:
    """An uninitialized tensor (contiguous, or channels-last when asked, 4-D only) in a per-thread
    buffer that grows to the largest size asked for ``key`` and is reused by later calls.

    Temporaries of large activations then skip the page faults of a fresh allocation each run. The
    tensor is valid until the next call with the same key in the same thread: never return it."""
    import torch

    cl = channels_last and len(shape) == 4
    views: dict[tuple, Any] = _SCRATCH.__dict__.setdefault("views", {})
    vkey = (key, dtype, shape, cl)
    view = views.get(vkey)
    if view is not None:
        return view
    if len(views) > 512:  # many distinct shapes (dynamic sizes): forget the views, keep the buffers
        views.clear()
    bufs: dict[tuple[str, Any], Any] = _SCRATCH.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    buf = bufs.get((key, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(key, dtype)] = torch.empty(max(n, 1), dtype=dtype)
        for stale in [k for k in views if k[:2] == (key, dtype)]:  # views of the old buffer
            del views[stale]
    flat = buf[:n]
    if cl:
        nb, c, h, w = shape
        view = flat.view(nb, h, w, c).permute(0, 3, 1, 2)
    else:
        view = flat.view(shape)
    views[vkey] = view
    return view


def scratch_like(key: str, like: Any, dtype: Any) -> Any:
    """:func:`scratch` with the shape and layout (contiguous or channels-last) of tensor ``like``; a
    fresh tensor for any other layout."""
    import torch

    if like.is_contiguous():
        return scratch(key, tuple(like.shape), dtype)
    if like.dim() == 4 and like.is_contiguous(memory_format=torch.channels_last):
        return scratch(key, tuple(like.shape), dtype, channels_last=True)
    return torch.empty_like(like, dtype=dtype)


def shifts(spec: OutSpec) -> bool:
    """Whether :func:`blocked_shifted` can finish outputs of ``spec`` (8- and 16-bit types)."""
    return spec.dtype.itemsize <= 2


_UNSIGNED = {1: "uint8", 2: "uint16"}

# elements per cache block of the float64 evaluations: their temporaries (8 + 4 bytes an element)
# stay in the L2 / L3 caches instead of streaming through memory once per pass
BLOCK = 1 << 19


def in_memory_order(t: Any) -> tuple[Any, bool]:
    """(``t`` permuted to its memory order, channels_last): a view of a contiguous or channels-last
    (then NHWC) tensor, a contiguous copy of any other layout."""
    import torch

    cl = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    return (t.permute(0, 2, 3, 1) if cl else t.contiguous()), cl


def blocked_shifted(count: int, tail: tuple[int, ...], spec: OutSpec, fill: Callable[[Any, int, int], None],
                    safe32: bool) -> Any:
    """Evaluate an exact float64 form :data:`BLOCK` elements at a time into a fresh unsigned tensor of
    the output width, shape ``(count, *tail)``: ``fill(t, i, j)`` writes ``v - out_min`` for rows
    ``[i, j)`` into the float64 block ``t``; the block is clamped to ``[0, out_max - out_min]`` and
    truncated (the floor, on values >= 0) through int32. With ``safe32`` (every ``|v - out_min| <
    2**31``, proven by the caller) the truncation runs first and the clamp on int32: truncating a
    value in (-1, 0) gives 0 where the floor gives -1, and both clamp to 0."""
    import torch

    out = torch.empty((count, *tail), dtype=getattr(torch, _UNSIGNED[spec.dtype.itemsize]))
    step = max(1, BLOCK // max(math.prod(tail), 1))
    top = spec.hi - spec.lo
    for i in range(0, count, step):
        j = min(i + step, count)
        t = scratch("float_form", (j - i, *tail), torch.float64)
        fill(t, i, j)
        q = scratch("float_form/int32", (j - i, *tail), torch.int32)
        if safe32:
            q.copy_(t)
            q.clamp_(0, top)
        else:
            t.clamp_(0, top)
            q.copy_(t)
        out[i:j].copy_(q)
    return out


def shifted_codes(out: Any, spec: OutSpec, shape: tuple[int, ...], cl: bool) -> np.ndarray:
    """The output codes from the unsigned tensor ``out`` (``y - out_min`` in memory order), reshaped
    to the memory-order ``shape`` and laid out as the input was (a channels-last NCHW view when
    ``cl``): ``+ out_min`` modulo 2**bits is the signed code's bit pattern, so a view gives the
    signed dtype."""
    codes = out.numpy().reshape(shape)
    if spec.lo:
        np.add(codes, codes.dtype.type(spec.lo % (1 << (8 * codes.dtype.itemsize))), out=codes)
    codes = codes if codes.dtype == spec.dtype else codes.view(spec.dtype)
    return codes.transpose(0, 3, 1, 2) if cl else codes


def finish_float(t: Any, spec: OutSpec) -> np.ndarray:
    """``clamp(floor(t), lo, hi)`` cast to the output type, for a float64 torch tensor ``t`` (which it
    overwrites) holding values below 2**53 in magnitude; numpy result, ``t``'s memory layout."""
    if spec.lo < 0:  # float -> int casts truncate; on values >= lo >= 0 that is the floor already
        t.floor_()
    t.clamp_(spec.lo, spec.hi)
    return t.numpy().astype(spec.dtype)  # numpy's float -> int cast is several times torch's speed


def int_attr(attrs: dict[str, Any], name: str, default: int | None = None) -> int:
    value = attrs.get(name, default)
    if value is None:
        raise PulsarError(f"attribute {name!r} is missing")
    if isinstance(value, (bytes, str, float)) or np.ndim(value) != 0:
        raise PulsarError(f"attribute {name!r} must be an int, got {value!r}")
    return int(value)


def ints_attr(attrs: dict[str, Any], name: str, default: list[int] | None = None) -> list[int] | None:
    value = attrs.get(name, default)
    return None if value is None else [int(v) for v in value]


def str_attr(attrs: dict[str, Any], name: str, default: str) -> str:
    value = attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


@functools.lru_cache(maxsize=64)
def dtype_range(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def centered_bound(dtype: np.dtype, zp: int) -> int:
    """max |x - zp| over every value of ``dtype``: the static operand bound."""
    lo, hi = dtype_range(dtype)
    return max(abs(lo - zp), abs(hi - zp))


def data_bound(x: np.ndarray, zp: int) -> int:
    """max |x - zp| over the actual data (a tighter, still exact, bound)."""
    if x.size == 0:
        return 0
    return max(abs(int(x.max()) - zp), abs(int(x.min()) - zp))


def check_shift(n: np.ndarray, what: str = "N") -> np.ndarray:
    n = np.asarray(n, dtype=np.int64)
    if n.size and (n.min() < 0 or n.max() > MAX_SHIFT):
        raise PulsarError(f"shift {what} must be in [0, {MAX_SHIFT}], got [{n.min()}, {n.max()}]")
    return n


def as_int64(value: np.ndarray | int, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise PulsarError(f"{what} must be an integer tensor, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class OutSpec:
    """Output grid of an integer op: dtype (attribute ``to``), zero point and clamp bounds."""

    dtype: np.dtype
    zp: int
    lo: int
    hi: int

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> OutSpec:
        to = int_attr(attrs, "to")
        if to not in ELEM_DTYPES:
            raise PulsarError(f"attribute 'to' = {to} is not an integer element type {sorted(ELEM_DTYPES)}")
        dtype = ELEM_DTYPES[to]
        tmin, tmax = dtype_range(dtype)
        zp = int_attr(attrs, "out_zp", 0)
        lo, hi = int_attr(attrs, "out_min", tmin), int_attr(attrs, "out_max", tmax)
        if not tmin <= lo <= hi <= tmax:
            raise PulsarError(f"out_min / out_max = {lo} / {hi} must satisfy {tmin} <= out_min <= out_max <= {tmax}")
        return cls(dtype, zp, lo, hi)

    def finish(self, v: np.ndarray) -> np.ndarray:
        """``clamp(v + zp)`` cast to the output type; ``v`` is an int64 array the caller owns."""
        if self.zp:
            v += self.zp
        np.clip(v, self.lo, self.hi, out=v)
        return v.astype(self.dtype)


def requant(acc: np.ndarray, m: np.ndarray | int, n: np.ndarray | int, spec: OutSpec) -> np.ndarray:
    """``clamp(rshift_round(acc * M, N) + zp, lo, hi)``; M / N broadcast against ``acc``."""
    m = np.asarray(m, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    if m.size == 1 and n.size == 1:
        v = np.multiply(acc, int(m.reshape(-1)[0]), dtype=np.int64)
        s = int(n.reshape(-1)[0])
        if s:
            v += 1 << (s - 1)
            v >>= s
        return spec.finish(v.reshape(np.broadcast_shapes(acc.shape, m.shape, n.shape)))
    return spec.finish(rshift_round(np.multiply(acc, m, dtype=np.int64), n))


def round_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``floor((2a + b) / (2b))`` for b > 0: nearest, ties toward +inf (int64)."""
    return np.floor_divide(2 * a + b, 2 * b)


def accum_float(bound: int, what: str = "accumulator") -> str:
    """'float32' when every partial sum (|.| <= bound) is an exact float32 integer, else 'float64'."""
    if bound < FLOAT32_EXACT:
        return "float32"
    if bound < FLOAT64_EXACT:
        return "float64"
    raise PulsarError(f"{what} bound {bound} exceeds 2**53; the simulator cannot accumulate it exactly")


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
            v = np.multiply(acc, mp, dtype=np.int64)
            v += off
            if s:
                v >>= s
            np.clip(v, self.spec.lo, self.spec.hi, out=v)
            return v.astype(self.spec.dtype)
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

    def _cast(self, t: Any) -> np.ndarray:
        """Cast a clamped integer torch tensor to the output dtype (numpy's casts are the fast ones)."""
        return t.numpy().astype(self.spec.dtype)


def channel_param(value: np.ndarray | None, what: str, channels: int, ndim_after: int) -> np.ndarray | None:
    """A per-channel vector ([C] or [1]) reshaped to broadcast along axis ``-1 - ndim_after``."""
    if value is None:
        return None
    arr = as_int64(value, what).reshape(-1)
    if arr.size not in (1, channels):
        raise PulsarError(f"{what} has {arr.size} values; expected 1 or {channels} (one per output channel)")
    return arr.reshape((arr.size,) + (1,) * ndim_after)
