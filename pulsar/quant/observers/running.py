"""Two Compass calibration strategies that need no histogram search of their own.

``Mean`` (Compass's ``mean``): the running extremes, ``run = m * run + (1 - m) * batch extreme`` per
calibration batch with ``m`` = ``quant.calibration_momentum``; they follow the typical batch rather
than the one outlier batch that MinMax keeps.

``WeightedScale`` (Compass's ``weighted_scale_param``): for a symmetric grid, whose one threshold
must serve both signs, the threshold is ``alpha * max + (1 - alpha) * |min|`` instead of the larger
of the two; ``alpha`` is ``quant.calibration_weighted_alpha`` or, unset, the value whose threshold
has the least expected squared error on the histogram (rounding noise inside, clipping outside).
An asymmetric grid gives each sign its own extent already: there the method keeps the extremes.
"""

from __future__ import annotations

import numpy as np

from pulsar.quant.observers.histogram import TensorStats, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method

_ALPHAS = np.linspace(0.0, 1.0, 101)


@register_method("Mean")
def mean_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    if stats.batches == 0:
        return stats.min, stats.max
    return stats.run_min, stats.run_max


def symmetric_error(stats: TensorStats, thresholds: np.ndarray, levels: int) -> np.ndarray:
    """Expected squared error per value of a symmetric grid ``[-t, t]`` with ``levels`` levels, for
    each ``t``: step^2 / 12 for values inside, the distance to ``t`` squared for values outside."""
    sides = side_histograms(stats)
    folded = sides.folded()
    centres = (np.arange(folded.size) + 0.5) * sides.width
    total = max(float(folded.sum()), 1.0)
    t = np.asarray(thresholds, np.float64)[:, None]
    step = t / max(levels // 2 - 1, 1)
    outside = np.maximum(centres[None, :] - t, 0.0)
    err = np.where(centres[None, :] <= t, step**2 / 12.0, outside**2)
    return np.asarray((err * folded[None, :]).sum(axis=1) / total)


def weighted_threshold(stats: TensorStats, spec: GridSpec) -> float:
    pos, neg = max(stats.max, 0.0), max(-stats.min, 0.0)
    if spec.weighted_alpha is not None:
        return float(spec.weighted_alpha * pos + (1.0 - spec.weighted_alpha) * neg)
    cands = _ALPHAS * pos + (1.0 - _ALPHAS) * neg
    cands = np.where(cands > 0, cands, max(pos, neg))
    err = symmetric_error(stats, cands, spec.levels)
    return float(cands[int(np.argmin(err))])


@register_method("WeightedScale")
def weighted_scale_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    if not spec.symmetric:
        return stats.min, stats.max
    t = weighted_threshold(stats, spec)
    return -t, t
