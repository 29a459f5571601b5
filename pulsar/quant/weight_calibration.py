"""Weight ranges by a calibration method (``quant.weight_calibration_method`` or a layer's), per row
(a channel, or the whole tensor): each row's values make a :class:`TensorStats` and the method
picks the row's range on the weights' symmetric (S*) or affine (U4) grid, as for activations."""

from __future__ import annotations

from typing import Any

import numpy as np

from pulsar.quant.observers import TensorStats, compute_range


def method_ranges(rows: np.ndarray, method: str, num_bits: int, signed: bool,
                  params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) per row of ``rows`` ([rows, values], float64) by ``method``."""
    lo, hi = np.zeros(rows.shape[0]), np.zeros(rows.shape[0])
    for k, row in enumerate(rows):
        stats = TensorStats.empty()
        stats.update(row)
        lo[k], hi[k] = compute_range(stats, method, num_bits=num_bits, signed=signed, symmetric=signed, **params)
    return lo, hi
