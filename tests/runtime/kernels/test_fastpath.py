"""The simulator's fast paths: float64 requantization, float64 QAdd / Requantize, the zero point folded
into the bias of unpadded convolutions, channels-last layouts and per-thread scratch buffers; each one
against the per-element Python-int references, at the edges of the bounds that allow it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from onnx import helper

from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.runtime.kernels import KERNELS, int8
from pulsar.runtime.kernels.common import FLOAT64_EXACT, OutSpec, to_torch
from pulsar.runtime.kernels.conv import _Weights
from pulsar.runtime.kernels.requant import Requant
from pulsar.runtime.npu_sim import NpuProgram
from tests.runtime.kernels import intref

RNG = np.random.default_rng(11)


def randint(shape, dtype, lo=None, hi=None):
    info = np.iinfo(dtype)
    return RNG.integers(info.min if lo is None else lo, info.max if hi is None else hi, size=shape,
                        endpoint=True).astype(dtype)


def reference(acc, m, n, bias, attrs):
    out = np.zeros(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        c = idx[1]
        out[idx] = intref.finish(int(acc[idx]) + int(bias[c]), int(m[c]), int(n[c]), attrs)
    return out


# ---------------------------------------------------------------------------------------------------
# Requant: the float64 form
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("odt,zp", [(np.uint8, 3), (np.int8, -128), (np.int8, 5), (np.uint16, 500),
                                    (np.int16, -123), (np.int32, 7), (np.int64, 0)])
def test_float_requant_equals_reference(odt, zp):
    # per-channel shifts several bits apart, a negative multiplier, and a tiny (M, N) = (5, 3) channel
    # whose outputs land on exact rounding ties (acc + bias = 4 mod 8)
    bound = (1 << 20) - 1
    m = np.array([(1 << 30) + 12345, 5, -((1 << 29) + 777), (1 << 31) - 1, 3 << 25])
    n = np.array([40, 3, 38, 43, 39])
    bias = RNG.integers(-(1 << 18), 1 << 18, size=m.size)
    attrs = intref.out_attrs(odt, zp)
    rq = Requant(m.reshape(-1, 1), n.reshape(-1, 1), OutSpec.from_attrs(attrs), bias.reshape(-1, 1), bound)
    assert rq.exact64 is not None
    acc = RNG.integers(-bound, bound, size=(2, m.size, 64), endpoint=True)
    acc[0, :, 0], acc[0, :, 1] = bound, -bound
    acc[1, 1, :16] = 4 - bias[1] + 8 * np.arange(-8, 8)  # ties toward +infinity on the (5, 3) channel
    want = reference(acc, m, n, bias, attrs)
    for kind in (torch.float32, torch.float64):
        got = rq.torch(torch.from_numpy(acc).to(kind))
        assert got.dtype == np.dtype(odt)
        np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 10


def test_float_form_needs_the_2_53_bound():
    spec = OutSpec.from_attrs(intref.out_attrs(np.int32))
    m, n = np.array([[1 << 30]]), np.array([[40]])
    assert Requant(m, n, spec, bound=(1 << 22) - 1).exact64 is not None  # 2**52 + offset < 2**53
    refused = Requant(m, n, spec, bound=1 << 23)  # 2**53: not exact in float64 any more
    assert refused.exact64 is None and refused.fast is not None
    acc = np.array([[[(1 << 23) - 1, -(1 << 23), 12345, -12345]]])
    want = reference(acc, m.reshape(-1), n.reshape(-1), np.zeros(1, np.int64), intref.out_attrs(np.int32))
    np.testing.assert_array_equal(refused.torch(torch.from_numpy(acc).double()), want)
    # the output zero point enters the offset as zp << N: a large one refuses the float form too
    attrs = intref.out_attrs(np.uint16, 40000)
    big_zp = Requant(np.array([[(1 << 31) - 1]]), np.array([[43]]), OutSpec.from_attrs(attrs), bound=1 << 20)
    assert big_zp.exact64 is None
    acc = RNG.integers(-(1 << 20), 1 << 20, size=(1, 1, 50))
    np.testing.assert_array_equal(big_zp.torch(torch.from_numpy(acc).float()),
                                  reference(acc, [(1 << 31) - 1], [43], [0], attrs))


@pytest.mark.parametrize("odt,zp", [(np.uint16, 42018), (np.uint8, 0), (np.int16, -300), (np.int8, 127)])
def test_split_form_with_large_bias_and_spread_shifts(odt, zp):
    # the recognizer's 16-bit convolutions: biases up to 2**36 (|bias * M| near 2**63), shifts from 3
    # to 52 across channels, so neither the folded int64 nor the float64 form holds for the static
    # bound; the split form does for the data's own bound (|acc| < 2**19), saturated channels (q
    # clipped) included
    m = np.array([(1 << 31) - 1, 5, -((1 << 30) + 777), (1 << 30) + 12345, 3 << 25, (1 << 31) - 3])
    n = np.array([49, 3, 33, 40, 52, 30])
    bias = np.array([1 << 30, -(1 << 34) + 3, 12345, -(1 << 31), (1 << 36) - 1, -7])
    attrs = intref.out_attrs(odt, zp)
    rq = Requant(m.reshape(-1, 1), n.reshape(-1, 1), OutSpec.from_attrs(attrs), bias.reshape(-1, 1),
                 bound=1 << 40)
    assert rq.fast is None and rq.exact64 is None
    bound = (1 << 19) - 1
    acc = RNG.integers(-bound, bound, size=(2, m.size, 64), endpoint=True)
    acc[0, :, 0], acc[0, :, 1] = bound, -bound
    acc[1, 1, :16] = 4 - bias[1] % 8 + 8 * np.arange(-8, 8)  # ties toward +infinity on the (5, 3) channel
    want = reference(acc, m, n, bias, attrs)
    for got in (rq.torch(torch.from_numpy(acc).double()), rq.torch(torch.from_numpy(acc).to(torch.int64)), rq(acc)):
        assert got.dtype == np.dtype(odt)
        np.testing.assert_array_equal(got, want)
    assert rq._split[19] is not None  # the split form ran
    # channels-last accumulators keep their layout
    rq4 = Requant(m.reshape(-1, 1, 1), n.reshape(-1, 1, 1), OutSpec.from_attrs(attrs), bias.reshape(-1, 1, 1),
                  bound=1 << 40)
    cl = torch.from_numpy(acc.reshape(2, m.size, 8, 8)).double().contiguous(memory_format=torch.channels_last)
    got = rq4.torch(cl)
    assert got.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_array_equal(got, want.reshape(2, m.size, 8, 8))
    # data past the split form's bound (|M| * |acc| >= 2**53) take the literal form, same values
    wide = np.array([[[1 << 30, -(1 << 30), 12345]] * m.size])
    np.testing.assert_array_equal(rq(wide.copy()), reference(wide, m, n, bias, attrs))
    assert rq._split[31] is None


def test_float_form_exact_just_below_2_53():
    # |acc * M| + |offset| a hair under 2**53, accumulators at and near the bound: every product and
    # sum still has to be exact for the floor to be the rounding shift
    m, n, zp = (1 << 31) - 1, 45, -17
    half, off = 1 << (n - 1), zp << n
    bound = (FLOAT64_EXACT - 1 - half - abs(off)) // m
    attrs = intref.out_attrs(np.int64, zp)
    rq = Requant(np.array([[m]]), np.array([[n]]), OutSpec.from_attrs(attrs), bound=bound)
    assert rq.exact64 is not None
    acc = np.concatenate([bound - np.arange(200), -bound + np.arange(200), RNG.integers(-bound, bound, 200)])
    acc = acc.reshape(1, 1, -1)
    got = rq.torch(torch.from_numpy(acc).double())
    np.testing.assert_array_equal(got, reference(acc, [m], [n], [0], attrs))


# ---------------------------------------------------------------------------------------------------
# QAdd / Requantize in float64
# ---------------------------------------------------------------------------------------------------

ADD_CASES = {
    # name: (dtype a, a_zp, dtype b, b_zp, Ma, Mb, N, out dtype, out zp)
    "u8_31bit": (np.uint8, 111, np.uint8, 120, 712279197, 1213725692, 30, np.uint8, 120),
    "s8_sub_s8_out": (np.int8, -128, np.int8, 127, (1 << 30) - 3, -((1 << 29) + 5), 31, np.int8, -3),
    "u16_extremes": (np.uint16, 65535, np.uint16, 0, (1 << 31) - 1, (1 << 31) - 1, 36, np.uint16, 32768),
    "s16_ties": (np.int16, 0, np.int16, 0, 1, 1, 1, np.int16, 0),  # (a + b) / 2: half the sums are ties
}


@pytest.mark.parametrize("name", sorted(ADD_CASES))
def test_float_qadd_equals_reference(name):
    adt, a_zp, bdt, b_zp, ma, mb, n, odt, ozp = ADD_CASES[name]
    shape = (2, 3, 5, 7)
    a, b = randint(shape, adt), randint(shape, bdt)
    a.reshape(-1)[:2] = np.iinfo(adt).min, np.iinfo(adt).max
    b.reshape(-1)[:2] = np.iinfo(bdt).max, np.iinfo(bdt).min
    attrs = {"a_zp": a_zp, "b_zp": b_zp, "Ma": ma, "Mb": mb, "N": n, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QAdd", attrs, [a, b], const=set())[0]
    np.testing.assert_array_equal(got, intref.qadd(a, b, attrs))
    assert got.dtype == np.dtype(odt)


def test_qadd_on_channels_last_operands_and_int32_fallback():
    attrs = {"a_zp": 7, "b_zp": 200, "Ma": 1 << 30, "Mb": 3 << 28, "N": 31, **intref.out_attrs(np.uint8, 9)}
    a = np.ascontiguousarray(randint((1, 5, 6, 4), np.uint8).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    b = randint((1, 5, 6, 4), np.uint8)
    got = intref.run_kernel("QAdd", attrs, [a, b], const=set())[0]
    np.testing.assert_array_equal(got, intref.qadd(a, b, attrs))
    # int32 operands: |a * Ma| can pass 2**53, so the int64 formula runs, with the same result
    a32, b32 = randint((3, 4), np.int32, -(1 << 30), 1 << 30), randint((3, 4), np.int32, -(1 << 30), 1 << 30)
    attrs32 = {**attrs, **intref.out_attrs(np.int32, 9)}
    np.testing.assert_array_equal(intref.run_kernel("QAdd", attrs32, [a32, b32], const=set())[0],
                                  intref.qadd(a32, b32, attrs32))


@pytest.mark.parametrize("xdt,x_zp,m,n,odt,ozp", [(np.uint8, 128, 181, 0, np.int16, 0),
                                                  (np.int16, -5, (1 << 30) + 1, 37, np.int8, -2),
                                                  (np.uint16, 65535, 3, 2, np.int16, 100)])
def test_float_requantize_equals_reference(xdt, x_zp, m, n, odt, ozp):
    x = randint((2, 3, 17), xdt)
    attrs = {"x_zp": x_zp, "M": m, "N": n, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("Requantize", attrs, [x])[0]
    np.testing.assert_array_equal(got, intref.requantize(x, attrs))


# ---------------------------------------------------------------------------------------------------
# QConv: zero point folded into the bias, channels-last, scratch buffers
# ---------------------------------------------------------------------------------------------------

FOLD_CASES = {
    # name: (x dtype, x_zp, w shape, attrs, out dtype, folded into the bias)
    "u8_zp255_1x1": (np.uint8, 255, (6, 4, 1, 1), {}, np.uint8, True),
    "s8_zpmin_3x3_unpadded_stride": (np.int8, -128, (5, 4, 3, 3), {"strides": [2, 1]}, np.int8, True),
    "u8_zp_groups": (np.uint8, 77, (4, 2, 2, 2), {"group": 2, "dilations": [2, 1]}, np.uint8, True),
    "u16_raw_bound_too_big": (np.uint16, 30000, (3, 8, 1, 1), {}, np.int16, False),  # 8 * 127 * 65535
    "u8_padded_keeps_centering": (np.uint8, 200, (3, 4, 3, 3), {"pads": [1, 0, 1, 2]}, np.uint8, False),
}


@pytest.mark.parametrize("name", sorted(FOLD_CASES))
def test_qconv_zero_point_fold_matches_reference(name, monkeypatch):
    xdt, x_zp, wshape, geo, odt, folded = FOLD_CASES[name]
    x = randint((2, wshape[1] * geo.get("group", 1), 7, 6), xdt)
    w = randint(wshape, np.int8)
    if not folded:
        w[:, :, 0, 0] = 127  # keep sum|w| * 65535 past 2**24
    bias = RNG.integers(-3000, 3000, size=wshape[0]).astype(np.int32)
    attrs = {"x_zp": x_zp, **geo, **intref.out_attrs(odt, 5)}
    acc = intref.qconv(x, w, bias, [1], [0], intref.raw_attrs(attrs))
    m, n = intref.fit_multipliers(acc, 1, odt, RNG)
    with monkeypatch.context() as pinned:  # the fold is the float32 path's (avx2 hands the zp to onnxruntime)
        pinned.setattr(int8, "FORCE", "float32")
        core = _Weights(w, bias, m, n, OutSpec.from_attrs(attrs), attrs, False)
        assert (core.plan(x.dtype, x_zp)[0] == 0) == folded
    got = intref.run_kernel("QConv", attrs, [x, w, bias, m, n])[0]  # on the path this machine takes
    np.testing.assert_array_equal(got, intref.qconv(x, w, bias, m, n, attrs))


def _conv_case(seed: int, cin: int = 4, cout: int = 6):
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, size=(cout, cin, 3, 3)).astype(np.int8)
    bias = rng.integers(-2000, 2000, size=cout).astype(np.int32)
    m, n = quantize_multiplier(rng.uniform(1e-3, 4e-3, size=cout), 1 << 20)
    attrs = {"x_zp": 9, "pads": [1, 1, 1, 1], **intref.out_attrs(np.uint8, 2)}
    return w, bias, m, n, attrs


def test_conv_outputs_stay_correct_across_scratch_reuse_and_layouts():
    w, bias, m, n, attrs = _conv_case(1)
    run = KERNELS["QConv"](attrs, [None, w, bias, m, n])
    xs = [randint((1, 4, 9, 8), np.uint8), randint((2, 4, 5, 11), np.uint8), randint((1, 4, 9, 8), np.uint8)]
    outs = [run([x, w, bias, m, n])[0] for x in xs]  # later runs reuse the scratch buffers
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out, intref.qconv(x, w, bias, m, n, attrs))
    assert outs[0].strides[1] == 1  # channels-last memory, logical NCHW shape
    # a channels-last, a read-only and a reversed (negative-stride) input all read the same codes
    x = xs[0]
    cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    ro = x.copy()
    ro.flags.writeable = False
    rev = np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    for variant in (cl, ro, rev):
        np.testing.assert_array_equal(run([variant, w, bias, m, n])[0], outs[0])
    assert to_torch(rev).stride()[-1] == 1  # copied, since torch has no negative strides


def test_conv_kernel_is_thread_safe():
    w, bias, m, n, attrs = _conv_case(2)
    run = KERNELS["QConv"](attrs, [None, w, bias, m, n])
    inputs = [randint((1, 4, 12 + i, 10), np.uint8) for i in range(4)]
    results: dict[int, list[np.ndarray]] = {}

    def work(i: int) -> None:
        results[i] = [run([inputs[i], w, bias, m, n])[0] for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(inputs):
        want = intref.qconv(x, w, bias, m, n, attrs)
        for got in results[i]:
            np.testing.assert_array_equal(got, want)


def test_program_chains_channels_last_tensors_and_returns_c_order():
    w1, b1, m1, n1, attrs1 = _conv_case(3, cin=3, cout=4)
    w2, b2, m2, n2, attrs2 = _conv_case(4, cin=4, cout=4)
    add = {"a_zp": 2, "b_zp": 2, "Ma": 1 << 29, "Mb": 1 << 29, "N": 30, **intref.out_attrs(np.uint8, 1)}
    consts = {"w1": w1, "b1": b1, "m1": m1, "n1": n1, "w2": w2, "b2": b2, "m2": m2, "n2": n2}
    node = helper.make_node
    nodes = [
        node("QConv", ["x", "w1", "b1", "m1", "n1"], ["c1"], "c1", domain="pulsar.int", **attrs1),
        node("QConv", ["c1", "w2", "b2", "m2", "n2"], ["c2"], "c2", domain="pulsar.int", **attrs2),
        node("QAdd", ["c1", "c2"], ["y"], "add", domain="pulsar.int", **add),
    ]
    shape = [1, 4, 6, 5]
    u8 = helper.np_dtype_to_tensor_dtype(np.dtype(np.uint8))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", u8, [1, 3, 6, 5])],
        [helper.make_tensor_value_info("y", u8, shape)],
        value_info=[helper.make_tensor_value_info(t, u8, shape) for t in ("c1", "c2")])
    program = NpuProgram(graph, consts)
    x = randint((1, 3, 6, 5), np.uint8)
    out = program.run({"x": x})
    c1 = intref.qconv(x, w1, b1, m1, n1, attrs1)
    c2 = intref.qconv(c1, w2, b2, m2, n2, attrs2)
    np.testing.assert_array_equal(out["y"], intref.qadd(c1, c2, add))
    assert out["y"].flags.c_contiguous
    dumps = program.run({"x": x}, keep=True)
    np.testing.assert_array_equal(dumps["c2"], c2)


@pytest.mark.parametrize("xdt", [np.int16, np.uint8])
def test_qlut_gathers_channels_last_inputs_in_memory_order(xdt):
    from pulsar.runtime.kernels.lut import memory_order

    step_bits = 8 if np.dtype(xdt).itemsize == 2 else 0
    table = RNG.integers(-30000, 30000, size=257 if step_bits else 256).astype(np.int32)
    attrs = {"step_bits": step_bits, **intref.out_attrs(np.int16, 0, -20000, 20000)}
    nhwc = randint((2, 5, 7, 6), xdt)
    x = nhwc.transpose(0, 3, 1, 2)  # logical NCHW, channels-last memory
    assert memory_order(x) == [0, 2, 3, 1] and memory_order(np.ascontiguousarray(x)) is None
    got = intref.run_kernel("QLut", attrs, [x, table])[0]
    np.testing.assert_array_equal(got, intref.qlut(x, table, attrs))
    assert got.transpose(0, 2, 3, 1).flags.c_contiguous  # the layout came through
    sliced = x[:, :, ::2]  # not dense: gathered in logical order, same values
    assert memory_order(sliced) is None
    np.testing.assert_array_equal(intref.run_kernel("QLut", attrs, [sliced, table])[0],
                                  intref.qlut(sliced, table, attrs))
