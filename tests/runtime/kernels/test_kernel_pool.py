"""Pooling / reductions: QAvgPool and QReduceMean against Python-int references; window geometry,
MaxPool, GlobalMaxPool and ReduceMax against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from pulsar.core.fixedpoint import quantize_multiplier
from tests.runtime.kernels import intref

RNG = np.random.default_rng(13)


def randint(shape, dtype):
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


def ort_run(op, x, inputs=(), n_outputs=1, **attrs):
    """One float (or integer) node in onnxruntime; extra inputs are initializers."""
    names = ["x"] + [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, [f"y{k}" for k in range(n_outputs)], **attrs)
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", elem, x.shape)],
        [helper.make_tensor_value_info(f"y{k}", elem, None) for k in range(n_outputs)],
        initializer=[numpy_helper.from_array(np.asarray(v), f"i{k}") for k, v in enumerate(inputs)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def count_table(ksize, s_ratio, bound):
    """M[c] ~ s_x / (s_y * c), M[0] = 0 (an empty window)."""
    real = np.array([0.0] + [s_ratio / c for c in range(1, ksize + 1)])
    return quantize_multiplier(real, bound)


AVG_CASES = {
    # name: (x shape, x dtype, x_zp, attrs, out dtype, out zp)
    "u8_k3s2p1": ((1, 2, 7, 6), np.uint8, 0, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                  np.uint8, 0),
    "u8_ceil_overhang": ((1, 2, 5, 5), np.uint8, 255, {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
                         np.uint8, 200),
    "s8_asym_pads_ceil": ((2, 1, 6, 7), np.int8, -128, {"kernel_shape": [3, 2], "strides": [2, 3],
                                                        "pads": [2, 0, 1, 1], "ceil_mode": 1}, np.int8, -3),
    "u16_1d": ((1, 3, 11), np.uint16, 65535, {"kernel_shape": [4], "strides": [3], "pads": [2, 1]}, np.uint16, 60000),
    "s16_global_like": ((1, 2, 4, 4), np.int16, 7, {"kernel_shape": [4, 4]}, np.int16, 0),
}


@pytest.mark.parametrize("name", sorted(AVG_CASES))
@pytest.mark.parametrize("cip", [0, 1])
def test_qavgpool_matches_reference(name, cip):
    xshape, xdt, x_zp, geo, odt, ozp = AVG_CASES[name]
    x = randint(xshape, xdt)
    ksize = int(np.prod(geo["kernel_shape"]))
    ratio = (np.iinfo(odt).max - np.iinfo(odt).min) / (np.iinfo(xdt).max - np.iinfo(xdt).min)
    m, n = count_table(ksize, ratio, ksize * 65536)
    n_shift = int(n.max())
    m = np.array([0] + [int(v) << (n_shift - int(s)) for v, s in zip(m[1:], n[1:], strict=True)])  # one shared N
    attrs = {"x_zp": x_zp, "N": n_shift, "count_include_pad": cip, **geo, **intref.out_attrs(odt, ozp)}
    got = intref.run_kernel("QAvgPool", attrs, [x, m])[0]
    want = intref.qavgpool(x, m, attrs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("geo", [
    {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [2, 0, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 0},
])
def test_avgpool_window_counts_follow_onnxruntime(geo):
    """Shapes and count_include_pad divisors (ceil_mode windows hanging past the end padding)."""
    x = np.ones((1, 1, 5, 5), dtype=np.float32)
    ones_u8 = np.ones((1, 1, 5, 5), np.uint8)
    for cip in (0, 1):
        want = ort_run("AveragePool", x, count_include_pad=cip, **geo)[0]  # in-bounds count / divisor
        attrs = {"x_zp": 0, "N": 0, "count_include_pad": cip, **geo, **intref.out_attrs(np.int32)}
        ksize = int(np.prod(geo["kernel_shape"]))
        inbounds = intref.run_kernel("QAvgPool", attrs, [ones_u8, np.ones(ksize + 1, np.int64)])[0]
        # M[c] = 1024 + c encodes the count c the kernel picked: y = inbounds * (1024 + c)
        coded = intref.run_kernel("QAvgPool", attrs, [ones_u8, 1024 + np.arange(ksize + 1)])[0]
        counts = coded // inbounds - 1024
        assert counts.shape == want.shape
        np.testing.assert_allclose(inbounds / counts, want, rtol=1e-6)


@pytest.mark.parametrize("xdt,axes,keepdims,x_zp", [
    (np.uint8, [2, 3], 1, 128), (np.int8, [-1], 0, -128), (np.uint16, [1, 2], 0, 65535), (np.int16, [0, 3], 1, 3)])
def test_qreducemean_matches_reference(xdt, axes, keepdims, x_zp):
    x = randint((2, 3, 4, 5), xdt)
    count = int(np.prod([x.shape[a] for a in axes]))
    m, n = quantize_multiplier(0.9 / count, count * 65536)
    attrs = {"x_zp": x_zp, "axes": axes, "keepdims": keepdims, "M": int(m), "N": int(n),
             **intref.out_attrs(np.int16 if xdt in (np.uint16, np.int16) else np.int8)}
    got = intref.run_kernel("QReduceMean", attrs, [x])[0]
    want = intref.qreducemean(x, attrs)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


MAX_CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [0, 1, 2, 0], "dilations": [2, 1], "ceil_mode": 1},
]


@pytest.mark.parametrize("geo", MAX_CASES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16])
def test_maxpool_matches_onnxruntime(geo, dtype):
    x = randint((2, 3, 7, 6), dtype)
    x[0, 0] = np.iinfo(dtype).min  # an all-minimum plane: padding must not leak in
    got = intref.run_kernel("MaxPool", geo, [x])[0]
    want = ort_run("MaxPool", x.astype(np.float32), **geo)[0]
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, want)


def test_maxpool_1d_matches_onnxruntime():
    x = randint((1, 2, 9), np.int8)
    geo = {"kernel_shape": [3], "strides": [2], "pads": [1, 2], "ceil_mode": 1}
    np.testing.assert_array_equal(intref.run_kernel("MaxPool", geo, [x])[0], ort_run("MaxPool", x, **geo)[0])


def test_global_maxpool_and_reducemax():
    x = randint((2, 3, 4, 5), np.int16)
    xf = x.astype(np.float32)
    np.testing.assert_array_equal(intref.run_kernel("GlobalMaxPool", {}, [x])[0], ort_run("GlobalMaxPool", xf)[0])
    np.testing.assert_array_equal(intref.run_kernel("ReduceMax", {"axes": [1, -1], "keepdims": 0}, [x])[0],
                                  ort_run("ReduceMax", xf, axes=[1, -1], keepdims=0)[0])
    # opset 18 form: axes as an input
    np.testing.assert_array_equal(intref.run_kernel("ReduceMax", {"keepdims": 1}, [x, np.array([2])])[0],
                                  ort_run("ReduceMax", xf, axes=[2], keepdims=1)[0])
    assert intref.run_kernel("ReduceMax", {"keepdims": 0}, [x])[0] == x.max()
