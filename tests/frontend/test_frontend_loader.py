"""Loading models, opset conversion, node naming, input_shapes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from frontend_graphs import conv_bn_model, make_model, randn, shape_chain_model, tensor
from onnx import TensorProto, helper

from pulsar.errors import PulsarError
from pulsar.frontend.check import compare_models
from pulsar.frontend.loader import (
    TARGET_OPSET,
    apply_input_shapes,
    default_opset,
    infer_shapes,
    load_model,
    parse_input_shapes,
    require_static_inputs,
)


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


# --- load_model errors -----------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(PulsarError, match="does not exist") as err:
        load_model(tmp_path / "nope.onnx")
    assert "nope.onnx" in str(err.value)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(PulsarError, match="not a file"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "content", [b"this is not onnx at all\n", bytes(range(256)) * 4], ids=["text", "bytes"]
)
def test_corrupt_bytes(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(PulsarError, match="not a valid ONNX model") as err:
        load_model(path)
    assert "bad.onnx" in str(err.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(PulsarError, match="empty"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_truncated_file(tmp_path, keep):
    data = conv_bn_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(PulsarError, match="cut.onnx.*(truncated|no ONNX graph|checker)"):
        load_model(path)


def test_checker_failure_names_file_and_reason(tmp_path):
    # A node reading a tensor nobody defines: the checker rejects the graph.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["ghost"], ["y"])], "g", [tensor("x", [1])], [tensor("y", [1])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = _save(model, tmp_path / "broken.onnx")
    with pytest.raises(PulsarError, match="broken.onnx fails the ONNX checker") as err:
        load_model(path)
    assert "ghost" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_external_data(tmp_path):
    model = conv_bn_model()
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    (tmp_path / "ext.bin").unlink()
    with pytest.raises(PulsarError, match="external weight data"):
        load_model(path)


def test_external_data_is_loaded(tmp_path):
    model = conv_bn_model()
    expected = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    assert (tmp_path / "ext.bin").stat().st_size > 0
    loaded = load_model(path)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value)


# --- opset conversion and naming --------------------------------------------------------------


def _opset11_model() -> onnx.ModelProto:
    """Ops whose signature changed after opset 11: Softmax, Squeeze/Unsqueeze axes, ReduceSum axes, Split."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Softmax", ["c"], ["s"], axis=1),
        helper.make_node("Unsqueeze", ["s"], ["u"], axes=[0]),
        helper.make_node("Squeeze", ["u"], ["q"], axes=[0]),
        helper.make_node("Split", ["q"], ["p0", "p1"], axis=1, split=[2, 2]),
        helper.make_node("ReduceSum", ["p0"], ["y"], axes=[2], keepdims=0),
        helper.make_node("Clip", ["p1", "lo", "hi"], ["z"]),
    ]
    inits = {"w": randn(4, 3, 3, 3), "lo": np.array(0.0, np.float32), "hi": np.array(0.02, np.float32)}
    graph = helper.make_graph(
        nodes,
        "old",
        [tensor("x", [1, 3, 6, 6])],
        [tensor("y", [1, 2, 6]), tensor("z", [1, 2, 6, 6])],
        initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def test_opset11_converted_to_17_and_still_matches(tmp_path):
    original = _opset11_model()
    loaded = load_model(_save(original, tmp_path / "old.onnx"))
    assert default_opset(loaded) == TARGET_OPSET == 17
    rows = compare_models(original, loaded)
    assert [r["output"] for r in rows] == ["y", "z"]
    for row in rows:
        assert row["rel_diff"] <= 1e-6, row


def test_newer_opset_is_kept(tmp_path):
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [tensor("x", [2])], [tensor("y", [2])], opset=18
    )
    assert default_opset(load_model(_save(model, tmp_path / "m.onnx"))) == 18


def test_unnamed_nodes_get_unique_names(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"], name="Relu_0"),  # clashes with the generated name
        helper.make_node("Neg", ["b"], ["c"]),
        helper.make_node("Neg", ["c"], ["y"], name="Relu_0"),  # a repeated name
    ]
    model = make_model(nodes, [tensor("x", [2])], [tensor("y", [2])])
    names = [n.name for n in load_model(_save(model, tmp_path / "m.onnx")).graph.node]
    assert all(names) and len(set(names)) == 4
    assert names[1] == "Relu_0"  # an existing, unique-so-far name is kept
    assert names[0].startswith("Relu_0_") and names[2] == "Neg_2"


