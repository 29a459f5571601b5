"""MSE: the range that minimises the expected squared quantization error over the histogram.

The error of a range has two parts: values outside it are clipped to the nearest end (their
squared distance, exact for values spread uniformly within a bin), and values inside are rounded
to the grid (step^2 / 12 each, except exact zeros, which every grid holds). Everything is measured
in bin units on the per-sign histograms, with suffix sums of the bin moments, so the clipping cost
of every candidate edge costs O(1): one-sided and symmetric grids try every edge; two-sided
asymmetric grids start from the best of a coarse 2-D grid of (lo, hi) edges and then alternate
exact 1-D searches on each side until neither moves.
"""

from __future__ import annotations

import numpy as np

from pulsar.quant.observers.histogram import TensorStats, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method

_COARSE = 64
_MAX_ROUNDS = 20


def clip_costs(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every edge j = 0..n of a one-sided histogram ``p`` (probabilities, bin units from zero):
    the expected squared clipping error when clipping at j, and the mass clipped."""
    n = p.size
    c = np.arange(n) + 0.5

    def suffix(v: np.ndarray) -> np.ndarray:
        return np.concatenate([np.cumsum(v[::-1])[::-1], [0.0]])

    s0, s1, s2 = suffix(p), suffix(p * c), suffix(p * (c * c + 1.0 / 12.0))
    j = np.arange(n + 1, dtype=np.float64)
    return np.maximum(s2 - 2.0 * j * s1 + j * j * s0, 0.0), s0


@register_method("MSE")
def mse_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    sides = side_histograms(stats)
    zero = sides.zeros / sides.total
    if spec.symmetric:
        cost, clipped = clip_costs(sides.folded() / sides.total)
        t = np.arange(cost.size, dtype=np.float64)
        inside = np.maximum(1.0 - clipped - zero, 0.0)
        step = spec.step(-1.0, 1.0) * t  # grid [-t, t]
        err = cost + inside * step * step / 12.0
        err[0] = np.inf if cost.size > 1 else 0.0
        best = int(np.argmin(err))
        return -best * sides.width, best * sides.width

    cost_n, clip_n = clip_costs(sides.neg / sides.total)
    cost_p, clip_p = clip_costs(sides.pos / sides.total)
    inv_steps = 1.0 / (spec.levels - 1)

    def err(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        inside = np.maximum(1.0 - clip_n[i] - clip_p[j] - zero, 0.0)
        step = (i + j) * inv_steps
        out = cost_n[i] + cost_p[j] + inside * step * step / 12.0
        return np.where((i + j == 0) & (cost_n.size + cost_p.size > 2), np.inf, out)

    all_i, all_j = np.arange(cost_n.size), np.arange(cost_p.size)
    coarse_i = np.unique(np.linspace(0, cost_n.size - 1, _COARSE + 1).round().astype(np.int64))
    coarse_j = np.unique(np.linspace(0, cost_p.size - 1, _COARSE + 1).round().astype(np.int64))
    grid = err(coarse_i[:, None], coarse_j[None, :])
    a, b = np.unravel_index(int(np.argmin(grid)), grid.shape)
    i, j = int(coarse_i[a]), int(coarse_j[b])
    for _ in range(_MAX_ROUNDS):
        new_j = int(np.argmin(err(np.full_like(all_j, i), all_j)))
        new_i = int(np.argmin(err(all_i, np.full_like(all_i, new_j))))
        if (new_i, new_j) == (i, j):
            break
        i, j = new_i, new_j
    return -i * sides.width, j * sides.width
