"""KL (entropy) calibration, TensorRT style.

For a one-sided histogram (bins of ``|x|`` from zero) and ``L`` quantization levels, keeping the
first ``i`` bins means: the reference distribution P is those bins with all clipped mass added to
the last one; the quantized distribution Q merges the i bins into L groups and spreads each
group's mass evenly over its non-empty bins. The threshold is the ``i`` (L <= i <= bins) with the
smallest KL(P || Q). Symmetric grids work on ``|x|`` with half the levels; asymmetric grids search
each side, splitting the levels between the sides in proportion to their thresholds.

KL(P || Q) for all candidates is evaluated in closed form from prefix sums of the counts, of
``h log h`` and of the non-empty-bin counts, so one candidate costs O(L), not O(bins); long
candidate lists are searched coarse-to-fine.
"""

from __future__ import annotations

import math

import numpy as np

from pulsar.quant.observers.histogram import TensorStats, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method

_COARSE = 192  # candidates in the coarse pass
_TOP = 4  # best coarse candidates refined at full resolution
_MIN_LEVELS = 8  # fewer levels than this on a side: clipping it is pointless, keep its extreme


def _xlogx(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, v * np.log(np.where(v > 0, v, 1.0)), 0.0)


def kl_divergences(h: np.ndarray, cands: np.ndarray, levels: int) -> np.ndarray:
    """KL(P || Q) for keeping the first ``i`` bins of ``h``, for each ``i`` in ``cands`` (>= levels)."""
    cum = np.concatenate([[0.0], np.cumsum(h)])
    cum_nz = np.concatenate([[0], np.cumsum(h > 0)])
    cum_xlogx = np.concatenate([[0.0], np.cumsum(_xlogx(h))])
    total = cum[-1]
    i = np.asarray(cands, dtype=np.int64)
    clipped = np.maximum(total - cum[i], 0.0)
    last = h[i - 1]
    starts = (np.arange(levels + 1)[None, :] * i[:, None]) // levels  # group g = bins [s_g, s_g+1)
    mass = cum[starts[:, 1:]] - cum[starts[:, :-1]]
    nonzero = (cum_nz[starts[:, 1:]] - cum_nz[starts[:, :-1]]).astype(np.float64)
    nonzero[:, -1] += (last <= 0) & (clipped > 0)  # the last bin holds the clipped mass
    nonzero = np.maximum(nonzero, 1.0)
    tiny = np.finfo(np.float64).tiny
    # sum over P's support of P log Q (Q unnormalised: a group's mass over its non-empty bins)
    cross = _xlogx(mass).sum(1) - (mass * np.log(nonzero)).sum(1)
    last_mass = mass[:, -1]
    cross += clipped * (np.log(np.maximum(last_mass, tiny)) - np.log(nonzero[:, -1]))
    p_log_p = cum_xlogx[i - 1] + _xlogx(last + clipped)
    kept = np.maximum(cum[i], tiny)
    kl = (p_log_p - cross) / total - math.log(total) + np.log(kept)
    return np.where((clipped > 0) & (last_mass <= 0), np.inf, kl)  # Q = 0 where P > 0


def kl_threshold(h: np.ndarray, levels: int) -> int:
    """Number of bins of ``h`` to keep (``h.size`` = no clipping)."""
    n = h.size
    if n <= levels or levels < _MIN_LEVELS or h.sum() <= 0:
        return n
    cands = np.arange(levels, n + 1)
    if cands.size > 2 * _COARSE:
        stride = math.ceil(cands.size / _COARSE)
        coarse = np.unique(np.append(cands[::stride], n))
        best = coarse[np.argsort(kl_divergences(h, coarse, levels), kind="stable")[:_TOP]]
        near = (best[:, None] + np.arange(-stride, stride + 1)[None, :]).ravel()
        cands = np.unique(np.clip(near, levels, n))
    return int(cands[int(np.argmin(kl_divergences(h, cands, levels)))])


@register_method("KL")
def kl_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    sides = side_histograms(stats)
    w = sides.width
    if spec.symmetric:
        t = kl_threshold(sides.folded(), spec.levels // 2) * w
        return -t, t
    if sides.neg.size == 0 or sides.pos.size == 0:
        return -kl_threshold(sides.neg, spec.levels) * w, kl_threshold(sides.pos, spec.levels) * w
    # both signs share one grid: each side gets levels in proportion to its extent, then to its
    # clipped extent once known
    t_neg, t_pos = sides.neg.size, sides.pos.size
    for _ in range(2):
        lv_neg = round(spec.levels * t_neg / (t_neg + t_pos))
        t_neg = kl_threshold(sides.neg, lv_neg)
        t_pos = kl_threshold(sides.pos, spec.levels - lv_neg)
    return -t_neg * w, t_pos * w
