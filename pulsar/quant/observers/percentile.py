"""Percentile: clip the rarest (100 - p)% on each side, read off the histogram's cumulative counts.

One-sided data keeps its lower (or upper) extreme: only the tail away from zero is an outlier
tail. Symmetric grids take the p-th percentile of ``|x|``.
"""

from __future__ import annotations

from pulsar.quant.observers.histogram import TensorStats, hist_quantile, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method


@register_method("Percentile")
def percentile_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    q = spec.percentile / 100.0
    if spec.symmetric:
        sides = side_histograms(stats)
        t = hist_quantile(sides.folded(), 0.0, sides.width, q)
        return -t, t
    w = stats.bin_width
    lo = stats.min if stats.min >= 0 else hist_quantile(stats.hist, stats.hist_lo, w, 1.0 - q)
    hi = stats.max if stats.max <= 0 else hist_quantile(stats.hist, stats.hist_lo, w, q)
    return max(lo, stats.min), min(hi, stats.max)
