"""The compiler end to end: integer NPU programs in the compiled model, the two run modes, the
checks (a corrupted multiplier caught by check 2 per layer), the estimate and the Chrome trace."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import pulsar
from pulsar.core.integrity import sealed_bytes
from pulsar.errors import PulsarError
from pulsar.runtime.check import compare, integer_reference
from pulsar.runtime.session import Session


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"check": 2, "check_mode": "CheckPerLayer", "npu_perf": True}}
    out = tmp_path_factory.mktemp("npu")
    return pulsar.build(tiny["model"], out, cfg, quiet=True), out


def _x(seed=0):
    return {"image": np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)}


def test_compiled_model_holds_integer_programs(built):
    res, _ = built
    m = onnx.load(str(res.compiled_model))
    npu = [n for n in m.graph.node if n.domain == "pulsar.npu"]
    assert npu, "no NPU subgraph"
    for node in npu:
        attrs = {a.name: a for a in node.attribute}
        assert {n.domain for n in attrs["body"].g.node} <= {"pulsar.int", ""}
        assert any(n.op_type == "QConv" for n in attrs["body"].g.node)
        assert any(n.op_type == "QuantizeLinear" for n in attrs["reference_body"].g.node)
    meta = json.loads({p.key: p.value for p in m.metadata_props}["pulsar.estimate"])
    assert meta["cycles"] > 0 and meta["target"] == "VNPU-M"


def test_modes_agree_and_reference_equals_qdq(built):
    res, _ = built
    import onnxruntime as ort

    from pulsar.core.ort_options import reference_session_options

    npu, ref = Session(res.compiled_model), Session(res.compiled_model, mode="Reference")
    qdq = ort.InferenceSession(str(res.quantized_model), reference_session_options(),
                               providers=["CPUExecutionProvider"])
    for seed in range(3):
        x = _x(seed)
        r = ref.run(x)["logits"]
        np.testing.assert_array_equal(r, qdq.run(None, x)[0])
        n = npu.run(x)["logits"]
        step = float(json.loads(res.quant_config.read_text())["tensors"]["logits"]["scale"])
        assert np.abs(n - r).max() <= 2 * step + 1e-6


def test_corrupted_multiplier_is_named_by_check_2_per_layer(built, tmp_path):
    res, out = built
    m = onnx.load(str(res.compiled_model))
    body = next(a.g for n in m.graph.node if n.domain == "pulsar.npu" for a in n.attribute if a.name == "body")
    conv = next(n for n in body.node if n.op_type == "QConv")
    m_name = conv.input[3]
    init = next(t for t in m.graph.initializer if t.name == m_name)
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] = arr.flat[0] * 3 // 2  # one channel's multiplier off by half
    init.CopyFrom(numpy_helper.from_array(arr, m_name))
    bad = tmp_path / "corrupted.pulsar"
    bad.write_bytes(sealed_bytes(m))  # a valid checksum: the check, not the loader, must find the change

    class C:
        check, check_mode, check_tensor_black_list = 2, "CheckPerLayer", []

    ref = integer_reference(onnx.load(str(res.quantized_model)), tmp_path / "ref.pulsar")
    compare(Session(res.compiled_model), ref, [_x()], C, "integer reference")  # the intact file passes
    with pytest.raises(PulsarError) as e:
        compare(Session(bad), ref, [_x()], C, "integer reference")
    assert f"'{conv.output[0]}'" in str(e.value) and "CheckPerLayer" in str(e.value)
    # the black list skips that tensor (the next one differs then only if the error propagates: it
    # does not, each op is fed the reference's inputs)
    C.check_tensor_black_list = [conv.output[0].replace("/", ".")]
    compare(Session(bad), ref, [_x()], C, "integer reference")


def test_trace_and_estimate_follow_npu_mode_and_bandwidth(tiny, tmp_path, built):
    _, out = built
    trace = json.loads((out / "compiler" / "npu_perf_trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert events and all(e["dur"] >= 0 for e in events)

    def cycles(**over):
        cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                            "calibration_format": "Numpy"}]}}
        res = pulsar.build(tiny["model"], tmp_path / str(len(list(tmp_path.iterdir()))), cfg,
                           {"work_dir": str(tmp_path / "work"), **over}, quiet=True)
        m = onnx.load(str(res.compiled_model))
        return json.loads({p.key: p.value for p in m.metadata_props}["pulsar.estimate"])["cycles"]

    base = cycles()
    assert cycles(**{"compiler.ddr_bw_limit": 0.05}) > base
    assert cycles(target_hardware="VNPU-L", npu_mode="NPU4") < cycles(target_hardware="VNPU-L")


def test_pulsar_run_modes_perlayer_and_batches(built, tmp_path):
    res, _ = built
    inp = tmp_path / "in"
    inp.mkdir()
    x = np.concatenate([_x(0)["image"], _x(1)["image"]])
    np.save(inp / "image.npy", x)
    pulsar.api.run_model(res.compiled_model, tmp_path / "o", input_dir=inp, batch_size=2, perlayer=True)
    y = np.load(tmp_path / "o" / "logits.npy")
    one = Session(res.compiled_model).run(_x(1))["logits"]
    assert y.shape[0] == 2 and np.array_equal(y[1:], one)
    assert len(list((tmp_path / "o" / "perlayer" / "batch_0").glob("*.npy"))) > 5
    with pytest.raises(PulsarError, match=r"expects shape \(3, 3, 16, 16\)"):
        pulsar.api.run_model(res.compiled_model, tmp_path / "o3", input_dir=inp, batch_size=3)


def test_precision_analysis_from_the_simulator(tiny, tmp_path):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 4}],
                     "precision_analysis": True, "precision_analysis_method": "EndToEnd",
                     "precision_analysis_mode": "NPUBackend"}}
    res = pulsar.build(tiny["model"], tmp_path / "o", cfg, quiet=True)
    text = (tmp_path / "o" / "quant" / "debug" / "precision_analysis_table.txt").read_text()
    assert text.startswith("Quant Precision Table [EndToEnd NPUBackend]")
    rows = [line for line in text.splitlines()[3:] if line.strip()]
    cos = {line.split()[0]: float(line.split()[-3]) for line in rows}
    assert "fc" in cos and 0.9 < cos["fc"] <= 1.0 + 1e-9
    assert (tmp_path / "o" / "quant" / "debug" / "precision_analysis.mmd").is_file()
    assert res.compiled_model.is_file()
    with pytest.raises(PulsarError, match="precision_analysis_method EndToEnd"):
        cfg["quant"]["precision_analysis_method"] = "PerLayer"
        pulsar.build(tiny["model"], tmp_path / "bad", cfg, quiet=True)


def test_output_processors_in_a_build(tiny, tmp_path):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 4}]},
           "output_processors": [{"tensor_name": "logits", "output_dtype": "S16"}],
           "compiler": {"check": 2, "check_mode": "CheckPerLayer"}}
    res = pulsar.build(tiny["model"], tmp_path / "o", cfg, quiet=True)
    sess = Session(res.compiled_model)
    assert sess.outputs[0].dtype == np.int16
    y = sess.run(_x())["logits"]
    ref = Session(res.compiled_model, mode="Reference").run(_x())["logits"]
    assert y.dtype == np.int16 and np.abs(y.astype(int) - ref.astype(int)).max() <= 2
