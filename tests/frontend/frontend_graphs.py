"""Small ONNX graphs built with onnx.helper for the frontend tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 8  # what onnxruntime accepts for opset 17 (the helper's default may be newer)
RNG = np.random.default_rng(1234)


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "test",
        inputs,
        outputs,
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def tensor(name: str, shape: list, dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def bn_params(channels: int) -> dict[str, np.ndarray]:
    return {
        "gamma": RNG.uniform(0.5, 2.0, channels).astype(np.float32),
        "beta": randn(channels),
        "mean": randn(channels),
        "var": RNG.uniform(0.1, 3.0, channels).astype(np.float32),
    }


def conv_bn_model(
    cin: int = 4,
    cout: int = 8,
    group: int = 1,
    bias: bool = True,
    transpose: bool = False,
) -> onnx.ModelProto:
    """x -> Conv / ConvTranspose -> BatchNormalization -> Relu -> y."""
    weight = randn(cin, cout // group, 3, 3) if transpose else randn(cout, cin // group, 3, 3)
    inits = {"w": weight, **bn_params(cout)}
    conv_inputs = ["x", "w"]
    if bias:
        inits["b"] = randn(cout)
        conv_inputs.append("b")
    nodes = [
        helper.make_node(
            "ConvTranspose" if transpose else "Conv",
            conv_inputs,
            ["c"],
            name="conv",
            group=group,
            pads=[1] * 4,
        ),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"], epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    return make_model(nodes, [tensor("x", [1, cin, 8, 8])], [tensor("y", [1, cout, 8, 8])], inits)


def shape_chain_model() -> onnx.ModelProto:
    """Flatten written the torch way: Shape -> Gather -> Unsqueeze -> Concat -> Reshape."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "axes0": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
    }
    return make_model(nodes, [tensor("x", ["N", 3, "H", "W"])], [tensor("y", ["N", "F"])], inits)
