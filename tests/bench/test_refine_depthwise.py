"""The auto scale refinement rule bench.bench_quant chose (pulsar/quant/algorithms/refine_scale.py):
an 8-bit input read only by depthwise convolutions takes the tighter of its MSE and Percentile
ranges; an input of an ordinary convolution keeps its MSE range; 16-bit grids are left alone."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pulsar.quant.algorithms.refine_scale import depthwise_only_inputs, refine_input_ranges
from pulsar.quant.observers import TensorStats, compute_range
from pulsar.quant.plan import QuantPlan, WeightUse


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "pw.w"),
        numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "dw.w"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "pw.w"], ["a"], name="pw"),
        helper.make_node("Conv", ["a", "dw.w"], ["y"], name="dw", group=4, pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _plan(dtype: str = "U8") -> QuantPlan:
    return QuantPlan(
        activations=["x", "a", "y"],
        weights=[WeightUse("pw", 1, "pw.w", 0), WeightUse("dw", 1, "dw.w", 0)],
        dtypes={"x": dtype, "a": dtype, "y": dtype},
    )


def _heavy_tailed() -> TensorStats:
    rng = np.random.default_rng(1)
    stats = TensorStats.empty()
    stats.update(np.concatenate([rng.standard_normal(200_000), 40.0 * rng.standard_normal(30)]).astype(np.float32))
    return stats


def test_depthwise_input_takes_the_tighter_of_mse_and_percentile() -> None:
    model, plan = _model(), _plan()
    assert depthwise_only_inputs(model, plan) == {"a"}
    stats = {"x": _heavy_tailed(), "a": _heavy_tailed(), "y": _heavy_tailed()}
    minmax = {k: compute_range(s, "MinMax") for k, s in stats.items()}
    ranges = dict(minmax)
    refine_input_ranges(model, plan, stats, ranges)
    mse, pct = compute_range(stats["a"], "MSE"), compute_range(stats["a"], "Percentile", percentile=99.99)
    assert ranges["x"] == compute_range(stats["x"], "MSE")  # ordinary conv input: the MSE optimum
    assert ranges["a"] == (max(mse[0], pct[0]), min(mse[1], pct[1]))  # depthwise input: the tighter one
    assert ranges["a"][1] - ranges["a"][0] <= ranges["x"][1] - ranges["x"][0]
    assert ranges["y"] == minmax["y"]  # no weighted reader: untouched


def test_sixteen_bit_depthwise_input_keeps_its_mse_range() -> None:
    model, plan = _model(), _plan("U16")
    stats = {"x": _heavy_tailed(), "a": _heavy_tailed(), "y": _heavy_tailed()}
    minmax = {k: compute_range(s, "MinMax", num_bits=16) for k, s in stats.items()}
    ranges = dict(minmax)
    refine_input_ranges(model, plan, stats, ranges)
    mse16 = compute_range(stats["a"], "MSE", num_bits=16)
    pct = compute_range(stats["a"], "Percentile", num_bits=16, percentile=99.99)
    assert ranges["a"] == (max(minmax["a"][0], mse16[0]), min(minmax["a"][1], mse16[1]))
    assert ranges["a"][1] > pct[1]  # not clipped to the percentile
