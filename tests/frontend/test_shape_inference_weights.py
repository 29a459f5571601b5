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
