"""An ``If`` that picks a branch by a sample-rate input (the silero-vad layout: a conv front end and an
LSTM with h / c state in each branch) builds once the input is fixed with ``const_processors``: the If
folds to the branch it takes, the LSTM gets its shapes, and the compiled model (without the ``sr``
input) matches the float model run at that rate. An If on an input's shape folds by ``input_shapes``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.errors import PulsarError
from pulsar.runtime.session import Session
from tests.unseen.helpers import calib_config, cosine, ort_run, vi

T, FEAT, HID = 6, 8, 16


def _branch(tag: str, rng: np.random.Generator) -> onnx.GraphProto:
    w = numpy_helper.from_array((rng.normal(size=(1, 4 * HID, FEAT)) * 0.3).astype(np.float32), f"{tag}_W")
    r = numpy_helper.from_array((rng.normal(size=(1, 4 * HID, HID)) * 0.3).astype(np.float32), f"{tag}_R")
    b = numpy_helper.from_array((rng.normal(size=(1, 8 * HID)) * 0.1).astype(np.float32), f"{tag}_B")
    k = numpy_helper.from_array((rng.normal(size=(FEAT, 1, 3)) * 0.4).astype(np.float32), f"{tag}_K")
    perm = numpy_helper.from_array(np.array([T, 1, FEAT], np.int64), f"{tag}_shape")
    nodes = [
        helper.make_node("Conv", ["x", f"{tag}_K"], [f"{tag}_conv"], kernel_shape=[3], pads=[1, 1], group=FEAT),
        helper.make_node("Relu", [f"{tag}_conv"], [f"{tag}_act"]),
        helper.make_node("Transpose", [f"{tag}_act"], [f"{tag}_t"], perm=[2, 0, 1]),          # [T, 1, FEAT]
        helper.make_node("Reshape", [f"{tag}_t", f"{tag}_shape"], [f"{tag}_seq"]),
        helper.make_node("LSTM", [f"{tag}_seq", f"{tag}_W", f"{tag}_R", f"{tag}_B", "", "h", "c"],
                         [f"{tag}_Y", f"{tag}_Yh", f"{tag}_Yc"], hidden_size=HID),
        helper.make_node("Sigmoid", [f"{tag}_Yh"], [f"{tag}_prob"]),
    ]
    return helper.make_graph(nodes, tag, [], [vi(f"{tag}_prob", [1, 1, HID]), vi(f"{tag}_Yh", [1, 1, HID]),
                                              vi(f"{tag}_Yc", [1, 1, HID])], [w, r, b, k, perm])


def vad_like(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Constant", [], ["rate"], value=numpy_helper.from_array(np.array(16000, np.int64))),
             helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["prob", "hN", "cN"], name="by_rate",
                              then_branch=_branch("k16", rng), else_branch=_branch("k8", rng))]
    graph = helper.make_graph(nodes, "vad", [vi("x", [1, FEAT, T]), vi("h", [1, 1, HID]), vi("c", [1, 1, HID]),
                                             vi("sr", [], TensorProto.INT64)],
                              [vi("prob", [1, 1, HID]), vi("hN", [1, 1, HID]), vi("cN", [1, 1, HID])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _samples(n: int, seed: int) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {"x": [rng.normal(size=(1, FEAT, T)).astype(np.float32) for _ in range(n)],
            "h": [np.tanh(rng.normal(size=(1, 1, HID))).astype(np.float32) * 0.5 for _ in range(n)],
            "c": [rng.normal(size=(1, 1, HID)).astype(np.float32) for _ in range(n)]}


def test_if_on_a_fixed_sample_rate_folds_and_the_lstm_builds(tmp_path: Path) -> None:
    model = vad_like(tmp_path / "vad.onnx")
    cfg = calib_config(tmp_path, _samples(12, 1))
    cfg["const_processors"] = [{"name": "sr", "data": [16000]}]
    res = pulsar.build(model, tmp_path / "out", cfg, quiet=True)
    optimized = onnx.load(res.optimized_model)
    assert "If" not in {n.op_type for n in optimized.graph.node}
    assert "LSTM" in {n.op_type for n in optimized.graph.node}
    sess = Session(res.compiled_model, mode="NPUBackend")
    assert [i.name for i in sess.inputs] == ["x", "h", "c"]
    test = {k: v[0] for k, v in _samples(1, 42).items()}
    want = ort_run(model, {**test, "sr": np.array(16000, np.int64)})
    other = ort_run(model, {**test, "sr": np.array(8000, np.int64)})
    got = sess.run(test)
    for name, w, o in zip(["prob", "hN", "cN"], want, other, strict=True):
        assert cosine(got[name], w) > 0.99, name
        assert cosine(got[name], w) > cosine(got[name], o), name  # the 16 kHz branch, not the other


def test_a_fixed_input_with_calibration_data_is_one_error_naming_both(tmp_path: Path) -> None:
    model = vad_like(tmp_path / "vad.onnx")
    samples = {**_samples(2, 1), "sr": [np.array(16000, np.int64)] * 2}
    cfg = calib_config(tmp_path, samples)
    cfg["const_processors"] = [{"name": "sr", "data": [16000]}]
    with pytest.raises(PulsarError, match=r"quant.input_configs\[3\].tensor_name: input 'sr' is fixed by "
                                          r"const_processors\[0\]"):
        pulsar.build(model, tmp_path / "out", cfg, quiet=True)
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def test_if_on_an_input_shape_folds_with_input_shapes(tmp_path: Path) -> None:
    """If(Shape(x)[2] == 6): fixed once input_shapes gives x its length."""
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["a"])], "t", [], [vi("a", [1, FEAT, None])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "e", [], [vi("b", [1, FEAT, None])])
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=2, end=3),
             helper.make_node("Equal", ["s", "six"], ["eq"]),
             helper.make_node("Squeeze", ["eq"], ["cond"]),
             helper.make_node("If", ["cond"], ["y0"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Relu", ["y0"], ["y"])]
    graph = helper.make_graph(nodes, "m", [vi("x", [1, FEAT, "T"])], [vi("y", [1, FEAT, "T"])],
                              [numpy_helper.from_array(np.array([T], np.int64), "six"),
                               numpy_helper.from_array(np.float32(2.0), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "shape_if.onnx")
    cfg = calib_config(tmp_path, {"x": _samples(4, 3)["x"]})
    cfg["input_shapes"] = f"x:1x{FEAT}x{T}"
    res = pulsar.build(tmp_path / "shape_if.onnx", tmp_path / "out", cfg, quiet=True)
    assert "If" not in {n.op_type for n in onnx.load(res.optimized_model).graph.node}
    x = _samples(1, 9)["x"][0]
    got = Session(res.compiled_model, mode="NPUBackend").run({"x": x})["y"]
    ref = ort.InferenceSession(str(tmp_path / "shape_if.onnx")).run(None, {"x": x})[0]
    assert cosine(got, ref) > 0.999
