"""The exact integer kernel paths (vnni / avx2 / float32): each pinned in turn, every 8-bit convolution
kind bit-exact against the per-element Python-int reference, at the operand extremes, and the path
pinned is the one that runs. A path this machine does not trust is skipped (never silently run on
another one)."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import conv, int8
from pulsar.runtime.kernels.common import OutSpec
from pulsar.runtime.kernels.ort_int import MAX_DEPTH, U8U8Matmul, byte_split, split_exact, u8u8_exact
from tests.runtime.kernels import intref

RNG = np.random.default_rng(28)


def available(path: str) -> bool:
    if path == "vnni":
        return int8._int_mm_exact() or int8._qconv_exact()
    if path == "avx2":
        return u8u8_exact() or int8._depthwise_exact()
    return True


@pytest.fixture(params=int8.PATHS)
def path(request, monkeypatch):
    """Pin one kernel path for the test (skipped where this machine does not trust it)."""
    if not available(request.param):
        pytest.skip(f"the {request.param} kernels are not exact on this machine")
    monkeypatch.setattr(int8, "FORCE", request.param)
    return request.param


def expected_kind(path: str, pointwise: bool, depthwise: bool) -> str:
    """The accumulation kind conv._Weights.plan must pick for 8-bit codes under a pinned path."""
    if path == "vnni":
        if pointwise:
            return "int8" if int8._int_mm_exact() else "float32"
        return "qconv" if int8._qconv_exact() else "float32"
    if path == "avx2":
        if pointwise:
            return "u8u8" if u8u8_exact() else "float32"
        return "qconv" if depthwise and int8._depthwise_exact() else "float32"
    return "float32"


CASES = {
    # name: (x dtype, x_zp, x shape, w shape, attrs); weights int8 over the full range
    "pointwise_u8": (np.uint8, 201, (2, 24, 5, 6), (7, 24, 1, 1), {}),
    "pointwise_s8": (np.int8, -3, (3, 16, 4, 4), (9, 16, 1, 1), {}),
    "depthwise_u8_stride2": (np.uint8, 0, (2, 6, 9, 8), (6, 1, 3, 3), {"group": 6, "strides": [2, 2],
                                                                        "pads": [1, 1, 1, 1]}),
    "depthwise_s8_5x5": (np.int8, 127, (1, 5, 7, 7), (5, 1, 5, 5), {"group": 5, "pads": [2, 2, 2, 2]}),
    "dense_3x3_u8": (np.uint8, 9, (1, 3, 6, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("extreme", [False, True])
def test_qconv_bit_exact_on_each_path(path, name, extreme):
    xdt, x_zp, xshape, wshape, geo = CASES[name]
    info = np.iinfo(xdt)
    if extreme:  # codes at both ends against weights at both ends: the sums saturating kernels get wrong
        x = np.where(RNG.random(xshape) < 0.5, info.min, info.max).astype(xdt)
        w = np.where(RNG.random(wshape) < 0.5, -128, 127).astype(np.int8)
    else:
        x = RNG.integers(info.min, info.max, size=xshape, endpoint=True).astype(xdt)
        w = RNG.integers(-128, 127, size=wshape, endpoint=True).astype(np.int8)
    bias = RNG.integers(-(1 << 12), 1 << 12, size=wshape[0]).astype(np.int32)
    attrs = {"x_zp": x_zp, **geo, **intref.out_attrs(np.uint8, 3)}
    acc = intref.qconv(x, w, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, 1, np.uint8, RNG)
    got = intref.run_kernel("QConv", attrs, [x, w, bias, m, n])[0]
    want = intref.qconv(x, w, bias, m, n, attrs)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 8
    core = conv._Weights(w, bias, m, n, OutSpec.from_attrs(attrs), attrs, False)
    assert core.plan(np.dtype(xdt), x_zp)[1] == expected_kind(path, core.pointwise, core.depthwise)


def test_batched_channels_last_pointwise_is_exact_on_each_path(path):
    """A batch in the channels-last layout the previous convolution leaves, large enough for several
    requantization blocks, against int64 sums requantized by the literal formula."""
    x = RNG.integers(0, 256, size=(4, 40, 24, 20), dtype=np.uint8)
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # NCHW shape, NHWC memory
    w = RNG.integers(-128, 128, size=(33, 40, 1, 1)).astype(np.int8)
    attrs = {"x_zp": 77, **intref.out_attrs(np.int8, -5)}
    acc = np.einsum("nchw,oc->nohw", x.astype(np.int64) - 77, w[:, :, 0, 0].astype(np.int64))
    m, n = intref.fit_multipliers(acc, 1, np.int8, RNG)
    got = intref.run_kernel("QConv", attrs, [x, w, None, m, n])[0]
    from pulsar.runtime.kernels.common import requant

    want = requant(acc, m.reshape(-1, 1, 1), n.reshape(-1, 1, 1), OutSpec.from_attrs(attrs))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("xdt,x_zp", [(np.uint8, 55), (np.int8, -128)])
def test_sixteen_bit_pointwise_weights_bit_exact_on_each_path(path, xdt, x_zp):
    """16-bit weights (the recognizer's 1x1 convolutions): on "avx2" split into high and low bytes
    for one double-width MatMulInteger; codes and weights at both ends, the low byte at its edges
    (127 / 128, -128 / -129), against the Python-int reference."""
    info = np.iinfo(xdt)
    x = np.where(RNG.random((2, 96, 5, 7)) < 0.5, info.min, info.max).astype(xdt)
    x[1] = RNG.integers(info.min, info.max, size=x.shape[1:], endpoint=True)
    w = RNG.choice(np.array([-32768, 32639, 127, 128, -128, -129, 16256, -2240]), size=(40, 96, 1, 1))
    w[:20] = RNG.integers(-3000, 17000, size=(20, 96, 1, 1))
    w = w.astype(np.int16)
    bias = RNG.integers(-(1 << 30), 1 << 30, size=40).astype(np.int64)
    attrs = {"x_zp": x_zp, **intref.out_attrs(np.uint16, 18733)}
    acc = intref.qconv(x, w, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, 1, np.uint16, RNG)
    got = intref.run_kernel("QConv", attrs, [x, w, bias, m, n])[0]
    np.testing.assert_array_equal(got, intref.qconv(x, w, bias, m, n, attrs))
    core = conv._Weights(w, bias, m, n, OutSpec.from_attrs(attrs), attrs, False)
    split = path == "avx2" and split_exact()
    assert (core.plan(np.dtype(xdt), x_zp)[1] == "u8u8") == split
    assert core.byte_halves is not None


@pytest.mark.parametrize("adt,a_zp,trans", [(np.uint8, 201, 0), (np.int8, -128, 1), (np.int8, 127, 0)])
def test_qmatmul_constant_weights_bit_exact_on_each_path(path, adt, a_zp, trans, monkeypatch):
    """A constant int8 weight (a classifier's Gemm) against 8-bit codes at both ends, a batch of rows
    in front: on "avx2" onnxruntime's uint8 MatMulInteger gives the sums, the other paths torch's;
    every path bit-exact against the Python-int reference."""
    from pulsar.runtime.kernels import ort_int

    calls = []
    real = ort_int.U8U8Matmul.__call__
    monkeypatch.setattr(ort_int.U8U8Matmul, "__call__", lambda self, a: calls.append(a.shape) or real(self, a))
    info = np.iinfo(adt)
    a = np.where(RNG.random((2, 3, 300)) < 0.5, info.min, info.max).astype(adt)
    a[1] = RNG.integers(info.min, info.max, size=a.shape[1:], endpoint=True)
    bshape = (40, 300) if trans else (300, 40)
    b = np.where(RNG.random(bshape) < 0.5, -128, 127).astype(np.int8)
    bias = RNG.integers(-(1 << 20), 1 << 20, size=40).astype(np.int32)
    attrs = {"a_zp": a_zp, "trans_b": trans, **intref.out_attrs(np.uint8, 3)}
    acc = intref.qmatmul(a, b, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, acc.ndim - 1, np.uint8, RNG)
    got = intref.run_kernel("QMatMul", attrs, [a, b, bias, m, n])[0]
    want = intref.qmatmul(a, b, bias, m, n, attrs)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 8
    assert (calls == [(6, 300)]) == (path == "avx2" and u8u8_exact())  # the rows of the whole batch at once


def test_byte_split_recombines_and_refuses_past_int16_edge():
    w = np.array([[-32768, 32639, 127, 128, -128, -129, 0, 255, -256, 12345]])
    hi, lo = byte_split(w)
    np.testing.assert_array_equal(256 * hi + lo, w)
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    assert byte_split(np.array([[32640]])) is None  # its high byte would be 128
    assert split_exact() == u8u8_exact()


@pytest.mark.skipif(not u8u8_exact(), reason="onnxruntime's uint8 x uint8 MatMulInteger is not exact here")
@pytest.mark.parametrize("zp", [0, 128, 255])
def test_u8u8_matmul_exact_at_the_int32_edge(zp):
    """Deep sums of the largest products: every raw product 255 * 255 over K = MAX_DEPTH rows reaches
    just under 2**31, and the zero-point corrections must still come out exact."""
    k = MAX_DEPTH
    a = np.full((3, k), 255, np.uint8)
    a[1] = 0
    a[2, ::2] = 0
    w = np.full((k, 4), 127, np.int8)
    w[:, 1] = -128
    w[::2, 2] = -128
    got = U8U8Matmul(w, zp)(a)
    want = (a.astype(np.int64) - zp) @ w.astype(np.int64)
    raw = a.astype(np.int64) @ (w.astype(np.int64) + 128)  # what MLAS sums before the corrections
    assert raw.max() > (1 << 31) - 255 * 255
    np.testing.assert_array_equal(got.astype(np.int64), want)


def test_wide_sums_stay_off_the_int32_paths(monkeypatch):
    """A pointwise convolution whose bound reaches 2**31 takes no int32 kernel."""
    monkeypatch.setattr(int8, "FORCE", "avx2")
    w = np.full((2, MAX_DEPTH + 1, 1, 1), 127, np.int8)
    attrs = {"x_zp": 0, **intref.out_attrs(np.uint8)}
    core = conv._Weights(w, None, np.array([1]), np.array([20]), OutSpec.from_attrs(attrs), attrs, False)
    assert core.u8u8_zp(np.dtype(np.uint8), 0) is None
    assert core.plan(np.dtype(np.uint8), 0)[1] not in ("u8u8", "int8", "qconv")


def test_kernel_paths_follow_the_pin(monkeypatch):
    for pinned in int8.PATHS:
        monkeypatch.setattr(int8, "FORCE", pinned)
        paths = int8.kernel_paths()
        assert set(paths) == {"matmul", "depthwise", "conv", "path"}
        if pinned == "float32":
            assert paths == dict.fromkeys(paths, "float32")
        if pinned == "avx2":
            assert paths["conv"] == "float32" and paths["matmul"] in ("ort-u8u8", "float32")
            assert paths["matmul"] == ("ort-u8u8" if u8u8_exact() else "float32")
        if pinned == "vnni":
            assert "ort-u8u8" not in paths.values() and "onednn" not in paths.values()


def test_kernel_path_from_the_environment(monkeypatch):
    monkeypatch.setattr(int8, "FORCE", None)
    monkeypatch.setenv(int8.ENV, "float32")
    assert int8.kernel_paths()["path"] == "float32"
    monkeypatch.setenv(int8.ENV, "auto")
    assert int8.forced() is None
    monkeypatch.setenv(int8.ENV, "avx512")
    with pytest.raises(PulsarError, match="PULSAR_SIM_KERNELS='avx512' is not a kernel path; use auto, vnni"):
        int8.kernel_paths()


@pytest.mark.parametrize("dtype,out", [(np.uint16, np.int32), (np.int16, np.uint16), (np.int8, np.int8),
                                       (np.uint8, np.uint8)])
def test_large_table_lookups_take_torch_gather_exactly(dtype, out):
    """Lookups past the torch-gather threshold (here channels-last, so gathered in memory order) equal
    numpy's take of the expanded table, for every code width and table type."""
    from pulsar.runtime.kernels import lut

    info, oinfo = np.iinfo(dtype), np.iinfo(out)
    x = RNG.integers(info.min, info.max, size=(2, 40, 24, 20), endpoint=True).astype(dtype)
    x.reshape(-1)[:2] = info.min, info.max
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    assert x.size >= lut._TORCH_GATHER
    table = RNG.integers(oinfo.min, oinfo.max, size=1 << info.bits, endpoint=True)
    attrs = {"step_bits": 0, **intref.out_attrs(out)}
    got = intref.run_kernel("QLut", attrs, [x, table])[0]
    want = table[x.astype(np.int64) - info.min].astype(out)
    assert got.dtype == out
    np.testing.assert_array_equal(got, want)
