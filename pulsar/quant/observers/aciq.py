"""ACIQ (Banner et al., "Post training 4-bit quantization of convolutional networks", 2019): fit a
Laplace or a Gaussian to the tensor and clip where the expected squared error is least.

The fit needs two moments of the histogram: the mean and, for Laplace, the mean absolute deviation
``b`` (the scale of Laplace(mu, b)), for Gauss the standard deviation ``sigma``. The clipping
threshold ``alpha`` around the mean minimises clipping noise + rounding noise for the grid's
``2^bits`` levels over ``2 alpha``:

- Laplace: ``2 b^2 exp(-alpha / b) + alpha^2 / (3 * 4^bits)``
- Gauss: ``(alpha^2 + sigma^2) (1 - erf(alpha / (sigma sqrt 2))) - sqrt(2 / pi) alpha sigma
  exp(-alpha^2 / (2 sigma^2)) + alpha^2 / (3 * 4^bits)``

solved numerically for any bit width (the paper's table: Laplace 9.89 b and Gauss 3.92 sigma at 8
bits, 5.03 b and 2.55 sigma at 4). The range is ``mean +- alpha`` within the data's extremes.
``Std`` uses the same moments with a fixed ``alpha = N sigma`` (``quant.calibration_std_n``).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.observers.registry import GridSpec, register_method

_RATIOS = np.linspace(0.05, 40.0, 8000)  # alpha / spread candidates, fine enough for 0.1 % of alpha


def moments(stats: TensorStats) -> tuple[float, float, float]:
    """(mean, mean absolute deviation, standard deviation) of the histogram (bin centres)."""
    centres = stats.edges()[:-1] + stats.bin_width / 2
    counts = stats.hist.astype(np.float64)
    n = counts.sum()
    if n <= 0:
        return 0.0, 0.0, 0.0
    mean = float((counts * centres).sum() / n)
    mad = float((counts * np.abs(centres - mean)).sum() / n)
    std = float(math.sqrt((counts * (centres - mean) ** 2).sum() / n))
    return mean, mad, std


@cache
def laplace_ratio(bits: int) -> float:
    """alpha / b minimising the expected error of Laplace(0, b) on ``2^bits`` levels."""
    a = _RATIOS
    err = 2 * np.exp(-a) + a**2 / (3 * 4.0**bits)
    return float(a[np.argmin(err)])


@cache
def gauss_ratio(bits: int) -> float:
    """alpha / sigma minimising the expected error of N(0, sigma^2) on ``2^bits`` levels."""
    a = _RATIOS
    erf = np.array([math.erf(v / math.sqrt(2)) for v in a])
    err = (a**2 + 1) * (1 - erf) - math.sqrt(2 / math.pi) * a * np.exp(-(a**2) / 2) + a**2 / (3 * 4.0**bits)
    return float(a[np.argmin(err)])


def _around_mean(stats: TensorStats, mean: float, alpha: float, spec: GridSpec) -> tuple[float, float]:
    if spec.symmetric:
        t = abs(mean) + alpha
        return -t, t
    return max(stats.min, mean - alpha), min(stats.max, mean + alpha)


@register_method("ACIQ_Laplace")
def aciq_laplace_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    mean, mad, _ = moments(stats)
    return _around_mean(stats, mean, laplace_ratio(spec.num_bits) * mad, spec)


@register_method("ACIQ_Gauss")
def aciq_gauss_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    mean, _, std = moments(stats)
    return _around_mean(stats, mean, gauss_ratio(spec.num_bits) * std, spec)


@register_method("Std")
def std_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    """mean +- ``spec.std_n`` standard deviations (quant.calibration_std_n; Compass's ``[N]std``)."""
    mean, _, std = moments(stats)
    return _around_mean(stats, mean, spec.std_n * std, spec)
