"""const_processors / op_processors / quant_op_processors: patches take effect in onnxruntime, bad entries fail clearly."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError
from pulsar.frontend.patch import apply_const_processors, apply_op_processors

IR_VERSION = 8  # onnx's default IR is newer than onnxruntime accepts
SHAPE_NAME = "onnx::Reshape_xyz"


def _model(nodes, inputs, outputs, inits=(), opset=17, extra_opsets=()):
    graph = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(inits))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def _run(model: onnx.ModelProto, **feeds: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def const(name: str, data=None, data_path=None) -> SimpleNamespace:
    return SimpleNamespace(name=name, data=data, data_path=data_path)


def op(op_name: str, **attrs) -> SimpleNamespace:
    return SimpleNamespace(op_name=op_name, attrs=attrs)


def reshape_model(shape_as: str = "initializer") -> onnx.ModelProto:
    """x [1, 4608] -> Reshape(x, [1, 96, 48]); the shape is an initializer or a Constant node."""
    shape = np.array([1, 96, 48], dtype=np.int64)
    nodes, inits = [], []
    if shape_as == "initializer":
        inits.append(numpy_helper.from_array(shape, SHAPE_NAME))
    elif shape_as == "constant":
        nodes.append(helper.make_node("Constant", [], [SHAPE_NAME], value=numpy_helper.from_array(shape)))
    else:
        nodes.append(helper.make_node("Constant", [], [SHAPE_NAME], value_ints=shape.tolist()))
    nodes.append(helper.make_node("Reshape", ["x", SHAPE_NAME], ["y"], name="Reshape_3"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 96 * 48])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def bias_model(dtype: int = TensorProto.FLOAT, shape=(2, 3)) -> onnx.ModelProto:
    """y = x + bias, bias an initializer of the given dtype, all zeros."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    zeros = np.full(shape, "", dtype=object) if dtype == TensorProto.STRING else np.zeros(shape, dtype=np_dtype)
    bias = numpy_helper.from_array(zeros, "bias")
    return _model([helper.make_node("Add", ["x", "bias"], ["y"], name="Add_0")],
                  [helper.make_tensor_value_info("x", dtype, list(shape))],
                  [helper.make_tensor_value_info("y", dtype, None)], [bias])


