"""The NPU / CPU op counts of the quant placement and of the compiled model agree, and where the compiled
model's subgraphs hold other ops than the placement counted (Q / DQ at the borders, fused ops, processor
ops) each difference is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar


def _softmax_in_the_middle(src: Path, dst: Path) -> Path:
    """The tiny CNN with a Softmax between two Gemms: a manual op whose input and output are quantized by
    its neighbours (the compiler could lower it at their 8-bit grids; the placement keeps it in float)."""
    m = onnx.load(str(src))
    g = m.graph
    rng = np.random.default_rng(5)
    g.initializer.extend([numpy_helper.from_array((rng.standard_normal((4, 10)) * 0.3).astype(np.float32), "fc2.w"),
                          numpy_helper.from_array(np.zeros(4, np.float32), "fc2.b")])
    g.node.extend([helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
                   helper.make_node("Gemm", ["probs", "fc2.w", "fc2.b"], ["out"], name="fc2", transB=1)])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4]))
    onnx.save(m, str(dst))
    return dst


def _counts(out: Path) -> tuple[dict, dict, str]:
    qjson = json.loads((out / "quant" / "quant_config.json").read_text())
    meta = pulsar.Session(out / "compiled.pulsar").metadata
    return qjson["nodes"], meta["op_counts"], (out / "build.log").read_text()


def _placed(nodes: dict) -> tuple[int, int]:
    npu = sum(v["placement"] == "NPU" for v in nodes.values())
    return npu, len(nodes) - npu


def test_tiny_model_counts_agree_and_subgraphs_explain_fusion_and_borders(tmp_path, tiny, tiny_config):
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, tiny_config, {"compiler.check": 0}, quiet=True)
    nodes, counts, log = _counts(out)
    assert _placed(nodes) == (9, 0)
    assert (counts["model_ops"], counts["placed_npu"], counts["npu"], counts["cpu"]) == (9, 9, 9, 0)
    assert counts["moved"] == [] and counts["processor_ops"] == {}
    assert "placement: 9 of 9 ops on the NPU, 0 on the CPU" in log
    assert "compiled: 9 of 9 model ops on the NPU, 0 on the CPU (as placed by quantization)" in log
    subs = {s["name"]: s for s in counts["subgraphs"]}
    assert sum(s["model_ops"] for s in subs.values()) == 9
    # 9 model ops, 7 integer ops: the two Relu are fused into their Conv
    assert (subs["npu_0"]["ops"], subs["npu_0"]["model_ops"]) == (7, 9)
    assert subs["npu_0"]["notes"] == ["Conv+Relu -> QConv (x2)"]
    assert subs["cpu_0"]["notes"] == ["1 QuantizeLinear at the NPU borders"]
    assert subs["cpu_1"]["notes"] == ["1 DequantizeLinear at the NPU borders"]
    assert "Subgraphs in execution order" in log


def test_cpu_softmax_stays_on_the_cpu_and_counts_agree(tmp_path, tiny, tiny_config):
    model = _softmax_in_the_middle(tiny["model"], tmp_path / "softmax.onnx")
    out = tmp_path / "out"
    pulsar.build(model, out, tiny_config, {"compiler.check": 2, "compiler.check_mode": "CheckPerLayer",
                                           "quant.precision_analysis": True,
                                           "quant.precision_analysis_method": "EndToEnd",
                                           "quant.precision_analysis_mode": "NPUBackend"}, quiet=True)
    nodes, counts, log = _counts(out)
    assert nodes["softmax"]["placement"] == "CPU"
    assert _placed(nodes) == (10, 1)
    # before: the compiler lowered the Softmax to the NPU (its input and output are quantized) and
    # reported 11 of 11 on the NPU against a placement of 10
    assert (counts["model_ops"], counts["placed_npu"], counts["npu"], counts["cpu"]) == (11, 10, 10, 1)
    assert "placement: 10 of 11 ops on the NPU, 1 on the CPU" in log
    assert "compiled: 10 of 11 model ops on the NPU, 1 on the CPU (as placed by quantization)" in log
    cpu = [s for s in counts["subgraphs"] if s["kind"] == "cpu" and s["model_ops"]]
    assert len(cpu) == 1 and cpu[0]["notes"] == ["1 QuantizeLinear at the NPU borders",
                                                 "1 DequantizeLinear at the NPU borders"]
    fallbacks = pulsar.Session(out / "compiled.pulsar").metadata["cpu_fallbacks"]
    assert [(f["node"], f["reason"]) for f in fallbacks] == [("softmax", nodes["softmax"]["placement_reason"])]
    assert "manual op" in fallbacks[0]["reason"]
    compiled = onnx.load(str(out / "compiled.pulsar"))
    bodies = {n.name: next(a.g for a in n.attribute if a.name == "body") for n in compiled.graph.node}
    assert not any(n.op_type == "QSoftmax" for b in bodies.values() for n in b.node)


def test_softmax_moved_by_layer_configs_runs_on_the_npu_in_both_counts(tmp_path, tiny, tiny_config):
    model = _softmax_in_the_middle(tiny["model"], tmp_path / "softmax.onnx")
    out = tmp_path / "out"
    pulsar.build(model, out, tiny_config, {"compiler.check": 0, "quant.layer_configs": [
        {"op_type": "Softmax", "data_type": "U16"}]}, quiet=True)
    nodes, counts, _ = _counts(out)
    assert nodes["softmax"]["placement"] == "NPU"
    assert (counts["placed_npu"], counts["npu"], counts["cpu"]) == (11, 11, 0)


def test_fp32_layer_between_quantized_layers_stays_in_float(tmp_path, tiny, tiny_config):
    """An explicit FP32 layer was lowered to the NPU when its neighbours quantized its input and output."""
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, tiny_config, {"compiler.check": 0, "quant.layer_configs": [
        {"layer_name": "residual", "data_type": "FP32"}]}, quiet=True)
    nodes, counts, log = _counts(out)
    assert nodes["residual"]["placement"] == "CPU"
    assert (counts["placed_npu"], counts["npu"], counts["cpu"]) == (8, 8, 1)
    fallbacks = pulsar.Session(out / "compiled.pulsar").metadata["cpu_fallbacks"]
    assert [(f["node"], f["reason"]) for f in fallbacks] == [("residual", "layer_configs data_type FP32")]
    assert "Ops kept on the CPU by the compiler" not in log  # nothing the compiler decided by itself


def test_processor_ops_are_counted_apart_with_their_own_reason(tmp_path, tiny, tiny_config):
    tiny_config["input_processors"] = [{"tensor_name": "image", "tensor_format": "BGR", "src_format": "BGR",
                                        "src_layout": "NHWC", "src_dtype": "U8", "mean": [1.0, 2.0, 3.0],
                                        "std": [4.0, 5.0, 6.0]}]
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, tiny_config, {"compiler.check": 0}, quiet=True)
    _, counts, log = _counts(out)
    assert (counts["model_ops"], counts["npu"], counts["cpu"]) == (9, 9, 0)
    assert counts["processor_ops"] == {"input": {"Cast": 1, "Sub": 1, "Div": 1, "Transpose": 1}}
    assert "input processors add 4 ops (Cast, Sub, Div, Transpose), on the CPU, not counted as model ops" in log
    assert "input_processors step: preprocessing runs in float" in log
    fallbacks = pulsar.Session(out / "compiled.pulsar").metadata["cpu_fallbacks"]
    assert {f["op_type"] for f in fallbacks} == {"Cast", "Sub", "Div", "Transpose"}
    # not "select it in quant.layer_configs": processor ops cannot be selected there
    assert all(f["reason"].startswith("input_processors step") for f in fallbacks)
    first = counts["subgraphs"][0]
    assert first["kind"] == "cpu" and "4 processor ops" in first["notes"]


@pytest.mark.parametrize("model", ["ocr_rec"])
def test_real_model_counts_agree(tmp_path, model):
    root = Path(__file__).resolve().parents[2]
    asset = root / "examples" / "assets" / f"{model}.onnx"
    if not asset.is_file():
        pytest.skip("examples/assets not made (python examples/make_assets.py)")
    out = tmp_path / "out"
    cfg = json.loads(re.sub(r"^\s*#.*$", "", (root / "configs" / f"{model}.json").read_text(), flags=re.M))
    cfg["quant"]["input_configs"][0]["calibration_dataset"] = str(root / cfg["quant"]["input_configs"][0][
        "calibration_dataset"])
    cfg["quant"]["input_configs"][0]["calibration_size"] = 4
    pulsar.build(asset, out, cfg, {"compiler.check": 0}, quiet=True)
    nodes, counts, _ = _counts(out)
    npu, cpu = _placed(nodes)
    assert (counts["model_ops"], counts["placed_npu"], counts["npu"], counts["cpu"]) == (npu + cpu, npu, npu, cpu)
    assert sum(s["model_ops"] for s in counts["subgraphs"]) == npu + cpu
    # the 5 LayerNormalization of the recognizer were placed on the CPU; 4 used to be lowered to the NPU
    assert sum(v["op_type"] == "LayerNormalization" and v["placement"] == "CPU" for v in nodes.values()) == 5
