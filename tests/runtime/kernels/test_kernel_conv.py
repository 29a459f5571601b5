"""QConv / QConvTranspose against the per-element Python-int references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.errors import PulsarError
from pulsar.runtime.kernels import KERNELS
from pulsar.runtime.kernels.common import accum_float
from tests.runtime.kernels import intref

RNG = np.random.default_rng(7)


def randint(shape, dtype, lo=None, hi=None):
    info = np.iinfo(dtype)
    lo = info.min if lo is None else lo
    hi = info.max if hi is None else hi
    return RNG.integers(lo, hi, size=shape, endpoint=True).astype(dtype)


def multipliers(real: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    return quantize_multiplier(np.asarray(real, dtype=np.float64), bound)


CASES = {
    # name: (x dtype, x_zp, w dtype, x shape, w shape, attrs, out dtype, out zp)
    "u8_zp0_pads_stride": (np.uint8, 0, np.int8, (1, 3, 7, 6), (4, 3, 3, 3),
                           {"strides": [2, 1], "pads": [1, 0, 2, 1]}, np.uint8, 3),
    "u8_zp255_dilation": (np.uint8, 255, np.int8, (2, 2, 7, 7), (3, 2, 3, 2),
                          {"dilations": [2, 3], "pads": [2, 1, 0, 3]}, np.int8, -5),
    "s8_zp_min_groups": (np.int8, -128, np.int8, (1, 4, 5, 5), (6, 2, 3, 3),
                         {"group": 2, "pads": [1, 1, 1, 1]}, np.int8, 0),
    "s8_zp_max_depthwise": (np.int8, 127, np.int8, (1, 4, 6, 6), (4, 1, 3, 3),
                            {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}, np.uint8, 128),
    "u16_zp_max_s16": (np.uint16, 65535, np.int16, (1, 2, 5, 5), (3, 2, 3, 3),
                       {"pads": [1, 1, 1, 1]}, np.uint16, 30000),
    "s16_1d": (np.int16, -7, np.int16, (2, 3, 9), (4, 3, 3),
               {"strides": [2], "pads": [2, 1], "dilations": [2]}, np.int16, 11),
    "u8_1d_depthwise": (np.uint8, 128, np.int8, (1, 3, 10), (3, 1, 5),
                        {"group": 3, "pads": [2, 2]}, np.uint8, 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_qconv_matches_reference(name, with_bias):
    xdt, x_zp, wdt, xshape, wshape, geo, odt, ozp = CASES[name]
    x, w = randint(xshape, xdt), randint(wshape, wdt)
    cout = wshape[0]
    bias = RNG.integers(-(1 << 12), 1 << 12, size=cout).astype(np.int32) if with_bias else None
    attrs = {"x_zp": x_zp, **geo, **intref.out_attrs(odt, ozp)}
    acc = intref.qconv(x, w, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, 1, odt, RNG)  # per-channel M / N
    got = intref.run_kernel("QConv", attrs, [x, w, bias, m, n])[0]
    want = intref.qconv(x, w, bias, m, n, attrs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert len(np.unique(want)) > want.size // 4  # outputs spread over the range, not saturated
    np.testing.assert_array_equal(got, want)


def test_qconv_saturates_and_fuses_relu():
    x, w = randint((1, 2, 5, 5), np.uint8), randint((3, 2, 3, 3), np.int8)
    m, n = np.array([1 << 20, 3 << 18, 1 << 21]), np.array([20, 20, 20])  # ratio ~1: most outputs clamp
    attrs = {"x_zp": 100, "pads": [1, 1, 1, 1], **intref.out_attrs(np.uint8, 50, lo=50, hi=240)}
    got = intref.run_kernel("QConv", attrs, [x, w, None, m, n])[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, None, m, n, attrs))
    assert (got == 50).any() and (got == 240).any()  # both bounds are hit
    assert got.min() >= 50 and got.max() <= 240


def test_qconv_rounding_ties_go_up():
    # 1x1 kernel with weight 1, M = 1, N = 1: y = (x - zp) / 2 exactly at .5 for odd values
    x = np.array([-5, -3, -1, 1, 3, 5, 0, 2], dtype=np.int8).reshape(1, 1, 1, 8)
    w = np.ones((1, 1, 1, 1), dtype=np.int8)
    attrs = {"x_zp": 0, **intref.out_attrs(np.int8)}
    got = intref.run_kernel("QConv", attrs, [x, w, None, np.array([1]), np.array([1])])[0]
    np.testing.assert_array_equal(got.reshape(-1), [-2, -1, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(got, intref.qconv(x, w, None, [1], [1], attrs))


def test_qconv_padding_value_is_the_zero_point():
    x = np.full((1, 1, 2, 2), 200, dtype=np.uint8)
    w = np.ones((1, 1, 3, 3), dtype=np.int8)
    attrs = {"x_zp": 200, "pads": [1, 1, 1, 1], **intref.out_attrs(np.int8)}
    got = intref.run_kernel("QConv", attrs, [x, w, np.array([7], np.int32), np.array([1]), np.array([0])])[0]
    np.testing.assert_array_equal(got, np.full((1, 1, 2, 2), 7))  # real zeros everywhere, + bias


def test_accumulation_precision_guard():
    assert accum_float((1 << 24) - 1) == "float32"
    assert accum_float(1 << 24) == "float64"
    with pytest.raises(PulsarError, match="2\\*\\*53"):
        accum_float(1 << 53)


def test_float64_path_beyond_2_24_is_exact_where_float32_is_not():
    # 16-bit activations x 16-bit weights: |acc| reaches ~2**33, far past float32's exact integers
    x = randint((1, 4, 4, 4), np.uint16, 60000, 65535)
    w = randint((2, 4, 3, 3), np.int16, 30000, 32767)
    w[1] *= -1
    bound = int(np.abs(w.astype(np.int64)).reshape(2, -1).sum(axis=1).max()) * 65535
    assert bound >= 1 << 24
    m, n = multipliers([3e-9, 5e-9], bound)
    attrs = {"x_zp": 1, "pads": [1, 1, 1, 1], **intref.out_attrs(np.int16)}
    got = intref.run_kernel("QConv", attrs, [x, w, None, m, n])[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, None, m, n, attrs))
    # the same sums in float32 are not exact: the guard is what keeps the kernel right
    xc = torch.from_numpy(x.astype(np.float64) - 1)
    exact = torch.nn.functional.conv2d(xc, torch.from_numpy(w.astype(np.float64)), padding=1)
    f32 = torch.nn.functional.conv2d(xc.float(), torch.from_numpy(w.astype(np.float32)), padding=1)
    assert (f32.double() != exact).any()


def test_float32_chosen_from_the_data_when_the_dtype_bound_is_too_big():
    from pulsar.runtime.kernels.common import OutSpec
    from pulsar.runtime.kernels.conv import _Weights

    x = randint((1, 3, 5, 5), np.uint16, 0, 300)  # small 16-bit data: exact in float32
    w = randint((2, 3, 3, 3), np.int16, -2000, 2000)
    attrs = {"x_zp": 0, "pads": [1, 1, 1, 1], **intref.out_attrs(np.int16)}
    m, n = multipliers([1e-4, 2e-4], 1 << 30)
    core = _Weights(w, None, m, n, OutSpec.from_attrs(attrs), attrs, False)
    assert core.accumulate_as(x, 0)[0] == "float32"
    assert core.accumulate_as(np.full_like(x, 65535), 0)[0] == "float64"
    got = intref.run_kernel("QConv", attrs, [x, w, None, m, n])[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, None, m, n, attrs))


def test_qconv_runtime_weights_and_bias():
    x, w = randint((1, 2, 4, 4), np.uint8), randint((2, 2, 2, 2), np.int8)
    bias = np.array([-300, 4000], np.int32)
    m, n = multipliers([2e-3, 3e-3], 1 << 20)
    attrs = {"x_zp": 9, **intref.out_attrs(np.uint8, 17)}
    got = intref.run_kernel("QConv", attrs, [x, w, bias, m, n], const=set())[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, bias, m, n, attrs))


TRANSPOSE_CASES = {
    "u8_stride2_asym_outpad": (np.uint8, 0, (1, 2, 3, 4), (2, 3, 3, 3),
                               {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}, 1),
    "s8_groups_dilation": (np.int8, -128, (1, 4, 3, 3), (4, 2, 2, 3),
                           {"group": 2, "dilations": [2, 1], "strides": [1, 2], "pads": [0, 1, 1, 0]}, 2),
    "u16_1d": (np.uint16, 65535, (2, 2, 5), (2, 3, 4), {"strides": [3], "pads": [1, 2], "output_padding": [2]}, 1),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSE_CASES))
def test_qconv_transpose_matches_reference(name):
    xdt, x_zp, xshape, wshape, geo, group = TRANSPOSE_CASES[name]
    wdt = np.int16 if xdt == np.uint16 else np.int8
    x, w = randint(xshape, xdt), randint(wshape, wdt)
    cout = wshape[1] * group
    bias = RNG.integers(-5000, 5000, size=cout).astype(np.int32)
    odt = np.int16 if xdt == np.uint16 else np.int8
    attrs = {"x_zp": x_zp, **geo, **intref.out_attrs(odt, -3)}
    acc = intref.qconv_transpose(x, w, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, 1, odt, RNG)
    got = intref.run_kernel("QConvTranspose", attrs, [x, w, bias, m, n])[0]
    want = intref.qconv_transpose(x, w, bias, m, n, attrs)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_qconv_bad_nodes_are_user_errors():
    w = randint((2, 2, 3, 3), np.int8)
    attrs = {"x_zp": 0, **intref.out_attrs(np.uint8)}
    with pytest.raises(PulsarError, match="one per output channel"):
        KERNELS["QConv"](attrs, [None, w, None, np.array([1, 2, 3]), np.array([1])])
    with pytest.raises(PulsarError, match="shift N"):
        KERNELS["QConv"](attrs, [None, w, None, np.array([1]), np.array([63])])
    with pytest.raises(PulsarError, match="'to'"):
        KERNELS["QConv"]({"x_zp": 0}, [None, w, None, np.array([1]), np.array([1])])
    with pytest.raises(PulsarError, match="auto_pad"):
        KERNELS["QConv"]({**attrs, "auto_pad": b"SAME_UPPER"}, [None, w, None, np.array([1]), np.array([1])])


def test_qconv_far_apart_shifts_take_the_literal_path():
    from pulsar.runtime.kernels.common import OutSpec
    from pulsar.runtime.kernels.conv import _Weights

    x, w = randint((1, 2, 4, 4), np.int16), randint((2, 2, 3, 3), np.int16)
    m, n = np.array([1, 1 << 30]), np.array([0, 45])  # folding would need M << 45 on channel 0: refused
    attrs = {"x_zp": -3, "pads": [1, 1, 1, 1], **intref.out_attrs(np.int16, 5)}
    core = _Weights(w, None, m, n, OutSpec.from_attrs(attrs), attrs, False)
    assert core.requant(65535).fast is None
    got = intref.run_kernel("QConv", attrs, [x, w, None, m, n])[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, None, m, n, attrs))
