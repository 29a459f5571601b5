"""KL (entropy) calibration, TensorRT style.

For a one-sided histogram (bins of ``|x|`` from zero) and ``L`` quantization levels, keeping the
first ``i`` bins means: the reference distribution P is those bins with all clipped mass added to
the last one; the quantized distribution Q merges the i bins into L groups and spreads each
group's mass evenly over its non-empty bins. The threshold is the ``i`` (L <= i <= bins) with the
smallest KL(P || Q). Symmetric grids work on ``|x|`` with half the levels; asymmetric grids give
one-sided data all levels and otherwise search each side, splitting the levels between the sides
in proportion to their thresholds. Exact zeros are left out: zero is on every grid, and the spike
of a ReLU output at zero would otherwise drag the threshold down to the smallest candidate.

KL(P || Q) for all candidates is evaluated in closed form from prefix sums of the counts, of
``h log h`` and of the non-empty-bin counts, so one candidate costs O(L), not O(bins); long
candidate lists are searched coarse-to-fine.
"""

from __future__ import annotations

import math

import numpy as np

from pulsar.quant.observers.histogram import TensorStats, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method

_COARSE = 128  # candidates in the coarse pass
_TOP = 4  # best coarse candidates whose neighbourhoods are searched more finely
_REFINE = 8  # each refinement pass divides the candidate spacing by this
_MIN_LEVELS = 8
_MIN_PER_BIN = 16  # average values per bin the divergence needs to mean anything  # fewer levels than this on a side: clipping it is pointless, keep its extreme


def _log0(v: np.ndarray) -> np.ndarray:
    """log(v) where v > 0, else 0 (only ever multiplied by v)."""
    out = np.zeros(np.shape(v), dtype=np.result_type(v, np.float32))
    np.log(v, out=out, where=v > 0)
    return out


def _xlogx(v: np.ndarray) -> np.ndarray:
    return _log0(v) * v


def kl_divergences(h: np.ndarray, cands: np.ndarray, levels: int) -> np.ndarray:
    """KL(P || Q) for keeping the first ``i`` bins of ``h``, for each ``i`` in ``cands`` (>= levels)."""
    cum = np.concatenate([[0.0], np.cumsum(h)])
    cum_nz = np.concatenate([[0], np.cumsum(h > 0)])
    cum_xlogx = np.concatenate([[0.0], np.cumsum(_xlogx(h))])
    total = cum[-1]
    i = np.asarray(cands, dtype=np.int64)
    clipped = np.maximum(total - cum[i], 0.0)
    last = h[i - 1]
    # group g = bins [s_g, s_g+1), s_g = floor(g * i / levels); exact in float64 for these sizes
    starts = (np.multiply.outer(i.astype(np.float64), np.arange(levels + 1.0)) / levels).astype(np.intp)
    at = np.take(cum, starts)
    mass = at[:, 1:] - at[:, :-1]
    at_nz = np.take(cum_nz, starts)
    nonzero = at_nz[:, 1:] - at_nz[:, :-1]
    nonzero[:, -1] += (last <= 0) & (clipped > 0)  # the last bin holds the clipped mass
    log_n = np.log(np.maximum(np.arange(int(nonzero.max()) + 1), 1))  # log of small integers by lookup
    log_nonzero = np.take(log_n, nonzero)
    # float32 logs: 2-3x faster, and their ~1e-7 relative error is far below KL differences that matter
    log_mass = _log0(mass.astype(np.float32))
    tiny = np.finfo(np.float64).tiny
    # sum over P's support of P log Q (Q unnormalised: a group's mass over its non-empty bins)
    cross = np.einsum("ij,ij->i", mass, log_mass - log_nonzero)
    last_mass = mass[:, -1]
    cross += clipped * (np.log(np.maximum(last_mass, tiny)) - log_nonzero[:, -1])
    p_log_p = cum_xlogx[i - 1] + _xlogx(last + clipped)
    kept = np.maximum(cum[i], tiny)
    kl = (p_log_p - cross) / total - math.log(total) + np.log(kept)
    return np.where((clipped > 0) & (last_mass <= 0), np.inf, kl)  # Q = 0 where P > 0


def kl_threshold(h: np.ndarray, levels: int) -> int:
    """Number of bins of ``h`` to keep (``h.size`` = no clipping): coarse-to-fine argmin of KL.

    Sparse histograms (small tensors, e.g. after global pooling: a few thousand values over
    thousands of bins) are merged first to at least ``_MIN_PER_BIN`` values per bin on average;
    empty bins between single values would otherwise read as a tail worth clipping. Too few values
    for more bins than levels: nothing is clipped.
    """
    n = h.size
    if n <= levels or levels < _MIN_LEVELS or h.sum() <= 0:
        return n
    factor = math.ceil(n * _MIN_PER_BIN / h.sum())
    if factor > 1:
        if n // factor <= levels:
            return n
        return min(n, factor * _threshold(np.add.reduceat(h, np.arange(0, n, factor)), levels))
    return _threshold(h, levels)


def _threshold(h: np.ndarray, levels: int) -> int:
    n = h.size
    cands = np.arange(levels, n + 1)
    stride = math.ceil(cands.size / _COARSE)
    cands = np.unique(np.append(cands[::stride], n))
    top = _TOP
    while True:
        kl = np.nan_to_num(kl_divergences(h, cands, levels), nan=np.inf)
        if stride == 1:
            return int(cands[int(np.argmin(kl))])
        best = cands[np.argsort(kl, kind="stable")[:top]]
        finer = max(1, stride // _REFINE)
        near = (best[:, None] + np.arange(-stride, stride + 1, finer)[None, :]).ravel()
        cands, stride, top = np.unique(np.clip(near, levels, n)), finer, max(1, top // 2)


@register_method("KL")
def kl_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    sides = side_histograms(stats, exclude_zeros=True)  # zeros are exact on any grid: not a spike to fit
    w = sides.width
    if spec.symmetric:
        t = kl_threshold(sides.folded(), spec.levels // 2) * w
        return -t, t
    if sides.neg.size == 0 or sides.pos.size == 0:
        return -kl_threshold(sides.neg, spec.levels) * w, kl_threshold(sides.pos, spec.levels) * w
    # both signs share one grid: each side gets levels in proportion to its extent, then to its
    # clipped extent once known
    t_neg, t_pos, lv_neg = sides.neg.size, sides.pos.size, -1
    for _ in range(2):
        split = round(spec.levels * t_neg / (t_neg + t_pos))
        if split == lv_neg:
            break
        lv_neg = split
        t_neg = kl_threshold(sides.neg, lv_neg)
        t_pos = kl_threshold(sides.pos, spec.levels - lv_neg)
    return -t_neg * w, t_pos * w
