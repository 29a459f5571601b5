"""The failure classes the ONNX conformance suite found, each on a small real build (fast versions of
bench/conformance cases): sequence interfaces and empty inputs refused at load time, every compiled
subgraph loaded at the end of the build, NaN / inf accepted where only float ops read them, and
``x - max(x)`` over large values and attention masks fed as inputs kept accurate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.core.container import Subgraph, package
from pulsar.errors import PulsarError
from pulsar.runtime.runner import run_model
from pulsar.runtime.session import Session
from pulsar.runtime.validate import check_loadable


def _save(tmp: Path, nodes, inputs, outputs, inits=(), opset: int = 17) -> Path:
    model = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp / "m.onnx"
    onnx.save(model, path)
    return path


def _config(tmp: Path, samples: dict[str, list[np.ndarray]]) -> dict:
    specs = []
    for name, arrays in samples.items():
        folder = tmp / "calib" / name
        folder.mkdir(parents=True)
        for i, a in enumerate(arrays):
            np.save(folder / f"{i}.npy", a)
        specs.append({"tensor_name": name, "calibration_dataset": str(folder), "calibration_format": "Numpy",
                      "calibration_size": len(arrays)})
    return {"quant": {"input_configs": specs}}


def _vi(name: str, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape))


def test_sequence_output_is_refused_at_load_time_naming_it(tmp_path: Path) -> None:
    path = _save(tmp_path, [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0)], [_vi("x", [2, 3])],
                 [helper.make_value_info("seq", helper.make_sequence_type_proto(
                     helper.make_tensor_type_proto(TensorProto.FLOAT, None)))])
    cfg = _config(tmp_path, {"x": [np.ones((2, 3), np.float32)]})
    with pytest.raises(PulsarError, match="model output 'seq' is a sequence.*ConcatFromSequence"):
        pulsar.build(path, tmp_path / "out", cfg, quiet=True)
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def test_empty_input_is_refused_with_its_reason(tmp_path: Path) -> None:
    path = _save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2, 0])], [_vi("y", [2, 0])])
    cfg = _config(tmp_path, {"x": [np.ones((2, 0), np.float32)]})
    with pytest.raises(PulsarError, match='"x" \\[2, 0\\] has a dimension of size 0'):
        pulsar.build(path, tmp_path / "out", cfg, quiet=True)


def test_a_body_the_runtime_cannot_load_fails_the_check(tmp_path: Path) -> None:
    good = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "cpu", [_vi("x", [2])], [_vi("y", [2])])
    bad = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["y"])], "cpu", [_vi("x", [2])], [_vi("y", [2])])
    kw = {"inputs": [_vi("x", [2])], "outputs": [_vi("y", [2])], "opset_imports": [helper.make_opsetid("", 17)],
          "metadata": {}}
    ok = package([Subgraph("cpu_0", "cpu", good)], path=tmp_path / "good.pulsar", **kw)
    assert check_loadable(ok) == 1  # a CPU body is prepared once for both modes
    broken = package([Subgraph("cpu_0", "cpu", bad)], path=tmp_path / "bad.pulsar", **kw)
    with pytest.raises(PulsarError, match="does not run in .* mode: subgraph .cpu_0. cannot be loaded.*onnxruntime .* lacks it"):
        check_loadable(broken)


def test_nonfinite_inputs_run_where_only_float_ops_read_them(tmp_path: Path) -> None:
    """IsNaN on the CPU takes NaN from a file; a quantized input still refuses it (no integer code)."""
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("Relu", ["z"], ["r"])]
    path = _save(tmp_path, nodes, [_vi("x", [4]), _vi("z", [1, 4, 4, 4])],
                 [_vi("nan", [4], TensorProto.BOOL), _vi("r", [1, 4, 4, 4])])
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
    cfg = _config(tmp_path, {"x": [np.arange(4, dtype=np.float32)], "z": [z]})
    built = pulsar.build(path, tmp_path / "out", cfg, quiet=True)
    feeds = tmp_path / "in"
    feeds.mkdir()
    np.save(feeds / "x.npy", np.array([0, np.nan, np.inf, 1], np.float32))
    np.save(feeds / "z.npy", z)
    run_model(built.compiled_model, tmp_path / "run", input_dir=feeds)
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "nan.npy"), [False, True, False, False])
    z[0, 0, 0, 0] = np.nan
    np.save(feeds / "z.npy", z)
    with pytest.raises(PulsarError, match='input "z" holds 1 non-finite value'):
        run_model(built.compiled_model, tmp_path / "run2", input_dir=feeds)


def _log_softmax_model(tmp_path: Path) -> Path:
    """log_softmax written out: x - max(x), Exp, ReduceSum, Log, Sub (opset 17)."""
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["s"]),
        helper.make_node("Exp", ["s"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axes"], ["se"], keepdims=1),
        helper.make_node("Log", ["se"], ["l"]),
        helper.make_node("Sub", ["s", "l"], ["y"]),
    ]
    return _save(tmp_path, nodes, [_vi("x", [8, 16])], [_vi("y", [8, 16])], [axes])


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_max_subtraction_over_large_values_stays_accurate(tmp_path: Path, offset: float) -> None:
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((8, 16)) * 2 + offset * rng.integers(0, 2, (8, 1))).astype(np.float32)
            for _ in range(4)]
    built = pulsar.build(_log_softmax_model(tmp_path), tmp_path / "out", _config(tmp_path, {"x": data}), quiet=True)
    nodes = json.loads(built.quant_config.read_text())["nodes"]
    sub = next(v for v in nodes.values() if v["op_type"] == "Sub" and v["inputs"][1] == "m")
    # small logits keep the subtraction on the NPU; logits of 1e4 move it (and its max) to float
    assert (sub["placement"] == "CPU") == (offset > 0)
    if offset:
        assert "x - max(x) over large values" in sub["placement_reason"]
    x = data[0]
    want = x - x.max(1, keepdims=True)
    want = want - np.log(np.exp(want).sum(1, keepdims=True))
    for mode in ("NPUBackend", "Reference"):
        got = Session(built.compiled_model, mode=mode).run({"x": x})["y"]
        cos = float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want))
        assert cos > 0.99, (mode, cos)


def test_a_sequence_inside_the_graph_runs_on_the_cpu(tmp_path: Path) -> None:
    nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=1),
             helper.make_node("ConcatFromSequence", ["seq"], ["c"], axis=0),
             helper.make_node("Relu", ["c"], ["y"])]
    path = _save(tmp_path, nodes, [_vi("x", [2, 3])], [_vi("y", [6, 1])])
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    built = pulsar.build(path, tmp_path / "out", _config(tmp_path, {"x": [x]}), quiet=True)
    want = np.maximum(np.concatenate(np.split(x, 3, axis=1), axis=0), 0)
    for mode in ("NPUBackend", "Reference"):
        got = Session(built.compiled_model, mode=mode).run({"x": x})["y"]
        np.testing.assert_allclose(got, want, atol=0.02)


def test_nan_that_reaches_a_quantized_tensor_through_a_cpu_op_is_refused_inf_is_taken(tmp_path: Path) -> None:
    """x -> Softmax (float, CPU) -> MatMul (NPU): NaN in x would reach the NPU's quantized input; -inf is
    what a mask holds, and the Softmax turns it into a 0 before anything is quantized."""
    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32), "w")
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "w"], ["y"])]
    path = _save(tmp_path, nodes, [_vi("x", [1, 4, 8])], [_vi("y", [1, 4, 8])], [w])
    x = np.random.default_rng(4).standard_normal((1, 4, 8)).astype(np.float32)
    built = pulsar.build(path, tmp_path / "out", _config(tmp_path, {"x": [x]}), quiet=True)
    feeds = tmp_path / "in"
    feeds.mkdir()
    x[0, 0, 0] = np.nan
    np.save(feeds / "x.npy", x)
    with pytest.raises(PulsarError, match='input "x" holds 1 NaN value'):
        run_model(built.compiled_model, tmp_path / "run", input_dir=feeds)
    x[0, 0, 0] = -np.inf  # a -inf the Softmax absorbs (a mask) is taken: nothing quantized sees it
    np.save(feeds / "x.npy", x)
    run_model(built.compiled_model, tmp_path / "run", input_dir=feeds)
    assert np.isfinite(np.load(tmp_path / "run" / "y.npy")).all()


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_scalar_inputs_run_from_files(tmp_path: Path, suffix: str) -> None:
    """Clip with its bounds as rank-0 inputs: built, then run from .npy / raw .bin files in both modes."""
    path = _save(tmp_path, [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])],
                 [_vi("x", [1, 3, 4, 5]), _vi("lo", []), _vi("hi", [])], [_vi("y", [1, 3, 4, 5])])
    x = np.random.default_rng(5).standard_normal((1, 3, 4, 5)).astype(np.float32)
    lo, hi = np.array(-0.5, np.float32), np.array(0.7, np.float32)
    built = pulsar.build(path, tmp_path / "out", _config(tmp_path, {"x": [x], "lo": [lo], "hi": [hi]}), quiet=True)
    feeds = tmp_path / "in"
    feeds.mkdir()
    for name, value in (("x", x), ("lo", lo), ("hi", hi)):
        if suffix == ".npy":
            np.save(feeds / f"{name}.npy", value)
        else:
            value.tofile(feeds / f"{name}.bin")
    for mode in ("NPUBackend", "Reference"):
        run_model(built.compiled_model, tmp_path / mode, input_dir=feeds, mode=mode)
        got = np.load(tmp_path / mode / "y.npy")
        assert got.shape == x.shape
        np.testing.assert_allclose(got, np.clip(x, lo, hi), atol=0.01)
