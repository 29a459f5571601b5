"""model_type QuantModel (pulsar2: QuantAxModel): an earlier build's quantized model compiled again, for
another target or batch sizes, without the float model's frontend and without calibration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

import pulsar
from pulsar.core.container import load_compiled
from pulsar.errors import PulsarError
from tests.hostile.harness import assert_clean_failure, run_cli


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory) -> Path:
    """A finished build whose calibration data is gone afterwards: a recompile that tried to calibrate
    (or to read the float model's data at all) would fail."""
    root = tmp_path_factory.mktemp("recompile")
    calib = Path(shutil.copytree(tiny["calib"], root / "calib"))
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "src_dtype": "U8"}]}
    out = pulsar.build(tiny["model"], root / "base", cfg, quiet=True).output_dir
    shutil.rmtree(calib)
    return out


def _recompile(src: Path | str, out: Path, overrides: dict | None = None, config: dict | None = None):
    return pulsar.build(src, out, config, {"model_type": "QuantModel", **(overrides or {})}, quiet=True)


def _inputs(path: Path, n: int = 3) -> list[dict[str, np.ndarray]]:
    info = pulsar.Session(path).inputs[0]
    rng = np.random.default_rng(0)
    return [{info.name: rng.integers(0, 256, (1, *info.shape[1:])).astype(info.dtype)} for _ in range(n)]


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in load_compiled(path).model.graph.initializer}


def test_same_settings_give_the_same_compiled_model_byte_for_byte(base, tmp_path):
    res = _recompile(base, tmp_path / "re")
    assert res.compiled_model.read_bytes() == (base / "compiled.pulsar").read_bytes()
    assert set(res.stage_seconds) == {"load quantized model", "compile"}  # no frontend, data or calibration
    for name in ("quantized.onnx", "quant_config.json"):  # the output dir is complete, and itself an input
        assert (res.output_dir / "quant" / name).read_bytes() == (base / "quant" / name).read_bytes()
    assert res.optimized_model.is_file()
    written = json.loads((res.output_dir / "build_config.json").read_text())
    assert written["model_type"] == "QuantModel" and written["input"] == str(base)
    assert written["input_processors"][0]["src_dtype"] == "U8"  # the base build's config is the base
    again = _recompile(res.output_dir, tmp_path / "again")  # a recompile's output recompiles the same
    assert again.compiled_model.read_bytes() == res.compiled_model.read_bytes()


def test_another_target_and_batch_sizes_keep_every_scale_and_output(base, tmp_path):
    res = _recompile(base, tmp_path / "re", {"target_hardware": "VNPU-L", "compiler.static_batch_sizes": [1, 2],
                                              "compiler.check": 2})
    meta = load_compiled(res.compiled_model).metadata
    assert meta["target_hardware"] == "VNPU-L" and meta["batch_sizes"] == [1, 2]
    old = load_compiled(base / "compiled.pulsar").metadata
    assert meta["estimate"]["target"] == "VNPU-L" != old["estimate"]["target"]
    new_w, old_w = _weights(res.compiled_model), _weights(base / "compiled.pulsar")
    assert new_w.keys() == old_w.keys()  # integer weights, scales and zero points: the same, stored once
    for name, value in old_w.items():
        np.testing.assert_array_equal(new_w[name], value, err_msg=name)
    assert res.quant_config.read_bytes() == (base / "quant" / "quant_config.json").read_bytes()
    before, after = pulsar.Session(base / "compiled.pulsar"), pulsar.Session(res.compiled_model)
    for feeds in _inputs(base / "compiled.pulsar"):
        np.testing.assert_array_equal(after.run(feeds)["logits"], before.run(feeds)["logits"])
    pair = {"image": np.concatenate([f["image"] for f in _inputs(base / "compiled.pulsar", 2)])}
    np.testing.assert_array_equal(after.run_batches(pair, 2)["logits"],
                                  np.concatenate([before.run({"image": pair["image"][i:i + 1]})["logits"]
                                                  for i in range(2)]))