# --- input_shapes -----------------------------------------------------------------------------


def test_parse_input_shapes():
    assert parse_input_shapes("a:1x3x224x224;b:1x16") == {"a": [1, 3, 224, 224], "b": [1, 16]}
    assert parse_input_shapes("") == {}
    assert parse_input_shapes(" x : 1x3 ; ") == {"x": [1, 3]}
    assert parse_input_shapes("input:0:1x8") == {"input:0": [1, 8]}


@pytest.mark.parametrize("text", ["x=1x3", "x:1x3x", "x:1,3", ":1x3", "x:axb", "x:0x3", "x:1x3;x:1x3"])
def test_parse_input_shapes_errors(text):
    with pytest.raises(PulsarError, match="input_shapes") as err:
        parse_input_shapes(text)
    message = str(err.value)
    assert "x" in message
    if "twice" not in message:
        assert "expected" in message or "positive" in message


def test_apply_input_shapes_fixes_dims_and_reinfers():
    model = shape_chain_model()
    # Stale annotations carrying the old symbolic dims must not survive.
    model.graph.value_info.append(tensor("r", ["N", 3, "H", "W"]))
    fixed = apply_input_shapes(model, {"x": [2, 3, 4, 5]})
    dims = [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, 4, 5]
    out_dims = [d.dim_value for d in fixed.graph.output[0].type.tensor_type.shape.dim]
    assert out_dims == [2, 60]
    r_info = [vi for vi in fixed.graph.value_info if vi.name == "r"]
    assert [d.dim_value for d in r_info[0].type.tensor_type.shape.dim] == [2, 3, 4, 5]
    require_static_inputs(fixed)


def test_apply_input_shapes_unknown_input_did_you_mean():
    model = make_model(
        [helper.make_node("Relu", ["input"], ["y"])], [tensor("input", ["N"])], [tensor("y", ["N"])]
    )
    with pytest.raises(PulsarError, match='no input "inptu" \\(did you mean "input"\\?\\)'):
        apply_input_shapes(model, {"inptu": [1]})


def test_apply_input_shapes_rank_and_fixed_dim_mismatch():
    with pytest.raises(PulsarError, match='input "x" has rank 4'):
        apply_input_shapes(shape_chain_model(), {"x": [1, 3, 4]})
    with pytest.raises(PulsarError, match='input "x" has fixed dim 1 = 3'):
        apply_input_shapes(shape_chain_model(), {"x": [1, 4, 4, 4]})


def test_require_static_inputs_names_input_and_field():
    with pytest.raises(PulsarError, match='"x" \\[\\?, 3, \\?, \\?\\].*`input_shapes`.*x:1x3xNxN'):
        require_static_inputs(shape_chain_model())


