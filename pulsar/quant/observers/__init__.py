"""Calibration methods: statistics of a tensor -> clipping range for a given integer grid.

``CALIBRATION_METHODS`` maps the names used by ``quant.calibration_method`` (MinMax, Percentile, Mean,
MSE, KL, ACIQ, Std, WeightedScale) to functions registered with :func:`register_method`; InIR ranges come
from the model itself (:mod:`pulsar.quant.in_ir`).
"""

from __future__ import annotations

from pulsar.quant.observers import aciq, kl, minmax, mse, percentile, running  # noqa: F401  (register the methods)
from pulsar.quant.observers.histogram import DEFAULT_NUM_BINS, SideHistograms, TensorStats, side_histograms
from pulsar.quant.observers.registry import (
    CALIBRATION_METHODS,
    CalibrationMethod,
    GridSpec,
    compute_range,
    get_method,
    register_method,
)

__all__ = [
    "CALIBRATION_METHODS",
    "DEFAULT_NUM_BINS",
    "CalibrationMethod",
    "GridSpec",
    "SideHistograms",
    "TensorStats",
    "compute_range",
    "get_method",
    "register_method",
    "side_histograms",
]
