"""Batched NPU bodies: a batch-N program gives exactly the N batch-1 outputs, on every kernel family.

The fast paths batching leans on are checked against the per-element Python-int references as well,
across many cache blocks (``BLOCK`` shrunk to a few rows, ragged last block) and in their fallbacks:
the blocked float64 requantization (:meth:`Requant.torch`, :meth:`Requant.by_rows`), the int8
convolutions (``torch._int_mm`` for 1x1, oneDNN's quantized convolution for the others, or torch's
float32 ones where those are not trusted) and the blocked QAdd / Requantize."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from onnx import helper, numpy_helper

from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.runtime.kernels import common, conv
from pulsar.runtime.kernels import int8 as kernel_int8
from pulsar.runtime.kernels.common import OutSpec
from pulsar.runtime.kernels.requant import Requant
from pulsar.runtime.npu_sim import NpuProgram
from tests.runtime import test_npu_sim as base
from tests.runtime.kernels import intref
from tests.runtime.kernels.test_fastpath import reference  # per-channel Python-int requantization

RNG = np.random.default_rng(47)
BATCH = 3
INT = "pulsar.int"


def batched(graph, n: int):
    """A batch-``n`` copy of a batch-1 body: dim 0 of every input / output / value_info that is 1
    becomes ``n``, and the batch dim of every constant Reshape shape becomes -1."""
    g = copy.deepcopy(graph)
    for v in (*g.input, *g.output, *g.value_info):
        dims = v.type.tensor_type.shape.dim
        if len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value == 1:
            dims[0].dim_value = n
    shapes = {node.input[1] for node in g.node if node.op_type == "Reshape"}
    for node in g.node:
        if node.op_type == "Constant" and node.output[0] in shapes:
            value = numpy_helper.to_array(node.attribute[0].t).copy()
            value[0] = -1
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(value))
    for init in g.initializer:
        if init.name in shapes:
            value = numpy_helper.to_array(init).copy()
            value[0] = -1
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return g


def per_sample(program: NpuProgram, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of ``program`` (a batch-1 body) run sample by sample, concatenated."""
    runs = [program.run({k: v[i:i + 1] for k, v in feeds.items()}, keep=True) for i in range(BATCH)]
    return {name: np.concatenate([r[name] for r in runs]) for name in runs[0]}


