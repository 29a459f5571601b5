"""Each frontend pass on small onnx.helper graphs, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from frontend_graphs import conv_bn_model, make_model, randn, shape_chain_model, tensor
from onnx import TensorProto, helper, numpy_helper

from pulsar.frontend.check import compare_models, random_samples, run
from pulsar.frontend.loader import apply_input_shapes
from pulsar.frontend.pass_manager import op_histogram
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES


def _apply(name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """Run one pass on a copy; the result must still pass the ONNX checker."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    changed = PASSES[name](copy)
    onnx.checker.check_model(copy)
    return copy, changed


def _assert_same(a: onnx.ModelProto, b: onnx.ModelProto, rtol: float = 1e-5) -> None:
    for row in compare_models(a, b):
        assert row["rel_diff"] <= rtol, row


def test_registry_has_the_default_passes():
    assert set(DEFAULT_PASSES) <= set(PASSES)
    assert DEFAULT_PASSES[0] == "constant_to_initializer" and DEFAULT_PASSES[-1] == "eliminate_dead_nodes"


# --- constant_to_initializer --------------------------------------------------------------------


def _constant_kinds_model() -> onnx.ModelProto:
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([5.0, 7.0], np.float32), "sv"),
        numpy_helper.from_array(np.array([1, 4], np.int64), "si"),
        [2, 3],
    )
    constants = [
        helper.make_node("Constant", [], ["k_tensor"], value=numpy_helper.from_array(randn(2, 3))),
        helper.make_node("Constant", [], ["k_float"], value_float=1.5),
        helper.make_node("Constant", [], ["k_floats"], value_floats=[1.0, 2.0, 3.0]),
        helper.make_node("Constant", [], ["k_int"], value_int=3),
        helper.make_node("Constant", [], ["k_ints"], value_ints=[2, 3]),
        helper.make_node("Constant", [], ["k_sparse"], sparse_value=sparse),
        helper.make_node("Constant", [], ["k_string"], value_string="hello"),
        helper.make_node("Constant", [], ["k_strings"], value_strings=["a", "bc"]),
    ]
    nodes = [
        *constants,
        helper.make_node("Add", ["x", "k_tensor"], ["a1"]),
        helper.make_node("Mul", ["a1", "k_float"], ["a2"]),
        helper.make_node("Add", ["a2", "k_floats"], ["a3"]),
        helper.make_node("Add", ["a3", "k_sparse"], ["a4"]),
        helper.make_node("Reshape", ["a4", "k_ints"], ["a5"]),
        helper.make_node("Cast", ["k_int"], ["k_int_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["a5", "k_int_f"], ["y"]),
        helper.make_node("Identity", ["k_string"], ["s"]),
        helper.make_node("Identity", ["k_strings"], ["ss"]),
    ]
    return make_model(
        nodes,
        [tensor("x", [2, 3])],
        [tensor("y", [2, 3]), tensor("s", [], TensorProto.STRING), tensor("ss", [2], TensorProto.STRING)],
    )


def test_constant_to_initializer_all_value_kinds():
    model = _constant_kinds_model()
    new, changed = _apply("constant_to_initializer", model)
    assert changed
    assert "Constant" not in op_histogram(new)
    inits = {t.name: numpy_helper.to_array(t) for t in new.graph.initializer}
    np.testing.assert_array_equal(inits["k_sparse"], [[0, 5, 0], [0, 7, 0]])
    assert inits["k_int"].dtype == np.int64 and inits["k_floats"].dtype == np.float32
    assert list(inits["k_strings"]) == ["a", "bc"]
    _assert_same(model, new, rtol=0)
    assert not PASSES["constant_to_initializer"](new)  # idempotent


def test_constant_feeding_a_graph_output_stays_a_node():
    node = helper.make_node("Constant", [], ["y"], value_floats=[1.0, 2.0])
    model = make_model([node], [], [tensor("y", [2])])
    _, changed = _apply("constant_to_initializer", model)
    assert not changed


# --- fold_constants -----------------------------------------------------------------------------


def test_fold_shape_chain_into_static_reshape():
    model = apply_input_shapes(shape_chain_model(), {"x": [2, 3, 4, 5]})
    new, changed = _apply("fold_constants", model)
    assert changed
    assert op_histogram(new) == {"Relu": 1, "Reshape": 1}
    inits = {t.name: numpy_helper.to_array(t) for t in new.graph.initializer}
    reshape = new.graph.node[-1]
    np.testing.assert_array_equal(inits[reshape.input[1]], [2, -1])
    _assert_same(model, new, rtol=0)


def test_shape_of_dynamic_tensor_is_not_folded():
    new, changed = _apply("fold_constants", shape_chain_model())
    assert not changed
    assert op_histogram(new)["Shape"] == 1


def test_shape_start_end_and_size_are_folded():
    nodes = [
        helper.make_node("Shape", ["x"], ["hw"], start=2, end=-1),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Cast", ["hw"], ["hwf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["hwf", "nf"], ["p"]),
        helper.make_node("ReduceSum", ["x"], ["r"], keepdims=0),
        helper.make_node("Add", ["p", "r"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x", [1, 2, 3, 4])], [tensor("y", [1])])
    new, changed = _apply("fold_constants", model)
    assert changed
    assert op_histogram(new) == {"ReduceSum": 1, "Add": 1}
    inits = {t.name: numpy_helper.to_array(t) for t in new.graph.initializer}
    np.testing.assert_array_equal(inits["p"], [72.0])  # H (3) * numel (24)
    _assert_same(model, new, rtol=0)


@pytest.mark.parametrize(("shape", "folded"), [([4, 8], True), ([2000, 1000], False)])
def test_fold_constants_skips_big_expansions(shape, folded):
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["big"], value=numpy_helper.from_array(np.ones(1, np.float32))
        ),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x", [1])], [tensor("y", [1])], {"shape": np.array(shape, np.int64)})
    new, changed = _apply("fold_constants", model)
    assert changed is folded
    assert ("ConstantOfShape" in op_histogram(new)) is not folded
    _assert_same(model, new)


def test_fold_constants_keeps_random_and_output_nodes():
    nodes = [
        helper.make_node("RandomNormal", [], ["noise"], shape=[2], seed=1.0),
        helper.make_node("Neg", ["c"], ["y"]),
        helper.make_node("Add", ["x", "noise"], ["z"]),
    ]
    model = make_model(nodes, [tensor("x", [2])], [tensor("y", [2]), tensor("z", [2])], {"c": randn(2)})
    new, changed = _apply("fold_constants", model)
    assert not changed
    assert op_histogram(new) == {"RandomNormal": 1, "Neg": 1, "Add": 1}


# --- remove_identity ----------------------------------------------------------------------------


def test_identity_chain_before_output_keeps_output_name():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["i1"]),
        helper.make_node("Identity", ["i1"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x", [2, 3])], [tensor("y", [2, 3])])
    new, changed = _apply("remove_identity", model)  # the whole chain goes in one sweep
    assert changed
    assert [n.op_type for n in new.graph.node] == ["Relu"]
    assert new.graph.node[0].output[0] == "y" and new.graph.output[0].name == "y"
    _assert_same(model, new, rtol=0)


def test_noop_dropout_cast_reshape_removed():
    nodes = [
        helper.make_node("Dropout", ["x"], ["d"], name="drop"),
        helper.make_node("Cast", ["d"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["c", "same"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 1]),
        helper.make_node("Relu", ["t"], ["y"]),
        helper.make_node("Cast", ["y"], ["y16"], to=TensorProto.FLOAT16),  # a real cast stays
    ]
    model = make_model(
        nodes,
        [tensor("x", [2, 3])],
        [tensor("y", [2, 3]), tensor("y16", [2, 3], TensorProto.FLOAT16)],
        {"same": np.array([2, -1], np.int64)},
    )
    new, changed = _apply("remove_identity", model)
    assert changed
    assert [n.op_type for n in new.graph.node] == ["Relu", "Cast"]
    assert [o.name for o in new.graph.output] == ["y", "y16"]
    _assert_same(model, new, rtol=0)


def test_dropout_with_used_mask_and_input_passthrough_kept():
    nodes = [
        helper.make_node("Dropout", ["x"], ["d", "mask"]),
        helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["d", "m"], ["y"]),
        helper.make_node("Identity", ["x"], ["z"]),  # input straight to output: nothing to rewire
    ]
    model = make_model(nodes, [tensor("x", [2])], [tensor("y", [2]), tensor("z", [2])])
    _, changed = _apply("remove_identity", model)
    assert not changed


# --- fold_batchnorm -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"bias": False},
        {"cin": 8, "cout": 8, "group": 8},  # depthwise
        {"cin": 4, "cout": 6, "group": 2, "bias": False},  # grouped
        {"transpose": True},
        {"cin": 4, "cout": 6, "group": 2, "transpose": True},
    ],
    ids=["conv", "conv-no-bias", "depthwise", "grouped", "conv-transpose", "grouped-conv-transpose"],
)
def test_fold_batchnorm_matches_onnxruntime(kwargs):
    model = conv_bn_model(**kwargs)
    new, changed = _apply("fold_batchnorm", model)
    assert changed
    assert "BatchNormalization" not in op_histogram(new)
    conv = new.graph.node[0]
    assert conv.output[0] == "n" and len(conv.input) == 3
    _assert_same(model, new, rtol=1e-5)


def test_fold_batchnorm_skips_conv_with_other_readers():
    model = conv_bn_model()
    model.graph.node.append(helper.make_node("Neg", ["c"], ["z"]))
    model.graph.output.append(tensor("z", [1, 8, 8, 8]))
    _, changed = _apply("fold_batchnorm", model)
    assert not changed


def test_fold_batchnorm_shared_weight_gets_new_name():
    model = conv_bn_model()
    model.graph.node.append(helper.make_node("Conv", ["x", "w"], ["c2"], pads=[1] * 4))
    model.graph.output.append(tensor("c2", [1, 8, 8, 8]))
    new, changed = _apply("fold_batchnorm", model)
    assert changed
    assert new.graph.node[0].input[1] != "w" and new.graph.node[-1].input[1] == "w"
    _assert_same(model, new, rtol=1e-5)


# --- eliminate_dead_nodes -----------------------------------------------------------------------


def test_eliminate_dead_nodes():
    nodes = [
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Mul", ["x", "unused_w"], ["dead1"]),
        helper.make_node("Neg", ["dead1"], ["dead2"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", [2]), tensor("extra", [2])],
        [tensor("y", [2])],
        {"unused_w": randn(2), "orphan": randn(3)},
    )
    model.graph.value_info.append(tensor("dead2", [2]))
    new, changed = _apply("eliminate_dead_nodes", model)
    assert changed
    assert [n.op_type for n in new.graph.node] == ["Relu"]
    assert not new.graph.initializer and not new.graph.value_info
    assert [i.name for i in new.graph.input] == ["x", "extra"]  # the interface is kept
    _, again = _apply("eliminate_dead_nodes", new)
    assert not again


def test_random_samples_follow_input_dtypes():
    model = make_model(
        [helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT)],
        [tensor("ids", ["N", 5], TensorProto.INT64)],
        [tensor("y", ["N", 5])],
    )
    samples = random_samples(model, count=2, seed=3)
    assert len(samples) == 2 and samples[0]["ids"].dtype == np.int64 and samples[0]["ids"].shape == (1, 5)
    out = run(model, samples)
    np.testing.assert_array_equal(out[1]["y"], samples[1]["ids"].astype(np.float32))
