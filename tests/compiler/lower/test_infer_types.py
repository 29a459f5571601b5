"""The compiler's type inference of QDQ models (com.microsoft Q / DQ read as Casts)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from pulsar.compiler.lower.qdq_graph import infer_types


def test_a_large_per_channel_zero_point_still_types_its_quantize() -> None:
    """A zero point past 64 KiB of float32 (the size above which inference sees weights as typed inputs,
    not initializers) still gives the QuantizeLinear output its type: int8 here, not the uint8 default."""
    c = 20_000
    inits = [numpy_helper.from_array(np.ones(c, np.float32), "s"), numpy_helper.from_array(np.zeros(c, np.int8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain="com.microsoft", axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], domain="com.microsoft", axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    types = infer_types(model)
    assert types["q"].elem_type == TensorProto.INT8
    assert types["q"].shape == (1, c) and types["y"].elem_type == TensorProto.FLOAT
