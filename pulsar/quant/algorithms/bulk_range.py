"""Keep the bulk of a heavy-tailed tensor: 16 bits where an 8-bit step is larger than most of its values.

A squared magnitude (an STFT power spectrum, ``x^2`` before a Sqrt), an energy, a detector's class
scores (mostly near 0, a few near 1) or any value with a long tail spans orders of magnitude: an
8-bit grid over its whole range rounds most of its values to zero, and downstream a Sqrt, a Log or a
recurrent cell reads them as silence (Silero VAD's front end: per-chunk speech decisions agree with
float 0.86). Clipping the range instead (KL, Percentile) keeps the bulk but cuts the tail, and the
tail is often the signal itself (the scores of the objects a detector finds: a layout detector's
box F1 fell from 0.73 to 0.70). The statistics show the problem before anything runs: the histogram
says how many of the non-zero values fall within half a step of zero. Where that is most of them
(:data:`FLATTENED`), the tensor is stored at 16 bits, which keeps both (a ReLU output's exact zeros do
not count: zero is on every grid). The inputs of weighted layers are left to automatic scale
refinement, which clips them to their MSE optimum (a weighted sum averages the clipping error away). A tensor a ``layer_configs`` entry set stays as it was set.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import numpy as np

from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.plan import QuantPlan
from pulsar.quant.scheme import BITS

log = logging.getLogger(__name__)

FLATTENED = 0.5  # share of the non-zero values that round to zero at which the bulk is lost
WIDER = {"U8": "U16", "S8": "S16"}


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


def flattened(s: TensorStats, dtype: str) -> float:
    """:func:`rounded_to_zero` on the grid of ``dtype`` over the tensor's whole range (0 included)."""
    if s.count == 0:
        return 0.0
    return rounded_to_zero(s, min(s.min, 0.0), max(s.max, 0.0), 2 ** BITS[dtype])


def widen_flattened(plan: QuantPlan, stats: Mapping[str, TensorStats],
                    fixed: AbstractSet[str] = frozenset(), refined: AbstractSet[str] = frozenset()) -> list[str]:
    """Raise, in ``plan``, every 8-bit activation whose grid would round most of its non-zero values to
    zero to 16 bits, with the passive outputs that share its grid; ``fixed`` (tensors of nodes a
    layer_configs entry chose) and ``refined`` (weighted-layer inputs, which automatic scale refinement
    clips to their MSE optimum instead) are left alone. Returns the tensors raised."""
    raised = []
    for name in plan.activations:
        dtype = plan.dtypes.get(name, "")
        s = stats.get(name)
        if dtype not in WIDER or name in plan.shared or name in fixed or name in refined or s is None:
            continue
        share = flattened(s, dtype)
        if share < FLATTENED:
            continue
        plan.dtypes[name] = WIDER[dtype]
        raised.append(name)
        log.debug("bulk: %s: %.0f%% of its non-zero values round to zero at %s over %.4g .. %.4g: %s", name,
                  100 * share, dtype, s.min, s.max, WIDER[dtype])
    for out, src in plan.shared.items():  # passive outputs follow the grid they share
        if plan.dominator(src) in raised:
            plan.dtypes[out] = plan.dtypes[plan.dominator(src)]
    if raised:
        log.info("bulk: %d heavy-tailed tensors whose 8-bit step is larger than most of their values are "
                 "stored at 16 bits (%s%s)", len(raised), ", ".join(raised[:3]), " ..." if len(raised) > 3 else "")
    return raised