def test_infer_shapes_never_raises():
    # onnx raises on an op whose domain the model does not import; infer_shapes must not.
    node = helper.make_node("Mystery", ["x"], ["m"], domain="example.custom")
    graph = helper.make_graph(
        [node, helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [tensor("x", [2, 3])],
        [tensor("y", [2, 3]), tensor("m", [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    assert infer_shapes(model) is model


def test_infer_shapes_propagates_through_shape_ops():
    model = apply_input_shapes(shape_chain_model(), {"x": [1, 3, 8, 8]})
    inferred = infer_shapes(model)
    target = [vi for vi in inferred.graph.value_info if vi.name == "target"]
    assert target and target[0].type.tensor_type.elem_type == TensorProto.INT64


def test_the_checker_verdict_comes_before_later_steps_errors(tmp_path):
    """The checker runs before the conversion; a model it refuses is reported as that even when a later
    step (here the opset conversion of a graph whose node reads nothing) would fail too."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["ghost"], ["y"])], "g", [tensor("x", [1])], [tensor("y", [1])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)
    path = _save(model, tmp_path / "old_broken.onnx")
    with pytest.raises(PulsarError, match="old_broken.onnx fails the ONNX checker") as err:
        load_model(path)
    assert "ghost" in str(err.value) and "\n" not in str(err.value)


def _big_weight_model(weight: TensorProto, reads: str = "w") -> onnx.ModelProto:
    """y = x + w with w a 128 KiB initializer: over the size the loader checks itself (64 KiB)."""
    graph = helper.make_graph([helper.make_node("Add", ["x", reads], ["y"])], "g", [tensor("x", [256, 128])],
                              [tensor("y", [256, 128])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_large_weights_pass_the_check_and_keep_their_values(tmp_path):
    w = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    path = _save(_big_weight_model(onnx.numpy_helper.from_array(w, "w")), tmp_path / "big.onnx")
    model = load_model(path)
    (init,) = model.graph.initializer
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), w)
    assert [i.name for i in model.graph.input] == ["x"]  # checked as an input, loaded as the initializer


def test_large_weight_with_too_few_raw_bytes_fails_the_check(tmp_path):
    raw = np.zeros(256 * 128 - 1, np.float32).tobytes()  # one float short of its shape
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[256, 128], raw_data=raw)
    path = _save(_big_weight_model(weight), tmp_path / "short.onnx")
    with pytest.raises(PulsarError, match="short.onnx fails the ONNX checker") as err:
        load_model(path)
    assert "tensor name: w" in str(err.value) and f"({len(raw)} bytes)" in str(err.value)
    assert f"({256 * 128 * 4} bytes required)" in str(err.value) and "\n" not in str(err.value)


def test_large_weight_with_two_value_fields_fails_the_check(tmp_path):
    weight = onnx.numpy_helper.from_array(np.zeros((256, 128), np.float32), "w")
    weight.float_data.extend([1.0])  # raw bytes and a typed field: the checker's own rule
    path = _save(_big_weight_model(weight), tmp_path / "two.onnx")
    with pytest.raises(PulsarError, match="two.onnx fails the ONNX checker.*one and only one value field"):
        load_model(path)


def test_graph_errors_are_found_next_to_large_weights(tmp_path):
    weight = onnx.numpy_helper.from_array(np.zeros((256, 128), np.float32), "w")
    path = _save(_big_weight_model(weight, reads="ghost"), tmp_path / "ghost.onnx")
    with pytest.raises(PulsarError, match="ghost.onnx fails the ONNX checker.*ghost"):
        load_model(path)


def test_large_weights_of_an_ir3_model_must_be_graph_inputs(tmp_path):
    weight = onnx.numpy_helper.from_array(np.zeros((256, 128), np.float32), "w")
    model = _big_weight_model(weight)
    model.ir_version = 3  # before IR 4 every initializer is also a graph input
    model.opset_import[0].version = 8
    path = _save(model, tmp_path / "ir3.onnx")
    with pytest.raises(PulsarError, match="ir3.onnx fails the ONNX checker.*w.*graph input"):
        load_model(path)


def test_large_weights_with_one_name_twice_fail_the_check(tmp_path):
    weight = onnx.numpy_helper.from_array(np.zeros((256, 128), np.float32), "w")
    model = _big_weight_model(weight)
    model.graph.initializer.append(weight)
    path = _save(model, tmp_path / "twice.onnx")
    with pytest.raises(PulsarError, match="twice.onnx fails the ONNX checker.*w.*not unique"):
        load_model(path)


def test_the_checker_sees_large_weights_as_typed_inputs(monkeypatch):
    """What reaches onnx's checker: the graph without the 128 KiB of weight bytes (a model in memory,
    not the file), the weight as a typed input."""
    seen = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: seen.append(m))
    weight = onnx.numpy_helper.from_array(np.zeros((256, 128), np.float32), "w")
    from pulsar.frontend.loader import check_model_light

    check_model_light(_big_weight_model(weight), "m.onnx")
    (checked,) = seen
    assert isinstance(checked, onnx.ModelProto) and not checked.graph.initializer
    assert [i.name for i in checked.graph.input] == ["x", "w"] and checked.ByteSize() < 4096
