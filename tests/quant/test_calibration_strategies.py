"""Compass's calibration strategies (Mean with momentum, WeightedScale, KL top-N, InIR, weight methods)
on a real model's tensors, each against a reference computed here from the raw values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import pulsar
from pulsar.quant.observers import TensorStats, compute_range
from pulsar.quant.scheme import weight_quant
from tests.tiny_model import tiny_activations


def _per_sample(tiny: dict[str, Path]) -> dict[str, list[np.ndarray]]:
    return tiny_activations(tiny)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_mean_is_the_running_average_of_each_samples_extremes(tiny, momentum):
    for name, samples in _per_sample(tiny).items():
        stats = TensorStats.empty(momentum=momentum)
        run_lo = run_hi = None
        for x in samples:
            stats.update(x)
            lo, hi = float(x.min()), float(x.max())  # reference: Compass's formula, written out
            run_lo = lo if run_lo is None else momentum * run_lo + (1 - momentum) * lo
            run_hi = hi if run_hi is None else momentum * run_hi + (1 - momentum) * hi
        got = compute_range(stats, "Mean")
        want = (min(run_lo, 0.0), max(run_hi, 0.0))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), name
        if momentum == 0.0:  # the last sample's extremes
            assert got[1] == pytest.approx(max(float(samples[-1].max()), 0.0))


def _sym_mse(x: np.ndarray, t: float, levels: int) -> float:
    """Mean squared error of rounding ``x`` to the symmetric grid [-t, t] (reference: on the raw values)."""
    step = t / (levels // 2 - 1)
    q = np.clip(np.round(x / step), -(levels // 2 - 1), levels // 2 - 1) * step
    return float(np.mean((x - q) ** 2))


def test_weighted_scale_threshold_lies_between_the_signs_and_fits_the_data(tiny):
    checked = 0
    for name, samples in _per_sample(tiny).items():
        x = np.concatenate(samples).astype(np.float64)
        if not (x.min() < 0 < x.max()):
            continue
        stats = TensorStats.empty()
        stats.update(x)
        pos, neg = float(x.max()), float(-x.min())
        # a fixed alpha: exactly the weighted threshold
        lo, hi = compute_range(stats, "WeightedScale", symmetric=True, signed=True, weighted_alpha=0.25)
        assert hi == pytest.approx(0.25 * pos + 0.75 * neg, rel=1e-9) and lo == -hi
        # searched: the reference searches alpha on the raw values; the histogram's choice is as good
        _, t = compute_range(stats, "WeightedScale", symmetric=True, signed=True)
        alphas = np.linspace(0, 1, 101)
        errs = [_sym_mse(x, a * pos + (1 - a) * neg, 256) for a in alphas]
        best = min(errs)
        assert min(neg, pos) - 1e-9 <= t <= max(neg, pos) + 1e-9, name
        if x.size < 10_000:
            continue  # the expected-error model (step^2 / 12 inside) needs many values; logits has 80
        assert _sym_mse(x, t, 256) <= best * 1.05 + 1e-12, (name, t)
        checked += 1
    assert checked >= 3


def test_weighted_scale_keeps_the_extremes_on_an_asymmetric_grid():
    x = np.random.default_rng(1).normal(1.0, 2.0, 10_000)
    stats = TensorStats.empty()
    stats.update(x)
    assert compute_range(stats, "WeightedScale") == (float(x.min()), float(x.max()))


def _kl_reference(h: np.ndarray, t: int, levels: int, sub: int = 2) -> float:
    """KL(P || Q) of threshold ``t`` (whole bins), TensorRT's definition on [0, t) resampled into ``sub``
    sub-bins per level: P holds the clipped mass in its last sub-bin; Q spreads each level's mass (of
    the histogram below ``t``, without the clipped mass) evenly over the level's sub-bins where P is
    non-zero; each is normalised to 1."""
    cum = np.concatenate([[0.0], np.cumsum(h.astype(np.float64))])
    edges = np.linspace(0, t, sub * levels + 1)
    below = np.maximum(np.diff(np.interp(edges, np.arange(h.size + 1), cum)), 0.0)
    p = below.copy()
    p[-1] += cum[-1] - cum[t]
    q = np.zeros_like(p)
    for g in range(levels):
        part = slice(g * sub, (g + 1) * sub)
        nz = p[part] > 0
        if nz.any():
            q[part][nz] = below[part].sum() / nz.sum()
    p, q = p / p.sum(), q / q.sum()
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / q[m]))) if np.all(q[m] > 0) else math.inf


@pytest.mark.parametrize("top_n", [1, 4, 16])
def test_kl_top_n_against_a_dense_reference(top_n):
    x = np.abs(np.random.default_rng(2).laplace(0.0, 1.0, 400_000))
    stats = TensorStats.empty(1024)
    stats.update(x)
    levels = 64  # 7-bit symmetric grid: |x| over 64 levels
    from pulsar.quant.observers.histogram import side_histograms
    from pulsar.quant.observers.kl import kl_threshold

    h = side_histograms(stats, exclude_zeros=True).folded()
    kls = np.array([_kl_reference(h, t, levels) for t in range(levels, h.size + 1)])
    ref = levels + np.argsort(kls, kind="stable")[:top_n]
    got = kl_threshold(h, levels, top_n)
    if top_n == 1:  # the coarse-to-fine search lands where the divergence is as low as the dense optimum's
        assert _kl_reference(h, round(got), levels) <= kls.min() * 1.01, (got, ref[0])
    else:
        assert got == ref.max()
    assert kl_threshold(h, levels, h.size) == h.size  # large N: the whole range


def test_kl_top_n_widens_ranges_of_real_tensors(tiny):
    wider = 0
    for samples in _per_sample(tiny).values():
        stats = TensorStats.empty()
        stats.update(np.concatenate(samples))
        one = compute_range(stats, "KL", kl_top_n=1)
        many = compute_range(stats, "KL", kl_top_n=64)
        assert many[1] >= one[1] - 1e-9 and many[0] <= one[0] + 1e-9
        wider += many != one
    assert wider >= 1


@pytest.mark.parametrize("method", ["Std", "Percentile"])
def test_weight_method_per_channel_against_numpy(method):
    w = np.random.default_rng(3).standard_t(3, size=(16, 64, 3, 3)).astype(np.float32)
    tq, _ = weight_quant("w", w, 0, "S8", method=method, method_params={"std_n": 2.0, "percentile": 99.0})
    rows = np.abs(w.reshape(16, -1).astype(np.float64))
    for c, row in enumerate(w.reshape(16, -1).astype(np.float64)):
        width = 2 * rows[c].max() / 4096  # the histogram's bin
        got = float(tq.scale[c]) * 127
        if method == "Std":  # a symmetric grid: |mean| + N sigma, within the largest |w|
            want = min(rows[c].max(), abs(row.mean()) + 2 * row.std())
            assert got == pytest.approx(want, abs=3 * width + 0.01 * want), c
        else:  # the 99th percentile of |w|: between the order statistics around it
            low = np.quantile(rows[c], 0.99, method="inverted_cdf")
            high = np.quantile(rows[c], min(1.0, 0.99 + 1 / row.size), method="inverted_cdf")
            assert low - 3 * width <= got <= high + 3 * width, (c, got, low, high)
    minmax, _ = weight_quant("w", w, 0, "S8")
    assert np.all(tq.scale <= minmax.scale * (1 + 1e-6)) and np.any(tq.scale < minmax.scale * 0.9)


def _annotated(src: Path, dst: Path, tensor: str, scale: float, zp: int) -> Path:
    m = onnx.load(src)
    m.graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{tensor}_scale"),
                                numpy_helper.from_array(np.array(zp, np.uint8), f"{tensor}_zp")])
    ann = onnx.TensorAnnotation(tensor_name=tensor)
    ann.quant_parameter_tensor_names.add(key="SCALE_TENSOR", value=f"{tensor}_scale")
    ann.quant_parameter_tensor_names.add(key="ZERO_POINT_TENSOR", value=f"{tensor}_zp")
    m.graph.quantization_annotation.append(ann)
    onnx.save(m, dst)
    return dst


def test_in_ir_takes_the_models_annotated_range(tmp_path, tiny, tiny_config):
    model = _annotated(tiny["model"], tmp_path / "ann.onnx", "r2", 0.05, 0)
    res = pulsar.build(model, tmp_path / "out", tiny_config, {"quant.calibration_method": "InIR"}, quiet=True)
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    assert tensors["r2"]["range"] == pytest.approx([0.0, 255 * 0.05])
    assert math.isclose(tensors["r2"]["scale"], 0.05, rel_tol=1e-6)
    assert tensors["r2"]["calibration"] == {"method": "InIR"}
    assert tensors["r1"]["calibration"] == {"method": "MinMax", "instead_of": "InIR"}
    assert "1 tensors annotated in the model, 1 of them in the optimized graph" in (res.output_dir / "build.log").read_text()
