"""onnx_opt.enable_onnxsim: onnxsim (default) or onnxslim before the passes, and the fallback when
the simplifier fails or changes the model."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxsim
import pytest
from frontend_graphs import conv_bn_model, shape_chain_model
from onnx import numpy_helper

import pulsar
from pulsar.errors import PulsarError
from pulsar.frontend import simplify as simplify_module
from pulsar.frontend.loader import apply_input_shapes
from pulsar.frontend.pass_manager import compare_models, op_histogram
from pulsar.frontend.simplify import SIMPLIFIERS, simplify


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(path).graph.node}


@pytest.mark.parametrize("tool", list(SIMPLIFIERS))
def test_simplifiers_fold_a_shape_chain_and_keep_outputs(tool):
    model = apply_input_shapes(shape_chain_model(), {"x": [1, 3, 4, 4]})
    result = simplify(model, tool)
    assert result.fallback is None and result.tool == tool
    assert "Shape" not in op_histogram(result.model)
    assert result.nodes_before == 6 and result.nodes_after == len(result.model.graph.node) < 6
    assert all(n.name for n in result.model.graph.node)
    assert compare_models(model, result.model)[0]["rel_diff"] == 0.0
    assert len(model.graph.node) == 6  # the caller's model is untouched


def test_onnxsim_provenance_metadata_is_dropped():
    model = conv_bn_model()
    model.metadata_props.add(key="author", value="me")
    result = simplify(model, "onnxsim")
    assert "BatchNormalization" not in op_histogram(result.model)
    assert {p.key: p.value for p in result.model.metadata_props} == {"author": "me"}


def test_simplifier_exception_falls_back_to_the_original_graph(monkeypatch, caplog):
    """No real model is known to make onnxsim 0.8 raise while onnxruntime runs it, so the failure is
    injected, worded like a real one (onnx-optimizer assertion, onnxsim issue tracker)."""

    def broken(*_args, **_kwargs):
        raise RuntimeError("eliminate_shape_gather.h:48: runTransform: Assertion 'indices_val < dims.size()' failed.")

    monkeypatch.setattr(onnxsim, "simplify", broken)
    model = conv_bn_model()
    with caplog.at_level(logging.WARNING, "pulsar.frontend.simplify"):
        result = simplify(model, "onnxsim", model_name="net.onnx")
    assert result.model is model and result.nodes_after == result.nodes_before
    assert "RuntimeError" in result.fallback and "indices_val" in result.fallback
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "onnxsim failed" in record.message and "net.onnx" in record.message
    assert "unsimplified graph" in record.message and "onnx_opt.simplifier: onnxslim" in record.message


def test_simplifier_that_changes_the_numbers_is_not_used(monkeypatch, caplog):
    def wrong(model: onnx.ModelProto) -> onnx.ModelProto:
        w = next(t for t in model.graph.initializer if t.name == "w")
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.01, "w"))
        return model

    monkeypatch.setitem(SIMPLIFIERS, "onnxslim", wrong)
    model = conv_bn_model()
    with caplog.at_level(logging.WARNING, "pulsar.frontend.simplify"):
        result = simplify(model, "onnxslim", model_name="net.onnx")
    assert result.model is model
    assert "not equivalent" in result.fallback and '"y" differs' in result.fallback
    assert "net.onnx" in caplog.text and "may work" not in caplog.text
    # with the check off, the (wrong) result is taken as it is: the user asked for no check
    assert simplify(model, "onnxslim", check=False).fallback is None


def test_simplifier_that_renames_an_output_is_not_used(monkeypatch):
    def rename(model: onnx.ModelProto) -> onnx.ModelProto:
        model.graph.output[0].name = "renamed"
        model.graph.node[-1].output[0] = "renamed"
        return model

    monkeypatch.setitem(SIMPLIFIERS, "onnxsim", rename)
    result = simplify(conv_bn_model(), "onnxsim")
    assert result.fallback and "changed the graph outputs" in result.fallback


def test_unknown_simplifier_is_a_bug_not_a_user_error():
    with pytest.raises(ValueError, match="unknown simplifier"):
        simplify(conv_bn_model(), "onnx-magic")


# --------------------------------------------------------------------------------------------------
# Builds on the tiny CNN (Conv + BatchNormalization + Identity ...)
# --------------------------------------------------------------------------------------------------


def _build(tmp_path, tiny, config, overrides, name="out"):
    res = pulsar.build(tiny["model"], tmp_path / name, config, overrides, quiet=True)
    return res, (tmp_path / name / "build.log").read_text()


def test_build_with_enable_onnxsim_runs_onnxsim(tmp_path, tiny, tiny_config):
    """With pulsar's passes off, only onnxsim can have folded the BatchNormalization and Identity."""
    off = {"onnx_opt.disable_onnx_optimization": True}
    plain, _ = _build(tmp_path, tiny, tiny_config, off, "plain")
    assert {"BatchNormalization", "Identity"} <= _ops(plain.optimized_model)
    res, log = _build(tmp_path, tiny, tiny_config, {**off, "onnx_opt.enable_onnxsim": True}, "sim")
    assert not {"BatchNormalization", "Identity"} & _ops(res.optimized_model)
    assert "onnxsim simplified tiny.onnx: 11 -> 9 nodes" in log
    passes_table = log.split("Passes that changed the graph")[1].split(" INFO ")[0]
    assert "onnxsim" in passes_table  # the simplifier is listed with the passes that changed the graph
    assert "onnxslim" not in log
    assert not [p for p in onnx.load(res.optimized_model).metadata_props if p.key.startswith("onnxsim.")]


