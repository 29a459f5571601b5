"""The :class:`TensorStats` update for torch tensors, computed where the tensor lives (e.g. a GPU).

Calibration on ``quant.device cuda:N`` produces its activations on the GPU; copying every one to the
host to bin it there would cost more than the model itself. Here the extremes, the zero count and
the bin counts are reduced on the device, so per tensor and batch only three scalars and the
``num_bins`` counts travel to the host. The arithmetic mirrors :func:`histogram._bin_counts`
step by step in the same float dtype (subtract ``lo``, multiply by ``scale``, clamp, truncate), so
the result equals the numpy update on the same values bit for bit (tests check it on CPU tensors).
This module is separate so that :mod:`.histogram` stays numpy-only (no torch import there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pulsar.quant.observers.histogram import _CHUNK, TensorStats

__all__ = ["BatchReductions", "bin_counts_torch", "reduce_batch", "update_torch"]


@dataclass(frozen=True)
class BatchReductions:
    """One batch's device-side reductions over its finite values (a new per-batch statistic of
    :class:`TensorStats` adds its reduction here and in :func:`reduce_batch`)."""

    finite: torch.Tensor  # the finite values, flat, float32 or float64 (what numpy would bin)
    count: int
    lo: float
    hi: float
    zeros: int
    nonfinite: int


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """The dtype numpy's update would bin in: float32 for anything narrower or non-float."""
    x = x.detach()
    if not x.is_floating_point() or x.element_size() < 4:
        x = x.to(torch.float32)
    return x.reshape(-1)


def reduce_batch(x: torch.Tensor) -> BatchReductions | None:
    """Extremes, zeros and non-finite count of one batch in one host transfer (two when NaN / Inf
    are present, as in the numpy update); None for an empty tensor."""
    x = _as_float(x)
    if x.numel() == 0:
        return None
    lo_t, hi_t = torch.aminmax(x)  # NaN propagates, as in numpy's min / max
    zeros_t = (x == 0).sum()  # NaN and Inf are never zero: the count over x is the count over its finite part
    lo, hi, zeros = torch.stack([lo_t.double(), hi_t.double(), zeros_t.double()]).tolist()
    nonfinite = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):  # rare: pay for the mask only then
        finite = x[torch.isfinite(x)]
        nonfinite = x.numel() - finite.numel()
        x = finite
        if x.numel() > 0:
            lo_t, hi_t = torch.aminmax(x)
            lo, hi = torch.stack([lo_t.double(), hi_t.double()]).tolist()
    return BatchReductions(x, int(x.numel()), float(lo), float(hi), int(zeros), int(nonfinite))


def bin_counts_torch(x: torch.Tensor, lo: float, hi: float, n: int) -> np.ndarray:
    """:func:`histogram._bin_counts` on the tensor's device: only the ``n`` counts come back."""
    scale = n / (hi - lo)
    if x.dtype == torch.float32 and (scale > 1e30 or abs(lo) > 1e30):
        x = x.to(torch.float64)  # as numpy: keep float32 arithmetic away from overflow on degenerate grids
    # the constants rounded to the data's dtype first, as numpy's x.dtype.type(lo) does
    lo_ = torch.tensor(lo, dtype=x.dtype, device=x.device)
    scale_ = torch.tensor(scale, dtype=x.dtype, device=x.device)
    counts = torch.zeros(n, dtype=torch.int64, device=x.device)
    for start in range(0, x.numel(), _CHUNK):
        t = x[start : start + _CHUNK] - lo_
        t.mul_(scale_)
        t.clamp_(0.0, n - 0.5)  # rounding can push the extremes just past the outer edges
        counts += torch.bincount(t.to(torch.int64), minlength=n)[:n]
        del t
    return counts.cpu().numpy()


def update_torch(stats: TensorStats, x: torch.Tensor) -> None:
    """``stats.update`` for a torch tensor, reduced on its device; equal to the numpy update."""
    batch = reduce_batch(x)
    if batch is None:
        return
    stats.nonfinite += batch.nonfinite
    if batch.count == 0:
        return
    finite, count, zeros = batch.finite, batch.count, batch.zeros
    part, weight = stats.binned(count)
    if weight != 1:  # the histogram's weighted sample, as the numpy update takes it
        finite = finite[part]
        count, zeros = int(finite.numel()) * weight, int((finite == 0).sum()) * weight
    stats.add_batch(count, batch.lo, batch.hi, zeros,
                    lambda lo, hi, n: bin_counts_torch(finite, lo, hi, n) * weight)
