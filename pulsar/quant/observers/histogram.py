"""Streaming per-tensor statistics: one pass over the calibration data feeds every calibration method.

A :class:`TensorStats` keeps the count, extremes, number of exact zeros and a fixed-size histogram,
so its memory does not depend on how many samples were seen. The histogram grid starts at the first
batch's [min, max] and, when a later batch falls outside, grows by an integer factor with the new
edges aligned on old edges. Re-binning is then an exact merge of neighbouring bins, so the counts
equal ``np.histogram`` of all data seen on the current grid (up to values that rounding puts on
the other side of an edge), and growth is at least 2x, which keeps re-binning rare. Only when all
earlier data fit in less than one new bin (e.g. a constant first batch) does the grid restart,
with the old counts placed at their bin centres.

With ``sample_cap`` (``quant.calibration_histogram_values``, 1 Mi by default; 0 bins every value) large
activations are binned from a sample of their values: the extremes and the non-finite count always
see every value, the histogram at most about ``sample_cap`` values of a batch, every k-th one (k a
prime, so the sample does not line up with a feature map's power-of-two rows and columns) from an
offset that moves with each batch (k batches of one size bin each position once). Each binned value
counts k times, so ``count`` and ``zeros`` stay the number of values seen (up to k a batch) and
batches of different sizes keep their weight. Binning costs about 2 ns a value (numpy's
``bincount``) against 0.1 ns for the extremes, and a detector's 640x640 feature maps hold tens of
millions of values a sample.

The methods mostly look at one side of zero at a time (the grid always contains zero):
:func:`side_histograms` re-bins the histogram into ``|x|`` bins starting at zero for each sign.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal, overload

import numpy as np

DEFAULT_NUM_BINS = 4096
_CHUNK = 1 << 18  # values binned at a time (per thread: calibration counts two tensors at once)
_SCALAR_FIELDS = ("count", "min", "max", "hist_lo", "hist_hi", "zeros", "nonfinite", "batches", "momentum",
                  "run_min", "run_max", "sample_cap")
DEFAULT_MOMENTUM = 0.9


@dataclass(eq=False)
class TensorStats:
    """Extremes of the finite values of one tensor over all samples, and a histogram of them (from a
    weighted sample of each batch past ``sample_cap`` values; ``count`` and ``zeros`` are the
    histogram's)."""

    count: int = 0
    min: float = math.inf
    max: float = -math.inf
    hist: np.ndarray = field(default_factory=lambda: np.zeros(DEFAULT_NUM_BINS, np.int64))
    hist_lo: float = 0.0
    hist_hi: float = 0.0
    zeros: int = 0  # exact zeros: they are never rounded (zero is on every grid), MSE leaves them out
    nonfinite: int = 0  # NaN / Inf values, skipped
    # running extremes (Compass's ``mean`` strategy): per batch, run = momentum * run + (1 - momentum) * batch
    # extreme, the first batch's extremes to start; a batch is one update() (one calibration sample)
    batches: int = 0
    momentum: float = DEFAULT_MOMENTUM
    run_min: float = 0.0
    run_max: float = 0.0
    sample_cap: int = 0  # the most values of one batch the histogram bins (0: all)

    @classmethod
    def empty(cls, num_bins: int = DEFAULT_NUM_BINS, momentum: float = DEFAULT_MOMENTUM,
              sample_cap: int = 0) -> TensorStats:
        if num_bins < 16:
            raise ValueError(f"num_bins must be at least 16, got {num_bins}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if sample_cap < 0:
            raise ValueError(f"sample_cap must be >= 0, got {sample_cap}")
        return cls(hist=np.zeros(int(num_bins), np.int64), momentum=float(momentum), sample_cap=int(sample_cap))

    def binned(self, size: int) -> tuple[slice, int]:
        """(the values of a batch of ``size`` finite values the histogram bins, the weight of each):
        all of them, or past ``sample_cap`` every k-th, k the smallest prime at least ``size /
        sample_cap``, from offset ``batches * g mod k`` (g about k / 1.618: consecutive batches take
        offsets far apart, and k of them take each offset once), each counting k times."""
        if not self.sample_cap or size <= self.sample_cap:
            return slice(None), 1
        stride = _prime_at_least(-(-size // self.sample_cap))
        step = max(1, round(stride * 0.6180339887)) % stride or 1
        return slice(self.batches * step % stride, None, stride), stride

    @property
    def num_bins(self) -> int:
        return int(self.hist.shape[0])

    @property
    def bin_width(self) -> float:
        return (self.hist_hi - self.hist_lo) / self.num_bins

    def edges(self) -> np.ndarray:
        return np.linspace(self.hist_lo, self.hist_hi, self.num_bins + 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStats):
            return NotImplemented
        mine, theirs = self.to_arrays(), other.to_arrays()
        return all(np.array_equal(mine[k], theirs[k]) for k in mine)

    __hash__ = None  # mutable

    # ----------------------------------------------------------------------------------- update
    def update(self, x: np.ndarray) -> None:
        """Add the values of one batch (any shape; non-float data is cast to float32)."""
        x = np.asarray(x)
        if x.dtype.kind != "f" or x.dtype.itemsize < 4:
            x = x.astype(np.float32)
        x = x.reshape(-1)
        if x.size == 0:
            return
        lo, hi = _extremes(x)
        if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN / Inf are rare: pay for the mask only then
            finite = x[np.isfinite(x)]
            self.nonfinite += int(x.size - finite.size)
            x = finite
            if x.size == 0:
                return
            lo, hi = _extremes(x)
        part, weight = self.binned(x.size)
        finite = x[part]
        zeros = [0]  # counted while binning: each chunk is read from memory once for both

        def bins(g_lo: float, g_hi: float, n: int) -> np.ndarray:
            counts, zeros[0] = _bin_counts(finite, g_lo, g_hi, n, count_zeros=True)
            return counts * weight if weight != 1 else counts

        self.add_batch(int(finite.size) * weight, lo, hi, 0, bins)
        self.zeros += zeros[0] * weight

    def add_batch(self, count: int, lo: float, hi: float, zeros: int,
                  bin_counts: Callable[[float, float, int], np.ndarray]) -> None:
        """One batch whose finite values lie in [lo, hi]: ``count`` > 0 of them, ``zeros`` of those exact
        zeros, both as the histogram counts them (a sample's values weighted, :meth:`binned`).

        Every update path ends here: numpy's :meth:`update` and the torch one that reduces on the
        tensor's device (:mod:`pulsar.quant.observers.torch_stats`), so a per-batch field is added
        once. ``bin_counts(grid_lo, grid_hi, n)`` bins the values on the grid grown to hold them.
        """
        self._cover(lo, hi)
        self.hist += bin_counts(self.hist_lo, self.hist_hi, self.num_bins)
        self.count += count
        self.zeros += zeros
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.add_batch_extremes(lo, hi)

    def add_batch_extremes(self, lo: float, hi: float) -> None:
        """One batch's extremes into the running ones (every update path calls this once per batch)."""
        if self.batches == 0:
            self.run_min, self.run_max = lo, hi
        else:
            m = self.momentum
            self.run_min = m * self.run_min + (1.0 - m) * lo
            self.run_max = m * self.run_max + (1.0 - m) * hi
        self.batches += 1

    def merge(self, other: TensorStats) -> None:
        """Add another tensor's statistics (e.g. tensors that must share one range)."""
        if other.count == 0:
            self.nonfinite += other.nonfinite
            return
        self._cover(other.min, other.max)
        cdf = np.interp(self.edges(), other.edges(), np.concatenate([[0], np.cumsum(other.hist)]))
        cdf[0], cdf[-1] = 0, other.count  # the grid holds [other.min, other.max]: all of its counts
        self.hist += np.diff(np.rint(cdf).astype(np.int64))
        self.count += other.count
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        # tensors sharing a range: the running range must hold both running ranges
        if self.batches == 0:
            self.run_min, self.run_max = other.run_min, other.run_max
        else:
            self.run_min, self.run_max = min(self.run_min, other.run_min), max(self.run_max, other.run_max)
        self.batches += other.batches

    def _cover(self, lo: float, hi: float) -> None:
        """Make the histogram grid contain [lo, hi], merging old bins exactly when it grows."""
        n = self.num_bins
        if self.count == 0:
            self.hist_lo, self.hist_hi = _initial_grid(lo, hi)
            return
        if lo >= self.hist_lo and hi <= self.hist_hi:
            return
        w = self.bin_width
        left = math.ceil((self.hist_lo - lo) / w) if lo < self.hist_lo else 0
        right = math.ceil((hi - self.hist_hi) / w) if hi > self.hist_hi else 0
        need = n + left + right
        factor = -(-need // n)
        if factor > n:  # the old data fit in less than one new bin: start a fresh grid
            new_lo, new_hi = _initial_grid(min(lo, self.min), max(hi, self.max))
            centres = self.hist_lo + (np.arange(n) + 0.5) * w
            idx = np.clip(((centres - new_lo) * (n / (new_hi - new_lo))).astype(np.int64), 0, n - 1)
        else:
            slack = factor * n - need
            if left and right:
                left += slack // 2
            elif left:
                left += slack  # only the low side grew: keep the high edge where it is
            new_lo = self.hist_lo - left * w
            new_hi = new_lo + factor * n * w
            idx = (np.arange(n) + left) // factor
        merged = np.zeros(n, np.int64)
        np.add.at(merged, idx, self.hist)
        self.hist, self.hist_lo, self.hist_hi = merged, new_lo, new_hi

    # ---------------------------------------------------------------------------- persistence
    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays (no objects), so the statistics can be cached with ``allow_pickle=False``."""
        arrays = {name: np.asarray(getattr(self, name)) for name in _SCALAR_FIELDS}
        arrays["hist"] = self.hist.copy()
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> TensorStats:
        hist = np.asarray(arrays["hist"], dtype=np.int64).copy()
        ints = {"count", "zeros", "nonfinite", "batches", "sample_cap"}
        kwargs = {name: int(arrays[name]) if name in ints else float(arrays[name]) for name in _SCALAR_FIELDS
                  if name in arrays or name != "sample_cap"}
        return cls(hist=hist, **kwargs)


def _prime_at_least(n: int) -> int:
    k = max(2, n)
    while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
        k += 1
    return k


def _initial_grid(lo: float, hi: float) -> tuple[float, float]:
    if hi > lo:
        return lo, hi
    pad = max(abs(lo) * 1e-6, 1e-20)  # constant data: any small positive width will do
    return lo - pad, hi + pad


def _extremes(x: np.ndarray) -> tuple[float, float]:
    """(min, max) of a flat array, chunk by chunk: the max reads each chunk from cache, not memory (NaN
    propagates as in ``x.min()``)."""
    if x.size <= _CHUNK:
        return float(x.min()), float(x.max())
    parts = [(c.min(), c.max()) for c in (x[s : s + _CHUNK] for s in range(0, x.size, _CHUNK))]
    return float(np.min([p[0] for p in parts])), float(np.max([p[1] for p in parts]))


@overload
def _bin_counts(x: np.ndarray, lo: float, hi: float, n: int) -> np.ndarray: ...
@overload
def _bin_counts(x: np.ndarray, lo: float, hi: float, n: int, count_zeros: Literal[True]) -> tuple[np.ndarray, int]: ...
def _bin_counts(x: np.ndarray, lo: float, hi: float, n: int,
                count_zeros: bool = False) -> np.ndarray | tuple[np.ndarray, int]:
    """Counts of ``x`` (all within [lo, hi]) in ``n`` equal bins; the top edge goes to the last bin.
    With ``count_zeros`` also the number of exact zeros (-0.0 counts alike).

    Large tensors go in chunks, so the temporaries (bin positions, indices) stay small and each
    chunk is read from memory once.
    """
    scale = n / (hi - lo)
    orig = x
    if x.dtype == np.float32 and (scale > 1e30 or abs(lo) > 1e30):
        x = x.astype(np.float64)  # keep float32 arithmetic away from overflow on degenerate grids
    lo_, scale_ = x.dtype.type(lo), x.dtype.type(scale)
    counts: np.ndarray | None = None
    zeros = 0
    buf = _buffers(x.dtype)
    for start in range(0, x.size, _CHUNK):
        chunk = x[start : start + _CHUNK]
        m = chunk.size
        if count_zeros:  # x == 0 then counting a bool array: 5x faster than count_nonzero on floats
            zeros += int(np.count_nonzero(np.equal(orig[start : start + _CHUNK], 0, out=buf.mask[:m])))
        t = np.subtract(chunk, lo_, out=buf.pos[:m])
        t *= scale_
        # t is in [0, n + rounding): x >= lo rounds to x >= lo_ (rounding is monotonic), so x - lo_ >= 0;
        # through int32 (a vectorized cast; float -> int64 is not) to the intp bincount takes, truncating
        # as astype does; the few values rounding pushes to n or past join the top bin, as a clip to
        # n - 0.5 would put them (one pass less than clipping every value)
        codes, index = buf.int32[:m], buf.index[:m]
        np.copyto(codes, t, casting="unsafe")
        np.copyto(index, codes)
        try:
            got = np.bincount(index, minlength=n)
        except ValueError:  # a negative code: values below lo after all; clip as the grid's edges do
            np.copyto(index, np.clip(t, 0.0, n - 0.5), casting="unsafe")
            got = np.bincount(index, minlength=n)
        if got.size > n:
            got[n - 1] += got[n:].sum()
            got = got[:n]
        if counts is None:
            counts = got
        else:
            counts += got
    if counts is None:
        counts = np.zeros(n, np.int64)
    return (counts, zeros) if count_zeros else counts


class _Scratch(threading.local):
    """Per thread (calibration counts two tensors at once), the chunk temporaries of :func:`_bin_counts`,
    allocated once: fresh ones for every chunk cost page faults (tensors of 64-128 Ki values took
    4x longer)."""

    def __init__(self) -> None:
        self.by_dtype: dict[np.dtype, SimpleNamespace] = {}


_SCRATCH = _Scratch()


def _buffers(dtype: np.dtype) -> SimpleNamespace:
    got = _SCRATCH.by_dtype.get(dtype)
    if got is None:
        got = SimpleNamespace(mask=np.empty(_CHUNK, np.bool_), pos=np.empty(_CHUNK, dtype),
                              int32=np.empty(_CHUNK, np.int32), index=np.empty(_CHUNK, np.intp))
        _SCRATCH.by_dtype[dtype] = got
    return got


# --------------------------------------------------------------------------- derived histograms
@dataclass(frozen=True)
class SideHistograms:
    """Counts of ``x`` in ``[k*w, (k+1)*w)`` (pos) and of ``-x`` likewise (neg), k = 0, 1, ..."""

    pos: np.ndarray
    neg: np.ndarray
    width: float
    zeros: float
    total: float

    def folded(self) -> np.ndarray:
        """Histogram of ``|x|``, for symmetric grids."""
        out = np.zeros(max(self.pos.size, self.neg.size))
        out[: self.pos.size] += self.pos
        out[: self.neg.size] += self.neg
        return out


def side_histograms(
    stats: TensorStats, max_bins: int | None = None, *, exclude_zeros: bool = False
) -> SideHistograms:
    """Re-bin the histogram into one ``|x|`` histogram per sign, each starting at zero.

    The bin width stays the native one (the counts are exact when zero is on a native edge, as for
    ReLU outputs), unless a side would need more than ``max_bins`` (default 2 * num_bins) bins, as
    for data far from zero, e.g. in [5, 6]. ``exclude_zeros`` leaves the exact zeros out of the
    bins (they are still in ``total`` and ``zeros``).
    """
    max_bins = max_bins or 2 * stats.num_bins
    raw_w, lo, last = stats.bin_width, stats.hist_lo, stats.num_bins - 1
    # each side reaches the far edge of the raw bin holding its extreme, so no count is cut off
    pos_cover = lo + (min(int((stats.max - lo) / raw_w), last) + 1) * raw_w if stats.max > 0 else 0.0
    neg_cover = -(lo + min(int((stats.min - lo) / raw_w), last) * raw_w) if stats.min < 0 else 0.0
    extent = max(pos_cover, neg_cover)
    width = max(raw_w, extent / max_bins) if extent > 0 else 1.0
    hist = _without_zeros(stats) if exclude_zeros else stats.hist
    cdf = np.concatenate([[0.0], np.cumsum(hist, dtype=np.float64)])
    raw_edges = stats.edges()

    def side(cover: float, sign: float, all_of_it: bool) -> np.ndarray:
        if cover <= 0:
            return np.zeros(0)
        n = max(1, math.ceil(cover / width - 1e-9))
        at = np.interp(sign * width * np.arange(n + 1), raw_edges, cdf)
        if all_of_it:  # one-sided data: the raw bin straddling zero belongs to this side entirely
            at[0] = 0.0 if sign > 0 else cdf[-1]
        return np.abs(np.diff(at))

    return SideHistograms(
        pos=side(pos_cover, 1.0, stats.min >= 0),
        neg=side(neg_cover, -1.0, stats.max <= 0),
        width=width,
        zeros=float(stats.zeros),
        total=float(stats.count),
    )


def _without_zeros(stats: TensorStats) -> np.ndarray:
    """The histogram minus the exact zeros (in the bin holding 0, or its neighbours by rounding)."""
    hist = stats.hist.astype(np.float64)
    left = float(stats.zeros)
    if left <= 0 or not stats.hist_lo <= 0.0 <= stats.hist_hi:
        return hist
    k = min(int((0.0 - stats.hist_lo) / stats.bin_width), stats.num_bins - 1)
    for b in (k, k - 1, k + 1):
        if 0 <= b < hist.size and left > 0:
            take = min(left, hist[b])
            hist[b] -= take
            left -= take
    return hist


def hist_quantile(counts: np.ndarray, lo: float, width: float, q: float) -> float:
    """Value below which a fraction ``q`` of the histogram mass lies (linear within a bin)."""
    cdf = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
    target = q * cdf[-1]
    k = int(np.searchsorted(cdf, target, side="left"))
    if k == 0:
        return lo
    k = min(k, counts.size)
    frac = (target - cdf[k - 1]) / counts[k - 1] if counts[k - 1] > 0 else 1.0
    return lo + (k - 1 + min(max(frac, 0.0), 1.0)) * width
