"""onnx_opt.save_tensors_data: frontend/optimized.onnx with its large tensors in optimized.onnx.data
(ONNX external data), which onnx and onnxruntime load back to the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.core.external_data import save_with_external_data
from pulsar.runtime.session import Session


def _two_convs(path: Path) -> Path:
    """3 -> 32 -> 8 channels, 3x3: 3.4 KiB and 9 KiB of float weights (moved out), small biases (kept)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n) for n, s in
             [("w1", (32, 3, 3, 3)), ("b1", (32,)), ("w2", (8, 32, 3, 3)), ("b2", (8,))]]
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["out"], name="conv2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "two_convs", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 16, 16])], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_writer_moves_large_tensors_and_loads_back(tmp_path: Path) -> None:
    model = onnx.load(_two_convs(tmp_path / "m.onnx"))
    files = save_with_external_data(model, tmp_path / "out" / "opt.onnx")
    assert files == [tmp_path / "out" / "opt.onnx", tmp_path / "out" / "opt.onnx.data"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["opt.onnx", "opt.onnx.data"]  # no temp file
    raw = onnx.load(files[0], load_external_data=False)
    external = {t.name for t in raw.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == {"w1", "w2"}  # the biases are under 1 KiB
    assert files[0].stat().st_size < 1024 < files[1].stat().st_size
    back = onnx.load(files[0])
    for a, b in zip(model.graph.initializer, back.graph.initializer, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    assert all(t.HasField("raw_data") for t in model.graph.initializer)  # the caller's model is untouched


def test_build_writes_external_data_that_runs(tiny, tmp_path: Path) -> None:
    src = _two_convs(tmp_path / "two.onnx")
    quant = {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                "calibration_format": "Numpy", "calibration_size": 4}]}
    plain = pulsar.build(src, tmp_path / "plain", {"quant": quant}, quiet=True)
    saved = pulsar.build(src, tmp_path / "saved", {"quant": quant, "onnx_opt": {"save_tensors_data": True}},
                         quiet=True)
    data = saved.optimized_model.parent / "optimized.onnx.data"
    assert data.is_file() and not (plain.optimized_model.parent / "optimized.onnx.data").exists()
    assert saved.optimized_model.stat().st_size < plain.optimized_model.stat().st_size
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
            for p in (plain.optimized_model, saved.optimized_model)]
    np.testing.assert_array_equal(runs[0], runs[1])
    # the rest of the build is unchanged by where the float weights were stored
    compiled = [Session(r.compiled_model).run({"image": x})["out"] for r in (plain, saved)]
    np.testing.assert_array_equal(compiled[0], compiled[1])
    log = (tmp_path / "saved" / "build.log").read_text()
    assert "its tensors in optimized.onnx.data" in log


@pytest.mark.parametrize("size", [0, 1023])
def test_nothing_large_keeps_one_file(tmp_path: Path, size: int) -> None:
    g = helper.make_graph([helper.make_node("Identity", ["c"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.UINT8, [size])],
                          initializer=[numpy_helper.from_array(np.zeros(size, np.uint8), "c")])
    files = save_with_external_data(helper.make_model(g), tmp_path / "m.onnx")
    assert files == [tmp_path / "m.onnx"] and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
