"""Malformed configs and inputs: each gives exit code 2, one line naming the problem, no traceback,
and leaves no artifact behind (no half-written output)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.cli_fork import run_pulsar

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def _calib_entry(path, fmt="Numpy", name="image", **kw):
    return {"tensor_name": name, "calibration_dataset": str(path), "calibration_format": fmt, **kw}


def _cfg(entry=None, **extra):
    cfg = {"quant": {"input_configs": [entry]}} if entry else {}
    for k, v in extra.items():
        cfg.setdefault(k, {}).update(v) if isinstance(v, dict) else cfg.__setitem__(k, v)
    return cfg


def _case_setups(root: Path, tiny: dict[str, Path]):
    """name -> (config contents or None, extra argv, expected text in the message)."""
    good = _calib_entry(tiny["calib"])
    cases: dict[str, tuple] = {}

    def cfg(name, c, args=(), needle="", ext="json"):
        cases[name] = (c, list(args), needle, ext)

    cfg("typo_key", {"quant": {"calibraton_method": "KL", "input_configs": [good]}}, needle='did you mean "calibration_method"')
    cfg("typo_section", {"comiler": {"check": 1}, "quant": {"input_configs": [good]}}, needle='did you mean "compiler"')
    cfg("wrong_type", {"quant": {"input_configs": [{**good, "calibration_size": "8"}]}},
        needle="quant.input_configs[0].calibration_size: '8' is a string, expected an integer")
    cfg("bad_enum", {"quant": {"calibration_method": "kl", "input_configs": [good]}}, needle='did you mean "KL"')
    cfg("bad_enum_format", {"quant": {"input_configs": [{**good, "calibration_format": "Numpi"}]}},
        needle='did you mean "Numpy"')
    cfg("out_of_range", {"quant": {"input_configs": [good]}}, ["--compiler.check", "7"], "compiler.check: 7")
    cfg("exclusive_batch", {"quant": {"input_configs": [good]},
                            "compiler": {"static_batch_sizes": [1, 2], "max_dynamic_batch_size": 4}},
        needle="exclude each other")
    cfg("two_selectors", {"quant": {"input_configs": [good], "layer_configs": [{"op_type": "Conv", "layer_name": "fc"}]}},
        needle="exactly one selector")
    cfg("unknown_tensor", {"quant": {"input_configs": [{**good, "tensor_name": "imag"}]}},
        needle="quant.input_configs[0].tensor_name: 'imag' is not an input of the model (did you mean \"image\"?)")
    cfg("unknown_layer", {"quant": {"input_configs": [good], "layer_configs": [{"layer_name": "conv_1", "data_type": "FP32"}]}},
        needle="quant.layer_configs[0].layer_name: 'conv_1' is not a layer")
    cfg("unknown_op_type", {"quant": {"input_configs": [good], "layer_configs": [{"op_type": "Softmax", "data_type": "FP32"}]}},
        needle="'Softmax' is not an op type")
    cfg("missing_dataset", {"quant": {"input_configs": [{**good, "calibration_dataset": str(root / "nope")}]}},
        needle="does not exist")
    cfg("no_calibration", {}, needle="quant.input_configs: empty")
    cfg("unknown_flag", {"quant": {"input_configs": [good]}}, ["--quant.calibraton_method", "KL"],
        'did you mean "--quant.calibration_method"')
    cfg("bad_bool_flag", {"quant": {"input_configs": [good]}}, ["--onnx_opt.model_check", "maybe"], "not a boolean")
    cfg("bad_int_flag", {"quant": {"input_configs": [good]}}, ["--compiler.check", "two"], "not an integer")
    cfg("bad_input_shapes", {"quant": {"input_configs": [good]}}, ["--input_shapes", "image=1x3"], "input_shapes")
    cfg("input_shapes_unknown", {"quant": {"input_configs": [good]}}, ["--input_shapes", "img:1x3x16x16"],
        'did you mean "image"')
    cfg("input_shapes_rank", {"quant": {"input_configs": [good]}}, ["--input_shapes", "image:1x3x16"], "image")
    cfg("refused_in_a_range", {"quant": {"input_configs": [good]}, "compiler": {"sub_configs": [
        {"start_tensor_names": ["r1"], "end_tensor_names": ["r2"], "disable_ir_fix": True}]}},
        needle="compiler.sub_configs[0].disable_ir_fix: true is not accepted")
    cfg("bad_extension", {"quant": {"input_configs": [good]}}, needle="unsupported config file extension", ext="ini")
    cases["invalid_json"] = ('{"quant": {"calibration_method": "KL",,}}', [], "invalid JSON at line 1", "json")
    cases["invalid_yaml"] = ("quant:\n  calibration_method: [KL\n", [], "invalid YAML", "yaml")
    cases["invalid_toml"] = ("[quant\ncalibration_method = 'KL'\n", [], "invalid TOML", "toml")

    # Data problems.
    shape_dir = root / "wrong_shape"
    shape_dir.mkdir()
    np.save(shape_dir / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    cfg("numpy_shape_mismatch", _cfg(_calib_entry(shape_dir)), needle="0.npy")
    bin_dir = root / "wrong_bin"
    bin_dir.mkdir()
    (bin_dir / "0.bin").write_bytes(b"\0" * 100)
    cfg("binary_size", _cfg(_calib_entry(bin_dir, "Binary")), needle="0.bin")
    evil_tar = root / "evil.tar"
    with tarfile.open(evil_tar, "w") as tf:
        data = io.BytesIO()
        np.save(data, np.zeros((1, 3, 16, 16), np.float32))
        info = tarfile.TarInfo("../escape.npy")
        info.size = len(data.getvalue())
        tf.addfile(info, io.BytesIO(data.getvalue()))
    cfg("tar_traversal", _cfg(_calib_entry(evil_tar)), needle="../escape.npy")
    evil_zip = root / "evil.zip"
    with zipfile.ZipFile(evil_zip, "w") as zf:
        zf.writestr("/abs/0.npy", b"x")
    cfg("zip_absolute", _cfg(_calib_entry(evil_zip)), needle="evil.zip")
    pk_dir = root / "pickle"
    pk_dir.mkdir()
    marker = root / "pwned.txt"
    with open(pk_dir / "0.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": ()})
        pickle.dump({"image": _Evil(marker)}, f, protocol=2)
    cfg("numpy_object_pickle", _cfg(_calib_entry(pk_dir, "NumpyObject", name="DEFAULT")), needle="0.npy")
    return cases, marker


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_pulsar([*args], cwd=cwd, timeout=120, env={**os.environ, "COLUMNS": "400"})


def _assert_clean_failure(proc: subprocess.CompletedProcess, needle: str, out: Path) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    assert needle in lines[0], text
    if out.exists():
        leftovers = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        assert not (leftovers & {"compiled.pulsar", "quant/quantized.onnx", "quant/quant_config.json"}), leftovers
        assert not [p for p in leftovers if p.endswith(".tmp")], leftovers


@pytest.fixture(scope="module")
def bad_cases(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("bad")
    return root, *_case_setups(root, tiny)


CASE_NAMES = ["typo_key", "typo_section", "wrong_type", "bad_enum", "bad_enum_format", "out_of_range",
              "exclusive_batch", "two_selectors", "unknown_tensor", "unknown_layer", "unknown_op_type",
              "missing_dataset", "no_calibration", "unknown_flag", "bad_bool_flag", "bad_int_flag",
              "bad_input_shapes", "input_shapes_unknown", "input_shapes_rank", "refused_in_a_range",
              "bad_extension", "invalid_json", "invalid_yaml", "invalid_toml", "numpy_shape_mismatch",
              "binary_size", "tar_traversal", "zip_absolute", "numpy_object_pickle"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_malformed_config_or_data(bad_cases, tiny, name):
    root, cases, marker = bad_cases
    content, args, needle, ext = cases[name]
    cfg_path = root / f"{name}.{ext}"
    cfg_path.write_text(content if isinstance(content, str) else json.dumps(content))
    out = root / f"out_{name}"
    proc = _run(["build", "--input", str(tiny["model"]), "--output_dir", str(out), "--config", str(cfg_path), *args],
                root)
    _assert_clean_failure(proc, needle, out)
    assert not marker.exists(), "a pickle in calibration data ran code"


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "missing", "directory"])
def test_bad_model_files(tmp_path, tiny, kind):
    model = tmp_path / "model.onnx"
    if kind == "corrupt":
        model.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        data = tiny["model"].read_bytes()
        model.write_bytes(data[: len(data) // 2])
    elif kind == "directory":
        model.mkdir()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_cfg(_calib_entry(tiny["calib"]))))
    out = tmp_path / "out"
    proc = _run(["build", "--input", str(model), "--output_dir", str(out), "--config", str(cfg)], tmp_path)
    _assert_clean_failure(proc, "model.onnx", out)


def test_missing_required_input_flag(tmp_path, tiny):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_cfg(_calib_entry(tiny["calib"]))))
    proc = _run(["build", "--output_dir", str(tmp_path / "o"), "--config", str(cfg)], tmp_path)
    _assert_clean_failure(proc, "input: required", tmp_path / "o")


def test_run_rejects_plain_onnx_and_missing_inputs(tmp_path, tiny):
    proc = _run(["run", "--model", str(tiny["model"]), "--random_input", "--output_dir", str(tmp_path / "o")],
                tmp_path)
    _assert_clean_failure(proc, "not a pulsar compiled model", tmp_path / "o")


def test_debug_flag_shows_traceback(tmp_path, tiny):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"quant": {"calibration_method": "kl"}}))
    proc = _run(["build", "--input", str(tiny["model"]), "--output_dir", str(tmp_path / "o"), "--config", str(cfg),
                 "--debug"], tmp_path)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
