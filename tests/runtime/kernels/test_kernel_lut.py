"""QLut against the per-element Python-int reference (8-bit direct, 16-bit interpolated)."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import KERNELS
from tests.runtime.kernels import intref

RNG = np.random.default_rng(17)


@pytest.mark.parametrize("xdt", [np.uint8, np.int8])
def test_qlut_8bit_direct(xdt):
    table = RNG.integers(-200, 300, size=256).astype(np.int32)  # values outside [0, 255] get clamped
    x = np.arange(256).astype(np.int64) + np.iinfo(xdt).min
    x = np.concatenate([x, RNG.permutation(x)]).astype(xdt).reshape(2, 16, 16)
    attrs = {"step_bits": 0, **intref.out_attrs(np.uint8, 0, lo=3, hi=250)}
    got = intref.run_kernel("QLut", attrs, [x, table])[0]
    np.testing.assert_array_equal(got, intref.qlut(x, table, attrs))
    assert got.min() == 3 and got.max() == 250


@pytest.mark.parametrize("xdt,step_bits,odt", [
    (np.int16, 8, np.int16), (np.uint16, 4, np.uint8), (np.int16, 16, np.int8), (np.uint16, 0, np.uint16)])
def test_qlut_16bit_interpolation_every_code(xdt, step_bits, odt):
    knots = (65536 >> step_bits) + 1 if step_bits else 65536
    info = np.iinfo(odt)
    table = RNG.integers(int(info.min) - 50, int(info.max) + 50, size=knots).astype(np.int32)  # steep, both signs
    x = (np.arange(65536) + np.iinfo(xdt).min).astype(xdt)  # every input code once
    attrs = {"step_bits": step_bits, **intref.out_attrs(odt, 0)}
    got = intref.run_kernel("QLut", attrs, [x, table])[0]
    np.testing.assert_array_equal(got, intref.qlut(x, table, attrs))


def test_qlut_interpolation_ties_round_up():
    # two knots 0 -> 0 and 2**s -> -1 (s = 16): halfway codes give -0.5 -> 0, 3/4 of the way -0.75 -> -1
    table = np.array([0, -1], dtype=np.int32)
    x = np.array([0, 32768, 49152, 65535], dtype=np.uint16)
    got = intref.run_kernel("QLut", {"step_bits": 16, **intref.out_attrs(np.int8)}, [x, table])[0]
    np.testing.assert_array_equal(got, [0, 0, -1, -1])


def test_qlut_sigmoid_table_built_from_scales():
    """The compiler's recipe (knots at u = i << s, last knot u = 65536) stays within the linear
    interpolation error h**2/8 * max|f''| (h = 2**s * s_x) plus one code of rounding."""
    s_x, x_zp, s_y, y_zp, s = 16.0 / 65535, 0, 1.0 / 65535, -32768, 8
    qmin = -32768
    u = np.arange(0, 65537, 1 << s)
    real = (u + qmin - x_zp) * s_x
    table = np.clip(np.round(1 / (1 + np.exp(-real)) / s_y) + y_zp, -32768, 32767).astype(np.int32)
    x = (np.arange(65536) + qmin).astype(np.int16)
    attrs = {"step_bits": s, **intref.out_attrs(np.int16, y_zp)}
    got = intref.run_kernel("QLut", attrs, [x, table])[0].astype(np.int64)
    exact = np.round(1 / (1 + np.exp(-((x.astype(np.int64) - x_zp) * s_x))) / s_y) + y_zp
    h, max_f2 = (1 << s) * s_x, 0.0963  # max |sigmoid''| = 1 / (6 * sqrt(3))
    assert np.abs(got - exact).max() <= h * h / 8 * max_f2 / s_y + 1
    assert np.abs(got - exact).mean() < 1


def test_qlut_table_too_short_is_a_user_error():
    run = KERNELS["QLut"]({"step_bits": 8, **intref.out_attrs(np.int16)}, [None, np.zeros(100, np.int32)])
    with pytest.raises(PulsarError, match="needs 257"):
        run([np.zeros(4, np.int16), np.zeros(100, np.int32)])
