"""layer_configs entries that tune a layer beyond its precision: calibration method and parameters,
weight calibration, bias bits and LUT size, by the precision's priority, every effective value in
quant_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.errors import PulsarError


def _build(tmp_path: Path, tiny, tiny_config, layer_configs, name: str) -> dict:
    cfg = {"quant": {**tiny_config["quant"], "layer_configs": layer_configs}}
    res = pulsar.build(tiny["model"], tmp_path / name, cfg, {"work_dir": str(tmp_path / "work")}, quiet=True)
    return json.loads(res.quant_config.read_text())


def test_per_layer_settings_act_and_are_shown(tmp_path, tiny, tiny_config):
    base = _build(tmp_path, tiny, tiny_config, [], "base")
    tuned = _build(tmp_path, tiny, tiny_config, [
        {"layer_name": "conv2", "calibration_method": "Percentile", "calibration_percentile": 99.0},
        {"op_type": "Conv", "weight_calibration_method": "Std", "calibration_std_n": 1.5},
        {"layer_name": "fc", "bias_bits": 8},
    ], "tuned")
    t, b = tuned["tensors"], base["tensors"]
    assert t["c2"]["calibration"] == {"method": "Percentile", "percentile": 99.0}
    assert t["c2"]["range"][1] < b["c2"]["range"][1]
    assert t["c1.w"]["calibration"] == {"method": "Std", "std_n": 1.5} and t["fc.w"]["calibration"] == {"method": "MinMax"}
    assert np.all(np.asarray(t["c1.w"]["scale"]) <= np.asarray(b["c1.w"]["scale"]) * (1 + 1e-6))
    assert t["fc.b"]["bias_bits"] == 8 and t["c1.b"]["bias_bits"] == 32
    assert t["r1"]["calibration"] == {"method": "MinMax"}  # untouched layers: the global method
    # the precision is not touched by tuning-only entries
    assert all(t[k]["dtype"] == b[k]["dtype"] for k in b)
    # everything not selected keeps its grid
    same = {k for k in b if t[k]["scale"] == b[k]["scale"]}
    assert {"r1", "r2", "image", "fc.w"} <= same


def test_bias_bits_saturate_the_codes(tmp_path, tiny, tiny_config):
    from pulsar.quant.scheme import bias_quant

    b = np.array([1.0, -1.0, 0.01], np.float32)  # on the 0.1 x 0.1 accumulator grid: 100, -100, 1
    _, q32 = bias_quant("b", b, 0.1, np.array([0.1]), 32)
    _, q8 = bias_quant("b", b, 0.1, np.array([0.1]), 8)
    assert q32.tolist() == [100, -100, 1] and q8.tolist() == [100, -100, 1]
    _, q6 = bias_quant("b", b, 0.1, np.array([0.1]), 6)
    assert q6.tolist() == [31, -32, 1]


def test_a_layer_name_beats_an_op_type(tmp_path, tiny, tiny_config):
    t = _build(tmp_path, tiny, tiny_config, [
        {"op_type": "Conv", "calibration_method": "KL"},
        {"layer_name": "conv2", "calibration_method": "MinMax"},
    ], "prec")["tensors"]
    assert t["c2"]["calibration"]["method"] == "MinMax"
    # a Conv's fused Relu writes the tensor the Conv's settings calibrate
    assert t["r1"]["calibration"]["method"] == "KL" and t["r2"]["calibration"]["method"] == "KL"


def test_two_entries_of_one_kind_disagreeing_is_an_error(tmp_path, tiny, tiny_config):
    with pytest.raises(PulsarError, match=r"layer_configs\[1\].calibration_method: layer 'conv2' .* by quant.layer_configs\[0\]"):
        _build(tmp_path, tiny, tiny_config, [{"layer_name": "conv2", "calibration_method": "KL"},
                                             {"layer_names": ["conv2"], "calibration_method": "MSE"}], "err")


def test_a_layers_lut_size_acts_in_the_compiled_model(tmp_path):
    rng = np.random.default_rng(0)
    g = helper.make_graph([
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s"], name="sig"),
        helper.make_node("Conv", ["s", "w2"], ["y"], name="conv2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32), "w2")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    (tmp_path / "cal").mkdir()
    for i in range(4):
        np.save(tmp_path / "cal" / f"{i}.npy", rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(tmp_path / "cal"),
                                        "calibration_format": "Numpy", "calibration_size": 4}],
                     "layer_configs": [{"layer_name": "sig", "data_type": "U16"}]}}
    a = pulsar.build(tmp_path / "m.onnx", tmp_path / "a", cfg, {"work_dir": str(tmp_path / "w")}, quiet=True)
    cfg["quant"]["layer_configs"].append({"layer_name": "sig", "lut_items_in_bits": 4})
    b = pulsar.build(tmp_path / "m.onnx", tmp_path / "b", cfg, {"work_dir": str(tmp_path / "w")}, quiet=True)
    assert json.loads(b.quant_config.read_text())["nodes"]["sig"]["lut_items_in_bits"] == 4
    meta = {p.key: p.value for n in onnx.load(b.quantized_model).graph.node if n.name == "sig" for p in n.metadata_props}
    assert meta == {"pulsar.lut_items_in_bits": "4"}
    # 17 knots instead of 1025: a smaller model, and a coarser sigmoid
    assert b.compiled_model.stat().st_size < a.compiled_model.stat().st_size - 3000
    x = np.load(tmp_path / "cal" / "0.npy")
    ya = pulsar.Session(a.compiled_model).run({"x": x})["y"]
    yb = pulsar.Session(b.compiled_model).run({"x": x})["y"]
    assert not np.array_equal(ya, yb)


def test_a_parameter_without_its_method_is_named(tmp_path, tiny, tiny_config):
    cfg = {"quant": {**tiny_config["quant"], "layer_configs": [
        {"layer_name": "conv2", "calibration_percentile": 99.0}, {"layer_name": "conv1", "lut_items_in_bits": 6}]}}
    res = pulsar.build(tiny["model"], tmp_path / "w", cfg, quiet=True)
    log = (res.output_dir / "build.log").read_text()
    assert "quant.layer_configs[0].calibration_percentile does not act" in log
    assert "quant.layer_configs[1].lut_items_in_bits does not act" in log