def assert_batched_equals_per_sample(one, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    got = NpuProgram(batched(one, BATCH)).run(feeds, keep=True)
    want = per_sample(NpuProgram(one), feeds)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    return got


@pytest.fixture(params=["one_block", "many_blocks"])
def blocks(request, monkeypatch):
    """Whole tensors in one cache block, or blocks of a few rows (ragged at the end)."""
    if request.param == "many_blocks":
        monkeypatch.setattr(common, "BLOCK", 40)
    return request.param


@pytest.fixture(params=["int8", "avx2", "float32"])
def int8(request, monkeypatch):
    """8-bit convolutions on torch._int_mm / oneDNN's quantized convolution (the "vnni" path, where
    this machine trusts them), on onnxruntime's uint8 x uint8 MatMulInteger / oneDNN's depthwise
    convolution (the "avx2" path), or all on torch's float32 convolutions."""
    monkeypatch.setattr(kernel_int8, "FORCE", {"int8": "vnni"}.get(request.param, request.param))
    return request.param


# ---------------------------------------------------------------------------------------------------
# every kernel family: the body of test_npu_sim, batched
# ---------------------------------------------------------------------------------------------------


def test_every_kernel_family_batched_equals_per_sample(blocks, int8):
    """QConv, MaxPool, Reshape, Transpose, QMatMul, Requantize, QLut, QAdd, Split, Concat, QSoftmax,
    QLayerNorm: batch 3 in one run == three batch-1 runs, every intermediate included."""
    w = base.weights()
    feeds = {"x/q": RNG.integers(0, 256, size=(BATCH, 3, 8, 8)).astype(np.uint8),
             "s/q": RNG.integers(-128, 128, size=(BATCH, 16, 6)).astype(np.int8)}
    got = assert_batched_equals_per_sample(base.body(w), feeds)
    ref = base.reference({k: v[:1] for k, v in feeds.items()}, w)  # and sample 0 is right
    for name in ("c/q", "m16/q", "a/q", "sm/q", "ln/q"):
        np.testing.assert_array_equal(got[name][:1], ref[name], err_msg=name)


# ---------------------------------------------------------------------------------------------------
# a MobileNet-like body: the convolution paths, pooling, reductions, QAdd, QMatMul
# ---------------------------------------------------------------------------------------------------


def _conv_layer(x, wshape, attrs, odt, zp, lo=None):
    """Weights, bias, per-channel (M, N) fitted to the reference sums, and the reference output."""
    w = RNG.integers(-128, 128, size=wshape).astype(np.int8)
    w.reshape(-1)[:2] = -128, 127  # the int8 extremes
    bias = RNG.integers(-3000, 3000, size=wshape[0]).astype(np.int32)
    out = {**attrs, **intref.out_attrs(odt, zp, lo)}
    acc = intref.qconv(x, w, bias, [1], [0], intref.raw_attrs(out))
    m, n = intref.fit_multipliers(acc, 1, odt, RNG)
    return {"w": w, "b": bias, "m": m, "n": n}, out, intref.qconv(x, w, bias, m, n, out)


def mobilenet_like():
    """(batch-1 body, constants, feeds, reference outputs of the batch) for a body mixing a padded
    3x3 convolution with an input zero point, uint8 and int8 pointwise convolutions (8-, 16- and
    32-bit outputs), depthwise and strided convolutions on uint8 and int8 codes, QAdd, QAvgPool,
    QReduceMean, Flatten and QMatMul."""
    x = RNG.integers(0, 256, size=(BATCH, 3, 9, 8)).astype(np.uint8)
    x[0, :, :2] = 255
    consts, nodes, ref = {}, [], {"x": x}
    layers = [  # name, input, weight shape, attrs, out dtype, out zp, out_min
        ("c1", "x", (8, 3, 3, 3), {"x_zp": 100, "pads": [1, 1, 1, 1]}, np.uint8, 0, 0),
        ("c2", "c1", (16, 8, 1, 1), {"x_zp": 0}, np.uint8, 5, None),
        ("c3", "c2", (16, 1, 3, 3), {"x_zp": 5, "pads": [1, 1, 1, 1], "group": 16}, np.int8, -3, None),
        ("c4", "c3", (8, 16, 1, 1), {"x_zp": -3}, np.int8, 2, -100),
        ("c5", "c1", (6, 8, 1, 1), {"x_zp": 0}, np.int32, 7, None),  # 32-bit: the unblocked fallback
        ("c6", "c3", (4, 16, 1, 1), {"x_zp": -3}, np.int16, -40, None),
        ("c7", "c3", (16, 1, 3, 3), {"x_zp": -3, "pads": [1, 1, 1, 1], "group": 16}, np.uint8, 0, None),
        ("c8", "c3", (4, 16, 3, 3), {"x_zp": -3, "strides": [2, 2]}, np.uint8, 9, None),  # zp into the bias
    ]
    for name, src, wshape, attrs, odt, zp, lo in layers:
        params, out, ref[name] = _conv_layer(ref[src], wshape, attrs, odt, zp, lo)
        consts.update({f"{name}/{k}": v for k, v in params.items()})
        nodes.append(helper.make_node("QConv", [src, *(f"{name}/{k}" for k in "wbmn")], [name], name,
                                      domain=INT, **out))
    add = {"a_zp": 0, "b_zp": 2, "Ma": 1 << 29, "Mb": -(3 << 27), "N": 30, **intref.out_attrs(np.uint8, 10)}
    ref["a"] = intref.qadd(ref["c1"], ref["c4"], add)
    nodes.append(helper.make_node("QAdd", ["c1", "c4"], ["a"], "add", domain=INT, **add))
    pool = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "x_zp": 10, "N": 20, **intref.out_attrs(np.uint8, 3)}
    consts["pool/M"] = np.array([0] + [round((1 << 20) / c) for c in range(1, 10)], np.int64)
    ref["p"] = intref.qavgpool(ref["a"], consts["pool/M"], pool)
    nodes.append(helper.make_node("QAvgPool", ["a", "pool/M"], ["p"], "pool", domain=INT, **pool))
    mean = {"axes": [2, 3], "keepdims": 1, "x_zp": 3, "M": (1 << 24) // 72, "N": 24, **intref.out_attrs(np.int8, 1)}
    ref["r"] = intref.qreducemean(ref["p"], mean)
    nodes.append(helper.make_node("QReduceMean", ["p"], ["r"], "mean", domain=INT, **mean))
    nodes.append(helper.make_node("Flatten", ["r"], ["f"], "flatten", axis=1))
    consts["fc/w"] = RNG.integers(-127, 128, size=(5, 8)).astype(np.int8)
    consts["fc/b"] = RNG.integers(-500, 500, size=5).astype(np.int32)
    consts["fc/m"], consts["fc/n"] = quantize_multiplier(np.full(5, 4e-3), 1 << 16)
    mm = {"a_zp": 1, "b_zp": 0, "trans_b": 1, **intref.out_attrs(np.int8, -5)}
    ref["fc"] = intref.qmatmul(ref["r"].reshape(BATCH, 8), consts["fc/w"], consts["fc/b"], consts["fc/m"],
                               consts["fc/n"], mm)
    nodes.append(helper.make_node("QMatMul", ["f", "fc/w", "fc/b", "fc/m", "fc/n"], ["fc"], "fc", domain=INT, **mm))

    def info(name):
        value = ref[name]
        shape = [1, *value.shape[1:]]
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), shape)

    outputs = ["fc", "c5", "c6", "c7", "c8", "p"]
    graph = helper.make_graph(nodes, "npu_0", [info("x")], [info(o) for o in outputs],
                              initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
                              value_info=[info(t) for t in ("c1", "c2", "c3", "c4", "a", "r")])
    return graph, {"x": x}, ref


