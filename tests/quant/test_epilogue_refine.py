"""Lookup-table chains fused into their producer, scalar constants folded, and auto scale refinement."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.quant.plan import make_plan


def _lab_block(path):
    """Conv -> HardSwish -> Mul(scalar) -> Add(scalar) -> Conv: PP-LCNet's learnable affine block."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((4, 8, 1, 1)) * 0.4).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array(1.3, np.float32), "a"),
             numpy_helper.from_array(np.array([-0.2], np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h"], name="hswish"),
             helper.make_node("Mul", ["h", "a"], ["m"], name="lab_scale"),
             helper.make_node("Add", ["m", "b"], ["l"], name="lab_bias"),
             helper.make_node("Conv", ["l", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "lab", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _calib(tmp_path, outlier: bool = False):
    calib = tmp_path / "calib"
    calib.mkdir(exist_ok=True)
    for i in range(6):
        rng = np.random.default_rng(i)
        x = (rng.standard_t(1.2, (1, 3, 8, 8)) if outlier else rng.standard_normal((1, 3, 8, 8))).astype(np.float32)
        np.save(calib / f"{i}.npy", x)
    return calib


def _build(tmp_path, name, overrides=None, outlier=False):
    model = _lab_block(tmp_path / "lab.onnx")
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(_calib(tmp_path, outlier)),
                                        "calibration_format": "Numpy"}]}}
    res = pulsar.build(model, tmp_path / name, cfg, overrides or {}, quiet=True)
    return res, json.loads(res.quant_config.read_text())["tensors"]


def test_plan_fuses_lut_chain_and_keeps_scalars_float(tmp_path):
    model = onnx.shape_inference.infer_shapes(onnx.load(_lab_block(tmp_path / "m.onnx")))
    plan = make_plan(model)
    assert plan.dtypes["c1"] == "U16" and plan.epilogues["c1"] == "hswish"  # 16 bits inside the fused op
    assert "h" not in plan.dtypes and "m" not in plan.dtypes                   # links of the table chain
    assert plan.dtypes["l"] == "U8" and plan.dtypes["x"] == "U8"               # what goes to memory stays 8-bit
    assert plan.fused == {"h": "lab_scale", "m": "lab_bias"}
    assert "a" not in plan.constants and "b" not in plan.constants             # folded, never quantized on their own
    off = make_plan(model, optimize=False)
    assert {off.dtypes[t] for t in ("c1", "h", "m", "l")} == {"U8"} and not off.epilogues


def test_fused_chain_build_is_closer_to_float_than_unfused(tmp_path):
    res_on, tensors = _build(tmp_path, "on")
    assert tensors["c1"]["dtype"] == "U16" and "h" not in tensors
    res_off, _ = _build(tmp_path, "off", {"quant.disable_quant_optimization": True})
    x = {"x": np.random.default_rng(42).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    ref = ort.InferenceSession(str(tmp_path / "lab.onnx"), providers=["CPUExecutionProvider"]).run(None, x)[0]

    def err(res):
        sess = ort.InferenceSession(str(res.quantized_model), providers=["CPUExecutionProvider"])
        return float(np.abs(sess.run(None, x)[0] - ref).mean())

    assert err(res_on) < err(res_off)


def test_auto_refine_tightens_weighted_layer_inputs_only(tmp_path):
    _, refined = _build(tmp_path, "refined", outlier=True)
    _, plain = _build(tmp_path, "plain", {"quant.disable_auto_refine_scale": True}, outlier=True)
    # x feeds conv1 and is heavy-tailed: the MSE-optimal range clips its rare extremes, MinMax keeps them
    assert refined["x"]["range"][1] < 0.5 * plain["x"]["range"][1]
    # never wider than the calibrated range, and the output (no weighted reader) is untouched
    assert refined["x"]["range"][0] >= plain["x"]["range"][0]
    assert refined["y"]["range"] == plain["y"]["range"]
