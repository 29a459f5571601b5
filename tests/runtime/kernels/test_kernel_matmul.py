"""QMatMul against the per-element Python-int reference."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.core.fixedpoint import quantize_multiplier
from tests.runtime.kernels import intref

RNG = np.random.default_rng(11)


def randint(shape, dtype, lo=None, hi=None):
    info = np.iinfo(dtype)
    return RNG.integers(info.min if lo is None else lo, info.max if hi is None else hi, size=shape,
                        endpoint=True).astype(dtype)


CASES = {
    # name: (a shape, a dtype, a_zp, b shape, b dtype, b_zp, trans_b, b constant, out dtype)
    "u8_weight": ((3, 5), np.uint8, 0, (5, 4), np.int8, 0, 0, True, np.uint8),
    "u8_weight_trans": ((2, 3, 6), np.uint8, 255, (4, 6), np.int8, 0, 1, True, np.int8),
    "s8_batched_weight": ((2, 3, 4), np.int8, -128, (2, 4, 3), np.int8, 0, 0, True, np.int8),
    "act_act_broadcast": ((3, 4), np.uint8, 7, (2, 4, 5), np.uint8, 250, 0, False, np.uint8),
    "act_act_trans": ((2, 1, 3, 4), np.int8, 127, (3, 5, 4), np.int8, -128, 1, False, np.int16),
    "u16_s16_weight": ((2, 6), np.uint16, 65535, (6, 3), np.int16, 0, 0, True, np.uint16),
    "s16_act_act": ((1, 3, 5), np.int16, 100, (1, 5, 2), np.uint16, 40000, 0, False, np.int16),
}


ZP = {np.uint8: 99, np.int8: -9, np.uint16: 30000, np.int16: 9}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_qmatmul_matches_reference(name, per_channel):
    ashape, adt, a_zp, bshape, bdt, b_zp, trans, const_b, odt = CASES[name]
    a, b = randint(ashape, adt), randint(bshape, bdt)
    cols = bshape[-2] if trans else bshape[-1]
    bias = RNG.integers(-20000, 20000, size=cols).astype(np.int32)
    attrs = {"a_zp": a_zp, "b_zp": b_zp, "trans_b": trans, **intref.out_attrs(odt, ZP[odt])}
    acc = intref.qmatmul(a, b, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, acc.ndim - 1 if per_channel else None, odt, RNG)
    const = {1, 2, 3, 4} if const_b else {2, 3, 4}
    got = intref.run_kernel("QMatMul", attrs, [a, b, bias, m, n], const=const)[0]
    want = intref.qmatmul(a, b, bias, m, n, attrs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert len(np.unique(want)) > want.size // 4  # outputs spread over the range, not saturated
    np.testing.assert_array_equal(got, want)


def test_qmatmul_saturation_and_ties():
    a = np.array([[1, 3, -1, -3, 5, -5, 0, 100]], dtype=np.int8).T  # [8, 1]
    b = np.array([[1, 2]], dtype=np.int8)  # [1, 2]
    attrs = {**intref.out_attrs(np.int8, 0, lo=-4, hi=4)}
    got = intref.run_kernel("QMatMul", attrs, [a, b, None, np.array([1]), np.array([1])])[0]
    # column 0: x / 2 with ties up; column 1: x exactly; both clamped to [-4, 4]
    np.testing.assert_array_equal(got[:, 0], [1, 2, 0, -1, 3, -2, 0, 4])
    np.testing.assert_array_equal(got[:, 1], [1, 3, -1, -3, 4, -4, 0, 4])
    np.testing.assert_array_equal(got, intref.qmatmul(a, b, None, [1], [1], attrs))


def test_qmatmul_float64_for_wide_activations():
    # K * 65535 * 65535 > 2**24: the activation x activation product must not use float32
    a, b = randint((2, 40), np.uint16, 60000), randint((40, 3), np.uint16, 60000)
    m, n = quantize_multiplier(np.array([1e-9]), 1 << 38)
    attrs = {"a_zp": 0, "b_zp": 0, **intref.out_attrs(np.uint16)}
    got = intref.run_kernel("QMatMul", attrs, [a, b, None, m, n], const={3, 4})[0]
    np.testing.assert_array_equal(got, intref.qmatmul(a, b, None, m, n, attrs))