@pytest.fixture(scope="module")
def mobilenet():
    return mobilenet_like()


def test_mobilenet_like_batched_equals_per_sample_and_reference(mobilenet, blocks, int8):
    graph, feeds, ref = mobilenet
    got = assert_batched_equals_per_sample(graph, feeds)
    for name in ("c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "a", "p", "r", "fc"):
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    assert len(np.unique(ref["c4"])) > 50 and len(np.unique(ref["c6"])) > 50


def test_int8_paths_are_taken_where_trusted(int8):
    m, n = quantize_multiplier(np.full(6, 1e-3), 1 << 16)
    attrs = {"x_zp": 9, **intref.out_attrs(np.uint8)}
    spec = OutSpec.from_attrs(attrs)

    def kinds(wshape, geometry=None, scale=1):
        w = RNG.integers(-128, 128, size=wshape).astype(np.int16) * scale
        core = conv._Weights(w, None, m, n, spec, {**attrs, **(geometry or {})}, False)
        assert core.plan(np.dtype(np.int16), 9)[1] not in ("int8", "qconv")  # 16-bit codes: torch's float
        return [core.plan(np.dtype(dt), 9)[1] for dt in (np.uint8, np.int8)]

    pw = ("int8" if int8 == "int8" and conv.int8_matmul() else
          "u8u8" if int8 == "avx2" and conv.u8u8_matmul() else "float32")
    qconv = "qconv" if int8 == "int8" and conv.int8_conv() else "float32"
    depthwise = "qconv" if int8 != "float32" and conv.depthwise_conv() else "float32"
    assert kinds((6, 4, 1, 1)) == [pw, pw]
    assert kinds((6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}) == [depthwise, depthwise]
    assert kinds((6, 4, 3, 3), {"strides": [2, 1]}) == [qconv, qconv]  # unpadded: zp in the bias
    assert kinds((6, 4, 3, 3), {"pads": [1, 0, 1, 2]}) == ["float32"] * 2  # asymmetric pads
    assert kinds((6, 4, 1, 1), scale=2) == ["float32"] * 2  # weights past int8


# ---------------------------------------------------------------------------------------------------
# Requant: the blocked float64 form against the Python-int reference
# ---------------------------------------------------------------------------------------------------


def layouts(acc: np.ndarray) -> dict[str, torch.Tensor]:
    """The same accumulator as channels-last float32, contiguous int32 and a non-dense float64 view."""
    wide = np.zeros((*acc.shape[:3], acc.shape[3] * 2), np.float64)
    wide[..., ::2] = acc
    return {"channels_last": torch.from_numpy(acc.astype(np.float32)).contiguous(memory_format=torch.channels_last),
            "contiguous_int32": torch.from_numpy(acc.astype(np.int32)),
            "strided_float64": torch.from_numpy(wide)[..., ::2]}


@pytest.mark.parametrize("odt,zp,lo,hi", [(np.uint8, 3, None, None), (np.uint8, 0, 20, 200),
                                          (np.int8, -128, None, None), (np.int8, 5, -100, 90),
                                          (np.uint16, 500, None, None), (np.int16, -123, None, None)])
def test_blocked_requant_equals_reference(monkeypatch, odt, zp, lo, hi):
    # channels: large multipliers several shifts apart, a negative one, a (5, 3) channel whose outputs
    # land on rounding ties, a slope above one (M > 2**N) and a zero multiplier
    monkeypatch.setattr(common, "BLOCK", 64)
    bound = (1 << 20) - 1
    m = np.array([(1 << 30) + 12345, 5, -((1 << 29) + 777), (1 << 31) - 1, 3, 0])
    n = np.array([40, 3, 38, 43, 1, 7])
    bias = RNG.integers(-(1 << 18), 1 << 18, size=m.size)
    attrs = intref.out_attrs(odt, zp, lo, hi)
    rq = Requant(m.reshape(-1, 1, 1), n.reshape(-1, 1, 1), OutSpec.from_attrs(attrs), bias.reshape(-1, 1, 1), bound)
    # int16: (zp - out_min) << 43 passes 2**53, so the unshifted float form (finish_float) runs
    assert rq.exact64 is not None and rq.shifted == (np.dtype(odt) != np.int16) and rq.safe32 == rq.shifted
    acc = RNG.integers(-bound, bound, size=(2, m.size, 5, 7), endpoint=True)
    acc[0, :, 0, 0], acc[0, :, 0, 1] = bound, -bound
    acc[1, 1, :2] = (4 - bias[1] + 8 * np.arange(-7, 7)).reshape(2, 7)  # ties on the (5, 3) channel
    acc[1, 4] = RNG.integers(-300, 300, size=(5, 7)) - bias[4]  # the slope-3/2 channel inside the range
    want = reference(acc, m, n, bias, attrs)
    for name, tensor in layouts(acc).items():
        got = rq.torch(tensor)
        assert got.dtype == np.dtype(odt), name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert rq.torch(layouts(acc)["channels_last"]).strides[1] == np.dtype(odt).itemsize  # stays channels-last
    assert len(np.unique(want)) > 30


def test_blocked_requant_beyond_int32(monkeypatch):
    """|v| past 2**31 (still exact in float64): the clamp runs before the int32 cast."""
    monkeypatch.setattr(common, "BLOCK", 16)
    m, n, bound = np.array([[(1 << 30) + 3]]), np.array([[2]]), 1 << 20
    attrs = intref.out_attrs(np.int8, 4)
    rq = Requant(m, n, OutSpec.from_attrs(attrs), bound=bound)
    assert rq.shifted and not rq.safe32
    acc = np.concatenate([[bound, -bound, 1 << 19, -(1 << 19)], np.arange(-40, 40)]).reshape(1, 1, -1)
    want = reference(acc, m.reshape(-1), n.reshape(-1), np.zeros(1, np.int64), attrs)
    np.testing.assert_array_equal(rq.torch(torch.from_numpy(acc.astype(np.float64))), want)
    assert set(want.reshape(-1).tolist()) == {-128, 4, 127}  # both clamps, and acc 0 -> out_zp


def test_by_rows_feeds_blocks_from_a_producer(monkeypatch):
    """A kernel's own blocks (here slices of a float32 tensor) requantized in NHWC memory order."""
    monkeypatch.setattr(common, "BLOCK", 50)
    m, n = np.array([1 << 30, (1 << 30) + 7, 3 << 28]), np.array([37, 38, 36])
    bias = np.array([100, -2000, 7])
    attrs = intref.out_attrs(np.int8, -7)
    rq = Requant(m.reshape(-1, 1, 1), n.reshape(-1, 1, 1), OutSpec.from_attrs(attrs), bias.reshape(-1, 1, 1),
                 1 << 20)
    acc = RNG.integers(-(1 << 20), 1 << 20, size=(2, 3, 6, 5))
    rows = torch.from_numpy(acc.transpose(0, 2, 3, 1).reshape(-1, 3).astype(np.float32))
    seen: list[tuple[int, int]] = []

    def produce(i: int, j: int) -> torch.Tensor:
        seen.append((i, j))
        return rows[i:j]

    got = rq.by_rows(acc.shape, True, produce)
    np.testing.assert_array_equal(got, reference(acc, m, n, bias, attrs))
    assert len(seen) > 1 and seen[-1][1] == 60 and got.strides[1] == 1
    wide = Requant(m.reshape(-1, 1, 1), n.reshape(-1, 1, 1), OutSpec.from_attrs(intref.out_attrs(np.int32)),
                   bound=1 << 20)
    assert wide.by_rows(acc.shape, True, produce) is None  # 32-bit outputs: the caller requantizes whole


# ---------------------------------------------------------------------------------------------------
# QAdd / Requantize: blocked float64
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("odt,ozp,lo", [(np.uint8, 120, None), (np.int8, -3, -128), (np.int8, 0, -60),
                                        (np.uint16, 32768, None), (np.int16, 5, None)])
def test_blocked_qadd_mixed_layouts_equals_reference(monkeypatch, odt, ozp, lo):
    monkeypatch.setattr(common, "BLOCK", 32)
    shape = (BATCH, 5, 6, 4)
    a = np.ascontiguousarray(RNG.integers(0, 256, size=shape).astype(np.uint8).transpose(0, 2, 3, 1))
    a = a.transpose(0, 3, 1, 2)  # channels-last memory
    b = RNG.integers(-128, 128, size=shape).astype(np.int8)  # contiguous
    attrs = {"a_zp": 7, "b_zp": -20, "Ma": 712279197, "Mb": -1213725692, "N": 30, **intref.out_attrs(odt, ozp, lo)}
    got = intref.run_kernel("QAdd", attrs, [a, b], const=set())[0]
    assert got.dtype == np.dtype(odt)
    np.testing.assert_array_equal(got, intref.qadd(a, b, attrs))
    np.testing.assert_array_equal(intref.run_kernel("QAdd", attrs, [b, a], const=set())[0],
                                  intref.qadd(b, a, attrs))


def test_blocked_requantize_beyond_int32(monkeypatch):
    monkeypatch.setattr(common, "BLOCK", 16)
    x = np.concatenate([np.arange(-40, 40), [-32768, 32767, 20000, -20000]]).astype(np.int16).reshape(2, 2, -1)
    attrs = {"x_zp": 3, "M": 3 << 30, "N": 25, **intref.out_attrs(np.uint8, 100)}  # |v| up to 2**22 * 3
    np.testing.assert_array_equal(intref.run_kernel("Requantize", attrs, [x])[0], intref.requantize(x, attrs))
    huge = {**attrs, "M": (1 << 36) + 5, "N": 3}  # |v| past 2**31
    np.testing.assert_array_equal(intref.run_kernel("Requantize", huge, [x])[0], intref.requantize(x, huge))
