"""MSE: the range that minimises the expected squared quantization error over the histogram.

The error of a range has three parts, all in bin units on the per-sign histograms (exact zeros
left out: zero is on every grid, so they cost nothing):

- values beyond an end are clipped to it: their squared distance (values uniform within a bin);
- values within half a step of zero round to zero: their square (this matters when the data
  crowd around zero relative to the step, e.g. heavy tails far out);
- the other values inside round to the grid: step^2 / 12 each.

Suffix / prefix sums of the bin moments make each candidate O(1): symmetric and one-sided grids try
every edge; two-sided asymmetric grids start from the best of a coarse 2-D grid of (lo, hi) edges
(linear and geometric spacing) and then alternate exact 1-D searches on each side until neither
moves, from a few starting points.
"""

from __future__ import annotations

import numpy as np

from pulsar.quant.observers.histogram import TensorStats, side_histograms
from pulsar.quant.observers.registry import GridSpec, register_method

_COARSE = 64
_MAX_ROUNDS = 20
_STARTS = 4


class _Side:
    """Moment sums of a one-sided histogram ``p`` (probabilities; bin k covers [k, k+1))."""

    def __init__(self, p: np.ndarray) -> None:
        n = p.size
        c = np.arange(n) + 0.5
        m2 = p * (c * c + 1.0 / 12.0)  # mass * E[x^2] of each bin
        self.edges = np.arange(n + 1, dtype=np.float64)
        self.below0 = np.concatenate([[0.0], np.cumsum(p)])  # mass in [0, k)
        self.below2 = np.concatenate([[0.0], np.cumsum(m2)])
        above0 = self.below0[-1] - self.below0  # mass in [k, n)
        above1 = np.concatenate([np.cumsum((p * c)[::-1])[::-1], [0.0]])
        above2 = self.below2[-1] - self.below2
        # clipping at edge k: sum over bins above of mass * E[(x - k)^2]
        self.clip = np.maximum(above2 - 2.0 * self.edges * above1 + self.edges**2 * above0, 0.0)
        self.clipped = np.maximum(above0, 0.0)

    @property
    def size(self) -> int:
        return self.edges.size  # number of candidate edges

    def near_zero(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mass and mass * E[x^2] of the values in [0, u) (u in bin units, fractional)."""
        return np.interp(u, self.edges, self.below0), np.interp(u, self.edges, self.below2)


def _error(neg: _Side, pos: _Side, i: np.ndarray, j: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Expected squared error of the range [-i, j] (bin units) with grid step ``step``."""
    half = 0.5 * step
    n0, n2 = neg.near_zero(np.minimum(half, i))
    p0, p2 = pos.near_zero(np.minimum(half, j))
    mid = np.maximum(neg.below0[-1] + pos.below0[-1] - neg.clipped[i] - pos.clipped[j] - n0 - p0, 0.0)
    return neg.clip[i] + pos.clip[j] + n2 + p2 + mid * step * step / 12.0


@register_method("MSE")
def mse_range(stats: TensorStats, spec: GridSpec) -> tuple[float, float]:
    sides = side_histograms(stats, exclude_zeros=True)
    if spec.symmetric:
        folded = _Side(sides.folded() / sides.total)
        empty = _Side(np.zeros(0))
        t = np.arange(folded.size)
        err = _error(empty, folded, np.zeros_like(t), t, spec.step(-1.0, 1.0) * t)
        err[0] = np.inf if folded.size > 1 else 0.0
        best = int(np.argmin(err))
        return -best * sides.width, best * sides.width

    neg, pos = _Side(sides.neg / sides.total), _Side(sides.pos / sides.total)
    inv_steps = 1.0 / (spec.levels - 1)

    def err(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        out = _error(neg, pos, i, j, (i + j) * inv_steps)
        return np.where((i + j == 0) & (neg.size + pos.size > 2), np.inf, out)

    all_i, all_j = np.arange(neg.size), np.arange(pos.size)
    coarse_i, coarse_j = _coarse(neg.size - 1), _coarse(pos.size - 1)
    grid = err(coarse_i[:, None], coarse_j[None, :])
    best = (np.inf, 0, 0)
    # sparse tails make the surface bumpy: descend from the best few local minima of the coarse grid
    for a, b in _local_minima(grid)[:_STARTS]:
        i, j = int(coarse_i[a]), int(coarse_j[b])
        for _ in range(_MAX_ROUNDS):
            new_j = int(np.argmin(err(np.full_like(all_j, i), all_j)))
            new_i = int(np.argmin(err(all_i, np.full_like(all_i, new_j))))
            if (new_i, new_j) == (i, j):
                break
            i, j = new_i, new_j
        value = float(err(np.array([i]), np.array([j]))[0])
        if value < best[0]:
            best = (value, i, j)
    return -best[1] * sides.width, best[2] * sides.width


def _local_minima(grid: np.ndarray) -> list[tuple[int, int]]:
    """Cells no larger than any of their 8 neighbours, best first (the global minimum is one)."""
    padded = np.pad(grid, 1, constant_values=np.inf)
    rows, cols = grid.shape
    is_min = np.ones(grid.shape, bool)
    for da in (-1, 0, 1):
        for db in (-1, 0, 1):
            if da or db:
                is_min &= grid <= padded[1 + da : 1 + da + rows, 1 + db : 1 + db + cols]
    cells = np.argwhere(is_min & np.isfinite(grid))
    if cells.size == 0:
        cells = np.array([np.unravel_index(int(np.argmin(grid)), grid.shape)])
    order = np.argsort(grid[cells[:, 0], cells[:, 1]], kind="stable")
    return [(int(a), int(b)) for a, b in cells[order]]


def _coarse(n: int) -> np.ndarray:
    """Candidate edges 0..n, spaced both linearly and geometrically (optima far below the max)."""
    if n <= 0:
        return np.zeros(1, np.int64)
    both = np.concatenate([np.linspace(0, n, _COARSE // 2 + 1), np.geomspace(1, n, _COARSE // 2)])
    return np.unique(both.round().astype(np.int64))
