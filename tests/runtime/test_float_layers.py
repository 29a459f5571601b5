"""FP16 / BF16 layers on the NPU (layer_configs data_type FP16 / BF16): a transformer block in FP16 is
bit-exact against a numpy float16 reference, a block with only Softmax / LayerNorm in FP16 converts at
their borders, and a target without the format refuses the build."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.compiler.workload import COST_RULES
from pulsar.core.container import load_compiled
from pulsar.core.float_ops import FLOAT_OPS
from pulsar.runtime.kernels import KERNELS
from pulsar.runtime.npu_sim import NpuProgram
from tests.cli_fork import run_pulsar

SEQ, D = 16, 32
F16, F32 = np.float16, np.float32


def make_block(path: Path, seed: int = 0) -> Path:
    """A pre-LN transformer block (one attention head, ReLU MLP) written with onnx.helper."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, s: float = 0.2) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * s).astype(F32), name)

    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(D)).astype(F32), "ln1.g"), w("ln1.b", D, s=0.1),
             w("wq", D, D), w("wk", D, D), w("wv", D, D), w("wo", D, D),
             numpy_helper.from_array(np.array(1 / np.sqrt(D), F32), "scale"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(D)).astype(F32), "ln2.g"), w("ln2.b", D, s=0.1),
             w("w1", D, 2 * D), w("b1", 2 * D, s=0.1), w("w2", 2 * D, D), w("b2", D, s=0.1)]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1.g", "ln1.b"], ["h1"], name="ln1", axis=-1, epsilon=1e-5),
        n("MatMul", ["h1", "wq"], ["q"], name="q_proj"), n("MatMul", ["h1", "wk"], ["k"], name="k_proj"),
        n("MatMul", ["h1", "wv"], ["v"], name="v_proj"), n("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s"], name="qk"), n("Mul", ["s", "scale"], ["ss"], name="qk_scale"),
        n("Softmax", ["ss"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["a"], name="pv"), n("MatMul", ["a", "wo"], ["o"], name="o_proj"),
        n("Add", ["x", "o"], ["r1"], name="res1"),
        n("LayerNormalization", ["r1", "ln2.g", "ln2.b"], ["h2"], name="ln2", axis=-1, epsilon=1e-5),
        n("MatMul", ["h2", "w1"], ["f1"], name="fc1"), n("Add", ["f1", "b1"], ["f1b"], name="fc1_bias"),
        n("Relu", ["f1b"], ["f1r"], name="act"),
        n("MatMul", ["f1r", "w2"], ["f2"], name="fc2"), n("Add", ["f2", "b2"], ["f2b"], name="fc2_bias"),
        n("Add", ["r1", "f2b"], ["y"], name="res2"),
    ]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, D])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def reference_block(model: onnx.ModelProto, x: np.ndarray, fmt: type = F16) -> np.ndarray:
    """The block in a float format, written out with numpy: every op reads values of the format,
    computes in float32 and rounds its result once to the format."""
    c = {t.name: numpy_helper.to_array(t).astype(fmt) for t in model.graph.initializer}

    def r(v: np.ndarray) -> np.ndarray:
        return np.asarray(v, F32).astype(fmt)

    def f(v: np.ndarray) -> np.ndarray:
        return v.astype(F32)

    def ln(v: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
        v = f(v)
        mean = v.mean(axis=-1, keepdims=True)
        d = v - mean
        return r(d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + F32(1e-5)) * f(g) + f(b))

    x = r(x)
    h1 = ln(x, c["ln1.g"], c["ln1.b"])
    q, k, v = (r(f(h1) @ f(c[w])) for w in ("wq", "wk", "wv"))
    s = r(f(q) @ f(k.transpose(0, 2, 1)))
    ss = f(r(f(s) * f(c["scale"])))
    e = np.exp(ss - ss.max(axis=-1, keepdims=True))
    p = r(e / e.sum(axis=-1, keepdims=True))
    o = r(f(r(f(p) @ f(v))) @ f(c["wo"]))
    r1 = r(f(x) + f(o))
    h2 = ln(r1, c["ln2.g"], c["ln2.b"])
    f1r = r(np.maximum(f(r(f(r(f(h2) @ f(c["w1"]))) + f(c["b1"]))), F32(0)))
    f2b = r(f(r(f(f1r) @ f(c["w2"]))) + f(c["b2"]))
    return f(r(f(r1) + f(f2b)))


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("block")
    calib = root / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(calib / f"{i:02d}.npy", rng.standard_normal((1, SEQ, D)).astype(F32))
    config = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                           "calibration_format": "Numpy", "calibration_size": 8}]}}
    return {"model": make_block(root / "block.onnx"), "calib": calib, "config": config}


