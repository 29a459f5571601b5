"""Fast end-to-end: build the tiny CNN, run it with `pulsar run`, reproduce a build from its
effective config."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

import pulsar
from pulsar.core.ort_options import reference_session_options
from tests.cli_fork import run_pulsar


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = run_pulsar([*args], cwd=cwd, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _qdq_reference(path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), reference_session_options(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed), strict=True))


def test_cli_build_writes_every_artifact_and_effective_config(tmp_path, tiny, tiny_config):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config))
    out = tmp_path / "out"
    proc = _cli("build", "--input", str(tiny["model"]), "--output_dir", str(out), "--config", str(cfg),
                "--quant.calibration_method", "KL", "--compiler.check", "0", cwd=tmp_path)
    for rel in ("build_config.json", "build.log", "frontend/optimized.onnx", "quant/quantized.onnx",
                "quant/quant_config.json", "compiled.pulsar"):
        assert (out / rel).is_file(), rel
    eff = json.loads((out / "build_config.json").read_text())
    assert eff["quant"]["calibration_method"] == "KL" and eff["compiler"]["check"] == 0
    assert eff["input"] == str(tiny["model"]) and eff["output_dir"] == str(out)
    log = (out / "build.log").read_text()
    assert "Quant Config Table" in log and "Artifacts" in log and "quantization done" in log
    assert "Quant Config Table" in proc.stderr
    # The QDQ model is standard ONNX that onnxruntime runs; every quantized tensor is in the JSON.
    qmodel = onnx.load(out / "quant" / "quantized.onnx")
    onnx.checker.check_model(qmodel)
    qjson = json.loads((out / "quant" / "quant_config.json").read_text())
    dq_outputs = {n.output[0] for n in qmodel.graph.node if n.op_type == "DequantizeLinear"}
    assert set(qjson["tensors"]) <= {t.removesuffix("/dq") for t in dq_outputs}
    kinds = {v["kind"] for v in qjson["tensors"].values()}
    assert {"activation", "weight", "bias"} <= kinds
    assert all(v["dtype"] == "S8" and v["policy"]["PER_CHANNEL"] for v in qjson["tensors"].values()
               if v["kind"] == "weight")
    assert all(v["dtype"] == "U8" for v in qjson["tensors"].values() if v["kind"] == "activation")
    assert all(v["dtype"] == "S32" for v in qjson["tensors"].values() if v["kind"] == "bias")

    # Rebuilding from build_config.json alone gives the same quantized model.
    out2 = tmp_path / "out2"
    _cli("build", "--config", str(out / "build_config.json"), "--output_dir", str(out2), cwd=tmp_path)
    assert (out2 / "quant" / "quantized.onnx").read_bytes() == (out / "quant" / "quantized.onnx").read_bytes()


def test_pulsar_run_reproduces_the_quantized_model(tmp_path, tiny, tiny_config):
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    rng = np.random.default_rng(7)
    samples = tmp_path / "samples"
    feeds = []
    for i in range(3):
        d = samples / f"s{i}"
        d.mkdir(parents=True)
        x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
        feeds.append(x)
        if i == 2:
            x.tofile(d / "image.bin")          # raw .bin works too
        else:
            np.save(d / "image.npy", x)
    (tmp_path / "list.txt").write_text("s0\n# a comment\n\ns1\n" + str(samples / "s2") + "\n")
    _cli("run", "--model", str(res.compiled_model), "--input_dir", str(samples), "--list",
         str(tmp_path / "list.txt"), "--output_dir", str(tmp_path / "run"), cwd=tmp_path)
    for i, x in enumerate(feeds):
        got = np.load(tmp_path / "run" / f"s{i}" / "logits.npy")
        want = _qdq_reference(res.quantized_model, {"image": x})["logits"]
        np.testing.assert_array_equal(got, want)
    _cli("run", "--model", str(res.compiled_model), "--input_dir", str(samples / "s0"), "--output_dir",
         str(tmp_path / "single"), cwd=tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "single" / "logits.npy"),
                                  np.load(tmp_path / "run" / "s0" / "logits.npy"))


@pytest.mark.parametrize("method", ["MinMax", "Percentile", "MSE", "KL", "ACIQ_Laplace", "ACIQ_Gauss", "Std", "Mean",
                                    "WeightedScale", "InIR"])
def test_every_calibration_method_builds_and_stays_close_to_float(tmp_path_factory, tiny, tiny_config, method):
    work = tmp_path_factory.getbasetemp() / "shared_work"
    res = pulsar.build(tiny["model"], tmp_path_factory.mktemp(method), tiny_config,
                       {"quant.calibration_method": method, "work_dir": str(work), "compiler.check": 3},
                       quiet=True)
    x = np.load(sorted(Path(tiny["calib"]).glob("*.npy"))[0])
    want = ort.InferenceSession(str(tiny["model"])).run(None, {"image": x})[0]
    got = pulsar.Session(res.compiled_model).run({"image": x})["logits"]
    cos = float((want * got).sum() / (np.linalg.norm(want) * np.linalg.norm(got)))
    assert cos > 0.98, (method, cos)
    meta = pulsar.Session(res.compiled_model).metadata
    assert meta["calibration_method"] == method and meta["target_hardware"] == "VNPU-M"


def test_calibration_statistics_are_cached(tmp_path, tiny, tiny_config):
    work = tmp_path / "work"
    pulsar.build(tiny["model"], tmp_path / "a", tiny_config, {"work_dir": str(work)}, quiet=True)
    cached = list((work / "cache").glob("calib_stats_*.npz"))
    assert len(cached) == 1
    pulsar.build(tiny["model"], tmp_path / "b", tiny_config, {"work_dir": str(work),
                                                               "quant.calibration_method": "MSE"}, quiet=True)
    assert "cache hit" in (tmp_path / "b" / "build.log").read_text()
    # ... and the cached build equals a fresh one with that method.
    fresh = pulsar.build(tiny["model"], tmp_path / "c", tiny_config, {"work_dir": str(tmp_path / "fresh"),
                                                                       "quant.calibration_method": "MSE"}, quiet=True)
    assert "cache miss" in (tmp_path / "c" / "build.log").read_text()
    assert fresh.quantized_model.read_bytes() == (tmp_path / "b" / "quant" / "quantized.onnx").read_bytes()


def test_fp32_layer_config_keeps_the_layer_float(tmp_path, tiny, tiny_config):
    tiny_config["quant"]["layer_configs"] = [{"layer_name": "fc", "data_type": "FP32"}]
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    qjson = json.loads(res.quant_config.read_text())
    assert qjson["nodes"]["fc"]["placement"] == "CPU"
    assert qjson["nodes"]["fc"]["placement_reason"] == "layer_configs data_type FP32"
    assert "fc.w" not in qjson["tensors"] and "logits" not in qjson["tensors"]
    assert "Layer Config Table" in (tmp_path / "out" / "build.log").read_text()


def _dtypes(res) -> dict[str, str]:
    return {k: v["dtype"] for k, v in json.loads(res.quant_config.read_text())["tensors"].items()}


@pytest.mark.parametrize("layer_configs,highest,expect", [
    # a named layer beats its op type; a tensor takes the widest of its producer's and readers' dtypes
    ([{"op_type": "Conv", "data_type": "S16", "weight_data_type": "S16"},
      {"layer_name": "conv2", "data_type": "U8"}],
     False, {"image": "S16", "c2": "U8", "dw.w": "S16", "c2.w": "S8", "fc.w": "S8", "r1": "S16", "r2": "U8"}),
    # a subgraph between two tensors (its first layers read r1, so r1 is 16-bit too)
    ([{"start_tensor_names": ["r1"], "end_tensor_names": ["res"], "data_type": "U16"}],
     False, {"r2": "U16", "c2": "U16", "res": "U16", "r1": "U16", "gap": "U8"}),
    # FP32 output and weights of one layer; everything else 16 bits
    ([{"op_type": "Gemm", "data_type": "U8", "output_data_type": "FP32", "weight_data_type": "FP32"}],
     True, {"image": "U16", "res": "U16", "gap": "U16"}),
])
def test_mixed_precision(tmp_path, tiny, tiny_config, layer_configs, highest, expect):
    tiny_config["quant"]["layer_configs"] = layer_configs
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {
        "quant.highest_mix_precision": highest, "compiler.check": 2, "quant.check": 1}, quiet=True)
    got = _dtypes(res)
    assert {k: got.get(k) for k in expect} == expect
    if highest:
        assert "logits" not in got and "fc.w" not in got and "fc.b" not in got
    # 16-bit tensors use onnxruntime's wide QuantizeLinear / DequantizeLinear; the model runs and stays close.
    qmodel = onnx.load(res.quantized_model)
    wide = {n.output[0] for n in qmodel.graph.node if n.domain == "com.microsoft"}
    assert bool(wide) == any(v.endswith("16") for v in got.values())
    x = np.load(sorted(Path(tiny["calib"]).glob("*.npy"))[0])
    want = ort.InferenceSession(str(tiny["model"])).run(None, {"image": x})[0]
    out = pulsar.Session(res.compiled_model).run({"image": x})["logits"]
    assert float((want * out).sum() / np.linalg.norm(want) / np.linalg.norm(out)) > 0.999


def test_sixteen_bits_beat_eight_on_error(tmp_path, tiny, tiny_config):
    x = np.load(sorted(Path(tiny["calib"]).glob("*.npy"))[1])
    want = ort.InferenceSession(str(tiny["model"])).run(None, {"image": x})[0]
    errs = {}
    for highest in (False, True):
        res = pulsar.build(tiny["model"], tmp_path / f"o{highest}", tiny_config,
                           {"quant.highest_mix_precision": highest}, quiet=True)
        errs[highest] = float(np.abs(pulsar.Session(res.compiled_model).run({"image": x})["logits"] - want).max())
    assert errs[True] < errs[False] / 4, errs


def test_transformation_check_runs_on_calibration_samples(tmp_path, tiny, tiny_config):
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {"onnx_opt.model_check": True}, quiet=True)
    log = (tmp_path / "out" / "build.log").read_text()
    assert "Model check" in log and "fold_batchnorm" in log
    ops = {n.op_type for n in onnx.load(res.optimized_model).graph.node}
    assert "BatchNormalization" not in ops and "Identity" not in ops


def test_option_fields_act_as_named(tmp_path, tiny, tiny_config):
    """conv_bias_data_type FP32, quant.check 1, onnxsim, compiler.input_sample_dir + check 2."""
    samples = tmp_path / "samples"
    for i in range(2):
        (samples / f"s{i}").mkdir(parents=True)
        np.save(samples / f"s{i}" / "image.npy", np.full((1, 3, 16, 16), 0.1 * i, np.float32))
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {
        "quant.conv_bias_data_type": "FP32", "quant.check": 1, "onnx_opt.enable_onnxsim": True,
        "compiler.check": 2, "compiler.input_sample_dir": str(samples)}, quiet=True)
    qjson = json.loads(res.quant_config.read_text())
    assert not [t for t, v in qjson["tensors"].items() if v["kind"] == "bias"]
    assert {"dw.b", "fc.b"} <= {t.name for t in onnx.load(res.quantized_model).graph.initializer}
    log = (tmp_path / "out" / "build.log").read_text()
    assert "quant check:" in log and "onnxsim simplified" in log
    assert log.count("all-equal") >= 1 and "FAIL" not in log


def test_refine_weight_threshold_floors_tiny_weight_channels(tmp_path, tiny, tiny_config):
    import onnx.numpy_helper as nh

    model = onnx.load(tiny["model"])
    w = next(t for t in model.graph.initializer if t.name == "c2.w")
    arr = nh.to_array(w).copy()
    arr[0] = 1e-9  # a dead output channel
    w.CopyFrom(nh.from_array(arr, "c2.w"))
    path = tmp_path / "dead.onnx"
    onnx.save(model, path)
    scales = {}
    for thr in (1e-6, -1):
        res = pulsar.build(path, tmp_path / f"out{thr}", tiny_config, {"quant.refine_weight_threshold": thr},
                           quiet=True)
        scales[thr] = json.loads(res.quant_config.read_text())["tensors"]["c2.w"]["scale"][0]
    assert scales[1e-6] == pytest.approx(1e-6 / 127, rel=1e-3)
    assert scales[-1] == pytest.approx(1e-9 / 127, rel=1e-3)


def test_processors_make_the_compiled_model_take_the_deployed_input(tmp_path, tiny, tiny_config):
    """NHWC uint8 BGR in, mean / std inside; an U8 NHWC output; an extra shape (model layout) compiled."""
    tiny_config["input_processors"] = [{"tensor_name": "image", "tensor_format": "BGR", "src_format": "BGR",
                                        "src_layout": "NHWC", "src_dtype": "U8",
                                        "mean": [10.0, 20.0, 30.0], "std": [50.0, 60.0, 70.0],
                                        "src_extra_shapes": [{"shape": [1, 3, 32, 32]}]}]
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {"compiler.check": 2}, quiet=True)
    sess = pulsar.Session(res.compiled_model)
    assert sess.inputs[0].shape == (1, 16, 16, 3) and sess.inputs[0].dtype == np.uint8
    group1 = pulsar.Session(res.compiled_model, group=1)
    assert group1.inputs[0].shape == (1, 32, 32, 3) and group1.inputs[0].dtype == np.uint8
    raw = np.random.default_rng(3).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    normalized = ((raw.astype(np.float32) - np.float32([10, 20, 30])) / np.float32([50, 60, 70])).transpose(0, 3, 1, 2)
    want = _qdq_reference(res.quantized_model, {"image": np.ascontiguousarray(normalized)})["logits"]
    np.testing.assert_allclose(sess.run({"image": raw})["logits"], want, atol=1e-5)


@pytest.mark.parametrize("method", ["PerLayer", "EndToEnd"])
def test_precision_analysis_writes_table_and_graph(tmp_path, tiny, tiny_config, method):
    samples = tmp_path / "samples"
    for i in range(2):
        (samples / f"s{i}").mkdir(parents=True)
        np.save(samples / f"s{i}" / "image.npy", np.random.default_rng(i).standard_normal((1, 3, 16, 16)).astype(np.float32))
    pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {
        "quant.precision_analysis": True, "quant.precision_analysis_method": method,
        "quant.input_sample_dir": str(samples)}, quiet=True)
    debug = tmp_path / "out" / "quant" / "debug"
    table = (debug / "precision_analysis_table.txt").read_text()
    assert f"[{method} Reference]" in table
    for col in ("Operator", "Type", "Output Tensor", "Shape", "DType", "QDType", "Cosine", "MSE", "SQNR"):
        assert col in table
    assert "fc " in table and "Gemm" in table
    assert (debug / "precision_analysis.mmd").read_text().startswith("flowchart")
    assert "precision analysis: lowest cosine" in (tmp_path / "out" / "build.log").read_text()


def test_auto_mixed_precision_writes_layer_configs_that_reproduce_it(tmp_path, tiny, tiny_config):
    # One calibration sample with 300x outliers: MinMax ranges get far too wide for 8 bits, so raising
    # the right layers to 16 bits pays off.
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(5)
    for i in range(6):
        np.save(calib / f"{i}.npy", (rng.standard_normal((1, 3, 16, 16)) * (300 if i == 0 else 1)).astype(np.float32))
    tiny_config["quant"]["input_configs"][0]["calibration_dataset"] = str(calib)
    res = pulsar.build(tiny["model"], tmp_path / "auto", tiny_config, {
        "quant.auto_mixed_precision.enable": True, "quant.auto_mixed_precision.max_16bit_layers": 8,
        "quant.auto_mixed_precision.num_samples": 6}, quiet=True)
    found = json.loads((tmp_path / "auto" / "quant" / "auto_mixed_precision.json").read_text())
    assert [len(t["layers"]) for t in found["trials"]][:2] == [0, 1]
    assert len(found["sensitivity"]) >= 4
    chosen = found["layer_configs"]
    best = max(found["trials"], key=lambda t: t["cosine"])
    assert best["cosine"] > found["trials"][0]["cosine"] + 0.1, found["trials"]
    assert chosen and set(best["layers"]) <= set(chosen[0]["layer_names"]), found
    if chosen:
        qjson, dtypes = json.loads(res.quant_config.read_text()), _dtypes(res)
        for name in chosen[0]["layer_names"]:
            node = qjson["nodes"][name]
            assert any(dtypes.get(t, "").endswith("16") for t in node["inputs"] + node["outputs"]), name
        # Keeping the written layer_configs in the config reproduces the same quantized model.
        tiny_config["quant"]["layer_configs"] = chosen
        again = pulsar.build(tiny["model"], tmp_path / "kept", tiny_config, quiet=True)
        assert again.quantized_model.read_bytes() == res.quantized_model.read_bytes()


def test_smooth_quant_runs_in_the_build(tmp_path, tiny, tiny_config):
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {
        "quant.enable_smooth_quant": True, "quant.smooth_quant_threshold": 1.0, "compiler.check": 2}, quiet=True)
    log = (tmp_path / "out" / "build.log").read_text()
    assert "SmoothQuant" in log and "smooth quant: 2 of 2 candidate layers smoothed" in log
    x = np.load(sorted(Path(tiny["calib"]).glob("*.npy"))[0])
    want = ort.InferenceSession(str(tiny["model"])).run(None, {"image": x})[0]
    got = pulsar.Session(res.compiled_model).run({"image": x})["logits"]
    assert float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got)) > 0.999


def test_smooth_quant_options_without_smooth_quant_warn(tiny_config):
    from pulsar.config import load_build_config

    eff = load_build_config(tiny_config, {"quant.smooth_quant_strength": 0.9}, require_io=False)
    assert eff.data["quant"]["smooth_quant_strength"] == 0.6
    assert len(eff.warnings) == 1
    assert "smooth_quant_strength" in eff.warnings[0] and "quant.enable_smooth_quant" in eff.warnings[0]


def test_easy_quant_runs_in_the_build(tmp_path, tiny, tiny_config):
    base = pulsar.build(tiny["model"], tmp_path / "base", tiny_config, quiet=True)
    res = pulsar.build(tiny["model"], tmp_path / "eq", tiny_config, {"quant.enable_easy_quant": True,
                                                                      "compiler.check": 2, "quant.check": 1}, quiet=True)
    log = (tmp_path / "eq" / "build.log").read_text()
    assert "EasyQuant" in log and "easy quant:" in log
    # quant_config.json follows the searched scales of the model it describes
    qjson = json.loads(res.quant_config.read_text())["tensors"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(res.quantized_model).graph.initializer}
    for name, tq in qjson.items():
        assert np.allclose(np.asarray(tq["scale"], np.float32).ravel(), inits[f"{name}/scale"].ravel()), name
    assert base.quant_config.read_text() != res.quant_config.read_text()
