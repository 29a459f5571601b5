"""Precision metrics between a float tensor and its quantized counterpart, streamed over samples.

All math is float64. Per sample ``a`` (float model) and ``b`` (QDQ model):

- cosine = <a, b> / (|a| |b|); 1.0 when both are all-zero, 0.0 when only one is;
- MSE = mean((a - b)^2);
- SQNR = 10 log10(sum a^2 / sum (a - b)^2) dB; +inf when a == b.

Over many samples the :class:`Accumulator` keeps running sums only (memory does not grow with the
sample count): the reported cosine is the mean of the per-sample cosines, the MSE is the mean over
every element of every sample, and the SQNR is the ratio of the summed signal to the summed noise
(so one near-silent sample cannot drive the average to -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
class Accumulator:
    """Running sums for one tensor over a stream of samples."""

    samples: int = 0
    elements: int = 0
    cos_sum: float = 0.0
    signal: float = 0.0     # sum a^2
    noise: float = 0.0      # sum (a - b)^2

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if np.shape(a) != np.shape(b):
            raise ValueError(f"shape mismatch: float {np.shape(a)} vs quantized {np.shape(b)}")
        a, b = _flat64(a), _flat64(b)
        d = a - b
        aa, noise = float(a @ a), float(d @ d)
        self.cos_sum += _cos_from(float(a @ b), aa, float(b @ b))
        self.signal += aa
        self.noise += noise
        self.samples += 1
        self.elements += a.size

    @property
    def cosine(self) -> float:
        return self.cos_sum / self.samples if self.samples else math.nan

    @property
    def mse(self) -> float:
        return self.noise / self.elements if self.elements else 0.0

    @property
    def sqnr_db(self) -> float:
        return _sqnr_from(self.signal, self.noise)