def _build(block: dict, out: Path, layer_configs: list[dict], **overrides) -> pulsar.BuildResult:
    cfg = {"quant": {**block["config"]["quant"], "layer_configs": layer_configs}}
    return pulsar.build(block["model"], out, cfg, {"compiler.check": 2, **overrides}, quiet=True)


def _samples(block: dict) -> list[np.ndarray]:
    return [np.load(p) for p in sorted(block["calib"].glob("*.npy"))]


def _npu_ops(compiled: Path) -> list[str]:
    cm = load_compiled(compiled)
    return [n.op_type for sg in cm.subgraphs if sg.kind == "npu" for n in sg.graph.node]


def test_every_float_op_has_a_kernel_and_a_cost_rule():
    assert not FLOAT_OPS - set(KERNELS) and not FLOAT_OPS - set(COST_RULES)
    assert {"Dequantize", "Quantize"} <= set(KERNELS) & set(COST_RULES)


@pytest.mark.parametrize("fmt", ["FP16", "BF16"])
def test_a_float_block_is_bit_exact_against_numpy(tmp_path, block, fmt):
    whole = [{"start_tensor_names": "DEFAULT", "end_tensor_names": "DEFAULT", "data_type": fmt}]
    res = _build(block, tmp_path / fmt, whole, target_hardware="VNPU-L")
    ops = _npu_ops(res.compiled_model)
    assert "Softmax" in ops and "LayerNormalization" in ops and not any(o.startswith("Q") for o in ops), ops
    qdq = onnx.load(res.quantized_model)  # onnxruntime runs the QDQ model: Cast pairs round to the format
    model = onnx.load(block["model"])
    np_fmt = F16 if fmt == "FP16" else ml_dtypes.bfloat16
    for x in _samples(block)[:3]:
        want = reference_block(model, x, np_fmt)
        npu = pulsar.Session(res.compiled_model).run({"x": x})["y"]
        ref = pulsar.Session(res.compiled_model, mode="Reference").run({"x": x})["y"]
        assert np.array_equal(npu, want), np.abs(npu - want).max()
        assert np.array_equal(ref, want)
        float_out = ort.InferenceSession(str(block["model"])).run(None, {"x": x})[0]
        qdq_out = ort.InferenceSession(qdq.SerializeToString()).run(None, {"x": x})[0]
        assert np.array_equal(qdq_out, want)
        tol = 0.01 if fmt == "FP16" else 0.05
        assert np.abs(npu - float_out).max() < tol * np.abs(float_out).max()


def test_softmax_and_layernorm_in_fp16_between_integer_layers(tmp_path, block):
    res = _build(block, tmp_path / "mixed", [{"op_types": ["Softmax", "LayerNormalization"], "data_type": "FP16"}])
    ops = _npu_ops(res.compiled_model)
    assert ops.count("Dequantize") == 3 and ops.count("Quantize") == 3, ops
    assert "QSoftmax" not in ops and "QMatMul" in ops and "Softmax" in ops
    nodes = json.loads(res.quant_config.read_text())["nodes"]
    assert "FP16" in json.dumps(nodes["softmax"])
    cm = load_compiled(res.compiled_model)
    npu = next(sg for sg in cm.subgraphs if sg.kind == "npu")
    program = NpuProgram(npu.graph)
    softmax = next(n for n in npu.graph.node if n.op_type == "Softmax")
    sess = pulsar.Session(res.compiled_model)
    for x in _samples(block)[:2]:
        assert np.array_equal(sess.run({"x": x})["y"],
                              pulsar.Session(res.compiled_model, mode="Reference").run({"x": x})["y"])
        feeds = sess.run({"x": x}, output_names=[i.name for i in npu.graph.input])
        env = program.run(feeds, keep=True)
        s_in, s_out = env[softmax.input[0]], env[softmax.output[0]]
        assert s_in.dtype == F16 and s_out.dtype == F16
        e = np.exp(s_in.astype(F32) - s_in.astype(F32).max(axis=-1, keepdims=True))
        assert np.array_equal(s_out, (e / e.sum(axis=-1, keepdims=True)).astype(F16))


