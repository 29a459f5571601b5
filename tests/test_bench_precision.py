"""bench.bench_precision's helpers on real pulsar output: the tiny CNN built with precision analysis,
its table and mermaid graph read back, losses ranked, and a 16-bit layer_configs entry built."""

from __future__ import annotations

import json
import math
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import pulsar
from bench.bench_precision import (
    MERMAID_FILE,
    TABLE_FILE,
    TableRow,
    candidates,
    layer_losses,
    parse_mermaid,
    parse_table,
    raised_entry,
    random_sets,
    ranked,
    search_result,
)
from pulsar.quant.analysis import LayerPrecision, mermaid_text, table_text


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, tiny) -> dict:
    """The tiny CNN built once per precision-analysis method."""
    root = tmp_path_factory.mktemp("bench_precision")
    config = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                           "calibration_format": "Numpy", "calibration_size": 8}]},
              "work_dir": str(root / "shared")}
    out = {"config": config, "root": root}
    for method in ("PerLayer", "EndToEnd"):
        out[method] = pulsar.build(tiny["model"], root / method, config, {
            "quant.precision_analysis": True, "quant.precision_analysis_method": method}, quiet=True)
    return out


def test_table_and_mermaid_read_back_match_the_build(analysed):
    res = analysed["PerLayer"]
    rows = parse_table((res.output_dir / TABLE_FILE).read_text())
    model = onnx.load(str(res.optimized_model))
    names = {n.name for n in model.graph.node}
    assert rows and {r.node for r in rows} <= names
    assert all(0.0 <= r.cosine <= 1.0 + 1e-9 for r in rows)
    ids, callouts = parse_mermaid((res.output_dir / MERMAID_FILE).read_text())
    assert {r.node for r in rows} <= set(ids)
    lowest = sorted(rows, key=lambda r: r.cosine)[: len(callouts)]
    assert [name for _, name, _ in callouts] == [r.node for r in lowest]
    assert all(nid == ids[name] for _, name, nid in callouts)


def test_names_with_mermaid_and_table_special_characters_survive():
    odd = 'conv [a] "b" #1 (x)|y'
    rows = [LayerPrecision(odd, "Conv", "t 1", (1, 4), "FP32", "U8", 0.9, 1e-3, 20.0),
            LayerPrecision("relu", "Relu", "t2", (1, 4), "FP32", "U8", 0.99, 1e-4, 30.0)]
    parsed = parse_table(table_text(rows))
    assert [(r.node, r.tensor, r.qdtype, r.cosine) for r in parsed] == [(odd, "t 1", "U8", 0.9),
                                                                          ("relu", "t2", "U8", 0.99)]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t 1"], name=odd),
         helper.make_node("Relu", ["t 1"], ["t2"], name="relu")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("t2", TensorProto.FLOAT, [1, 4])]))
    ids, callouts = parse_mermaid(mermaid_text(model, rows, worst=1))
    assert set(ids) == {odd, "relu"}
    assert callouts == [(1, odd, ids[odd])]


def test_losses_per_layer_and_end_to_end():
    # x -> A -> b -> B -> c, and B also reads the graph input x
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["b"], name="A"),
         helper.make_node("Add", ["b", "x"], ["c"], name="B")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])]))
    rows = [TableRow("A", "Relu", "b", "U8", 0.95), TableRow("B", "Add", "c", "U8", 0.90)]
    per = layer_losses(rows, "PerLayer", model)
    e2e = layer_losses(rows, "EndToEnd", model)
    assert per == pytest.approx({"A": 0.05, "B": 0.10})
    assert e2e == pytest.approx({"A": 0.05, "B": 0.05})  # A: x has no row (1.0); B: worst input b, 0.95
    nan_rows = [TableRow("A", "Relu", "b", "U8", math.nan), TableRow("B", "Add", "c", "U8", 0.9)]
    assert layer_losses(nan_rows, "PerLayer", model)["A"] == 1.0
    assert ranked(per, ["A", "B"], 1) == ["B"] and ranked(per, ["A", "B"], 1, worst=False) == ["A"]


def test_candidates_and_raised_entry_raise_the_layer(analysed, tiny):
    res = analysed["PerLayer"]
    qcfg = json.loads(Path(res.quant_config).read_text())
    pool = candidates(qcfg)
    assert pool and all(qcfg["nodes"][n]["placement"] == "NPU" for n in pool)
    assert not any(qcfg["nodes"][n]["op_type"] == "Relu" for n in pool)  # fused into their producer
    fused = next(n for n in pool if "fused_into" in qcfg["nodes"][n])
    entry = raised_entry([fused], qcfg)
    assert entry["layer_names"] == [fused, qcfg["nodes"][fused]["fused_into"]]
    config = {**analysed["config"], "quant": {**analysed["config"]["quant"], "layer_configs": [entry]}}
    out = pulsar.build(tiny["model"], analysed["root"] / "raised", config, quiet=True)
    raised = json.loads(Path(out.quant_config).read_text())
    node = raised["nodes"][fused]
    weight = next(t for t in node["inputs"] if raised["tensors"].get(t, {}).get("kind") == "weight")
    assert raised["tensors"][node["inputs"][0]]["dtype"] == "U16"
    assert raised["tensors"][weight]["dtype"] == "S16"


def test_random_sets_are_seeded_and_search_result_keeps_the_best_trial():
    pool = [f"L{i}" for i in range(20)]
    assert random_sets(pool, 4, 3, 0) == random_sets(pool, 4, 3, 0)
    assert random_sets(pool, 4, 3, 0) != random_sets(pool, 4, 3, 1)
    assert all(len(s) == 4 and len(set(s)) == 4 for s in random_sets(pool, 4, 3, 0))
    amp = {"trials": [{"layers": [], "cosine": 0.9}, {"layers": ["a"], "cosine": 0.95},
                      {"layers": ["a", "b"], "cosine": 0.93}]}
    assert search_result(amp) == (["a"], 0.95, [(0, 0.9), (1, 0.95), (2, 0.93)])
