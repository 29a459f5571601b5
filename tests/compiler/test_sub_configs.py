"""compiler.sub_configs: a start / end tensor range compiled as its own NPU subgraph with its own
options (unset ones inherited), equal to the plain build when the options do not change numerics,
checked by check 2, and lut_items_in_bits applied per range."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.compiler.lower import LowerOptions, lower_qdq_model
from pulsar.compiler.lower.model import SubRange
from pulsar.config.validate import ConfigError
from pulsar.core.container import load_compiled
from pulsar.errors import PulsarError
from pulsar.runtime.session import Session

RANGE = {"start_tensor_names": ["r1"], "end_tensor_names": ["r2"]}  # dwconv + relu2 of the tiny CNN


def _cfg(tiny_config: dict, compiler: dict) -> dict:
    return {**tiny_config, "compiler": compiler}


@pytest.fixture(scope="module")
def builds(tiny, tmp_path_factory):
    quant = {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                "calibration_format": "Numpy", "calibration_size": 8}]}
    root = tmp_path_factory.mktemp("subcfg")
    plain = pulsar.build(tiny["model"], root / "plain", {"quant": quant}, quiet=True)
    sub = {"check": 2, "check_mode": "CheckPerLayer", "sub_configs": [{**RANGE, "lut_items_in_bits": 8}]}
    ranged = pulsar.build(tiny["model"], root / "ranged", {"quant": quant, "compiler": sub}, quiet=True)
    return plain, ranged, root


def _subgraphs(path: Path) -> list:
    return load_compiled(path).subgraphs


def test_range_is_its_own_npu_subgraph_with_its_options(builds):
    plain, ranged, root = builds
    sgs = _subgraphs(ranged.compiled_model)
    subs = [sg for sg in sgs if "sub_config" in sg.options]
    assert len(subs) == 1
    (sg,) = subs
    assert sg.kind == "npu" and sg.name.endswith("_sub0") and sg.options["sub_config"] == 0
    assert sg.options["lut_items_in_bits"] == 8  # overridden
    assert sg.options["check_mode"] == "CheckPerLayer" and sg.options["check"] == 2  # inherited, not defaults
    assert [n.op_type for n in sg.graph.node] == ["QConv"]  # dwconv with relu2 fused, nothing else
    assert [i.name for i in sg.graph.input] == ["r1/q"] and [o.name for o in sg.graph.output] == ["r2/q"]
    others = [s for s in sgs if s.kind == "npu" and s is not sg]
    assert len(others) == 2 and all(s.options["lut_items_in_bits"] == 10 for s in others)
    assert sum(s.kind == "npu" for s in _subgraphs(plain.compiled_model)) == 1  # plain build: one NPU run
    log = (root / "ranged" / "build.log").read_text()
    assert f"NPU subgraph {sg.name}" in log and "r1 -> r2" in log
    assert "compiler check 2 passed" in log


def test_ranged_build_runs_and_equals_the_plain_build(builds):
    plain, ranged, _ = builds
    a, b = Session(plain.compiled_model), Session(ranged.compiled_model)
    step = float(json.loads(plain.quant_config.read_text())["tensors"]["logits"]["scale"])
    for seed in range(3):
        x = {"image": np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)}
        got, want = b.run(x)["logits"], a.run(x)["logits"]
        assert got.shape == (1, 10)
        assert np.abs(got - want).max() <= step + 1e-6


def test_unknown_tensor_in_sub_config_is_a_config_error(tiny, tiny_config, tmp_path):
    cfg = _cfg(tiny_config, {"sub_configs": [{"start_tensor_names": ["r1"], "end_tensor_names": ["r22"]}]})
    with pytest.raises(ConfigError) as e:
        pulsar.build(tiny["model"], tmp_path / "o", cfg, quiet=True)
    assert any("compiler.sub_configs[0].end_tensor_names" in p and "r22" in p and "r2" in p for p in e.value.problems)


def test_not_yet_features_inside_a_sub_config_are_rejected(tiny, tiny_config, tmp_path, monkeypatch):
    from pulsar.config import support

    # every per-range feature of this version is built: mark one as not yet, for this test only
    monkeypatch.setattr(support, "RULES", [*support.RULES, support._at_default("compiler.sub_configs[*].enable_tile_mode")])
    cfg = _cfg(tiny_config, {"sub_configs": [{**RANGE, "enable_tile_mode": True}]})
    with pytest.raises(ConfigError) as e:
        pulsar.build(tiny["model"], tmp_path / "o", cfg, quiet=True)
    assert any(p.startswith("compiler.sub_configs[0].enable_tile_mode: true is not accepted: not supported")
               for p in e.value.problems)
    assert not (tmp_path / "o").exists()


def test_fused_away_tensor_is_a_clear_error(builds):
    plain, _, _ = builds
    qmodel = onnx.load(str(plain.quantized_model))
    with pytest.raises(PulsarError, match="'c1'.*fused or removed"):  # BatchNormalization folded into conv1
        lower_qdq_model(qmodel, LowerOptions(sub_configs=[SubRange("s", ["c1"], ["r2"])]))
    with pytest.raises(PulsarError, match="no op lies between"):
        lower_qdq_model(qmodel, LowerOptions(sub_configs=[SubRange("s", ["r2"], ["r1"])]))


def _sigmoid_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array((rng.standard_normal((4, 4, 1, 1)) * 0.5).astype(np.float32), f"w{i}")
         for i in range(3)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c1"], name="conv1"),
             helper.make_node("Sigmoid", ["c1"], ["s1"], name="sig1"),
             helper.make_node("Conv", ["s1", "w1"], ["c2"], name="conv2"),
             helper.make_node("Sigmoid", ["c2"], ["s2"], name="sig2"),
             helper.make_node("Conv", ["s2", "w2"], ["y"], name="conv3")]
    graph = helper.make_graph(nodes, "sig", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], initializer=w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_lut_items_in_bits_applies_per_range_and_check_2_passes(tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(calib / f"{i}.npy", rng.standard_normal((1, 4, 6, 6)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 8}],
                     "layer_configs": [{"op_types": ["Sigmoid"], "data_type": "U16"}]},
           "compiler": {"check": 2, "sub_configs": [{"start_tensor_names": ["c2"], "end_tensor_names": ["s2"],
                                                     "lut_items_in_bits": 12}]}}
    res = pulsar.build(_sigmoid_model(tmp_path / "sig.onnx"), tmp_path / "out", cfg, quiet=True)
    step_bits = {}
    for sg in _subgraphs(res.compiled_model):
        for n in sg.graph.node:
            if n.op_type == "QLut":
                attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                step_bits[n.name] = (attrs["step_bits"], sg.options.get("sub_config"))
    # 16 - bits: sig1 at the top-level 10 bits, sig2 in the range at 12 bits and in its own subgraph
    assert step_bits == {"sig1": (6, None), "sig2": (4, 0)}
    assert "compiler check 2 passed" in (tmp_path / "out" / "build.log").read_text()


def test_npu_backend_precision_analysis_lowers_the_sub_config_ranges(tiny, tmp_path):
    quant = {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                "calibration_format": "Numpy", "calibration_size": 4}],
             "precision_analysis": True, "precision_analysis_method": "EndToEnd",
             "precision_analysis_mode": "NPUBackend"}
    compiler = {"sub_configs": [{**RANGE, "lut_items_in_bits": 8}]}
    pulsar.build(tiny["model"], tmp_path / "o", {"quant": quant, "compiler": compiler}, quiet=True)
    analysed = _subgraphs(tmp_path / "o" / "quant" / "debug" / "npu_backend_analysis.pulsar")
    subs = [sg for sg in analysed if "sub_config" in sg.options]
    assert [sg.name.endswith("_sub0") for sg in subs] == [True]
    assert subs[0].options["lut_items_in_bits"] == 8
    assert (tmp_path / "o" / "quant" / "debug" / "precision_analysis_table.txt").is_file()
