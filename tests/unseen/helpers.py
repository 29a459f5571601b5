"""Small models written in code, their calibration data, and the three ways to run a build's result
(float in onnxruntime, the QDQ model in onnxruntime with Q/DQ kept as float math, the compiled model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.runtime.session import Session


def vi(name: str, shape: list[Any], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def save(path: Path, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
         outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto] = (), opset: int = 17) -> Path:
    model = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def calib_config(root: Path, samples: dict[str, list[np.ndarray]], **quant: Any) -> dict[str, Any]:
    """Numpy calibration directories, one per input, and the config naming them."""
    specs = []
    for name, arrays in samples.items():
        folder = root / "calib" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i, a in enumerate(arrays):
            np.save(folder / f"{i:04d}.npy", a)
        specs.append({"tensor_name": name, "calibration_dataset": str(folder), "calibration_format": "Numpy",
                      "calibration_size": len(arrays)})
    return {"quant": {"input_configs": specs, **quant}}


def ort_run(path: Path | str, feeds: dict[str, np.ndarray], qdq: bool = False) -> list[np.ndarray]:
    so = ort.SessionOptions()
    if qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def build_and_run(model: Path, out: Path, cfg: dict[str, Any], feeds: dict[str, np.ndarray],
                  overrides: dict[str, Any] | None = None) -> dict[str, list[np.ndarray]]:
    """Build, then the outputs of the float model, the QDQ model and the compiled model (NPUBackend)."""
    res = pulsar.build(model, out, cfg, overrides, quiet=True)
    sess = Session(res.compiled_model, mode="NPUBackend")
    npu = sess.run(feeds)
    names = [o.name for o in sess.outputs]
    return {"float": ort_run(model, feeds), "qdq": ort_run(res.quantized_model, feeds, qdq=True),
            "npu": [npu[n] for n in names]}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
