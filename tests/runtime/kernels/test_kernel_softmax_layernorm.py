"""QSoftmax and QLayerNorm against the per-element Python-int references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.runtime.kernels.layernorm import isqrt
from tests.runtime.kernels import intref

RNG = np.random.default_rng(23)


def randint(shape, dtype, lo=None, hi=None):
    info = np.iinfo(dtype)
    return RNG.integers(info.min if lo is None else lo, info.max if hi is None else hi, size=shape,
                        endpoint=True).astype(dtype)


def exp_table(s_x: float, step_bits: int, bits: int) -> np.ndarray:
    """table[d] = round(exp(-d * s_x) * 2**20), knots every 2**step_bits codes for 16-bit inputs."""
    d = np.arange(0, (1 << bits) + 1, 1 << step_bits) if step_bits else np.arange(1 << bits)
    return np.round(np.exp(-d * s_x) * (1 << 20)).astype(np.int32)


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("xdt,step_bits,odt,ozp,s_y", [
    (np.uint8, 0, np.uint8, 0, 1 / 255), (np.int8, 0, np.int8, -128, 1 / 256),
    (np.int16, 8, np.uint16, 0, 1 / 65535), (np.uint16, 4, np.int16, -32768, 1 / 65536)])
def test_qsoftmax_matches_reference(axis, xdt, step_bits, odt, ozp, s_y):
    bits = 8 * np.dtype(xdt).itemsize
    s_x = 12.0 / (1 << bits)  # the input range covers ~12 nats
    x = randint((2, 3, 5), xdt)
    table = exp_table(s_x, step_bits, bits)
    p = 16
    attrs = {"axis": axis, "step_bits": step_bits, "Q": round(2**p / s_y), "P": p, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QSoftmax", attrs, [x, table])[0]
    want = intref.qsoftmax(x, table, attrs)
    assert got.dtype == want.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, want)
    real = np.exp((x.astype(np.float64) - x.max(axis=axis, keepdims=True)) * s_x)
    real /= real.sum(axis=axis, keepdims=True)
    assert np.abs((got.astype(np.float64) - ozp) * s_y - real).max() < 0.02  # and it is a softmax


def test_qsoftmax_rounding_tie_goes_up():
    x = np.array([[7, 7]], dtype=np.uint8)  # e / s = 1/2 exactly
    table = exp_table(0.05, 0, 8)
    attrs = {"axis": -1, "step_bits": 0, "Q": 3 << 16, "P": 16, **intref.out_attrs(np.int8)}
    got = intref.run_kernel("QSoftmax", attrs, [x, table])[0]
    np.testing.assert_array_equal(got, [[2, 2]])  # 3 / 2 = 1.5 -> 2
    np.testing.assert_array_equal(got, intref.qsoftmax(x, table, attrs))


def layernorm_params(width: int, odt, s_y: float, with_gamma: bool, with_beta: bool, f_bits: int = 12):
    s_gamma = 1.5 / 127
    gamma = RNG.integers(40, 127, size=width).astype(np.int8) if with_gamma else None
    beta = RNG.integers(-30, 30, size=width).astype(np.int64) if with_beta else None
    ratio = (s_gamma if with_gamma else 1.0) * math.sqrt(width) / (s_y * 2**f_bits)
    m, n = quantize_multiplier(np.full(width, ratio) * RNG.uniform(0.9, 1.1, size=width), 127 << f_bits)
    return gamma, beta, m, n


@pytest.mark.parametrize("with_gamma,with_beta", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("xdt,x_zp,odt,ozp,eps_q", [
    (np.int8, 0, np.int8, 0, 1000), (np.uint8, 255, np.uint8, 128, 0), (np.int16, -32768, np.int16, 7, 123456)])
def test_qlayernorm_matches_reference(with_gamma, with_beta, xdt, x_zp, odt, ozp, eps_q):
    width = 7
    x = randint((2, 3, width), xdt)
    s_y = 4.0 / (np.iinfo(odt).max - ozp)  # about +-4 sigma * gamma fits
    gamma, beta, m, n = layernorm_params(width, odt, s_y, with_gamma, with_beta)
    attrs = {"axis": -1, "x_zp": x_zp, "eps_q": eps_q, "F": 12, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QLayerNorm", attrs, [x, gamma, beta, m, n])[0]
    want = intref.qlayernorm(x, gamma, beta, m, n, attrs)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 10


def test_qlayernorm_ties_away_from_zero():
    # n = 2, xc = [1, -1]: d = [2, -2], v = 8 + 56 = 64, r = 8, |d| << 1 = 4, 4 / 8 = 0.5 -> 1 and -1
    x = np.array([[11, 9]], dtype=np.int8)
    attrs = {"axis": -1, "x_zp": 10, "eps_q": 56, "F": 1, **intref.out_attrs(np.int8)}
    got = intref.run_kernel("QLayerNorm", attrs, [x, None, None, np.array([1]), np.array([0])])[0]
    np.testing.assert_array_equal(got, [[1, -1]])
    np.testing.assert_array_equal(got, intref.qlayernorm(x, None, None, [1], [0], attrs))


def test_isqrt_is_exact_up_to_2_62():
    roots = RNG.integers(0, 1 << 31, size=2000)
    v = np.concatenate([roots * roots, roots * roots - 1, roots * roots + 1, RNG.integers(0, 1 << 62, size=2000),
                        [0, 1, 2, 3, (1 << 62)]])
    v = np.maximum(v, 0)
    np.testing.assert_array_equal(isqrt(v), [math.isqrt(int(t)) for t in v])
