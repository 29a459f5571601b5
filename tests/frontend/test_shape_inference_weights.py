"""pulsar's shape inference keeps large weights out of onnx's C++ round trip, with onnx's result."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pulsar.frontend import shapes
from pulsar.frontend.shapes import infer_shapes


def _model() -> onnx.ModelProto:
    """x[1,8,64] -> MatMul(W 64x512, 128 KB: lifted) -> Reshape(shape initializer: stays) -> Add(b) -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 512)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([1, 8, 16, 32], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Reshape", ["mm", "shape"], ["r"]),
             helper.make_node("Add", ["r", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_lifted_weights_give_onnx_own_result_byte_for_byte():
    model = _model()
    assert numpy_helper.to_array(model.graph.initializer[0]).nbytes > shapes._LIFT_BYTES  # W is lifted
    direct = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    ours = infer_shapes(model)
    assert ours.SerializeToString() == direct.SerializeToString()
    dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in ours.graph.value_info}
    assert dims["r"] == [1, 8, 16, 32]  # data propagation still read the small shape initializer
    assert [i.name for i in ours.graph.input] == ["x"] and len(ours.graph.initializer) == 3


def test_over_2gb_decision_matches_bytesize(monkeypatch, caplog):
    """The size check counts the large weights by their raw bytes; near the limit it is ByteSize itself."""
    model = _model()
    size = model.ByteSize()
    monkeypatch.setattr(shapes, "_PROTO_LIMIT", size - 1)  # one byte too many: skipped, model returned as is
    assert infer_shapes(model) is model
    assert "over 2 GB" in caplog.text
    monkeypatch.setattr(shapes, "_PROTO_LIMIT", size)  # exactly at the limit: inferred
    assert len(infer_shapes(model).graph.value_info) == 2
    big = {"W"}
    monkeypatch.setattr(shapes, "_PROTO_LIMIT", 2**31 - 1)
    assert not shapes.serialized_over(model, shapes._PROTO_LIMIT, big)
    assert shapes.serialized_over(model, size - 1) and not shapes.serialized_over(model, size)
    raw = len(model.graph.initializer[0].raw_data)
    assert raw == 64 * 512 * 4 and raw < size < raw + 1024  # the raw bytes are nearly all of the model


def test_every_model_and_graph_field_survives_the_lifting() -> None:
    """The light copy is built field by field: metadata, doc strings, value_info and sparse
    initializers come back as onnx's own inference leaves them."""
    model = _model()
    model.doc_string, model.graph.doc_string, model.producer_name = "model doc", "graph doc", "test"
    onnx.helper.set_model_props(model, {"k": "v"})
    model.graph.value_info.append(helper.make_tensor_value_info("mm", TensorProto.FLOAT, [1, 8, 512]))
    direct = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    assert infer_shapes(model).SerializeToString() == direct.SerializeToString()
    graph = shapes.inferred_graph(model)
    assert {vi.name for vi in graph.value_info} == {"mm", "r"} and "W" in {i.name for i in graph.input}
