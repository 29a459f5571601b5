"""4-bit weights: S4 / U4 grids, weights-only layer_configs entries, INT4 in the QDQ and compiled
models (two per byte), bit-exact simulation, fine-tuning at 4 bits and 4-bit QAT (QuantONNX) import."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.config.generated import LayerConfig
from pulsar.core.container import load_compiled
from pulsar.core.ort_options import reference_session_options
from pulsar.quant.layer_configs import resolve_layer_precision
from pulsar.quant.scheme import weight_quant

INT4_TYPES = (TensorProto.INT4, TensorProto.UINT4)


def _samples(tiny: dict[str, Path]) -> list[np.ndarray]:
    return [np.load(p) for p in sorted(Path(tiny["calib"]).glob("*.npy"))]


def _weights_entry(dtype: str, **extra: str) -> dict:
    return {"op_types": ["Conv", "Gemm"], "weight_data_type": dtype, **extra}


def _build(tiny, tiny_config, out: Path, entries: list[dict], **overrides) -> pulsar.BuildResult:
    cfg = {"quant": {**tiny_config["quant"], "layer_configs": entries}}
    return pulsar.build(tiny["model"], out, cfg, {"compiler.check": 2, **overrides}, quiet=True)


def _both_modes(compiled: Path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref = pulsar.Session(compiled, mode="Reference").run({"image": x})["logits"]
    npu = pulsar.Session(compiled).run({"image": x})["logits"]
    return ref, npu


# ---------------------------------------------------------------------------------------- grids
def test_s4_weights_are_symmetric_16_level_grids_clipped_for_the_least_error():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    w[0, 0] = 12.0  # an outlier: clipping it costs more than it saves, the search keeps it
    tq, q = weight_quant("w", w, 0, "S4")
    assert q.dtype == np.int8 and q.min() >= -8 and q.max() <= 7 and np.all(tq.zero_point == 0)
    assert tq.to_json()["bit_width"] == 4 and tq.to_json()["quant_min"] == -8
    err = ((q * tq.scale[:, None] - w) ** 2).sum(axis=1)
    minmax_scale = np.abs(w).max(axis=1) / 7
    minmax_err = ((np.clip(np.round(w / minmax_scale[:, None]), -8, 7) * minmax_scale[:, None] - w) ** 2).sum(axis=1)
    assert np.all(err <= minmax_err + 1e-9)
    assert err[1:].sum() < 0.85 * minmax_err[1:].sum()  # Gaussian channels: clipping the tails pays


def test_u4_weights_are_affine_per_channel_and_beat_s4_on_skewed_weights():
    rng = np.random.default_rng(1)
    w = (rng.random((8, 32)) * 2.0 + 0.5).astype(np.float32)  # all positive: half of a symmetric grid is unused
    t_u, q_u = weight_quant("w", w, 0, "U4")
    t_s, q_s = weight_quant("w", w, 0, "S4")
    assert q_u.dtype == np.uint8 and q_u.max() <= 15 and not t_u.symmetric
    real_u = (q_u.astype(np.float64) - t_u.zero_point[:, None]) * t_u.scale[:, None]
    real_s = q_s.astype(np.float64) * t_s.scale[:, None]
    assert ((real_u - w) ** 2).sum() < 0.5 * ((real_s - w) ** 2).sum()


def test_per_tensor_granularity_gives_one_scale():
    w = np.random.default_rng(2).standard_normal((6, 3, 3, 3)).astype(np.float32)
    tq, q = weight_quant("w", w, None, "S8")
    assert tq.axis is None and np.shape(tq.scale) == () and np.abs(q).max() == 127


# ------------------------------------------------------------------------------- layer_configs
def test_an_entry_without_data_type_sets_only_the_weights(tiny):
    model = onnx.load(tiny["model"])

    prec = resolve_layer_precision([LayerConfig(op_types=("Conv",), weight_data_type="S4"),
                                    LayerConfig(layer_name="conv2", data_type="U16")], model)
    assert prec["conv1"].weights == "S4" and prec["conv1"].data_type == "U8" and not prec["conv1"].explicit
    assert prec["conv2"].weights == "S4" and prec["conv2"].data_type == "U16" and prec["conv2"].explicit
    assert prec["fc"].weights == "S8"
    prec = resolve_layer_precision([LayerConfig(op_types=("Conv",), weight_data_type="S4"),
                                    LayerConfig(layer_name="conv2", weight_data_type="S8", weight_granularity="per_tensor")],
                                   model)
    assert prec["conv2"].weights == "S8" and prec["conv2"].per_tensor_weights and prec["dwconv"].weights == "S4"


# ------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("dtype", ["S4", "U4"])
def test_4bit_build_is_packed_and_simulated_bit_exactly(tmp_path, tiny, tiny_config, dtype):
    w8 = _build(tiny, tiny_config, tmp_path / "w8", [])
    w4 = _build(tiny, tiny_config, tmp_path / "w4", [_weights_entry(dtype)])
    tensors = json.loads(w4.quant_config.read_text())["tensors"]
    weights = {k: v for k, v in tensors.items() if v["kind"] == "weight"}
    assert len(weights) == 4 and all(v["dtype"] == dtype and v["bit_width"] == 4 for v in weights.values())
    # The QDQ model stores the weights as onnx INT4 / UINT4 and onnxruntime runs it.
    qdq = onnx.load(w4.quantized_model)
    packed = [t for t in qdq.graph.initializer if t.data_type in INT4_TYPES and t.name.endswith("/q")]
    assert len(packed) == 4 and all(len(t.raw_data) == (int(np.prod(t.dims)) + 1) // 2 for t in packed)
    x = _samples(tiny)[0]
    ort.InferenceSession(str(w4.quantized_model), reference_session_options()).run(None, {"image": x})
    # Every op on the NPU; the compiled file holds 4-bit weights (S4 as stored, U4 centred to q - zp).
    log = (tmp_path / "w4" / "build.log").read_text()
    assert "compiled: 9 of 9 model ops on the NPU" in log
    compiled = onnx.load(w4.compiled_model)
    kinds = {t.data_type for t in compiled.graph.initializer}
    assert kinds & set(INT4_TYPES) and TensorProto.INT8 not in kinds  # U4: stored as is, zero points beside
    if dtype == "U4":
        convs = [n for sg in load_compiled(w4.compiled_model).subgraphs if sg.kind == "npu" for n in sg.graph.node
                 if n.op_type in ("QConv", "QMatMul")]
        assert convs and all(len(n.input) == 6 and n.input[5] for n in convs)  # w_zp / b_zps given
        stored = {t.name: t.data_type for t in compiled.graph.initializer}
        assert all(stored[n.input[1]] == TensorProto.UINT4 for n in convs)  # the weights as stored, packed
    ref, npu = _both_modes(w4.compiled_model, x)
    assert np.array_equal(ref, npu)
    float_out = ort.InferenceSession(str(tiny["model"])).run(None, {"image": x})[0]
    ref8 = pulsar.Session(w8.compiled_model, mode="Reference").run({"image": x})["logits"]
    assert np.abs(ref - float_out).max() < 0.25 * np.abs(float_out).max()  # coarser than 8 bits, still the model
    assert np.abs(ref8 - float_out).max() <= np.abs(ref - float_out).max()
    if dtype == "S4":  # (U4's zero points outweigh the packing on this tiny model: 432 weights)
        assert w4.compiled_model.stat().st_size < w8.compiled_model.stat().st_size


@pytest.mark.parametrize("algorithm", ["adaround", "brecq", "lsq"])
def test_fine_tuning_at_4_bits_improves_the_whole_model(tmp_path, tiny, tiny_config, algorithm):
    res = _build(tiny, tiny_config, tmp_path / algorithm, [_weights_entry("S4")],
                 **{f"quant.enable_{algorithm}": True, "quant.finetune_epochs": 60})
    log = (tmp_path / algorithm / "build.log").read_text()
    m = re.search(rf"fine-tuning \({algorithm}\): the whole model .*SQNR ([\d.]+) -> ([\d.]+) dB", log)
    assert m and float(m.group(2)) > float(m.group(1)) + 1.0, log[-2000:]
    assert "every block keeps its calibrated parameters" not in log
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    assert all(v["dtype"] == "S4" for v in tensors.values() if v["kind"] == "weight")
    ref, npu = _both_modes(res.compiled_model, _samples(tiny)[0])
    assert np.array_equal(ref, npu)


# ------------------------------------------------------------------------------ 4-bit QAT import
def _fold_batchnorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """The Conv + BatchNormalization pairs of ``model`` as one Conv (what a QAT export holds)."""
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    bns = {n.input[0]: n for n in g.node if n.op_type == "BatchNormalization"}
    nodes = []
    for n in g.node:
        if n.op_type == "BatchNormalization":
            continue
        bn = bns.get(n.output[0]) if n.op_type == "Conv" else None
        if bn is not None:
            gamma, beta, mean, var = (inits[x] for x in bn.input[1:5])
            k = gamma / np.sqrt(var + 1e-5)
            inits[n.input[1]] = (inits[n.input[1]] * k[:, None, None, None]).astype(np.float32)
            inits[n.input[2]] = ((inits[n.input[2]] - mean) * k + beta).astype(np.float32)
            n.output[0] = bn.output[0]
        nodes.append(n)
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, g.name, list(g.input), list(g.output),
                              [numpy_helper.from_array(v, k) for k, v in inits.items() if k in used])
    return helper.make_model(graph, opset_imports=list(model.opset_import))


def _qat_int4_model(float_path: Path, samples: list[np.ndarray], out: Path, *, unsigned: bool) -> Path:
    """The float model as a QAT tool exports it at opset 21: U8 Q/DQ pairs on every activation, every
    Conv / Gemm weight an onnx INT4 (or affine UINT4) initializer dequantized per output channel."""
    model = _fold_batchnorm(onnx.load(float_path))
    g = model.graph
    names = [o for n in g.node for o in n.output]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                              if n not in {o.name for o in g.output})
    sess = ort.InferenceSession(probe.SerializeToString())
    runs = [dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"image": x}), strict=True))
            for x in samples]
    ranges = {n: (min(0.0, min(float(r[n].min()) for r in runs)), max(0.0, max(float(r[n].max()) for r in runs)))
              for n in names}
    ranges["image"] = (min(0.0, min(float(x.min()) for x in samples)), max(float(x.max()) for x in samples))
    nodes, inits = [], {t.name: t for t in g.initializer}
    new_inits = []

    def act_qdq(name: str, dst: str | None = None) -> str:
        lo, hi = ranges[name]
        scale = np.float32(max(hi - lo, 1e-6) / 255)
        zp = np.uint8(np.clip(np.round(-lo / scale), 0, 255))
        new_inits.extend([numpy_helper.from_array(np.asarray(scale), f"{name}.s"),
                          numpy_helper.from_array(np.asarray(zp), f"{name}.z")])
        nodes.append(helper.make_node("QuantizeLinear", [name, f"{name}.s", f"{name}.z"], [f"{name}.q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}.q", f"{name}.s", f"{name}.z"],
                                      [dst or f"{name}.dq"]))
        return dst or f"{name}.dq"

    current = {"image": act_qdq("image")}
    for n in g.node:
        ins = []
        for k, i in enumerate(n.input):
            if i in current:
                ins.append(current[i])
            elif k == 1 and n.op_type in ("Conv", "Gemm"):
                w = numpy_helper.to_array(inits[i]).astype(np.float64)
                rows = w.reshape(w.shape[0], -1)
                if unsigned:
                    lo, hi = np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0)
                    scale = ((hi - lo) / 15).astype(np.float32)
                    zp = np.clip(np.round(-lo / scale), 0, 15)
                    q = np.clip(np.round(rows / scale[:, None]) + zp[:, None], 0, 15)
                    q_t = helper.make_tensor(f"{i}.q", TensorProto.UINT4, w.shape, q.astype(int).reshape(-1).tolist())
                    z_t = helper.make_tensor(f"{i}.z", TensorProto.UINT4, [w.shape[0]], zp.astype(int).tolist())
                    new_inits += [q_t, z_t]
                    dq_in = [f"{i}.q", f"{i}.s", f"{i}.z"]
                else:  # symmetric: the zero point is left out, its type is the data's
                    scale = (np.abs(rows).max(1) / 7).astype(np.float32)
                    q = np.clip(np.round(rows / scale[:, None]), -8, 7)
                    new_inits.append(helper.make_tensor(f"{i}.q", TensorProto.INT4, w.shape,
                                                        q.astype(int).reshape(-1).tolist()))
                    dq_in = [f"{i}.q", f"{i}.s"]
                new_inits.append(numpy_helper.from_array(scale, f"{i}.s"))
                nodes.append(helper.make_node("DequantizeLinear", dq_in, [f"{i}.dq"], axis=0))
                ins.append(f"{i}.dq")
                w_scale = scale
            elif k == 2 and n.op_type in ("Conv", "Gemm"):  # int32 bias on the input x weight grid
                x_scale = numpy_helper.to_array(next(t for t in new_inits if t.name == f"{n.input[0]}.s"))
                b_scale = (np.float64(x_scale) * w_scale).astype(np.float32)
                b = np.round(numpy_helper.to_array(inits[i]) / b_scale).astype(np.int32)
                new_inits += [numpy_helper.from_array(b, f"{i}.q"), numpy_helper.from_array(b_scale, f"{i}.s"),
                              numpy_helper.from_array(np.zeros_like(b), f"{i}.z")]
                nodes.append(helper.make_node("DequantizeLinear", [f"{i}.q", f"{i}.s", f"{i}.z"], [f"{i}.dq"], axis=0))
                ins.append(f"{i}.dq")
            else:
                ins.append(i)
        outputs = {x.name for x in g.output}
        nodes.append(helper.make_node(n.op_type, ins, [f"{o}.f" if o in outputs else o for o in n.output],
                                      name=n.name, domain=n.domain))
        nodes[-1].attribute.extend(n.attribute)
        for o in n.output:
            if o in outputs:  # the graph output is quantized too, dequantized under its own name
                ranges[f"{o}.f"] = ranges[o]
                act_qdq(f"{o}.f", o)
            elif [c.op_type for c in g.node if o in c.input] == ["Relu"]:
                current[o] = o  # Conv + Relu: one fused op, quantized after the Relu
            else:
                current[o] = act_qdq(o)
    weights = {i for n in g.node if n.op_type in ("Conv", "Gemm") for i in n.input[1:]}
    keep = [t for t in g.initializer if t.name not in weights]
    graph = helper.make_graph(nodes, "qat_int4", list(g.input), list(g.output), keep + new_inits)
    qat = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    qat.ir_version = 10
    onnx.checker.check_model(qat)
    onnx.save(qat, out)
    return out


@pytest.mark.parametrize("unsigned", [False, True], ids=["INT4", "UINT4"])
def test_a_4bit_qat_model_imports_and_runs_bit_exactly_in_both_modes(tmp_path, tiny, tiny_config, unsigned):
    samples = _samples(tiny)
    qat = _qat_int4_model(tiny["model"], samples, tmp_path / "qat.onnx", unsigned=unsigned)
    res = pulsar.build(qat, tmp_path / "out", tiny_config, {"model_type": "QuantONNX", "compiler.check": 2},
                       quiet=True)
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    dtype = "U4" if unsigned else "S4"
    imported = {k: v for k, v in tensors.items() if v["kind"] == "weight"}
    assert len(imported) == 4 and all(v["dtype"] == dtype for v in imported.values())
    # the imported scales are kept exactly
    qat_inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(qat).graph.initializer}
    for name, v in imported.items():
        base = name.removesuffix(".dq")
        assert np.array_equal(np.asarray(v["scale"], np.float32), qat_inits[f"{base}.s"]), name
    want = ort.InferenceSession(str(qat), reference_session_options())
    for x in samples[:4]:
        expected = want.run(None, {"image": x})[0]
        ref, npu = _both_modes(res.compiled_model, x)
        assert np.array_equal(ref, expected)
        assert np.array_equal(npu, expected)


def test_the_cost_model_reads_half_a_byte_per_4bit_weight(tmp_path, tiny, tiny_config):
    from pulsar.compiler.cost import estimate_model
    from pulsar.core.container import load_compiled

    def weight_bytes(res: pulsar.BuildResult, kind: str) -> int:
        est = estimate_model(load_compiled(res.compiled_model).subgraphs, "VNPU-M")
        return sum(op.workload.weight_bytes for sg in est.subgraphs for op in sg.ops if op.op_type == kind)

    w8 = _build(tiny, tiny_config, tmp_path / "w8", [])
    w4 = _build(tiny, tiny_config, tmp_path / "w4", [_weights_entry("S4")])
    for kind in ("QConv", "QMatMul"):
        # the weights halve; multipliers, shifts and biases (int32) stay
        assert 0 < weight_bytes(w4, kind) < weight_bytes(w8, kind)
    est8, est4 = (estimate_model(load_compiled(r.compiled_model).subgraphs, "VNPU-M") for r in (w8, w4))
    conv = [(a.workload.weight_bytes, b.workload.weight_bytes) for a, b in
            zip(est8.subgraphs[0].ops, est4.subgraphs[0].ops, strict=True) if a.op_type == "QConv"]
    w_elems = [8 * 3 * 3 * 3, 8 * 1 * 3 * 3, 8 * 8]  # conv1, dwconv, conv2 weights
    assert [b8 - b4 for b8, b4 in conv] == [n - (n + 1) // 2 for n in w_elems]


def test_onnxruntimes_int4_qdq_model_imports_bit_exactly(tmp_path, tiny, tiny_config):
    """onnxruntime's own quantizer at QInt4 weights writes com.microsoft DequantizeLinear on INT4 at the
    model's opset 13: the same import, both modes equal to onnxruntime on that model."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    samples = _samples(tiny)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(samples)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"image": x}

    q4 = tmp_path / "ort_int4.onnx"
    quantize_static(str(tiny["model"]), str(q4), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt4)
    assert TensorProto.INT4 in {t.data_type for t in onnx.load(q4).graph.initializer}
    res = pulsar.build(q4, tmp_path / "out", tiny_config, {"model_type": "QuantONNX", "compiler.check": 2},
                       quiet=True)
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    assert sum(v["dtype"] == "S4" and v["kind"] == "weight" for v in tensors.values()) == 4
    want = ort.InferenceSession(str(q4), reference_session_options())
    for x in samples[:3]:
        ref, npu = _both_modes(res.compiled_model, x)
        expected = want.run(None, {"image": x})[0]
        assert np.array_equal(ref, expected) and np.array_equal(npu, expected)
