"""Precision metrics between a float tensor and its quantized counterpart, streamed over samples.

All math is float64. Per sample ``a`` (float model) and ``b`` (QDQ model):

- cosine = <a, b> / (|a| |b|); 1.0 when both are all-zero, 0.0 when only one is;
- MSE = mean((a - b)^2);
- SQNR = 10 log10(sum a^2 / sum (a - b)^2) dB; +inf when a == b.

Over many samples the :class:`Accumulator` keeps running sums only (memory does not grow with the
sample count): the reported cosine is the mean of the per-sample cosines, the MSE is the mean over
every element of every sample, and the SQNR is the ratio of the summed signal to the summed noise
(so one near-silent sample cannot drive the average to -inf).

Per slice: a whole-tensor figure hides a slice that lost everything (a detector output's class-score
rows beside pixel box coordinates: cosine 0.999 for the tensor, the scores all rounded to zero). The
accumulator also keeps, along the channel axis (1) and the last axis, the sums of every slice (one
index of that axis, all the rest), and :attr:`Accumulator.worst_slice` names the slice with the
lowest cosine (SQNR beside it). Slices whose float values are all zero are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# A slice keeping less than this SQNR has lost most of its signal (noise power >= 1/10 of it).
POOR_SLICE_DB = 10.0
# Cosine grades shared by the console table and the mermaid graph.
COSINE_GOOD = 0.999   # green: >= 0.999
COSINE_OK = 0.99      # yellow: >= 0.99, red below


def grade(cos: float) -> str:
    """'good' / 'ok' / 'bad' for a cosine (NaN is 'bad')."""
    if cos >= COSINE_GOOD:
        return "good"
    if cos >= COSINE_OK:
        return "ok"
    return "bad"


def _flat64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).ravel()


def _cos_from(dot: float, na2: float, nb2: float) -> float:
    if na2 == 0.0 and nb2 == 0.0:
        return 1.0
    if na2 == 0.0 or nb2 == 0.0:
        return 0.0
    return float(dot / (math.sqrt(na2) * math.sqrt(nb2)))


def _sqnr_from(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = _flat64(a), _flat64(b)
    return _cos_from(float(a @ b), float(a @ a), float(b @ b))


def mse(a: np.ndarray, b: np.ndarray) -> float:
    d = _flat64(a) - _flat64(b)
    return float(d @ d / d.size) if d.size else 0.0


def sqnr_db(a: np.ndarray, b: np.ndarray) -> float:
    a, d = _flat64(a), _flat64(a) - _flat64(b)
    return _sqnr_from(float(a @ a), float(d @ d))


@dataclass
class SliceScore:
    """One slice of a tensor: index ``index`` of axis ``axis`` (all other axes)."""

    axis: int
    index: int
    cosine: float
    sqnr_db: float
    size: int  # axis length
    rms: float = 0.0  # root mean square of its float values

    def __str__(self) -> str:
        return f"axis {self.axis} [{self.index}]"


def slice_axes(shape: tuple[int, ...]) -> list[int]:
    """The axes whose slices are scored: the channel axis and the last axis, when longer than 1 and the
    tensor has another axis with several elements (a slice of a vector is one number)."""
    axes = [ax for ax in dict.fromkeys((1, len(shape) - 1)) if 0 < ax < len(shape) and shape[ax] > 1]
    return [ax for ax in axes if int(np.prod(shape, dtype=np.int64)) > shape[ax]]


@dataclass
class _SliceSums:
    dot: np.ndarray
    aa: np.ndarray
    bb: np.ndarray
    noise: np.ndarray
    count: int = 0  # values per slice, over all samples

    @classmethod
    def of(cls, a: np.ndarray, b: np.ndarray, axis: int) -> _SliceSums:
        a2 = np.moveaxis(np.asarray(a, np.float64), axis, 0).reshape(a.shape[axis], -1)
        b2 = np.moveaxis(np.asarray(b, np.float64), axis, 0).reshape(a.shape[axis], -1)
        d = a2 - b2
        return cls(np.einsum("ij,ij->i", a2, b2), np.einsum("ij,ij->i", a2, a2), np.einsum("ij,ij->i", b2, b2),
                   np.einsum("ij,ij->i", d, d), int(a2.shape[1]))

    def add(self, other: _SliceSums) -> None:
        self.dot += other.dot
        self.aa += other.aa
        self.bb += other.bb
        self.noise += other.noise
        self.count += other.count


@dataclass
class Accumulator:
    """Running sums for one tensor over a stream of samples (and per slice, see the module doc)."""

    samples: int = 0
    elements: int = 0
    cos_sum: float = 0.0
    signal: float = 0.0     # sum a^2
    noise: float = 0.0      # sum (a - b)^2
    slices: dict[int, _SliceSums] = field(default_factory=dict)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if np.shape(a) != np.shape(b):
            raise ValueError(f"shape mismatch: float {np.shape(a)} vs quantized {np.shape(b)}")
        shape = tuple(np.shape(a))
        for ax in slice_axes(shape):
            sums = _SliceSums.of(np.asarray(a), np.asarray(b), ax)
            if ax in self.slices and self.slices[ax].dot.shape == sums.dot.shape:
                self.slices[ax].add(sums)
            else:
                self.slices[ax] = sums
        a, b = _flat64(a), _flat64(b)
        d = a - b
        aa, noise = float(a @ a), float(d @ d)
        self.cos_sum += _cos_from(float(a @ b), aa, float(b @ b))
        self.signal += aa
        self.noise += noise
        self.samples += 1
        self.elements += a.size

    def slice_scores(self) -> list[SliceScore]:
        """Every non-zero slice's cosine and SQNR (sums over all samples)."""
        out = []
        for ax, s in self.slices.items():
            for i in np.flatnonzero(s.aa > 0):
                out.append(SliceScore(ax, int(i), _cos_from(float(s.dot[i]), float(s.aa[i]), float(s.bb[i])),
                                      _sqnr_from(float(s.aa[i]), float(s.noise[i])), int(s.aa.size),
                                      math.sqrt(float(s.aa[i]) / max(s.count, 1))))
        return out

    @property
    def worst_slice(self) -> SliceScore | None:
        """The slice with the lowest cosine (ties: the lower SQNR), None for tensors without slices."""
        scores = self.slice_scores()
        return min(scores, key=lambda t: (t.cosine, t.sqnr_db)) if scores else None

    @property
    def cosine(self) -> float:
        return self.cos_sum / self.samples if self.samples else math.nan

    @property
    def mse(self) -> float:
        return self.noise / self.elements if self.elements else 0.0

    @property
    def sqnr_db(self) -> float:
        return _sqnr_from(self.signal, self.noise)


def flattened_slices(acc: Accumulator, axis: int, step: float | None) -> list[SliceScore]:
    """The slices along ``axis`` that the output grid flattens: below :data:`POOR_SLICE_DB` SQNR while
    their values are smaller than the grid's ``step`` (their RMS below it), worst first. None without a
    step: a float output's poor slice comes from upstream error, which the precision table shows."""
    if not step:
        return []
    bad = [t for t in acc.slice_scores() if t.axis == axis and t.sqnr_db < POOR_SLICE_DB and t.rms < step]
    return sorted(bad, key=lambda t: (t.sqnr_db, t.index))


def slice_aware_cosine(acc: Accumulator, step: float | None) -> float:
    """The tensor's cosine, or its poorest flattened slice's (see :func:`flattened_slices`): a score that
    does not call a build good while the grid of an output wipes out one of its slices."""
    bad = [t for ax in acc.slices for t in flattened_slices(acc, ax, step)]
    return min([acc.cosine, *(t.cosine for t in bad)])
