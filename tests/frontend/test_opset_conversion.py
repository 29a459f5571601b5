"""Opset conversion keeps the model's interface, and ends at an opset onnxruntime runs Q/DQ at."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from frontend_graphs import tensor
from onnx import helper

import pulsar.frontend.loader as loader
from pulsar.errors import PulsarError
from pulsar.frontend.loader import TARGET_OPSET, default_opset, load_model
from pulsar.frontend.ort_opset import max_qdq_opset, ort_loads_qdq, qdq_probe_model


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _interface(model: onnx.ModelProto) -> list[tuple[str, int, list[int]]]:
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*model.graph.input, *model.graph.output]]


def _scan8_model(batch: int = 1, *, ir_version: int = 3, feed_through_relu: bool = False,
                 other_readers: bool = False) -> onnx.ModelProto:
    """Opset-8 Scan: a running sum over the 3 steps of x, with Scan-8's leading batch axis."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y_t"])],
        "body", [tensor("s_in", [2]), tensor("x_t", [2])], [tensor("s_out", [2]), tensor("y_t", [2])])
    nodes = []
    state, seq = "init", "x"
    if feed_through_relu:  # the Scan's inputs are made by other nodes, not graph inputs
        nodes += [helper.make_node("Relu", ["init"], ["init_r"]), helper.make_node("Relu", ["x"], ["x_r"])]
        state, seq = "init_r", "x_r"
    nodes.append(helper.make_node("Scan", ["", state, seq], ["s", "y"], num_scan_inputs=1, body=body))
    outputs = [tensor("s", [batch, 2]), tensor("y", [batch, 3, 2])]
    if other_readers:  # ops besides the Scan read its graph input and output with the batch axis
        nodes += [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["y"], ["n"])]
        outputs += [tensor("r", [batch, 3, 2]), tensor("n", [batch, 3, 2])]
    graph = helper.make_graph(nodes, "scan8", [tensor("init", [batch, 2]), tensor("x", [batch, 3, 2])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=ir_version)


# --- up-conversion keeps the interface -----------------------------------------------------------


@pytest.mark.parametrize(("ir_version", "other_readers"), [(3, False), (7, False), (7, True)],
                         ids=["ir3", "ir7", "ir7-other-readers"])
def test_scan8_keeps_input_and_output_shapes(tmp_path, ir_version, other_readers):
    original = _scan8_model(ir_version=ir_version, other_readers=other_readers)
    loaded = load_model(_save(original, tmp_path / "scan8.onnx"))
    assert default_opset(loaded) == TARGET_OPSET
    assert _interface(loaded) == _interface(original)
    onnx.checker.check_model(loaded, full_check=True)
    feeds = {"init": np.array([[0.5, -1.0]], np.float32),
             "x": np.arange(6, dtype=np.float32).reshape(1, 3, 2)}
    want = _run(original, feeds)
    got = _run(loaded, feeds)
    expected_y = feeds["init"][:, None, :] + np.cumsum(feeds["x"], axis=1)
    np.testing.assert_allclose(want[1], expected_y)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w)


def test_scan8_with_batch_above_one_is_refused(tmp_path):
    path = _save(_scan8_model(batch=2), tmp_path / "scan8_b2.onnx")
    with pytest.raises(PulsarError) as err:
        load_model(path)
    message = str(err.value)
    assert "scan8_b2.onnx" in message
    assert "graph input 'init' from shape [2, 2] to [2]" in message
    assert "opset_version=17" in message


def test_scan8_fed_by_other_nodes_is_refused_not_miscompiled(tmp_path):
    # The converter relabels the Scan's input shapes without changing the data: the checker refuses it.
    path = _save(_scan8_model(feed_through_relu=True), tmp_path / "scan8_inner.onnx")
    with pytest.raises(PulsarError, match="fails the ONNX checker") as err:
        load_model(path)
    assert "scan8_inner.onnx" in str(err.value) and "opset_version=17" in str(err.value)


# --- down-conversion to an opset onnxruntime runs Q/DQ at -----------------------------------------


def test_probe_is_cached_and_loads_at_its_answer():
    limit = max_qdq_opset()
    assert limit is not None and limit >= TARGET_OPSET
    assert max_qdq_opset() == limit and max_qdq_opset.cache_info().hits >= 1
    assert ort_loads_qdq(limit)
    if limit < onnx.defs.onnx_opset_version():
        assert not ort_loads_qdq(limit + 1)
    onnx.checker.check_model(qdq_probe_model(limit))


def test_newest_opset_model_ends_where_onnxruntime_runs_qdq(tmp_path):
    newest = onnx.defs.onnx_opset_version()
    graph = helper.make_graph([helper.make_node("Celu", ["x"], ["y"], alpha=2.0)], "celu",
                              [tensor("x", [1, 4])], [tensor("y", [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", newest)])
    loaded = load_model(_save(model, tmp_path / "celu.onnx"))
    opset = default_opset(loaded)
    assert opset == min(newest, max_qdq_opset())
    assert ort_loads_qdq(opset)
    assert _interface(loaded) == _interface(model)
    x = np.array([[-2.0, -0.5, 0.0, 3.0]], np.float32)
    np.testing.assert_allclose(_run(loaded, {"x": x})[0], np.where(x > 0, x, 2.0 * np.expm1(x / 2.0)), rtol=1e-6)


def test_down_conversion_to_the_probed_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "max_qdq_opset", lambda: 19)
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [tensor("x", [2])], [tensor("y", [2])]),
        opset_imports=[helper.make_opsetid("", 21)])
    loaded = load_model(_save(model, tmp_path / "relu21.onnx"))
    assert default_opset(loaded) == 19
    assert [n.op_type for n in loaded.graph.node] == ["Relu"]  # an unchanged interface needs no Squeeze
    assert _interface(loaded) == _interface(model)
    model.opset_import[0].version = 19
    assert default_opset(load_model(_save(model, tmp_path / "relu19.onnx"))) == 19  # at the limit: kept


def test_failed_down_conversion_keeps_the_model_and_warns(tmp_path, monkeypatch, caplog):
    # Refusing would break models that build without Q/DQ on the CPU; the warning names the fix.
    monkeypatch.setattr(loader, "max_qdq_opset", lambda: 22)
    # Attention first appears in opset 23: there is nothing to convert it down to.
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    graph = helper.make_graph([node], "attn", [tensor(n, [1, 2, 4, 8]) for n in "qkv"],
                              [tensor("y", [1, 2, 4, 8])])
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), tmp_path / "attn.onnx")
    with caplog.at_level(logging.WARNING, logger="pulsar.frontend.loader"):
        loaded = load_model(path)
    assert default_opset(loaded) == 23
    message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "attn.onnx" in message and "converting opset 23 to 22 failed" in message
    assert "opset_version=22" in message and "kept at opset 23" in message
