"""MinMax: the exact extremes of the data; nothing is clipped, outliers stretch the step."""

from __future__ import annotations

from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.observers.registry import GridSpec, register_method


@register_method("MinMax")
def minmax_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    if spec.symmetric:
        t = max(-stats.min, stats.max)
        return -t, t
    return stats.min, stats.max
