"""quant.ln_scale_data_type U32: the LayerNorm scale on an unsigned 32-bit grid, widened in the QDQ
model (no DequantizeLinear takes uint32), folded back by the compiler; the build matches S32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import pulsar
from pulsar.compiler.lower.qdq_graph import QdqGraph
from pulsar.core.container import load_compiled
from pulsar.quant.qdq import constant_quant
from pulsar.runtime.session import Session
from tests.quant.test_scheme_weights import _layernorm_model


def _ln_model(path: Path, gamma: np.ndarray) -> Path:
    return _layernorm_model(path, gamma)


def test_u32_grid_is_unsigned_and_finer_than_s32() -> None:
    gamma = np.random.default_rng(1).uniform(0.5, 1.5, 64).astype(np.float32)
    u, qu = constant_quant("g", gamma, 1e-6, "U32")
    s, _ = constant_quant("g", gamma, 1e-6, "S32")
    assert qu.dtype == np.uint32 and (qu == 2**32 - 1).all() and not np.any(u.zero_point)
    assert np.all(u.scale < s.scale)  # positive scales: one more bit than the signed grid
    mixed = np.array([-0.5, 1.0], np.float32).reshape(2, 1) * np.ones((2, 3), np.float32)
    tq, q = constant_quant("m", mixed.T.copy(), 1e-6, "U32")  # a negative scale: an offset grid
    np.testing.assert_allclose((q.astype(np.float64) - tq.zero_point) * tq.scale, mixed.T, rtol=1e-6)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("u32")
    model = _ln_model(root / "ln.onnx", np.random.default_rng(4).uniform(0.5, 1.5, 16))
    calib = root / "calib"
    calib.mkdir()
    for i in range(4):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 8, 16)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 4}],
                     "transformer_opt_level": 1}}
    out = {d: pulsar.build(model, root / d, cfg, {"quant.ln_scale_data_type": d}, quiet=True) for d in ("S32", "U32")}
    return model, out


def test_qdq_model_stores_uint32_codes_that_onnxruntime_runs(builds) -> None:
    model, out = builds
    q = onnx.load(out["U32"].quantized_model)
    inits = {t.name: t for t in q.graph.initializer}
    assert inits["gamma/q"].data_type == TensorProto.UINT32
    assert [n.op_type for n in q.graph.node if n.name.startswith("gamma/")] == ["Cast", "Sub", "Mul", "Cast"]
    assert not any(n.op_type == "DequantizeLinear" and n.output[0] == "gamma" for n in q.graph.node)
    entry = json.loads(out["U32"].quant_config.read_text())
    assert "U32" in json.dumps(entry)  # the tensor's grid is recorded as U32
    x = np.random.default_rng(9).standard_normal((1, 8, 16)).astype(np.float32)
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    got = {d: ort.InferenceSession(str(r.quantized_model)).run(None, {"x": x})[0] for d, r in out.items()}
    np.testing.assert_allclose(got["U32"], got["S32"], rtol=1e-5, atol=1e-6)  # both grids far below float32
    assert float(np.corrcoef(want.ravel(), got["U32"].ravel())[0, 1]) > 0.99


def test_compiler_folds_the_widened_scale_and_matches_s32(builds) -> None:
    _, out = builds
    g = QdqGraph(onnx.load(out["U32"].quantized_model))
    assert "gamma" in g.inits and g.inits["gamma"].data_type == TensorProto.FLOAT
    assert not any(n.op_type == "Cast" and n.output[0] == "gamma" for n in g.graph.node)
    x = np.random.default_rng(9).standard_normal((1, 8, 16)).astype(np.float32)
    s32, u32 = (Session(out[d].compiled_model).run({"x": x})["y"] for d in ("S32", "U32"))
    for d in ("S32", "U32"):  # the LayerNorm runs on the NPU, not on the CPU
        npu_ops = [n.op_type for sg in load_compiled(out[d].compiled_model).subgraphs if sg.kind == "npu"
                   for n in sg.graph.node]
        assert "QLayerNorm" in npu_ops, npu_ops
    np.testing.assert_array_equal(u32, s32)  # the same multipliers: both grids hold gamma to float32
