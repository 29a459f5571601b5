"""Straightforward references for the integer kernels: per-element Python loops over Python ints.

Deliberately written unlike the kernels: explicit zero-point padding instead of centred zero padding,
scatter loops for transposed convolution, ``//`` and ``fractions.Fraction`` instead of shifts, window
walks instead of pooling formulas. numpy is only a container here (indexing and broadcast views).
"""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import product

import numpy as np

TO = {np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.uint16): 4, np.dtype(np.int16): 5,
      np.dtype(np.int32): 6, np.dtype(np.int64): 7}


def raw_attrs(attrs: dict) -> dict:
    """The same op with M = 1, N = 0 into int64: the reference then returns the accumulators."""
    return {**attrs, **out_attrs(np.int64)}


def fit_multipliers(acc: np.ndarray, channel_axis: int | None, out_dtype, rng: np.random.Generator):
    """(M, N) per channel scaling max|acc| to 40-90% of the output half-range (varied outputs)."""
    from pulsar.core.fixedpoint import quantize_multiplier

    a = np.abs(acc.astype(np.float64))
    peak = a.max() if channel_axis is None else np.moveaxis(a, channel_axis, 0).reshape(a.shape[channel_axis], -1).max(1)
    info = np.iinfo(out_dtype)
    half = (int(info.max) - int(info.min)) / 2
    real = rng.uniform(0.4, 0.9, size=np.shape(peak)) * half / np.maximum(peak, 1)
    return quantize_multiplier(np.atleast_1d(real), int(a.max()) + 1)


def rsr(v: int, n: int) -> int:
    """v / 2**n, nearest, ties toward +infinity."""
    return v if n == 0 else (v + 2 ** (n - 1)) // 2 ** n


def clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else hi if v > hi else v


def pick(values, i: int) -> int:
    flat = np.asarray(values).reshape(-1)
    return int(flat[0] if flat.size == 1 else flat[i])


def out_attrs(dtype, zp: int = 0, lo: int | None = None, hi: int | None = None) -> dict:
    info = np.iinfo(dtype)
    return {"to": TO[np.dtype(dtype)], "out_zp": zp, "out_min": info.min if lo is None else lo,
            "out_max": info.max if hi is None else hi}


def finish(acc: int, m: int, n: int, attrs: dict) -> int:
    return clamp(rsr(acc * m, n) + attrs["out_zp"], attrs["out_min"], attrs["out_max"])


def new_out(shape, attrs: dict) -> np.ndarray:
    dtype = {v: k for k, v in TO.items()}[attrs["to"]]
    return np.zeros(shape, dtype=dtype)