def pool_model(ceil_mode: int = 0, qdq: bool = False) -> onnx.ModelProto:
    """x [1, 1, 7, 7] -> AveragePool(kernel 2, stride 2), optionally wrapped in QuantizeLinear/DequantizeLinear."""
    pool_in, pool_out, nodes, inits = "x", "y", [], []
    if qdq:
        inits = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
                 numpy_helper.from_array(np.array(0, np.uint8), "zp")]
        nodes += [helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["xq"], name="x_Q"),
                  helper.make_node("DequantizeLinear", ["xq", "scale", "zp"], ["xd"], name="x_DQ")]
        pool_in, pool_out = "xd", "p"
    nodes.append(helper.make_node("AveragePool", [pool_in], [pool_out], name="AveragePool_12",
                                  kernel_shape=[2, 2], strides=[2, 2], ceil_mode=ceil_mode))
    if qdq:
        nodes += [helper.make_node("QuantizeLinear", ["p", "scale", "zp"], ["pq"], name="p_Q"),
                  helper.make_node("DequantizeLinear", ["pq", "scale", "zp"], ["y"], name="p_DQ")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 7, 7])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def avg_pool_ceil(x: np.ndarray, k: int = 2, s: int = 2) -> np.ndarray:
    """Reference AveragePool with ceil_mode=1, no pads: partial edge windows average what they cover."""
    h, w = x.shape[-2:]
    oh, ow = -(-(h - k) // s) + 1, -(-(w - k) // s) + 1
    out = np.zeros((*x.shape[:-2], oh, ow), np.float32)
    for i in range(oh):
        for j in range(ow):
            out[..., i, j] = x[..., i * s:min(i * s + k, h), j * s:min(j * s + k, w)].mean(axis=(-2, -1))
    return out


# ---------------------------------------------------------------------------------------------------- consts


@pytest.mark.parametrize("shape_as", ["initializer", "constant", "value_ints"])
def test_reshape_batch_becomes_dynamic(shape_as: str) -> None:
    model = reshape_model(shape_as)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    x = np.random.default_rng(0).standard_normal((2, 96 * 48)).astype(np.float32)
    with pytest.raises(Exception, match="reshape|Reshape"):
        _run(model, x=x)  # [1, 96, 48] cannot hold a batch of 2

    lines = apply_const_processors(model, [const(SHAPE_NAME, data=[-1, 96, 48])])

    assert lines == [f"const {SHAPE_NAME}: [1, 96, 48] -> [-1, 96, 48]"]
    (y,) = _run(model, x=x)
    np.testing.assert_array_equal(y, x.reshape(2, 96, 48))


def test_nested_data_and_config_tuples() -> None:
    model = bias_model()
    apply_const_processors(model, [const("bias", data=((1, 2.5, 3), (4, 5, -6)))])  # frozen configs hold tuples
    (y,) = _run(model, x=np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(y, [[2, 3.5, 4], [5, 6, -5]])


def _write(path, kind: str, values: np.ndarray) -> None:
    if kind == ".npy":
        np.save(path, values)
    elif kind == ".bin":
        path.write_bytes(values.astype("<f4").tobytes())
    else:
        path.write_text("1.5, 2\n-3   4e1\n5,6\n")


@pytest.mark.parametrize("kind", [".npy", ".bin", ".txt"])
def test_data_path_files(tmp_path, kind: str) -> None:
    values = np.array([[1.5, 2, -3], [40, 5, 6]], np.float32)
    path = tmp_path / f"bias{kind}"
    _write(path, kind, values)
    model = bias_model()
    lines = apply_const_processors(model, [const("bias", data_path=str(path))])
    assert lines == ["const bias: [0, 0, 0, 0, 0, 0] -> [1.5, 2, -3, 40, 5, 6]"]
    (y,) = _run(model, x=np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(y, values)


def test_npy_float64_and_ints_are_cast_when_lossless(tmp_path) -> None:
    np.save(tmp_path / "f64.npy", np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))  # numpy's default dtype
    np.save(tmp_path / "i32.npy", np.arange(6, dtype=np.int32))
    model, int_model = bias_model(), bias_model(TensorProto.INT64)
    apply_const_processors(model, [const("bias", data_path=str(tmp_path / "f64.npy"))])
    apply_const_processors(int_model, [const("bias", data_path=str(tmp_path / "i32.npy"))])
    np.testing.assert_allclose(_run(model, x=np.zeros((2, 3), np.float32))[0].ravel(), [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                               rtol=1e-6)
    assert _run(int_model, x=np.zeros((2, 3), np.int64))[0].ravel().tolist() == [0, 1, 2, 3, 4, 5]


def test_large_constant_log_is_abbreviated() -> None:
    model = bias_model(shape=(4, 5))
    (line,) = apply_const_processors(model, [const("bias", data=list(range(20)))])
    assert line == "const bias: [0, 0, 0, 0, 0, 0, 0, 0, ...] (20 values) -> [0, 1, 2, 3, 4, 5, 6, 7, ...] (20 values)"


def test_unknown_constant_suggests_a_name() -> None:
    with pytest.raises(PulsarError, match=r'const_processors\[0\]\.name: .*onnx::Reshape_xyy.*did you mean "onnx::Reshape_xyz"'):
        apply_const_processors(reshape_model("constant"), [const("onnx::Reshape_xyy", data=[-1, 96, 48])])


def test_errors_name_the_field_given() -> None:
    with pytest.raises(PulsarError, match=r"^my_consts\[1\]\.name"):
        apply_const_processors(reshape_model(), [const(SHAPE_NAME, data=[1, 96, 48]), const("nope", data=[1])],
                               field="my_consts")


def test_wrong_count_names_expected_and_got() -> None:
    model = reshape_model()
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data: 2 values given but 3 expected.*\(constant '.*' is int64, shape \[3\]\)"):
        apply_const_processors(model, [const(SHAPE_NAME, data=[96, 48])])
    assert numpy_helper.to_array(model.graph.initializer[0]).tolist() == [1, 96, 48]  # untouched


@pytest.mark.parametrize(("dtype", "data", "message"), [
    (TensorProto.INT64, [1.5, 0, 0, 0, 0, 0], r"value 1\.5 \(index 0\) is not a whole number"),
    (TensorProto.INT64, [0, 0, 0, 0, 0, 2**63], r"value 9223372036854775808 \(index 5\) is out of range for int64"),
    (TensorProto.UINT8, [0, 0, 300, 0, 0, 0], r"value 300 \(index 2\) is out of range for uint8 \[0, 255\]"),
    (TensorProto.INT8, [0, -1, 0, 0, 0, float("nan")], r"value nan \(index 5\) is not a whole number"),
    (TensorProto.FLOAT16, [0, 0, 0, 1e6, 0, 0], r"value 1000000\.0 \(index 3\) is too large for float16"),
    (TensorProto.FLOAT, [0, 0, 0, 0, 16777217, 0], r"value 16777217 \(index 4\) cannot be stored exactly"),
    (TensorProto.FLOAT, [0, 0, "a", 0, 0, 0], r"value 'a' \(index 2\) is not a number"),
    (TensorProto.INT4, [0, 0, 0, 0, 0, 8], r"value 8 \(index 5\) is out of range for int4 \[-8, 7\]"),
    (TensorProto.STRING, [1, 2, 3, 4, 5, 6], r"value 1 \(index 0\) is not a string"),
])
def test_values_must_fit_the_constant_dtype(dtype: int, data: list, message: str) -> None:
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data: " + message):
        apply_const_processors(bias_model(dtype), [const("bias", data=data)])


def test_integral_floats_fit_integer_constants() -> None:
    model = bias_model(TensorProto.INT64)
    apply_const_processors(model, [const("bias", data=[1.0, 2, 3, 4, 5, -6.0])])
    assert _run(model, x=np.zeros((2, 3), np.int64))[0].ravel().tolist() == [1, 2, 3, 4, 5, -6]


def test_bad_bin_size(tmp_path) -> None:
    (tmp_path / "b.bin").write_bytes(np.zeros(5, np.float32).tobytes())
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data_path: .*has 20 bytes but constant 'bias' "
                                          r"\(float32, shape \[2, 3\]\) needs 24"):
        apply_const_processors(bias_model(), [const("bias", data_path=str(tmp_path / "b.bin"))])


def test_missing_file(tmp_path) -> None:
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data_path: .*missing\.npy' does not exist"):
        apply_const_processors(bias_model(), [const("bias", data_path=str(tmp_path / "missing.npy"))])


def test_bad_txt(tmp_path) -> None:
    (tmp_path / "b.txt").write_text("1 2 3\n4 five 6\n")
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data_path: .*holds 'five' \(value 4\), which is not a number"):
        apply_const_processors(bias_model(), [const("bias", data_path=str(tmp_path / "b.txt"))])


@pytest.mark.parametrize(("name", "content", "message"), [
    ("pickled.npy", None, "is not a readable .npy array"),
    ("garbage.npy", b"not numpy", "is not a readable .npy array"),
    ("frac.npy", np.full(6, 0.5), r"value 0\.5 \(index 0\) is not a whole number"),
    ("values.csv", b"1,2,3", "unsupported extension"),
    ("binary.txt", b"\xff\xfe\x00", "is not a UTF-8 text file"),
])
def test_unreadable_files(tmp_path, name: str, content, message: str) -> None:
    path = tmp_path / name
    if name == "pickled.npy":
        np.save(path, np.array([{"a": 1}] * 6, dtype=object), allow_pickle=True)
    elif isinstance(content, np.ndarray):
        np.save(path, content)
    else:
        path.write_bytes(content)
    with pytest.raises(PulsarError, match=r"const_processors\[0\]\.data_path: .*" + message):
        apply_const_processors(bias_model(TensorProto.INT64), [const("bias", data_path=str(path))])


def test_needs_exactly_one_source() -> None:
    with pytest.raises(PulsarError, match=r"const_processors\[0\]: give exactly one of data or data_path"):
        apply_const_processors(bias_model(), [const("bias")])


# ------------------------------------------------------------------------------------------------------- ops


@pytest.mark.parametrize("value", [1, True, 1.0])
def test_avgpool_ceil_mode(value) -> None:
    model = pool_model()
    x = np.random.default_rng(1).standard_normal((1, 1, 7, 7)).astype(np.float32)
    assert _run(model, x=x)[0].shape == (1, 1, 3, 3)

    lines = apply_op_processors(model, [op("AveragePool_12", ceil_mode=value)])

    assert lines == ["op AveragePool_12: ceil_mode 0 -> 1"]
    (y,) = _run(model, x=x)
    assert y.shape == (1, 1, 4, 4)
    np.testing.assert_allclose(y, avg_pool_ceil(x), rtol=1e-6, atol=1e-6)


def test_unset_attribute_shows_schema_default_and_lists_are_set() -> None:
    model = pool_model()
    lines = apply_op_processors(model, [op("AveragePool_12", count_include_pad=1, pads=[0, 0, 1, 1])])
    assert lines == ["op AveragePool_12: count_include_pad 0 -> 1", "op AveragePool_12: pads (unset) -> [0, 0, 1, 1]"]
    x = np.ones((1, 1, 7, 7), np.float32)
    (y,) = _run(model, x=x)
    assert y.shape == (1, 1, 4, 4)
    assert y[0, 0, 3, 3] == pytest.approx(0.25)  # the padded window counts its 3 zeros


def test_quant_op_processors_on_qdq_model() -> None:
    model = pool_model(qdq=True)
    x = np.random.default_rng(2).uniform(0, 10, (1, 1, 7, 7)).astype(np.float32)
    lines = apply_op_processors(model, [op("AveragePool_12", ceil_mode=1)], field="quant_op_processors")
    assert lines == ["op AveragePool_12: ceil_mode 0 -> 1"]
    (y,) = _run(model, x=x)
    xd = np.clip(np.round(x / 0.05), 0, 255) * 0.05
    np.testing.assert_allclose(y, np.clip(np.round(avg_pool_ceil(xd) / 0.05), 0, 255) * 0.05, atol=0.051)
    with pytest.raises(PulsarError, match=r"^quant_op_processors\[0\]\.op_name: .*did you mean \"p_DQ\""):
        apply_op_processors(model, [op("p_DQQ", axis=0)], field="quant_op_processors")


def test_unknown_node_suggests_a_name() -> None:
    with pytest.raises(PulsarError, match=r'op_processors\[0\]\.op_name: .*AveragePool_21.*did you mean "AveragePool_12"'):
        apply_op_processors(pool_model(), [op("AveragePool_21", ceil_mode=1)])


def test_unknown_attribute_suggests_a_name() -> None:
    with pytest.raises(PulsarError, match=r'op_processors\[0\]\.attrs\.ceil_mod: AveragePool \(opset 17\) has no attribute '
                                          r"'ceil_mod' \(did you mean \"ceil_mode\"\?\)"):
        apply_op_processors(pool_model(), [op("AveragePool_12", ceil_mod=1)])


@pytest.mark.parametrize(("attrs", "message"), [
    ({"ceil_mode": 1.5}, r"attrs\.ceil_mode: 1\.5 is not an integer"),
    ({"ceil_mode": "1"}, r"attrs\.ceil_mode: '1' is not an integer"),
    ({"kernel_shape": 2}, r"attrs\.kernel_shape: 2 is not a list of integers"),
    ({"kernel_shape": [2, 2.5]}, r"attrs\.kernel_shape: \[2, 2\.5\] is not a list of integers"),
    ({"auto_pad": 1}, r"attrs\.auto_pad: 1 is not a string"),
])
def test_wrong_attribute_type(attrs: dict, message: str) -> None:
    with pytest.raises(PulsarError, match=r"op_processors\[0\]\." + message):
        apply_op_processors(pool_model(), [op("AveragePool_12", **attrs)])


@pytest.mark.parametrize(("attrs", "message"), [
    ({"ceil_mode": 2}, r"attrs\.ceil_mode: 2 is not allowed for AveragePool ceil_mode; use 0 or 1"),
    ({"auto_pad": "SAME_UPER"}, r'attrs\.auto_pad: .*did you mean "SAME_UPPER"'),
    ({"kernel_shape": [2, 2, 2]}, r"attrs: AveragePool node 'AveragePool_12' is invalid with kernel_shape=\[2, 2, 2\]: "
                                  r".*kernel_shape.*\(found by shape inference\)"),
    ({"strides": [0, 0]}, r"attrs: .*strides=\[0, 0\]: Attribute strides must only contain positive values"),
])
def test_invalid_values_are_caught(attrs: dict, message: str) -> None:
    model = pool_model()
    with pytest.raises(PulsarError, match=r"op_processors\[0\]\." + message):
        apply_op_processors(model, [op("AveragePool_12", **attrs)])
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert attrs == {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 0}  # node untouched
    assert _run(model, x=np.zeros((1, 1, 7, 7), np.float32))[0].shape == (1, 1, 3, 3)


def test_invalid_value_found_by_onnxruntime() -> None:
    grid = numpy_helper.from_array(np.zeros((1, 2, 2, 2), np.float32), "grid")
    model = _model([helper.make_node("GridSample", ["x", "grid"], ["y"], name="GridSample_0")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [grid])
    with pytest.raises(PulsarError, match=r"padding_mode=foo: .*padding_mode.*\(found by onnxruntime\)"):
        apply_op_processors(model, [op("GridSample_0", padding_mode="foo")])
    assert apply_op_processors(model, [op("GridSample_0", padding_mode="border")]) == [
        "op GridSample_0: padding_mode zeros -> border"]


def test_float_attribute_accepts_ints() -> None:
    model = _model([helper.make_node("LeakyRelu", ["x"], ["y"], name="LeakyRelu_0")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    assert apply_op_processors(model, [op("LeakyRelu_0", alpha=1)]) == ["op LeakyRelu_0: alpha 0.01 -> 1"]
    (y,) = _run(model, x=np.array([-2, -1, 0, 3], np.float32))
    np.testing.assert_array_equal(y, [-2, -1, 0, 3])
    with pytest.raises(PulsarError, match=r"attrs\.alpha: True is not a number"):
        apply_op_processors(model, [op("LeakyRelu_0", alpha=True)])


def test_custom_op_without_schema_is_patched_by_value_type(caplog) -> None:
    node = helper.make_node("MyOp", ["x"], ["y"], name="MyOp_0", domain="com.example", gain=1.0)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   extra_opsets=[helper.make_opsetid("com.example", 1)])
    with caplog.at_level(logging.WARNING, logger="pulsar"):
        lines = apply_op_processors(model, [op("MyOp_0", gain=2, sizes=[1, 2], tag="a")])
    assert "no ONNX schema for MyOp" in caplog.text
    assert lines == ["op MyOp_0: gain 1 -> 2", "op MyOp_0: sizes (unset) -> [1, 2]", "op MyOp_0: tag (unset) -> a"]
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert attrs == {"gain": 2.0, "sizes": [1, 2], "tag": b"a"}  # gain keeps its FLOAT type


def test_const_processors_on_qdq_model() -> None:
    model = pool_model(qdq=True)
    x = np.full((1, 1, 7, 7), 20.0, np.float32)
    assert _run(model, x=x)[0].max() == pytest.approx(12.75)  # 255 * 0.05: the scale clips at 12.75
    lines = apply_const_processors(model, [const("scale", data=[0.1])])
    assert lines == ["const scale: 0.05 -> 0.1"]
    np.testing.assert_allclose(_run(model, x=x)[0], np.full((1, 1, 3, 3), 20.0), rtol=1e-6)


def test_string_and_scalar_constants() -> None:
    model = _model([helper.make_node("Constant", [], ["c"], value_float=1.0),
                    helper.make_node("Constant", [], ["s"], value_strings=["a", "b"])], [],
                   [helper.make_tensor_value_info("c", TensorProto.FLOAT, []),
                    helper.make_tensor_value_info("s", TensorProto.STRING, [2])])
    lines = apply_const_processors(model, [const("c", data=[2.5]), const("s", data=["yes", "no"])])
    assert lines == ["const c: 1 -> 2.5", "const s: [a, b] -> [yes, no]"]
    c, s = _run(model)
    assert c == 2.5
    assert s.tolist() == ["yes", "no"]
