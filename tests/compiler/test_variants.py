"""Variants: batch splitting, and the quantized graph re-shaped per batch / shape group (IR fix, errors)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.compiler.variant_graph import reshaped
from pulsar.core.variants import plan_text, split_batch
from pulsar.errors import PulsarError


@pytest.mark.parametrize(("n", "batches", "plan"), [
    (3, [1, 2, 4], [2, 1]), (9, [1, 2, 4], [4, 4, 1]), (8, [1, 2, 4], [4, 4]), (1, [1, 2, 4], [1]),
    (8, [4, 6], [4, 4]), (12, [4, 6], [6, 6]), (7, [1, 4, 8], [4, 1, 1, 1]), (5, [1], [1, 1, 1, 1, 1]),
])
def test_split_batch_fewest_runs_largest_first(n, batches, plan):
    assert split_batch(n, batches) == plan
    assert plan_text(plan) == " + ".join(map(str, plan))


@pytest.mark.parametrize(("n", "batches"), [(3, [2, 4]), (0, [1]), (5, [])])
def test_split_batch_impossible(n, batches):
    assert split_batch(n, batches) is None


def _model(nodes, inits, shape, out_shape=None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _per_sample_equal(model: onnx.ModelProto, fixed: onnx.ModelProto, batch: int, shape: list[int]) -> None:
    x = np.random.default_rng(0).standard_normal([batch, *shape[1:]]).astype(np.float32)
    whole = _run(fixed, x)
    singles = np.concatenate([_run(model, x[i:i + 1]) for i in range(batch)])
    np.testing.assert_array_equal(whole, singles)


def test_reshape_with_the_batch_baked_in_gets_dim0_minus_one():
    shape = [1, 2, 4, 4]
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="flat")],
                   {"s": np.array([1, 32], np.int64)}, shape)
    fixed, fixes = reshaped(model, {"x": shape}, batch=3, ir_fix=True, what="batch 3")
    assert fixes == ["Reshape 'flat': shape [1, 32] -> [-1, 32]"]
    _per_sample_equal(model, fixed, 3, shape)


def test_reshape_with_another_minus_one_gets_dim0_zero():
    shape = [1, 2, 4, 4]
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="r")],
                   {"s": np.array([1, 8, -1], np.int64)}, shape)
    fixed, fixes = reshaped(model, {"x": shape}, batch=2, ir_fix=True, what="batch 2")
    assert fixes == ["Reshape 'r': shape [1, 8, -1] -> [0, 8, -1]"]
    _per_sample_equal(model, fixed, 2, shape)


def test_shared_shape_constant_keeps_its_other_readers():
    shape = [1, 4]
    model = _model([helper.make_node("Reshape", ["x", "s"], ["a"], name="r1"),
                    helper.make_node("Reshape", ["c", "s"], ["b"], name="r2"),
                    helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                   {"s": np.array([1, 4], np.int64), "c": np.ones((4,), np.float32)}, shape)
    fixed, fixes = reshaped(model, {"x": shape}, batch=2, ir_fix=True, what="batch 2")
    assert [f.split(":")[0] for f in fixes] == ["Reshape 'r1'"]  # r2 reshapes a constant: no batch there
    inits = {t.name: numpy_helper.to_array(t).tolist() for t in fixed.graph.initializer}
    assert inits["s"] == [1, 4]
    _per_sample_equal(model, fixed, 2, shape)


def test_disable_ir_fix_names_the_node_and_the_fix():
    shape = [1, 2, 4, 4]
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="flat")],
                   {"s": np.array([1, 32], np.int64)}, shape)
    with pytest.raises(PulsarError, match=r"batch 2: Reshape 'flat' has batch 1 baked into a constant .*"
                                          r"disable_ir_fix is true: patch it with const_processors"):
        reshaped(model, {"x": shape}, batch=2, ir_fix=False, what="batch 2")
    # batch 1 needs no fix: the graph is taken as it is
    same, fixes = reshaped(model, {"x": shape}, batch=1, ir_fix=False, what="batch 1")
    assert fixes == []


def test_reshape_that_folds_the_batch_away_is_an_error_naming_it():
    shape = [1, 2, 4]  # [1, 2, 4] -> [2, 4]: the batch is merged, no rewrite can keep samples apart
    model = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="squeeze_batch")],
                   {"s": np.array([2, 4], np.int64)}, shape)
    with pytest.raises(PulsarError, match=r"Reshape 'squeeze_batch' cannot reshape \[2, 2, 4\] to its constant "
                                          r"shape \[2, 4\].*const_processors"):
        reshaped(model, {"x": shape}, batch=2, ir_fix=True, what="group 0, batch 2")


def test_class_token_concat_is_repeated_to_the_batch():
    shape = [1, 3, 4]
    cls = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    model = _model([helper.make_node("Concat", ["cls", "x"], ["y"], name="cat", axis=1)], {"cls": cls}, shape)
    fixed, fixes = reshaped(model, {"x": shape}, batch=3, ir_fix=True, what="batch 3")
    assert fixes == ["Concat 'cat': constant 'cls' repeated to batch 3"]
    _per_sample_equal(model, fixed, 3, shape)


def test_expanded_constant_gets_the_batch_in_its_shape():
    shape = [1, 3, 4]
    model = _model([helper.make_node("Expand", ["cls", "e"], ["tok"], name="expand"),
                    helper.make_node("Concat", ["tok", "x"], ["y"], name="cat", axis=1)],
                   {"cls": np.ones((1, 1, 4), np.float32), "e": np.array([1, 1, 4], np.int64)}, shape)
    fixed, fixes = reshaped(model, {"x": shape}, batch=2, ir_fix=True, what="batch 2")
    assert fixes == ["Expand 'expand': [1, 1, 4] -> [2, 1, 4] (feeds Concat 'cat')"]
    _per_sample_equal(model, fixed, 2, shape)


def test_extra_shape_a_gemm_cannot_take_names_the_gemm():
    shape = [1, 8]
    model = _model([helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transB=1)],
                   {"w": np.ones((3, 8), np.float32)}, shape)
    with pytest.raises(PulsarError, match=r"group 1, batch 1: node 'fc' \(Gemm\) cannot take these input dims "
                                          r".*src_extra_shapes"):
        reshaped(model, {"x": [1, 12]}, batch=1, ir_fix=True, what="group 1, batch 1")


def test_a_rewrite_that_would_mix_samples_is_caught():
    """[1, 4, 8] -> Transpose -> [4, 1, 8] -> Reshape [1, 32]: dim 0 of the target is 1 but the batch is
    on axis 1 of the Reshape's input; -1 there would interleave samples, and the batched graph is
    compared with single-sample runs."""
    shape = [1, 4, 8]
    model = _model([helper.make_node("Transpose", ["x"], ["t"], name="tr", perm=[1, 0, 2]),
                    helper.make_node("Reshape", ["t", "s"], ["y"], name="flat")],
                   {"s": np.array([1, 32], np.int64)}, shape)
    with pytest.raises(PulsarError, match=r"batch 2: output 'y' of the batched graph differs from single-sample "
                                          r"runs after the IR fix \(Reshape 'flat'.*mixes the samples"):
        reshaped(model, {"x": shape}, batch=2, ir_fix=True, what="batch 2")
