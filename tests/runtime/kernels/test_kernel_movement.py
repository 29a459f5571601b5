"""Data-movement kernels against onnxruntime (on float copies of the integer data: exact below 2**24)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import KERNELS
from tests.runtime.kernels import intref

RNG = np.random.default_rng(29)


def data(shape, dtype=np.int16):
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


def ort_node(op, x, extra=(), n_out=1, opset=17, **attrs):
    """Run one node in onnxruntime: x is fed as float32, ``extra`` inputs are initializers (None = absent)."""
    names, inits = ["x"], []
    for i, value in enumerate(extra):
        if value is None:
            names.append("")
        else:
            names.append(f"c{i}")
            inits.append(numpy_helper.from_array(np.asarray(value), f"c{i}"))
    outs = [f"y{i}" for i in range(n_out)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outs, **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset < 18 else 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})


def check(op, x, extra=(), n_out=1, opset=17, kernel_attrs=None, **attrs):
    want = ort_node(op, x, extra, n_out, opset, **attrs)
    got = intref.run_kernel(op, {**attrs, **(kernel_attrs or {})}, [x, *extra])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == x.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w.astype(x.dtype))


I64 = np.int64


def test_reshape():
    x = data((2, 3, 4))
    check("Reshape", x, [np.array([0, -1, 2], I64)])  # 0 copies the input dimension
    check("Reshape", x, [np.array([4, 6], I64)])
    empty = data((6, 0, 1))
    got = intref.run_kernel("Reshape", {"allowzero": 1}, [empty, np.array([0, 6, 1], I64)])[0]
    assert got.shape == (0, 6, 1)  # allowzero: 0 is a real zero-sized dimension


def test_transpose_flatten_identity():
    x = data((2, 3, 4, 5), np.uint8)
    check("Transpose", x, perm=[0, 2, 3, 1])
    check("Transpose", x)
    check("Flatten", x, axis=-2)
    check("Flatten", x, axis=0)
    check("Identity", x)


def test_squeeze_unsqueeze():
    x = data((1, 3, 1, 4), np.int8)
    check("Squeeze", x, [np.array([0, -2], I64)])
    check("Squeeze", x)
    check("Unsqueeze", x, [np.array([-1, 0, 3], I64)])


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1, 0], [3, 100], [1, 2], [1, 2]),
    ([-1, 10], [-1000, -100], [0, 2], [-1, -3]),
    ([2], [-1], [-1], None),
    ([0, 0, 0], [9223372036854775807, 2, 3], None, None),
])
def test_slice(starts, ends, axes, steps):
    x = data((3, 4, 6), np.uint16)
    extra = [np.array(starts, I64), np.array(ends, I64)]
    extra += [None if axes is None else np.array(axes, I64)]
    extra += [None if steps is None else np.array(steps, I64)]
    while extra and extra[-1] is None:
        extra.pop()
    check("Slice", x, extra)


def test_split():
    x = data((2, 7, 3))
    check("Split", x, [np.array([2, 4, 1], I64)], n_out=3, axis=1)
    check("Split", data((2, 6)), n_out=3, axis=-1, kernel_attrs={"num_outputs": 3})  # opset 17: equal parts
    check("Split", x, n_out=3, opset=18, axis=1, num_outputs=3)  # uneven: 3, 3, 1


def test_concat():
    a, b = data((2, 3, 4), np.uint8), data((2, 1, 4), np.uint8)
    got = intref.run_kernel("Concat", {"axis": -2}, [a, b], const=set())[0]
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=1))
    want = ort_node("Concat", a, [b.astype(np.float32)], axis=1)[0]
    np.testing.assert_array_equal(intref.run_kernel("Concat", {"axis": 1}, [a, b])[0], want)


@pytest.mark.parametrize("pads,value", [([1, 0, 2, 0, 1, 3], -7), ([0, -1, 1, 1, 2, -2], None)])
def test_pad_constant(pads, value):
    x = data((2, 4, 5), np.int8)
    extra = [np.array(pads, I64)] + ([np.array(value, np.float32)] if value is not None else [])
    want = ort_node("Pad", x, extra, mode="constant")[0]
    kextra = [np.array(pads, I64)] + ([np.array(value, np.int8)] if value is not None else [])
    got = intref.run_kernel("Pad", {"mode": "constant"}, [x, *kextra])[0]
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, want)
    with pytest.raises(PulsarError, match="constant only"):
        KERNELS["Pad"]({"mode": b"reflect"}, [None, None])


def test_depth_space():
    x = data((2, 8, 3, 2), np.uint8)
    check("DepthToSpace", x, blocksize=2, mode="DCR")
    check("DepthToSpace", x, blocksize=2, mode="CRD")
    check("SpaceToDepth", data((1, 3, 4, 6), np.int8), blocksize=2)


def test_gather_expand_tile():
    x = data((4, 5, 3), np.int16)
    check("Gather", x, [np.array([[0, -1], [2, 2]], I64)], axis=1)
    check("Gather", x, [np.array(3, I64)], axis=0)
    check("Expand", data((3, 1), np.uint8), [np.array([2, 1, 4], I64)])
    check("Tile", data((2, 3), np.int8), [np.array([2, 3], I64)])


COORDS = ["asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners", "tf_half_pixel_for_nn",
          "half_pixel_symmetric"]
NEAREST = ["floor", "ceil", "round_prefer_floor", "round_prefer_ceil"]
SCALES = [0.3, 0.5, 0.6, 0.7, 1.1, 1.3, 1.5, 1.7, 2.0, 2.4, 2.9, 3.0, 4 / 7, 64 / 26]


def resize_session(attrs: dict, by_sizes: bool) -> ort.InferenceSession:
    """A Resize whose sizes (or scales) arrive at run time, on a [1, W] float input of any width."""
    second = helper.make_tensor_value_info("s", TensorProto.INT64 if by_sizes else TensorProto.FLOAT, [2])
    node = helper.make_node("Resize", ["x", "", "", "s"] if by_sizes else ["x", "", "s"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None]), second],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("coord", COORDS)
@pytest.mark.parametrize("nearest", NEAREST)
def test_resize_nearest_matches_onnxruntime(coord, nearest):
    """Every width 1..10 resized to 1..14 (sizes) and by fractional scales, index by index."""
    attrs = {"mode": "nearest", "coordinate_transformation_mode": coord, "nearest_mode": nearest}
    kernel = KERNELS["Resize"](dict(attrs), [None, None, None, None])
    by_sizes, by_scales = resize_session(attrs, True), resize_session(attrs, False)
    for width in range(1, 11):
        x = np.arange(width, dtype=np.int16).reshape(1, width) * 3 - 7
        for out in range(1, 15):
            sizes = np.array([1, out], I64)
            want = by_sizes.run(None, {"x": x.astype(np.float32), "s": sizes})[0]
            np.testing.assert_array_equal(kernel([x, None, None, sizes])[0], want, err_msg=f"{width} -> {out}")
        for scale in SCALES:
            scales = np.array([1, scale], np.float32)
            if int(np.float32(scale) * np.float32(width)) == 0:
                continue
            want = by_scales.run(None, {"x": x.astype(np.float32), "s": scales})[0]
            got = kernel([x, None, scales])[0]
            assert got.dtype == np.int16
            np.testing.assert_array_equal(got, want, err_msg=f"{width} x {scale}")


def test_resize_4d_two_axes():
    x = data((1, 2, 5, 7), np.uint8)
    attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    check("Resize", x, [None, np.array([1, 1, 2.0, 0.6], np.float32)], **attrs)
    check("Resize", x, [None, None, np.array([1, 2, 9, 4], I64)], **attrs)


def test_resize_rejects_what_is_not_movement():
    with pytest.raises(PulsarError, match="nearest only"):
        KERNELS["Resize"]({"mode": b"linear"}, [None])
    with pytest.raises(PulsarError, match="tf_crop_and_resize"):
        KERNELS["Resize"]({"coordinate_transformation_mode": b"tf_crop_and_resize"}, [None])
    with pytest.raises(PulsarError, match="nearest_mode"):
        KERNELS["Resize"]({"nearest_mode": b"stochastic"}, [None])
