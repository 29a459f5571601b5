"""input_shapes, const_processors and op_processors end to end through `pulsar build` and `pulsar run`
(the pulsar2 guide's examples: a Reshape target [1, 96, 48] -> [-1, 96, 48], AveragePool ceil_mode 0 -> 1)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.cli_fork import run_pulsar


def _model(path):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((96, 96, 1, 1)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1, 96, 48], np.int64), "flat_shape"),
             numpy_helper.from_array(np.array([-1, 96, 6, 8], np.int64), "map_shape")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Reshape", ["c", "flat_shape"], ["flat"], name="flatten_reshape"),
             helper.make_node("Relu", ["flat"], ["act"], name="relu"),
             helper.make_node("Reshape", ["act", "map_shape"], ["map"], name="unflatten"),
             helper.make_node("AveragePool", ["map"], ["y"], name="pool", kernel_shape=[3, 3], strides=[2, 2])]
    graph = helper.make_graph(nodes, "patch_me", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 96, 6, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 96, "H", "W"])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_shapes_const_and_op_processors_end_to_end(tmp_path):
    model = _model(tmp_path / "m.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        np.save(calib / f"{i}.npy", rng.standard_normal((1, 96, 6, 8)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}]},
           "const_processors": [{"name": "flat_shape", "data": [-1, 96, 48]}],
           "op_processors": [{"op_name": "pool", "attrs": {"ceil_mode": 1}}]}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "COLUMNS": "200"}
    proc = run_pulsar(["build", "--input", str(model), "--output_dir",
                      str(tmp_path / "out"), "--config", str(tmp_path / "cfg.json"), "--input_shapes",
                      "x:1x96x6x8", "--compiler.check", "2"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "out" / "build.log").read_text()
    assert "const flat_shape: [1, 96, 48] -> [-1, 96, 48]" in log
    assert "op pool: ceil_mode 0 -> 1" in log
    opt = onnx.load(tmp_path / "out" / "frontend" / "optimized.onnx")
    assert [d.dim_value for d in opt.graph.input[0].type.tensor_type.shape.dim] == [1, 96, 6, 8]
    shapes = {t.name: numpy_helper.to_array(t).tolist() for t in opt.graph.initializer if t.name == "flat_shape"}
    assert shapes == {"flat_shape": [-1, 96, 48]}
    x = rng.standard_normal((1, 96, 6, 8)).astype(np.float32)
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "x.npy", x)
    proc = run_pulsar(["run", "--model", str(tmp_path / "out" / "compiled.pulsar"),
                      "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "run")],
                      env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    y = np.load(tmp_path / "run" / "y.npy")
    assert y.shape == (1, 96, 3, 4)  # ceil_mode 1; the unpatched model gives 2 x 3
    # Values: the float model with the same patch, within quantization error.
    ref = np.maximum(np.einsum("oi,nihw->nohw", numpy_helper.to_array(onnx.load(model).graph.initializer[0])[:, :, 0, 0], x), 0)
    padded = np.pad(ref, ((0, 0), (0, 0), (0, 1), (0, 1)), constant_values=np.nan)
    pooled = np.stack([np.stack([np.nanmean(padded[0, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3], axis=(1, 2))
                                 for j in range(4)], -1) for i in range(3)], -2)
    assert np.abs(y[0] - pooled).max() < 0.05 * np.abs(pooled).max()
