"""Active / passive / manual placement: why each op runs where it does, and moving a manual op."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import pulsar


def _attention_like(path):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "wq"),
             numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "wo"),
             numpy_helper.from_array(np.array([1, 4, 2, 8], np.int64), "shape4")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="proj"),
             helper.make_node("Softmax", ["q"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "wo"], ["o"], name="out_proj"),
             helper.make_node("Reshape", ["o", "shape4"], ["y"], name="split_heads")]
    graph = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 8])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _build(tmp_path, name, layer_configs=()):
    model = _attention_like(tmp_path / "attn.onnx")
    calib = tmp_path / "calib"
    calib.mkdir(exist_ok=True)
    for i in range(4):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 8, 8)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}], "layer_configs": list(layer_configs)}}
    res = pulsar.build(model, tmp_path / name, cfg, {"compiler.check": 2}, quiet=True)
    return json.loads(res.quant_config.read_text()), (tmp_path / name / "build.log").read_text()


def test_manual_op_stays_on_cpu_with_reason_and_passive_op_shares_scale(tmp_path):
    q, log = _build(tmp_path, "default")
    assert q["nodes"]["softmax"]["placement"] == "CPU"
    assert '"op_type": "Softmax", "data_type": "U16"' in q["nodes"]["softmax"]["placement_reason"]
    assert "Ops on the CPU" in log and "manual op" in log
    assert q["tensors"]["p"]["dtype"] == "U8"  # the float Softmax output is quantized where out_proj reads it
    # The Reshape after a quantized MatMul runs on the NPU and shares its input's grid.
    assert q["nodes"]["split_heads"]["placement"] == "NPU"
    y, o = q["tensors"]["y"], q["tensors"]["o"]
    assert y["state"] == "OVERLAPPED" and y["dominator"] == "o"
    assert y["scale"] == o["scale"] and y["zero_point"] == o["zero_point"]


def test_layer_config_moves_a_manual_op_to_the_npu(tmp_path):
    q, _ = _build(tmp_path, "moved", [{"op_type": "Softmax", "data_type": "U16"}])
    assert q["nodes"]["softmax"]["placement"] == "NPU"
    assert q["tensors"]["p"]["dtype"] == "U16"


def _encoder_build(tmp_path, name, overrides):
    from examples.transformer import transformer_encoder_onnx

    model = transformer_encoder_onnx(tmp_path / "enc.onnx") if not (tmp_path / "enc.onnx").exists() \
        else tmp_path / "enc.onnx"
    calib = tmp_path / "tcal"
    calib.mkdir(exist_ok=True)
    for i in range(4):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 16, 64)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}]}}
    res = pulsar.build(model, tmp_path / name, cfg, {"compiler.check": 3, **overrides}, quiet=True)
    return json.loads(res.quant_config.read_text())


def test_transformer_opt_levels_move_norms_softmax_gelu_and_attention_matmuls(tmp_path):
    placed = {}
    for level in (0, 1, 2):
        q = _encoder_build(tmp_path, f"l{level}", {"quant.transformer_opt_level": level,
                                                   "quant.ln_scale_data_type": "S32" if level else "FP32"})
        placed[level] = {v["op_type"]: v["placement"] for v in q["nodes"].values()
                         if v["op_type"] in ("Softmax", "LayerNormalization", "Gelu")}
        u16 = {t for t, v in q["tensors"].items() if v["dtype"] == "U16"}
        if level == 0:  # the residual stream and block products only (pulsar.quant.transformer)
            assert u16
        else:
            s32 = [t for t, v in q["tensors"].items() if v["kind"] == "constant" and v["dtype"] == "S32"]
            assert len(s32) == 4  # the four LayerNorm scales
        placed[level]["u16"] = len(u16)
    assert set(placed[0].values()) - {placed[0]["u16"]} == {"CPU"} and set(placed[1].values()) - {placed[1]["u16"]} == {"NPU"}
    assert placed[2]["u16"] >= placed[1]["u16"] > placed[0]["u16"] > 0


def test_disable_quant_optimization_quantizes_pre_activations_and_passive_outputs(tmp_path):
    q_on, _ = _build(tmp_path, "on")
    q_off, _ = _build(tmp_path, "off_base")
    assert q_on == q_off
    model = _attention_like(tmp_path / "attn.onnx")
    calib = tmp_path / "calib"
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}]}}
    res = pulsar.build(model, tmp_path / "off", cfg, {"quant.disable_quant_optimization": True}, quiet=True)
    y = json.loads(res.quant_config.read_text())["tensors"]["y"]
    assert y["state"] == "ACTIVATED" and y["dominator"] == "y"