def qconv(x, w, bias, m, n, attrs: dict) -> np.ndarray:
    nd = x.ndim - 2
    strides = attrs.get("strides", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    dil = attrs.get("dilations", [1] * nd)
    group, x_zp = attrs.get("group", 1), attrs.get("x_zp", 0)
    batch, size = x.shape[0], x.shape[2:]
    cout, cin_g, ksize = w.shape[0], w.shape[1], w.shape[2:]
    osz = [(size[i] + pads[i] + pads[nd + i] - dil[i] * (ksize[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    y = new_out((batch, cout, *osz), attrs)
    for b, co in product(range(batch), range(cout)):
        g = co // (cout // group)
        for o in product(*[range(s) for s in osz]):
            acc = 0
            for ci in range(cin_g):
                for k in product(*[range(s) for s in ksize]):
                    pos = [o[i] * strides[i] - pads[i] + k[i] * dil[i] for i in range(nd)]
                    inside = all(0 <= pos[i] < size[i] for i in range(nd))
                    xv = int(x[(b, g * cin_g + ci, *pos)]) if inside else x_zp
                    acc += (xv - x_zp) * int(w[(co, ci, *k)])
            if bias is not None:
                acc += int(bias[co])
            y[(b, co, *o)] = finish(acc, pick(m, co), pick(n, co), attrs)
    return y


def qconv_transpose(x, w, bias, m, n, attrs: dict) -> np.ndarray:
    nd = x.ndim - 2
    strides = attrs.get("strides", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    dil = attrs.get("dilations", [1] * nd)
    opad = attrs.get("output_padding", [0] * nd)
    group, x_zp = attrs.get("group", 1), attrs.get("x_zp", 0)
    batch, cin, size = x.shape[0], x.shape[1], x.shape[2:]
    cout_g, ksize = w.shape[1], w.shape[2:]
    cout = cout_g * group
    osz = [strides[i] * (size[i] - 1) + opad[i] + (ksize[i] - 1) * dil[i] + 1 - pads[i] - pads[nd + i]
           for i in range(nd)]
    acc = {}
    for b, ci in product(range(batch), range(cin)):
        g = ci // (cin // group)
        for i in product(*[range(s) for s in size]):
            xv = int(x[(b, ci, *i)]) - x_zp
            for j in range(cout_g):
                for k in product(*[range(s) for s in ksize]):
                    o = tuple(i[a] * strides[a] + k[a] * dil[a] - pads[a] for a in range(nd))
                    if all(0 <= o[a] < osz[a] for a in range(nd)):
                        key = (b, g * cout_g + j, *o)
                        acc[key] = acc.get(key, 0) + xv * int(w[(ci, j, *k)])
    y = new_out((batch, cout, *osz), attrs)
    for key in product(range(batch), range(cout), *[range(s) for s in osz]):
        total = acc.get(key, 0) + (int(bias[key[1]]) if bias is not None else 0)
        y[key] = finish(total, pick(m, key[1]), pick(n, key[1]), attrs)
    return y


def qmatmul(a, b, bias, m, n, attrs: dict) -> np.ndarray:
    a_zp, b_zp, trans = attrs.get("a_zp", 0), attrs.get("b_zp", 0), attrs.get("trans_b", 0)
    if trans:
        b = np.swapaxes(b, -1, -2)
    rows, k, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    av = np.broadcast_to(a, (*batch, rows, k))
    bv = np.broadcast_to(b, (*batch, k, cols))
    y = new_out((*batch, rows, cols), attrs)
    for idx in product(*[range(s) for s in batch]):
        for r, c in product(range(rows), range(cols)):
            acc = sum((int(av[(*idx, r, t)]) - a_zp) * (int(bv[(*idx, t, c)]) - b_zp) for t in range(k))
            if bias is not None:
                acc += pick(bias, c)
            y[(*idx, r, c)] = finish(acc, pick(m, c), pick(n, c), attrs)
    return y


def elementwise(fn, arrays, attrs: dict) -> np.ndarray:
    shape = np.broadcast_shapes(*[np.shape(a) for a in arrays])
    views = [np.broadcast_to(a, shape) for a in arrays]
    y = new_out(shape, attrs)
    for idx in product(*[range(s) for s in shape]):
        y[idx] = fn(*[int(v[idx]) for v in views])
    return y


def qadd(a, b, attrs: dict) -> np.ndarray:
    def fn(av, bv):
        s = (av - attrs.get("a_zp", 0)) * attrs["Ma"] + (bv - attrs.get("b_zp", 0)) * attrs["Mb"]
        return clamp(rsr(s, attrs["N"]) + attrs["out_zp"], attrs["out_min"], attrs["out_max"])

    return elementwise(fn, [a, b], attrs)


def qmul(a, b, m, n, attrs: dict) -> np.ndarray:
    def fn(av, bv, mv, nv):
        return finish((av - attrs.get("a_zp", 0)) * (bv - attrs.get("b_zp", 0)), mv, nv, attrs)

    return elementwise(fn, [a, b, m, n], attrs)


def requantize(x, attrs: dict) -> np.ndarray:
    return elementwise(lambda v: finish(v - attrs.get("x_zp", 0), attrs["M"], attrs["N"], attrs), [x], attrs)


def pool_windows(size: int, k: int, s: int, pb: int, pe: int, d: int, ceil_mode: int) -> list[int]:
    """Window starts (in input coordinates) by walking: onnxruntime's ceil_mode rule."""
    span, total, starts, o = (k - 1) * d + 1, size + pb + pe, [], 0
    while True:
        full = o * s + span <= total
        partial = ceil_mode and o * s + span < total + s and o * s < size + pb
        if not (full or partial):
            return starts
        starts.append(o * s - pb)
        o += 1


def qavgpool(x, table, attrs: dict) -> np.ndarray:
    k, nd = attrs["kernel_shape"], len(attrs["kernel_shape"])
    strides = attrs.get("strides", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    x_zp, cip = attrs.get("x_zp", 0), attrs.get("count_include_pad", 0)
    size = x.shape[2:]
    starts = [pool_windows(size[i], k[i], strides[i], pads[i], pads[nd + i], 1, attrs.get("ceil_mode", 0))
              for i in range(nd)]
    y = new_out((*x.shape[:2], *[len(s) for s in starts]), attrs)
    for b, c in product(range(x.shape[0]), range(x.shape[1])):
        for o in product(*[range(len(s)) for s in starts]):
            acc = count = 0
            for t in product(*[range(v) for v in k]):
                pos = [starts[i][o[i]] + t[i] for i in range(nd)]
                if all(0 <= pos[i] < size[i] for i in range(nd)):
                    acc += int(x[(b, c, *pos)]) - x_zp
                    count += 1
                elif cip and all(-pads[i] <= pos[i] < size[i] + pads[nd + i] for i in range(nd)):
                    count += 1
            y[(b, c, *o)] = finish(acc, int(table[count]), attrs["N"], attrs)
    return y


def qreducemean(x, attrs: dict) -> np.ndarray:
    axes = sorted(a % x.ndim for a in attrs["axes"])
    keep = attrs.get("keepdims", 1)
    rest = [a for a in range(x.ndim) if a not in axes]
    shape = [1 if a in axes else x.shape[a] for a in range(x.ndim)] if keep else [x.shape[a] for a in rest]
    y = new_out(shape, attrs)
    for outer in product(*[range(x.shape[a]) for a in rest]):
        acc = 0
        for inner in product(*[range(x.shape[a]) for a in axes]):
            idx = [0] * x.ndim
            for a, v in zip(rest, outer, strict=True):
                idx[a] = v
            for a, v in zip(axes, inner, strict=True):
                idx[a] = v
            acc += int(x[tuple(idx)]) - attrs.get("x_zp", 0)
        oidx = [0 if a in axes else idx[a] for a in range(x.ndim)] if keep else list(outer)
        y[tuple(oidx)] = finish(acc, attrs["M"], attrs["N"], attrs)
    return y


def table_value(table, u: int, step_bits: int) -> int:
    if step_bits == 0:
        return int(table[u])
    i, f = divmod(u, 2 ** step_bits)
    lo_v, hi_v = int(table[i]), int(table[i + 1])
    return lo_v + rsr((hi_v - lo_v) * f, step_bits)


def qlut(x, table, attrs: dict) -> np.ndarray:
    qmin = int(np.iinfo(x.dtype).min)
    return elementwise(lambda v: clamp(table_value(table, v - qmin, attrs.get("step_bits", 0)),
                                       attrs["out_min"], attrs["out_max"]), [x], attrs)


def nearest_half_up(num: int, den: int) -> int:
    return math.floor(Fraction(num, den) + Fraction(1, 2))


def qsoftmax(x, table, attrs: dict) -> np.ndarray:
    axis = attrs.get("axis", -1) % x.ndim
    xm = np.moveaxis(x, axis, -1)
    y = new_out(xm.shape, attrs)
    q, p = attrs["Q"], attrs.get("P", 16)
    for idx in product(*[range(s) for s in xm.shape[:-1]]):
        row = [int(v) for v in xm[idx]]
        e = [table_value(table, max(row) - v, attrs.get("step_bits", 0)) for v in row]
        s = sum(e)
        for j, ev in enumerate(e):
            y[(*idx, j)] = clamp(nearest_half_up(ev * q, s * 2 ** p) + attrs["out_zp"], attrs["out_min"],
                                 attrs["out_max"])
    return np.ascontiguousarray(np.moveaxis(y, -1, axis))


def qlayernorm(x, gamma, beta, m, n, attrs: dict) -> np.ndarray:
    y = new_out(x.shape, attrs)
    f = attrs.get("F", 12)
    for idx in product(*[range(s) for s in x.shape[:-1]]):
        xc = [int(v) - attrs.get("x_zp", 0) for v in x[idx]]
        width, total = len(xc), sum(xc)
        d = [width * v - total for v in xc]
        r = max(math.isqrt(sum(v * v for v in d) + attrs.get("eps_q", 0)), 1)
        for c, dv in enumerate(d):
            z = nearest_half_up(abs(dv) * 2 ** f, r)
            z = -z if dv < 0 else z
            g = 1 if gamma is None else pick(gamma, c)
            bb = 0 if beta is None else pick(beta, c)
            y[(*idx, c)] = clamp(rsr(z * g * pick(m, c), pick(n, c)) + bb + attrs["out_zp"], attrs["out_min"],
                                 attrs["out_max"])
    return y


def run_kernel(op: str, attrs: dict, inputs: list, const: set[int] | None = None) -> list[np.ndarray]:
    """Prepare the registered kernel (inputs in ``const``, default all but the first, as constants) and run it."""
    from pulsar.runtime.kernels import KERNELS

    const = set(range(1, len(inputs))) if const is None else const
    consts = [v if i in const else None for i, v in enumerate(inputs)]
    return KERNELS[op](dict(attrs), consts)(list(inputs))