def test_pulsar2_name_and_the_quantized_onnx_file_are_accepted(base, tmp_path):
    res = pulsar.build(base / "quant" / "quantized.onnx", tmp_path / "re", None, {"model_type": "QuantAxModel"},
                       quiet=True)
    assert res.compiled_model.read_bytes() == (base / "compiled.pulsar").read_bytes()


def test_a_quant_setting_is_named_and_kept_as_the_model_was_built(base, tmp_path):
    res = _recompile(base, tmp_path / "re", {"quant.calibration_method": "KL", "input_shapes": "image:1x3x32x32"})
    log = (res.output_dir / "build.log").read_text()
    assert "quant.calibration_method: \"KL\" has no effect when recompiling" in log
    assert "input_shapes: \"image:1x3x32x32\" has no effect when recompiling" in log
    written = json.loads((res.output_dir / "build_config.json").read_text())
    assert written["quant"]["calibration_method"] == "MinMax" and written["input_shapes"] == ""
    assert res.compiled_model.read_bytes() == (base / "compiled.pulsar").read_bytes()


def test_a_new_input_processor_acts(base, tmp_path):
    res = _recompile(base, tmp_path / "re", {"input_processors": [{"tensor_name": "image", "src_dtype": "FP32"}]})
    assert pulsar.Session(res.compiled_model).inputs[0].dtype == np.float32
    assert pulsar.Session(base / "compiled.pulsar").inputs[0].dtype == np.uint8


def test_recompiling_in_place_keeps_the_quantized_model(base, tmp_path):
    out = Path(shutil.copytree(base, tmp_path / "out"))
    before = (out / "quant" / "quantized.onnx").read_bytes()
    _recompile(out, out, {"npu_mode": "NPU2"})
    assert (out / "quant" / "quantized.onnx").read_bytes() == before
    assert load_compiled(out / "compiled.pulsar").metadata["npu_mode"] == "NPU2"


@pytest.mark.parametrize(("make", "needle"), [
    (lambda b, t: b / "compiled.pulsar", "give its build's output dir"),
    (lambda b, t: t, "holds no quant/quantized.onnx"),
    (lambda b, t: t / "missing", "does not exist"),
])
def test_inputs_that_are_not_a_quant_output_are_refused(base, tmp_path, make, needle):
    with pytest.raises(PulsarError, match=needle):
        _recompile(make(base, tmp_path), tmp_path / "re")
    assert not (tmp_path / "re").exists()


def test_quant_files_of_two_builds_are_refused(base, tmp_path):
    quant = Path(shutil.copytree(base / "quant", tmp_path / "quant"))
    qjson = json.loads((quant / "quant_config.json").read_text())
    qjson["nodes"]["other_conv"] = {"op_type": "Conv", "placement": "NPU", "placement_reason": ""}
    (quant / "quant_config.json").write_text(json.dumps(qjson))
    with pytest.raises(PulsarError, match="come from different builds"):
        _recompile(quant, tmp_path / "re")


def test_a_build_dir_as_a_float_model_says_how_to_recompile(base, tmp_path):
    with pytest.raises(PulsarError, match="model_type QuantModel"):
        pulsar.build(base, tmp_path / "re", None, {}, quiet=True)


def test_cli_recompiles_a_build_dir(base, tmp_path):
    proc = run_cli(["build", "--model_type", "QuantAxModel", "--input", str(base), "--output_dir", "out",
                    "--target_hardware", "VNPU-S"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert load_compiled(tmp_path / "out" / "compiled.pulsar").metadata["target_hardware"] == "VNPU-S"
    bad = run_cli(["build", "--model_type", "QuantModel", "--input", str(base / "compiled.pulsar"), "--output_dir",
                   "out2"], tmp_path)
    assert_clean_failure(bad, "give its build's output dir")


def test_model_type_from_a_config_file(base, tmp_path):
    cfg = tmp_path / "recompile.yaml"
    cfg.write_text("model_type: QuantModel\nnpu_mode: NPU2\n")
    res = pulsar.build(base, tmp_path / "re", cfg, quiet=True)
    assert load_compiled(res.compiled_model).metadata["npu_mode"] == "NPU2"
