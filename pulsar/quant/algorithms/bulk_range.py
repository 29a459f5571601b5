"""Keep the bulk of a heavy-tailed tensor: a MinMax range whose step is larger than most of its values.

A squared magnitude (an STFT power spectrum, ``x^2`` before a Sqrt), an energy or any value with a
long tail spans orders of magnitude: MinMax sets the 8-bit step from the rare largest value and
most of the values round to zero. Downstream a Sqrt, a Log or a recurrent cell reads them as
silence (Silero VAD's front end: per-chunk speech decisions agree with float 0.86 at MinMax, 0.95
with KL). The statistics show it before anything runs: the histogram says how many of the non-zero
values fall within half a step of zero. Where that is most of them (:data:`FLATTENED`), the tensor
takes the KL range (its clipping keeps the distribution's bulk, unlike MSE, which weighs the tail's
large squared errors), if that is tighter. Tensors whose values are mostly resolved keep MinMax: a
ReLU output's exact zeros do not count (zero is on every grid), and an activation whose typical
value spans several steps is left alone.
"""

from __future__ import annotations

import logging

import numpy as np

from pulsar.quant.observers import compute_range
from pulsar.quant.observers.histogram import TensorStats

log = logging.getLogger(__name__)

FLATTENED = 0.5  # share of the non-zero values that round to zero at which the bulk is lost


def rounded_to_zero(s: TensorStats, lo: float, hi: float, levels: int) -> float:
    """The share of the non-zero values of ``s`` within half a step of zero on ``levels`` over [lo, hi]."""
    nonzero = s.count - s.zeros
    if nonzero <= 0 or hi <= lo or s.hist_hi <= s.hist_lo:
        return 0.0
    half = (hi - lo) / (levels - 1) / 2
    edges = s.edges()
    # counts inside (-half, half), bins split linearly where an edge cuts them
    left = np.clip(edges[:-1], -half, half)
    right = np.clip(edges[1:], -half, half)
    width = np.maximum(edges[1:] - edges[:-1], 1e-300)
    near = float((s.hist * np.maximum(right - left, 0.0) / width).sum()) - s.zeros
    return max(0.0, min(1.0, near / nonzero))


def keep_bulk(stats: dict[str, TensorStats], ranges: dict[str, tuple[float, float]], names: list[str], *,
              num_bits: int, signed: bool) -> list[str]:
    """Replace, in place, the range of every tensor of ``names`` whose bulk the range flattens by its
    KL range (when tighter); returns the tensors changed."""
    changed = []
    levels = 2**num_bits
    for name in names:
        s = stats.get(name)
        if s is None or s.count == 0 or name not in ranges:
            continue
        lo, hi = ranges[name]
        share = rounded_to_zero(s, lo, hi, levels)
        if share < FLATTENED:
            continue
        klo, khi = compute_range(s, "KL", num_bits=num_bits, signed=signed, symmetric=signed)
        if khi - klo >= hi - lo or khi - klo <= 0:
            continue
        ranges[name] = (klo, khi)
        changed.append(name)
        log.debug("bulk range: %s: %.0f%% of its non-zero values round to zero over %.4g .. %.4g; KL range "
                  "%.4g .. %.4g", name, 100 * share, lo, hi, klo, khi)
    if changed:
        log.info("bulk range: %d heavy-tailed tensors whose MinMax step was larger than most of their values "
                 "take their KL range (%s%s)", len(changed), ", ".join(changed[:3]), " ..." if len(changed) > 3 else "")
    return changed
