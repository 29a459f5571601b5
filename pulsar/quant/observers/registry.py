"""Registry of calibration methods and the one entry point that turns statistics into a range.

A method maps a tensor's :class:`TensorStats` and the integer grid it will be quantized to
(:class:`GridSpec`) onto a clipping range. :func:`compute_range` then enforces what every
quantizer needs regardless of the method: the range lies within the data extremes, contains zero
(so zero is exactly representable) and is ``[-t, t]`` for symmetric grids.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.observers.histogram import TensorStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GridSpec:
    """The integer grid a range is chosen for, plus the method options."""

    num_bits: int = 8
    signed: bool = False
    symmetric: bool = False
    percentile: float = 99.99
    std_n: float = 3.0
    kl_top_n: int = 1  # KL: the largest of the N best thresholds (Compass's [N]kld)
    weighted_alpha: float | None = None  # WeightedScale: weight of the positive side; None: searched

    @property
    def levels(self) -> int:
        return 2**self.num_bits

    def step(self, lo: float, hi: float) -> float:
        """Quantization step of the grid spanning [lo, hi] (signed symmetric drops -2^(b-1))."""
        if self.symmetric and self.signed:
            return hi / (self.levels // 2 - 1)
        return (hi - lo) / (self.levels - 1)


CalibrationMethod = Callable[[TensorStats, GridSpec], tuple[float, float]]

CALIBRATION_METHODS: dict[str, CalibrationMethod] = {}


def register_method(name: str) -> Callable[[CalibrationMethod], CalibrationMethod]:
    """Decorator: make a method available as ``quant.calibration_method: <name>``."""

    def deco(fn: CalibrationMethod) -> CalibrationMethod:
        if name in CALIBRATION_METHODS:
            raise ValueError(f"calibration method {name!r} registered twice")
        CALIBRATION_METHODS[name] = fn
        return fn

    return deco


def get_method(method: str) -> CalibrationMethod:
    """Look a method up by name (case-insensitive); unknown names are a config error."""
    if method in CALIBRATION_METHODS:
        return CALIBRATION_METHODS[method]
    by_lower = {name.lower(): fn for name, fn in CALIBRATION_METHODS.items()}
    if str(method).lower() in by_lower:
        return by_lower[str(method).lower()]
    names = sorted(CALIBRATION_METHODS)
    raise PulsarError(
        f"quant.calibration_method: unknown method {method!r}{did_you_mean(method, names)}; "
        f"use one of {', '.join(names)}"
    )


def compute_range(
    stats: TensorStats,
    method: str,
    *,
    num_bits: int = 8,
    signed: bool = False,
    symmetric: bool = False,
    percentile: float = 99.99,
    std_n: float = 3.0,
    kl_top_n: int = 1,
    weighted_alpha: float | None = None,
) -> tuple[float, float]:
    """Clipping range ``(lo, hi)`` with ``lo <= 0 <= hi`` for one tensor.

    ``signed`` / ``symmetric`` describe the integer grid: with a zero point (asymmetric) the grid
    spans [lo, hi] with 2^num_bits levels whatever the sign of the integer type; symmetric grids
    span [-t, t] (signed symmetric uses 2^num_bits - 1 levels, dropping the most negative one).
    A tensor without any finite value gets (0, 0).
    """
    fn = get_method(method)
    if not 2 <= num_bits <= 32:
        raise ValueError(f"num_bits must be in [2, 32], got {num_bits}")
    if not 50.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (50, 100], got {percentile}")
    if stats.count == 0:
        return 0.0, 0.0
    if kl_top_n < 1:
        raise ValueError(f"kl_top_n must be at least 1, got {kl_top_n}")
    if weighted_alpha is not None and not 0.0 <= weighted_alpha <= 1.0:
        raise ValueError(f"weighted_alpha must be in [0, 1], got {weighted_alpha}")
    spec = GridSpec(num_bits=num_bits, signed=signed, symmetric=symmetric, percentile=percentile, std_n=std_n,
                    kl_top_n=kl_top_n, weighted_alpha=weighted_alpha)
    lo, hi = fn(stats, spec)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"calibration method {method} returned a non-finite range ({lo}, {hi})")
    lo = min(max(lo, stats.min), 0.0)
    hi = max(min(hi, stats.max), 0.0)
    if symmetric:
        t = max(-lo, hi)
        lo, hi = -t, t
    return float(lo), float(hi)
