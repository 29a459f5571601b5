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


def contiguous(x: np.ndarray) -> np.ndarray:
    """``x`` itself when C-contiguous, else a C-ordered copy. Unlike ``np.ascontiguousarray`` (which
    returns at least 1-D) a rank-0 array stays rank 0."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def array0(value: Any) -> np.ndarray:
    """``value`` as an ndarray: numpy returns a scalar, not a 0-d array, from arithmetic, reductions
    and gathers whose result has rank 0; a kernel result (and an in-place operand) must be an array."""
    return value if isinstance(value, np.ndarray) else np.asarray(value)


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
        """``clamp(v + zp)`` cast to the output type; ``v`` is an int64 array the caller owns (or a
        numpy scalar, the rank-0 result of numpy arithmetic: it stays rank 0)."""
        v = array0(v)
        if self.zp:
            v += self.zp
        np.clip(v, self.lo, self.hi, out=v)
        return v.astype(self.dtype)


def requant(acc: np.ndarray, m: np.ndarray | int, n: np.ndarray | int, spec: OutSpec) -> np.ndarray:
    """``clamp(rshift_round(acc * M, N) + zp, lo, hi)``; M / N broadcast against ``acc``."""
    m = np.asarray(m, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    if m.size == 1 and n.size == 1:
        v = array0(np.multiply(acc, int(m.reshape(-1)[0]), dtype=np.int64))  # rank 0: a scalar
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


def channel_param(value: np.ndarray | None, what: str, channels: int, ndim_after: int) -> np.ndarray | None:
    """A per-channel vector ([C] or [1]) reshaped to broadcast along axis ``-1 - ndim_after``."""
    if value is None:
        return None
    arr = as_int64(value, what).reshape(-1)
    if arr.size not in (1, channels):
        raise PulsarError(f"{what} has {arr.size} values; expected 1 or {channels} (one per output channel)")
    return arr.reshape((arr.size,) + (1,) * ndim_after)


def weight_minus_zero_points(w: np.ndarray, zps: np.ndarray | None, axis: int) -> np.ndarray:
    """A constant weight stored affine (U4: integers and a zero point per output channel along
    ``axis``) as the centred integers the kernels multiply, q - zero point (int16)."""
    if zps is None:
        return w
    shape = [1] * w.ndim
    shape[axis % w.ndim] = -1
    return (np.asarray(w).astype(np.int16) - np.asarray(zps).astype(np.int16).reshape(shape)).astype(np.int16)
