"""QAdd / QMul / Requantize against the per-element Python-int references."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import KERNELS
from tests.runtime.kernels import intref

RNG = np.random.default_rng(5)


def randint(shape, dtype):
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


ADD_CASES = {
    # name: (a shape, a dtype, a_zp, b shape, b dtype, b_zp, Ma, Mb, N, out dtype, out zp, b constant)
    "u8_same_shape": ((2, 3, 4), np.uint8, 0, (2, 3, 4), np.uint8, 255, 1 << 20, 3 << 19, 21, np.uint8, 128, False),
    "s8_sub_broadcast": ((2, 3, 4), np.int8, -128, (3, 1), np.int8, 127, 1 << 18, -(5 << 16), 19, np.int8, 0, False),
    "u16_s16_mixed": ((4, 5), np.uint16, 65535, (5,), np.int16, -3, 7 << 14, 1 << 15, 18, np.int16, -7, True),
    "s16_broadcast_a": ((1, 5), np.int16, 100, (3, 1), np.uint16, 0, 1 << 12, 1 << 12, 13, np.uint16, 32768, False),
}


@pytest.mark.parametrize("name", sorted(ADD_CASES))
def test_qadd_matches_reference(name):
    ashape, adt, a_zp, bshape, bdt, b_zp, ma, mb, n, odt, ozp, const_b = ADD_CASES[name]
    a, b = randint(ashape, adt), randint(bshape, bdt)
    attrs = {"a_zp": a_zp, "b_zp": b_zp, "Ma": ma, "Mb": mb, "N": n, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QAdd", attrs, [a, b], const={1} if const_b else set())[0]
    want = intref.qadd(a, b, attrs)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 3


def test_qadd_int64_constant_on_the_sum_grid_and_ties():
    a = np.array([[0, 1, 2, 3], [253, 254, 255, 128]], dtype=np.uint8)
    b = np.array([-3, -1, 1, 3], dtype=np.int64)  # already on the sum's grid: b_zp 0, Mb 1
    attrs = {"a_zp": 128, "b_zp": 0, "Ma": 2, "Mb": 1, "N": 1, **intref.out_attrs(np.uint8, 128, lo=0, hi=255)}
    got = intref.run_kernel("QAdd", attrs, [a, b])[0]
    np.testing.assert_array_equal(got, intref.qadd(a, b, attrs))
    # (2*(0-128) - 3) / 2 = -129.5 -> -129 (tie up), + 128 -> clamped to 0; (0 + 3) / 2 = 1.5 -> 2, + 128
    assert got[0, 0] == 0 and got[1, 3] == 130


def test_qadd_saturates():
    a = np.array([0, 255], dtype=np.uint8)
    attrs = {"a_zp": 0, "b_zp": 0, "Ma": 1 << 10, "Mb": 1 << 10, "N": 8, **intref.out_attrs(np.int8, 0, lo=-100, hi=100)}
    got = intref.run_kernel("QAdd", attrs, [a, np.array([-255, 255], np.int16)], const=set())[0]
    np.testing.assert_array_equal(got, [-100, 100])


MUL_CASES = {
    "u8_scalar_mn": ((2, 3, 4), np.uint8, 3, (2, 3, 4), np.uint8, 250, (1,), np.uint8, 77),
    "s8_per_channel_const": ((2, 3, 4), np.int8, -128, (1, 3, 1), np.int8, 0, (1, 3, 1), np.int8, 5),
    "u16_broadcast": ((3, 4), np.uint16, 65535, (4,), np.uint16, 0, (4,), np.int16, -100),
}


@pytest.mark.parametrize("name", sorted(MUL_CASES))
def test_qmul_matches_reference(name):
    ashape, adt, a_zp, bshape, bdt, b_zp, mshape, odt, ozp = MUL_CASES[name]
    a, b = randint(ashape, adt), randint(bshape, bdt)
    peak = float(np.iinfo(adt).max - np.iinfo(adt).min) * float(np.iinfo(bdt).max - np.iinfo(bdt).min)
    half = (int(np.iinfo(odt).max) - int(np.iinfo(odt).min)) / 2
    from pulsar.core.fixedpoint import quantize_multiplier

    m, n = quantize_multiplier(RNG.uniform(0.5, 2.0, size=mshape) * half / peak, int(peak))
    attrs = {"a_zp": a_zp, "b_zp": b_zp, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QMul", attrs, [a, b, m, n])[0]
    want = intref.qmul(a, b, m, n, attrs)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype and len(np.unique(want)) > 3


@pytest.mark.parametrize("xdt,x_zp,odt,ozp,m,n", [
    (np.uint8, 128, np.int16, 0, 3 << 20, 18),   # 8 -> 16 bit
    (np.int16, -5, np.uint8, 0, 5 << 20, 30),     # 16 -> 8 bit
    (np.int8, -128, np.uint8, 0, 1, 0),           # same grid, shifted zero point
    (np.int8, 0, np.int8, 0, 1, 1),               # exact ties: x / 2
])
def test_requantize_matches_reference(xdt, x_zp, odt, ozp, m, n):
    x = randint((3, 17), xdt)
    x[0, :6] = [-5, -3, -1, 1, 3, 5] if np.iinfo(xdt).min < 0 else [0, 1, 2, 3, 4, 5]
    attrs = {"x_zp": x_zp, "M": m, "N": n, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("Requantize", attrs, [x])[0]
    np.testing.assert_array_equal(got, intref.requantize(x, attrs))


def test_requantize_as_clip_uses_the_bounds():
    x = np.array([-128, -20, 0, 20, 127], dtype=np.int8)
    attrs = {"x_zp": 0, "M": 1, "N": 0, **intref.out_attrs(np.int8, 0, lo=-10, hi=15)}
    np.testing.assert_array_equal(intref.run_kernel("Requantize", attrs, [x])[0], [-10, -10, 0, 15, 15])


def test_missing_attribute_is_a_user_error():
    with pytest.raises(PulsarError, match="'Ma'"):
        KERNELS["QAdd"]({"to": 2, "N": 1, "Mb": 1}, [None, None])