def test_a_target_without_fp16_refuses_the_layer(tmp_path, block):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"quant": {**block["config"]["quant"],
                                         "layer_configs": [{"op_type": "Softmax", "data_type": "FP16"}]},
                               "target_hardware": "VNPU-S"}))
    proc = run_pulsar(["build", "--input", str(block["model"]), "--config",
                      str(cfg), "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "FP16" in err[0] and "VNPU-S" in err[0] and "fp16_macs_per_cycle_per_core" in err[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def test_an_op_without_a_float_kernel_stays_on_the_cpu_with_the_reason(tmp_path, tiny, tiny_config):
    cfg = {"quant": {**tiny_config["quant"], "layer_configs": [{"layer_name": "gap", "data_type": "FP16"}]}}
    res = pulsar.build(tiny["model"], tmp_path / "out", cfg, {"compiler.check": 2}, quiet=True)
    why = json.loads(res.quant_config.read_text())["nodes"]["gap"]
    assert "no FP16 kernel" in json.dumps(why)


@pytest.mark.parametrize("weights", ["S4", "S8"])
def test_weight_only_layers_keep_integer_weights(tmp_path, block, weights):
    fp16 = [{"start_tensor_names": "DEFAULT", "end_tensor_names": "DEFAULT", "data_type": "FP16"}]
    plain = _build(block, tmp_path / "fp16", fp16)
    res = _build(block, tmp_path / weights, [{**fp16[0], "weight_data_type": weights}])
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    assert sum(v["kind"] == "weight" and v["dtype"] == weights for v in tensors.values()) == 6  # the 6 MatMuls
    ops = _npu_ops(res.compiled_model)
    assert ops.count("Dequantize") == 6 and ops.count("MatMul") == 8 and not any(o.startswith("Q") for o in ops)
    kinds = {t.data_type for t in onnx.load(res.compiled_model).graph.initializer}
    assert (TensorProto.INT4 if weights == "S4" else TensorProto.INT8) in kinds
    assert res.compiled_model.stat().st_size < plain.compiled_model.stat().st_size
    for x in _samples(block)[:2]:
        npu = pulsar.Session(res.compiled_model).run({"x": x})["y"]
        assert np.array_equal(npu, pulsar.Session(res.compiled_model, mode="Reference").run({"x": x})["y"])
        float_out = ort.InferenceSession(str(block["model"])).run(None, {"x": x})[0]
        cos = float((npu * float_out).sum() / np.linalg.norm(npu) / np.linalg.norm(float_out))
        assert cos > (0.98 if weights == "S4" else 0.999), cos


def test_grouped_weights_of_weight_only_layers(tmp_path, block):
    entry = {"start_tensor_names": "DEFAULT", "end_tensor_names": "DEFAULT", "data_type": "FP16",
             "weight_data_type": "S4"}
    per_channel = _build(block, tmp_path / "channel", [entry])
    res = _build(block, tmp_path / "g8", [{**entry, "weight_group_size": 8}])
    qdq = onnx.load(res.quantized_model)
    assert next(o.version for o in qdq.opset_import if o.domain == "") == 21  # blocked DequantizeLinear
    blocked = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 8 for a in n.attribute)]
    assert len(blocked) == 6
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    wq = tensors["wq"]
    assert wq["block_size"] == 8 and np.shape(wq["scale"]) == (D // 8, D)
    body_attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute}
                  for sg in load_compiled(res.compiled_model).subgraphs if sg.kind == "npu"
                  for n in sg.graph.node if n.op_type == "Dequantize"]
    assert sum(a.get("block_size") == 8 for a in body_attrs) == 6
    errs = []
    for x in _samples(block)[:3]:
        npu = pulsar.Session(res.compiled_model).run({"x": x})["y"]
        assert np.array_equal(npu, pulsar.Session(res.compiled_model, mode="Reference").run({"x": x})["y"])
        float_out = ort.InferenceSession(str(block["model"])).run(None, {"x": x})[0]
        coarse = pulsar.Session(per_channel.compiled_model).run({"x": x})["y"]
        errs.append((np.abs(npu - float_out).mean(), np.abs(coarse - float_out).mean()))
    assert sum(e for e, _ in errs) < sum(c for _, c in errs)  # groups of 8 beat one scale per channel


@pytest.mark.parametrize("entry, message", [
    ({"op_type": "MatMul", "weight_data_type": "S4", "weight_group_size": 8, "data_type": "U8"},
     "groups are for weight-only layers"),
    ({"op_type": "MatMul", "weight_data_type": "S4", "weight_group_size": 5, "data_type": "FP16"},
     "weight_group_size 5 does not divide"),
])
def test_group_size_mistakes_are_one_error_line(tmp_path, block, entry, message):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"quant": {**block["config"]["quant"], "layer_configs": [entry]}}))
    proc = run_pulsar(["build", "--input", str(block["model"]), "--config",
                      str(cfg), "--output_dir", str(tmp_path / "out")])
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(err) == 1 and message in err[0], proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "compiled.pulsar").exists()
