"""Session: runs compiled models in Reference mode and rejects bad feeds with one-line errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.compiler.package import package_qdq_model
from pulsar.core.container import Subgraph, load_compiled, package
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.runtime import Session, TensorInfo

OPSET = [helper.make_opsetid("", 17)]


def qdq_conv_model() -> onnx.ModelProto:
    """images -> Q/DQ -> Conv(per-channel int8 weights, int32 bias) -> Relu -> Q/DQ -> out, opset 17."""
    rng = np.random.default_rng(0)
    c_in, c_out = 3, 8
    w_scale = (rng.random(c_out) * 0.02 + 0.005).astype(np.float32)
    x_scale = np.float32(0.025)
    inits = [
        numpy_helper.from_array(x_scale, "x_scale"),
        numpy_helper.from_array(np.int8(0), "x_zp"),
        numpy_helper.from_array(rng.integers(-127, 128, (c_out, c_in, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(c_out, np.int8), "w_zp"),
        numpy_helper.from_array(rng.integers(-2000, 2000, c_out).astype(np.int32), "b_q"),
        numpy_helper.from_array((w_scale * x_scale).astype(np.float32), "b_scale"),
        numpy_helper.from_array(np.zeros(c_out, np.int32), "b_zp"),
        numpy_helper.from_array(np.float32(0.02), "y_scale"),
        numpy_helper.from_array(np.uint8(0), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["images", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], axis=0),
        helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b_dq"], axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["conv"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("QuantizeLinear", ["relu", "y_scale", "y_zp"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_conv",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [2, c_in, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, c_out, 8, 8])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def qdq(tmp_path_factory):
    model = qdq_conv_model()
    path = package_qdq_model(model, tmp_path_factory.mktemp("m") / "model.axmodel", {"npu_mode": "NPU1"})
    return model, path


@pytest.fixture(scope="module")
def session(qdq):
    return Session(qdq[1], mode="Reference")


def _out_step(model: onnx.ModelProto) -> float:
    return float(numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "y_scale")))


def _images(seed=0):
    return np.random.default_rng(seed).standard_normal((2, 3, 16, 16)).astype(np.float32)


def test_inputs_outputs_metadata(session):
    assert session.inputs == [TensorInfo("images", (2, 3, 16, 16), np.dtype(np.float32))]
    assert session.outputs == [TensorInfo("out", (2, 8, 8, 8), np.dtype(np.float32))]
    assert session.metadata["npu_mode"] == "NPU1"


def test_matches_onnxruntime_on_the_qdq_model_bit_for_bit(qdq, session):
    model, _ = qdq
    ref = ort.InferenceSession(
        model.SerializeToString(), reference_session_options(), providers=["CPUExecutionProvider"]
    )
    for seed in range(3):
        x = _images(seed)
        got = session.run({"images": x})
        assert list(got) == ["out"]
        np.testing.assert_array_equal(got["out"], ref.run(None, {"images": x})[0])
        assert np.count_nonzero(got["out"]) > 0


def test_equals_the_unoptimized_qdq_graph(qdq, session):
    """Reference is the QDQ graph's float math as written. (onnxruntime's default session fuses QDQ
    into integer kernels instead; for this int8-in / uint8-out Conv + Relu its 1.31 release gives 0
    where the graph saturates to 255, so the default session is not a reference.)"""
    model, _ = qdq
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = _images(5) * 4  # large enough that some outputs saturate
    got = session.run({"images": x})["out"]
    np.testing.assert_array_equal(got, plain.run(None, {"images": x})[0])
    assert np.isclose(got.max(), 255 * 0.02)


def test_accepts_a_loaded_compiled_model(qdq):
    sess = Session(load_compiled(qdq[1]))
    x = _images(1)
    np.testing.assert_array_equal(sess.run({"images": x})["out"], Session(qdq[1]).run({"images": x})["out"])


def _one_line(exc) -> str:
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_unknown_input_suggests_the_name(session):
    with pytest.raises(PulsarError, match=r'unknown input "image" \(did you mean "images"\?\)') as exc:
        session.run({"image": _images()})
    _one_line(exc)


def test_missing_input(session):
    with pytest.raises(PulsarError, match=r'missing input "images"') as exc:
        session.run({})
    assert "(2, 3, 16, 16)" in _one_line(exc)


def test_wrong_shape(session):
    with pytest.raises(PulsarError, match=r"images.*expected shape \(2, 3, 16, 16\), got \(1, 3, 16, 16\)"):
        session.run({"images": _images()[:1]})


def test_wrong_dtype(session):
    with pytest.raises(PulsarError, match=r"images.*expected dtype float32, got float64"):
        session.run({"images": _images().astype(np.float64)})


def test_unknown_output_name(session):
    with pytest.raises(PulsarError, match=r'unknown output "outt" \(did you mean "out"\?\)'):
        session.run({"images": _images()}, ["outt"])


def test_modes(qdq):
    x = _images()
    npu, ref = Session(qdq[1]).run({"images": x})["out"], Session(qdq[1], mode="Reference").run({"images": x})["out"]
    assert Session(qdq[1]).mode == "NPUBackend"
    # integer arithmetic vs float QDQ math: equal up to rounding ties and multiplier precision
    assert npu.shape == ref.shape and not np.array_equal(npu, np.zeros_like(npu))
    assert np.abs(npu - ref).max() <= 1.01 * _out_step(qdq[0])
    with pytest.raises(PulsarError, match=r'did you mean "Reference"'):
        Session(qdq[1], mode="Refrence")


def test_plain_onnx_is_refused(tmp_path):
    path = tmp_path / "plain.onnx"
    onnx.save(qdq_conv_model(), str(path))
    with pytest.raises(PulsarError, match="not a pulsar compiled model"):
        Session(path)


def _vi(name, elem=TensorProto.FLOAT, shape=("N", 4)):
    return helper.make_tensor_value_info(name, elem, list(shape))


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory):
    """npu: (a, b) -> a + b -> h ; cpu: h -> Neg -> y. Dynamic first dimension."""
    npu = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["h"])], "npu", [_vi("a"), _vi("b")], [_vi("h")]
    )
    cpu = helper.make_graph([helper.make_node("Neg", ["h"], ["y"])], "cpu", [_vi("h")], [_vi("y")])
    return package(
        [Subgraph("npu_0", "npu", npu), Subgraph("cpu_1", "cpu", cpu)],
        inputs=[_vi("a"), _vi("b")],
        outputs=[_vi("y")],
        opset_imports=OPSET,
        metadata={},
        path=tmp_path_factory.mktemp("two") / "two.axmodel",
    )


def test_two_subgraphs_pass_tensors_by_name(two_parts):
    sess = Session(two_parts, mode="Reference")  # hand-built float bodies run as written
    assert sess.inputs[0].shape == (-1, 4)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(sess.run({"a": a, "b": b})["y"], -(a + b))
    # a border tensor can be asked for too, alone or with the outputs
    both = sess.run({"a": a, "b": b}, ["h", "y"])
    assert list(both) == ["h", "y"]
    np.testing.assert_array_equal(both["h"], a + b)
    with pytest.raises(PulsarError, match='missing input "b"'):
        sess.run({"a": a})
    with pytest.raises(PulsarError, match=r'"b": expected shape \(-1, 4\), got \(3, 5\)'):
        sess.run({"a": a, "b": np.ones((3, 5), np.float32)})
