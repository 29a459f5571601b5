"""The pass manager: fixed point, transformation check, records, histogram."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from frontend_graphs import conv_bn_model, make_model, randn, tensor
from onnx import helper, numpy_helper

from pulsar.errors import PulsarError
from pulsar.frontend.check import random_samples
from pulsar.frontend.pass_manager import (
    PassRecord,
    compare_models,
    op_histogram,
    optimize,
)
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES, register_pass


@pytest.fixture
def broken_pass():
    """A pass with a bug: it scales the first Conv weight by 1.01."""

    @register_pass("scale_conv_weight_bug")
    def scale_conv_weight_bug(model: onnx.ModelProto) -> bool:
        inits = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Conv":
                weight = inits[node.input[1]]
                weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.01, weight.name))
                return True
        return False

    yield "scale_conv_weight_bug"
    del PASSES["scale_conv_weight_bug"]


def _model_with_everything() -> onnx.ModelProto:
    """Conv + BN + Constant + Identity + a shape chain + a dead branch."""
    model = conv_bn_model()
    graph = model.graph
    graph.node[-1].output[0] = "relu"
    graph.node.extend(
        [
            helper.make_node(
                "Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))
            ),
            helper.make_node("Mul", ["relu", "two"], ["m"]),
            helper.make_node("Identity", ["m"], ["m_id"]),
            helper.make_node("Shape", ["m_id"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
            helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
            helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["m_id", "target"], ["y"]),
            helper.make_node("Neg", ["m"], ["dead"]),
        ]
    )
    for name, value in {"zero": 0, "axes0": [0], "minus_one": [-1]}.items():
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    del graph.output[:]
    graph.output.append(tensor("y", [1, 512]))
    onnx.checker.check_model(model)
    return model


def test_optimize_reaches_fixed_point_and_matches():
    model = _model_with_everything()
    before = model.SerializeToString()
    optimized, records = optimize(model)
    assert model.SerializeToString() == before  # the caller's model is untouched
    assert op_histogram(optimized) == {"Conv": 1, "Mul": 1, "Relu": 1, "Reshape": 1}
    assert [o.name for o in optimized.graph.output] == ["y"]
    assert [r.name for r in records] == DEFAULT_PASSES
    assert all(isinstance(r, PassRecord) and r.seconds >= 0 for r in records)
    by_name = {r.name: r for r in records}
    assert by_name["fold_batchnorm"].changed_iterations == 1
    assert by_name["eliminate_dead_nodes"].nodes_after == 4
    assert records[0].nodes_before == len(model.graph.node)
    rows = compare_models(model, optimized)
    assert rows[0]["output"] == "y" and rows[0]["rel_diff"] <= 1e-5 and rows[0]["cosine"] > 0.999999
    again, records_again = optimize(optimized)
    assert all(r.changed_iterations == 0 for r in records_again)
    assert len(again.graph.node) == len(optimized.graph.node)


def test_transformation_check_catches_a_broken_pass(broken_pass):
    model = conv_bn_model()
    with pytest.raises(PulsarError) as err:
        optimize(model, [*DEFAULT_PASSES, broken_pass])
    message = str(err.value)
    assert f'pass "{broken_pass}"' in message
    assert 'output "y"' in message
    assert "onnx_opt.disable_transformation_check" in message
    assert "bug" in message


def test_broken_pass_runs_without_check(broken_pass):
    model = conv_bn_model()
    optimized, records = optimize(model, [broken_pass], check=False)
    assert records[0].changed_iterations >= 1
    assert compare_models(model, optimized)[0]["rel_diff"] > 1e-3  # the bug is real, only unchecked


def test_check_uses_given_samples(broken_pass):
    model = conv_bn_model()
    zeros = [{"x": np.zeros((1, 4, 8, 8), np.float32)}]
    # With an all-zero input the weight bug is invisible; the samples given are the ones used.
    optimize(model, [broken_pass], samples=zeros)
    with pytest.raises(PulsarError, match=broken_pass):
        optimize(model, [broken_pass], samples=random_samples(model, count=1, seed=5))


def test_unknown_pass_name_did_you_mean():
    with pytest.raises(
        PulsarError, match='unknown frontend pass "fold_batchnrom" \\(did you mean "fold_batchnorm"\\?\\)'
    ):
        optimize(conv_bn_model(), ["fold_batchnrom"])


def test_compare_models_reports_each_output():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"])],
        [tensor("x", [4])],
        [tensor("a", [4]), tensor("b", [4])],
    )
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.node[1].op_type = "Abs"
    samples = [{"x": np.array([1.0, -2.0, 3.0, -4.0], np.float32)}]
    rows = compare_models(model, other, samples)
    assert [r["output"] for r in rows] == ["a", "b"]
    assert rows[0] == {"output": "a", "max_abs_diff": 0.0, "rel_diff": 0.0, "cosine": 1.0}
    # Neg [-1, 2, -3, 4] vs Abs [1, 2, 3, 4]
    assert rows[1]["max_abs_diff"] == pytest.approx(6.0)
    assert rows[1]["rel_diff"] == pytest.approx(1.5)
    assert rows[1]["cosine"] == pytest.approx(1 / 3)


def test_op_histogram_counts_subgraphs():
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [tensor("t", [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [tensor("e", [2])])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    model = make_model(
        nodes, [tensor("x", [2]), tensor("cond", [], onnx.TensorProto.BOOL)], [tensor("y", [2])]
    )
    assert op_histogram(model) == {"Relu": 2, "If": 1, "Neg": 1}


def test_dead_code_inside_if_captures_is_kept():
    # The If branch reads "w" from the outer scope: neither w nor its producer may be removed.
    then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [tensor("t", [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [tensor("e", [2])])
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["w"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    model = make_model(
        nodes,
        [tensor("x", [2]), tensor("cond", [], onnx.TensorProto.BOOL)],
        [tensor("y", [2])],
        {"k": randn(2)},
    )
    samples = [{"x": randn(2), "cond": np.array(True)}, {"x": randn(2), "cond": np.array(False)}]
    optimized, _ = optimize(model, samples=samples)
    assert op_histogram(optimized) == op_histogram(model)


def test_check_runs_once_on_the_final_graph(monkeypatch):
    """The passes are checked together (one onnxruntime run of the input graph, one of the result),
    not once per change: each session costs about as much as the passes."""
    import pulsar.frontend.pass_manager as pm

    runs = []
    real_run = pm.run
    monkeypatch.setattr(pm, "run", lambda model, samples: runs.append(len(model.graph.node)) or real_run(model, samples))
    optimized, records = optimize(_model_with_everything())
    assert sum(r.changed_iterations for r in records) >= 3  # several passes changed the graph ...
    assert len(runs) == 2  # ... and onnxruntime ran the input graph and the final one only
    assert runs[-1] == len(optimized.graph.node)


def test_batched_check_still_names_the_broken_pass_among_good_ones(broken_pass):
    """The broken pass runs first and good passes change the graph after it: the replay after the
    failed check pins the difference on the broken pass, not on the last pass that ran."""
    with pytest.raises(PulsarError) as err:
        optimize(_model_with_everything(), [broken_pass, *DEFAULT_PASSES])
    assert f'after frontend pass "{broken_pass}"' in str(err.value)


def test_batched_check_names_the_pass_onnxruntime_fails_after():
    @register_pass("drop_conv_weight_bug")
    def drop_conv_weight_bug(model: onnx.ModelProto) -> bool:
        for node in model.graph.node:
            if node.op_type == "Conv" and node.input[1] != "missing":
                node.input[1] = "missing"  # a dangling input: onnxruntime cannot load the graph
                return True
        return False

    try:
        with pytest.raises(PulsarError, match='after frontend pass "drop_conv_weight_bug" onnxruntime cannot run'):
            optimize(conv_bn_model(), [*DEFAULT_PASSES, "drop_conv_weight_bug"])
    finally:
        del PASSES["drop_conv_weight_bug"]
