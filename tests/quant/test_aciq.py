"""ACIQ_Laplace / ACIQ_Gauss ranges against a reference written here: the moments from the raw values,
the optimal clipping threshold by golden-section search on the paper's error expressions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pulsar.quant.observers import TensorStats, compute_range
from tests.tiny_model import tiny_activations


def _golden(f, lo: float, hi: float, tol: float = 1e-6) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    while b - a > tol:
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def reference(x: np.ndarray, kind: str, bits: int) -> tuple[float, float]:
    x = x.astype(np.float64).reshape(-1)
    mean = float(x.mean())
    if kind == "laplace":
        b = float(np.abs(x - mean).mean())
        ratio = _golden(lambda a: 2 * math.exp(-a) + a * a / (3 * 4.0**bits), 0.05, 40)
        alpha = ratio * b
    else:
        s = float(x.std())
        ratio = _golden(lambda a: (a * a + 1) * (1 - math.erf(a / math.sqrt(2)))
                        - math.sqrt(2 / math.pi) * a * math.exp(-a * a / 2) + a * a / (3 * 4.0**bits), 0.05, 40)
        alpha = ratio * s
    lo, hi = max(float(x.min()), mean - alpha), min(float(x.max()), mean + alpha)
    return min(lo, 0.0), max(hi, 0.0)


def test_the_papers_thresholds():
    from pulsar.quant.observers.aciq import gauss_ratio, laplace_ratio

    # Banner et al. 2019, table of optimal clipping: Laplace 2.83 b / 5.03 b / 9.89 b, Gauss 1.71 / 2.55 / 3.92 sigma
    assert [round(laplace_ratio(b), 1) for b in (2, 4, 8)] == [2.8, 5.0, 9.9]
    assert [round(gauss_ratio(b), 2) for b in (2, 4, 8)] == [1.71, 2.56, 3.93]


def _activations(tiny: dict[str, Path]) -> dict[str, np.ndarray]:
    """Every intermediate tensor of the tiny CNN over its calibration samples (onnxruntime)."""
    return {n: np.concatenate(v) for n, v in tiny_activations(tiny).items()}


@pytest.mark.parametrize("method, kind", [("ACIQ_Laplace", "laplace"), ("ACIQ_Gauss", "gauss")])
@pytest.mark.parametrize("bits", [4, 8])
def test_aciq_ranges_of_a_real_models_tensors(tiny, method, kind, bits):
    checked = 0
    for name, x in _activations(tiny).items():
        stats = TensorStats.empty()
        for part in np.array_split(x, 4):
            stats.update(part)
        lo, hi = compute_range(stats, method, num_bits=bits)
        want_lo, want_hi = reference(x, kind, bits)
        # the histogram's moments are bin centres: within a bin width (and 1 % of the range) of the raw ones
        tol = 2 * stats.bin_width + 0.01 * (want_hi - want_lo)
        assert abs(lo - want_lo) <= tol and abs(hi - want_hi) <= tol, (name, (lo, hi), (want_lo, want_hi))
        checked += 1
    assert checked >= 10


def test_aciq_clips_the_tails_of_a_laplace_tensor():
    x = np.random.default_rng(0).laplace(0.0, 1.0, 200_000).astype(np.float32)
    stats = TensorStats.empty()
    stats.update(x)
    lo, hi = compute_range(stats, "ACIQ_Laplace", num_bits=4, symmetric=True, signed=True)
    assert 4.5 < hi < 5.5 and lo == -hi  # 5.03 b with b = 1
    assert hi < 0.5 * float(np.abs(x).max())


@pytest.mark.parametrize("n", [2.0, 3.0])
def test_std_ranges_of_a_real_models_tensors(tiny, n):
    for name, x in _activations(tiny).items():
        stats = TensorStats.empty()
        stats.update(x)
        lo, hi = compute_range(stats, "Std", std_n=n)
        x64 = x.astype(np.float64)
        mean, std = float(x64.mean()), float(x64.std())
        want_lo = min(max(float(x64.min()), mean - n * std), 0.0)
        want_hi = max(min(float(x64.max()), mean + n * std), 0.0)
        tol = 2 * stats.bin_width + 0.01 * (want_hi - want_lo)
        assert abs(lo - want_lo) <= tol and abs(hi - want_hi) <= tol, (name, (lo, hi), (want_lo, want_hi))


def test_std_n_acts_in_a_build(tmp_path, tiny, tiny_config):
    import json

    import pulsar

    ranges = {}
    for n in (1.0, 3.0):
        res = pulsar.build(tiny["model"], tmp_path / str(n), tiny_config,
                           {"quant.calibration_method": "Std", "quant.calibration_std_n": n,
                            "quant.disable_auto_refine_scale": True}, quiet=True)
        ranges[n] = json.loads(res.quant_config.read_text())["tensors"]["res"]["range"]
    assert ranges[1.0][1] < ranges[3.0][1]  # a narrower range with fewer standard deviations