def test_build_with_simplifier_onnxslim(tmp_path, tiny, tiny_config):
    res, log = _build(tmp_path, tiny, tiny_config, {"onnx_opt.enable_onnxsim": True,
                                                    "onnx_opt.simplifier": "onnxslim"})
    assert "onnxslim simplified tiny.onnx" in log
    assert "BatchNormalization" not in _ops(res.optimized_model)


def test_build_falls_back_when_onnxsim_fails(tmp_path, tiny, tiny_config, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("[ShapeInferenceError] Inferred shape and existing shape differ in rank: (3) vs (0)")

    monkeypatch.setattr(onnxsim, "simplify", broken)
    res, log = _build(tmp_path, tiny, tiny_config, {"onnx_opt.enable_onnxsim": True})
    assert "onnxsim failed (RuntimeError: [ShapeInferenceError]" in log and "tiny.onnx" in log
    assert "continuing with the unsimplified graph" in log
    assert "WARNING" in log.split("onnxsim failed")[0].splitlines()[-1]
    # pulsar's own passes still ran on the unsimplified graph, and the build finished
    assert not {"BatchNormalization", "Identity"} & _ops(res.optimized_model)
    assert res.compiled_model.is_file()


def test_simplifier_without_enable_onnxsim_warns_and_is_reset(tiny_config):
    from pulsar.config import load_build_config

    eff = load_build_config(tiny_config, {"onnx_opt.simplifier": "onnxslim"}, require_io=False)
    assert eff.data["onnx_opt"]["simplifier"] == "onnxsim"  # what runs: nothing, so the default is shown
    assert len(eff.warnings) == 1
    assert "simplifier" in eff.warnings[0] and "onnx_opt.enable_onnxsim" in eff.warnings[0]


def test_enable_onnxsim_is_rejected_for_quantonnx_input(tmp_path, tiny, tiny_config):
    first, _ = _build(tmp_path, tiny, tiny_config, {"compiler.check": 0}, "first")
    with pytest.raises(PulsarError, match=r"onnx_opt\.enable_onnxsim: a QuantONNX model"):
        pulsar.build(first.quantized_model, tmp_path / "again", tiny_config,
                     {"model_type": "QuantONNX", "onnx_opt.enable_onnxsim": True}, quiet=True)


def test_simplify_module_names_the_default():
    assert simplify_module.DEFAULT_SIMPLIFIER == "onnxsim"
    schema_default = pulsar.config.schema.load_schema()["$defs"]["OnnxOptConfig"]["properties"]["simplifier"]
    assert schema_default["default"] == simplify_module.DEFAULT_SIMPLIFIER
    assert schema_default["enum"] == list(SIMPLIFIERS)


def test_simplified_model_runs_the_same_on_real_shapes():
    """conv_bn: onnxsim folds BatchNormalization into the Conv; the numbers stay within the check."""
    model = conv_bn_model()
    result = simplify(model, "onnxsim")
    x = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    assert compare_models(model, result.model, [x])[0]["rel_diff"] < 1e-5
