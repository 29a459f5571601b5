"""Hostile inputs for `pulsar build`: configs, flags, calibration data, paths, processors, target
profiles and layer configs that a user (or an attacker) can hand to the build.

Every case runs the real command in a directory of its own and must fail cleanly: exit 2, one
``error:`` line naming the field / file / tensor, no traceback, nothing created or changed in the
case directory (a build that got as far as its staging folder may leave ``out/build_failed.log``
and the calibration cache, nothing else). The cases run two at a time in a module fixture.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hostile.harness import Case, assert_clean_failure, run_case

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow

SHAPE = (1, 3, 16, 16)


@dataclass(frozen=True)
class Env:
    model: Path  # the tiny CNN (outside every case directory)
    calib: Path  # its 8 Numpy calibration samples


Setup = Callable[[Path, Env], list[str]]


def _entry(env: Env, **kw: Any) -> dict[str, Any]:
    return {"tensor_name": "image", "calibration_dataset": str(env.calib), "calibration_format": "Numpy",
            "calibration_size": 8, **kw}


def _good(env: Env) -> dict[str, Any]:
    return {"quant": {"input_configs": [_entry(env)]}}


def _build(config: str = "c.json", *extra: str, env: Env) -> list[str]:
    return ["build", "--input", str(env.model), "--output_dir", "out", "--config", config, *extra]


def cfg(make: Callable[[Env], dict[str, Any]], *extra: str) -> Setup:
    """A JSON config made from the env (plus command-line flags)."""

    def setup(d: Path, env: Env) -> list[str]:
        (d / "c.json").write_text(json.dumps(make(env)))
        return _build("c.json", *extra, env=env)

    return setup


def text(name: str, make: Callable[[Env], str], *extra: str) -> Setup:
    """A config file written as text (json / yaml / toml), for what JSON objects cannot express."""

    def setup(d: Path, env: Env) -> list[str]:
        (d / name).write_text(make(env))
        return _build(name, *extra, env=env)

    return setup


def flags(*extra: str) -> Setup:
    return cfg(_good, *extra)


def data_dir(make_files: Callable[[Path], None], **entry: Any) -> Setup:
    """Calibration data made inside the case directory."""

    def setup(d: Path, env: Env) -> list[str]:
        calib = d / "calib"
        calib.mkdir()
        make_files(calib)
        conf = {"quant": {"input_configs": [{**_entry(env), "calibration_dataset": str(calib), **entry}]}}
        (d / "c.json").write_text(json.dumps(conf))
        return _build("c.json", env=env)

    return setup


def _npys(value: Callable[[int], np.ndarray], n: int = 4) -> Callable[[Path], None]:
    def make(calib: Path) -> None:
        for i in range(n):
            np.save(calib / f"{i}.npy", value(i))

    return make


def _noise(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(SHAPE).astype(np.float32)


def _with_value(i: int, v: float) -> np.ndarray:
    x = _noise(i)
    if i == 2:
        x[0, 1, 3, 4] = v
    return x


def _yaml_good(env: Env) -> str:
    return (f"quant:\n  input_configs:\n    - tensor_name: image\n      calibration_dataset: '{env.calib}'\n"
            "      calibration_format: Numpy\n      calibration_size: 8\n")


def _toml_good(env: Env) -> str:
    return (f"[[quant.input_configs]]\ntensor_name = 'image'\ncalibration_dataset = '{env.calib}'\n"
            "calibration_format = 'Numpy'\ncalibration_size = 8\n")


def _proto_good(env: Env) -> str:
    return (f"quant {{\n  input_configs {{\n    tensor_name: 'image'\n    calibration_dataset: '{env.calib}'\n"
            "    calibration_format: Numpy\n    calibration_size: 8\n  }\n}\n")


def _evaluation(env: Env) -> dict[str, Any]:
    return {"metric": "cosine", "input_configs": [_entry(env)]}


def _bomb(levels: int = 9) -> str:
    """A YAML billion-laughs document under ``anchors:`` (9 levels: 9^9 strings when expanded)."""
    lines = ['  a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join([f"*a{i - 1}"] * 9)
        lines.append(f"  a{i}: &a{i} [{refs}]")
    return "\n".join(lines)


def _yaml_bomb_in(field: str) -> Callable[[Env], str]:
    def make(env: Env) -> str:
        body = ("const_processors:\n  - name: fc.b\n    data: *a8\n" if field == "const" else
                "op_processors:\n  - op_name: fc\n    attrs:\n      alpha: *a8\n")
        return "x_anchors:\n" + _bomb() + "\n" + _yaml_good(env) + body

    return make


def _with_sections(**sections: Any) -> Callable[[Env], dict[str, Any]]:
    def make(env: Env) -> dict[str, Any]:
        out = _good(env)
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
        return out

    return make


def _quant(**fields: Any) -> Callable[[Env], dict[str, Any]]:
    def make(env: Env) -> dict[str, Any]:
        return {"quant": {"input_configs": [_entry(env)], **fields}}

    return make


def _entry_fields(**fields: Any) -> Callable[[Env], dict[str, Any]]:
    def make(env: Env) -> dict[str, Any]:
        return {"quant": {"input_configs": [_entry(env, **fields)]}}

    return make


def _profile(content: str, suffix: str = ".yaml") -> Setup:
    def setup(d: Path, env: Env) -> list[str]:
        (d / f"target{suffix}").write_text(content)
        (d / "c.json").write_text(json.dumps({**_good(env), "target_hardware": str(d / f"target{suffix}")}))
        return _build("c.json", env=env)

    return setup


def _dynamic(d: Path, env: Env, *extra: str) -> list[str]:
    """The tiny CNN with a free batch dimension (so input_shapes can set it)."""
    from tests.tiny_model import make_tiny_cnn

    make_tiny_cnn(d / "dyn.onnx", dynamic_batch=True)
    (d / "c.json").write_text(json.dumps(_good(env)))
    return ["build", "--input", "dyn.onnx", "--output_dir", "out", "--config", "c.json", *extra]


def _out_is_file(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_text(json.dumps(_good(env)))
    (d / "out").write_text("not a directory")
    return _build("c.json", env=env)


def _out_parent_file(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_text(json.dumps(_good(env)))
    (d / "blocker").write_text("a file")
    return ["build", "--input", str(env.model), "--output_dir", "blocker/out", "--config", "c.json"]


def _out_in_proc(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_text(json.dumps(_good(env)))
    return ["build", "--input", str(env.model), "--output_dir", "/proc/pulsar-out", "--config", "c.json"]


def _work_parent_file(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_text(json.dumps({**_good(env), "work_dir": "blocker/work"}))
    (d / "blocker").write_text("a file")
    return _build("c.json", env=env)


def _dangling_out(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_text(json.dumps(_good(env)))
    (d / "out").symlink_to(d / "nowhere" / "deeper")
    return _build("c.json", env=env)


def _dangling_sample(calib: Path) -> None:
    _npys(_noise)(calib)
    (calib / "9.npy").symlink_to(calib / "missing.npy")


def _fifo_sample(calib: Path) -> None:
    _npys(_noise)(calib)
    os.mkfifo(calib / "5.npy")


def _not_utf8_config(d: Path, env: Env) -> list[str]:
    (d / "c.json").write_bytes(b'{"quant": {"calibration_method": "\xff\xfe"}}')
    return _build("c.json", env=env)


def _config_is_dir(d: Path, env: Env) -> list[str]:
    (d / "c.json").mkdir()
    return _build("c.json", env=env)


def _huge_config(d: Path, env: Env) -> list[str]:
    with open(d / "c.json", "wb") as f:
        f.truncate(33 * 1024 * 1024)  # sparse: 33 MB of NUL bytes, no disk used
    return _build("c.json", env=env)


def _model_is_text(d: Path, env: Env) -> list[str]:
    (d / "m.onnx").write_text("this is not a model")
    (d / "c.json").write_text(json.dumps(_good(env)))
    return ["build", "--input", "m.onnx", "--output_dir", "out", "--config", "c.json"]


def _nan_mean_yaml(env: Env) -> str:
    return _yaml_good(env).replace("calibration_format: Numpy", "calibration_format: Image") + \
        "      calibration_mean: [.nan, 1, 2]\n"


def _image_data(calib: Path) -> None:
    from PIL import Image

    for i in range(2):
        Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(calib / f"{i}.png")


CASES: list[Case] = [
    # -- config resource attacks ------------------------------------------------------------------
    Case("json_deep_nesting", text("c.json", lambda e: "[" * 200_000 + "]" * 200_000), "nested too deeply"),
    Case("json_nested_40", text("c.json", lambda e: '{"x_data": ' + "[" * 40 + "]" * 40 + "}"),
         "nested more than 32 levels"),
    Case("yaml_deep_nesting", text("c.yaml", lambda e: "a: " + "[" * 100_000 + "]" * 100_000),
         "nested too deeply"),
    Case("toml_deep_nesting", text("c.toml", lambda e: "a = " + "[" * 100_000 + "]" * 100_000),
         "nested too deeply"),
    Case("json_int_5000_digits", text("c.json", lambda e: json.dumps(_good(e))[:-1] + ', "output_name": '
                                      + "7" * 5000 + "}"), "output_name: an integer with 5000 digits"),
    Case("yaml_int_5000_digits", text("c.yaml", lambda e: _yaml_good(e) + "  check: " + "9" * 5000 + "\n"),
         "quant.check: an integer with 5000 digits"),
    Case("toml_int_5000_digits", text("c.toml", lambda e: "output_name = " + "1" * 5000 + "\n" + _toml_good(e)),
         "an integer with more than 30 digits"),
    Case("toml_int_40_digits", text("c.toml", lambda e: "[compiler]\ncheck = " + "1" * 40 + "\n" + _toml_good(e)),
         "compiler.check: an integer with 40 digits"),
    Case("flag_int_4000_digits", flags("--compiler.check", "3" * 4000), "--compiler.check: an integer with 4000"),
    Case("yaml_alias_bomb_const_data", text("c.yaml", _yaml_bomb_in("const")), "alias bomb"),
    Case("yaml_alias_bomb_op_attrs", text("c.yaml", _yaml_bomb_in("op")), "alias bomb"),
    Case("yaml_alias_bomb_unknown_field", text("c.yaml", lambda e: "x_anchors:\n" + _bomb() + "\n" + _yaml_good(e)),
         "alias bomb"),
    Case("config_33mb", _huge_config, "a config file is at most"),
    Case("config_not_utf8", _not_utf8_config, "not a UTF-8 text file"),
    Case("config_is_directory", _config_is_dir, "is not a regular file"),
    Case("yaml_date_value", text("c.yaml", lambda e: _yaml_good(e) + "output_name: 2024-01-01\n"),
         "output_name: a date is not a config value"),
    Case("yaml_binary_value", text("c.yaml", lambda e: _yaml_good(e) + "output_name: !!binary aGVsbG8=\n"),
         "output_name: binary data is not a config value"),
    Case("yaml_int_key", text("c.yaml", lambda e: _yaml_good(e) + "compiler:\n  1: x\n"), "is not a string"),
    Case("yaml_python_tag", text("c.yaml", lambda e: _yaml_good(e) + "output_name: !!python/object/apply:os.system "
                                 "['echo pwned']\n"), "invalid YAML"),
    # -- duplicate keys ----------------------------------------------------------------------------
    Case("json_duplicate_key", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                    + ', "quant": {"calibration_method": "KL"}}'), "quant: duplicate key"),
    Case("json_duplicate_nested_key", text("c.json", lambda e: json.dumps(_good(e)).replace(
        '"calibration_size": 8', '"calibration_size": 8, "calibration_size": 4')),
        "quant.input_configs[0].calibration_size: duplicate key"),
    Case("yaml_duplicate_key", text("c.yaml", lambda e: _yaml_good(e) + "npu_mode: NPU1\nnpu_mode: NPU2\n"),
         ("npu_mode: duplicate key", "line 8")),
    Case("toml_duplicate_key", text("c.toml", lambda e: "npu_mode = 'NPU1'\nnpu_mode = 'NPU2'\n" + _toml_good(e)),
         "invalid TOML"),
    # -- non-finite numbers ------------------------------------------------------------------------
    Case("json_nan_percentile", text("c.json", lambda e: json.dumps(_quant(calibration_method="Percentile")(e))
                                     .replace('"Percentile"', '"Percentile", "calibration_percentile": NaN')),
         "quant.calibration_percentile: nan is not a finite number"),
    Case("json_infinity_check_atol", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                          + ', "compiler": {"check_atol": Infinity}}'),
         "compiler.check_atol: inf is not a finite number"),
    Case("json_minus_infinity_ddr", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                         + ', "compiler": {"ddr_bw_limit": -Infinity}}'),
         "compiler.ddr_bw_limit: -inf is not a finite number"),
    Case("yaml_nan_strength", text("c.yaml", lambda e: _yaml_good(e) + "  enable_smooth_quant: true\n"
                                   "  smooth_quant_strength: .nan\n"), "quant.smooth_quant_strength: nan"),
    Case("toml_inf_cosine", text("c.toml", lambda e: "[compiler]\ncheck_cosine_simularity = inf\n" + _toml_good(e)),
         "compiler.check_cosine_simularity: inf is not a finite number"),
    Case("flag_nan", flags("--compiler.check_rtol", "nan"), "--compiler.check_rtol: 'nan' is not a finite number"),
    Case("flag_infinity", flags("--compiler.ddr_bw_limit", "inf"), "--compiler.ddr_bw_limit: 'inf'"),
    Case("yaml_nan_calibration_mean", text("c.yaml", _nan_mean_yaml),
         "quant.input_configs[0].calibration_mean[0]: nan is not a finite number"),
    Case("json_nan_calibration_std", text("c.json", lambda e: json.dumps(_entry_fields(calibration_format="Image")(e))
                                          .replace('"Image"', '"Image", "calibration_std": [1, NaN, 1]')),
         "quant.input_configs[0].calibration_std[1]: nan is not a finite number"),
    Case("json_nan_const_data", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                     + ', "const_processors": [{"name": "fc.b", "data": [1, NaN]}]}'),
         "const_processors[0].data[1]: nan is not a finite number"),
    Case("json_nan_processor_mean", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                         + ', "input_processors": [{"tensor_name": "image", "mean": [NaN]}]}'),
         "input_processors[0].mean[0]: nan"),
    Case("calib_data_nan", data_dir(_npys(lambda i: _with_value(i, float("nan")))), ("2.npy", "NaN")),
    Case("calib_data_inf", data_dir(_npys(lambda i: _with_value(i, float("inf")))), ("2.npy", "infinite")),
    Case("calib_data_minus_inf", data_dir(_npys(lambda i: _with_value(i, -float("inf")))), "infinite"),
    Case("calib_binary_nan", data_dir(lambda c: [(_with_value(i, float("nan"))).tofile(c / f"{i}.bin")
                                                 for i in range(4)], calibration_format="Binary"), "2.bin"),
    # -- absurd sizes ------------------------------------------------------------------------------
    Case("calibration_size_1e12", cfg(_entry_fields(calibration_size=10**12)),
         "quant.input_configs[0].calibration_size: 1000000000000 is out of range; it must be at most 1,000,000"),
    Case("calibration_size_more_than_data", cfg(_entry_fields(calibration_size=10**6)),
         ("calibration_size: 1,000,000 samples asked for", "has 8")),
    # -- integers beyond their maximum (each would have failed deep in the build) ---------------------
    Case("amp_num_samples_1e20", cfg(_quant(auto_mixed_precision={"enable": True, "num_samples": 10**20})),
         "quant.auto_mixed_precision.num_samples: 100000000000000000000 is out of range; it must be at most"),
    Case("static_batch_1e25", cfg(_with_sections(compiler={"static_batch_sizes": [10**25]})),
         ("compiler.static_batch_sizes[0]", "at most 1,024")),
    Case("dynamic_batch_1e25", flags("--compiler.max_dynamic_batch_size", str(10**25)),
         ("--compiler.max_dynamic_batch_size", "at most 1,024")),
    Case("finetune_epochs_1e25", flags("--quant.enable_lsq", "--quant.finetune_epochs", str(10**25)),
         ("--quant.finetune_epochs", "at most")),
    Case("extra_shape_dim_1e25", cfg(_with_sections(input_processors=[
        {"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 10**25, 16]}]}])),
         ("input_processors[0].src_extra_shapes[0].shape[2]", "out of range")),
    Case("extra_shape_16_gib", cfg(_with_sections(input_processors=[
        {"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 16, 16]}, {"shape": [1, 4, 65536, 65536]}]}])),
         ("input_processors[0].src_extra_shapes[1].shape", "holds more than 1,073,741,824 values")),
    Case("extra_shape_wrong_rank", cfg(_with_sections(input_processors=[
        {"tensor_name": "image", "src_extra_shapes": [{"shape": [1, 3, 16]}]}])),
         ("input_processors[0].src_extra_shapes[0]: shape [1, 3, 16] has rank 3", "rank 4")),
    Case("input_shapes_dim_1e25", lambda d, e: _dynamic(d, e, "--input_shapes", "image:" + "9" * 25 + "x3x16x16"),
         "--input_shapes: input 'image' has a dim 9999999999999999999999999; a dim is at most 2,147,483,647"),
    # -- a value of the wrong type is reported as that, not as a rule combining fields ---------------
    Case("compiler_is_a_string", cfg(_with_sections(compiler="fast")),
         "compiler: 'fast' is a string, expected a mapping"),
    Case("extra_shape_not_a_mapping", cfg(_with_sections(input_processors=[
        {"tensor_name": "image", "src_extra_shapes": [[1, 3, 32, 32]]}])),
         ("input_processors[0].src_extra_shapes[0]: [1, 3, 32, 32] is a list, expected a mapping with key 'shape'",
          '(write {"shape": [1, 3, 32, 32]})')),
    Case("processor_is_a_name", cfg(_with_sections(input_processors=["image"])),
         "input_processors[0]: 'image' is a string, expected a mapping with key 'tensor_name'"),
    Case("input_shapes_terabytes", lambda d, e: _dynamic(d, e, "--input_shapes", "image:100000000x3x16x16"),
         ("input_shapes: input 'image'", "GB per sample", "available")),
    Case("processor_padding_huge", cfg(_with_sections(input_processors=[
        {"tensor_name": "image", "padding": [10**9, 10**9, 10**9, 10**9]}])), "input_processors"),
    Case("calibration_mean_many_values", cfg(_entry_fields(calibration_format="Image",
                                                           calibration_mean=[0.5] * 100_000)),
         "calibration_mean has 100000 values"),
    Case("config_million_values", text("c.json", lambda e: json.dumps({**_good(e), "x_list": [[0] * 1000] * 1100})),
         "more than 1,000,000 values"),
    # -- paths -------------------------------------------------------------------------------------
    Case("output_dir_is_file", _out_is_file, "output_dir: 'out' exists and is not a directory"),
    Case("output_dir_parent_is_file", _out_parent_file, ("output_dir", "is a file, not a directory")),
    Case("output_dir_in_proc", _out_in_proc, ("output_dir", "/proc")),
    Case("output_dir_dangling_symlink", _dangling_out, ("output_dir", "broken symbolic link")),
    Case("work_dir_parent_is_file", _work_parent_file, ("work_dir", "is a file, not a directory")),
    Case("output_dir_nul_byte", text("c.json", lambda e: json.dumps({**_good(e), "output_dir": "o\u0000ut"})),
         "output_dir: contains a NUL byte"),
    Case("work_dir_newline", text("c.json", lambda e: json.dumps({**_good(e), "work_dir": "w\nork"})),
         "work_dir: contains the control character '\\n'"),
    Case("output_dir_flag_escape", lambda d, e: ["build", "--input", str(e.model), "--config", "c.json",
                                                 "--output_dir", "out\x1b[2J"] if (d / "c.json").write_text(
        json.dumps(_good(e))) else [], "--output_dir: contains the control character '\\x1b'"),
    Case("calibration_dataset_escape", cfg(_entry_fields(calibration_dataset="calib\x1b[2J")),
         "calibration_dataset: contains the control character '\\x1b'"),
    Case("data_path_nul", text("c.json", lambda e: json.dumps({**_good(e), "const_processors": [
        {"name": "fc.b", "data_path": "a\u0000.npy"}]})), "const_processors[0].data_path: contains a NUL byte"),
    Case("output_name_dotdot", flags("--output_name", ".."), "--output_name: '..' is not a file name"),
    Case("output_name_slash", flags("--output_name", "../escape.pulsar"), ("--output_name", "is not valid")),
    Case("output_name_build_config", flags("--output_name", "build_config.json"), "name of another artifact"),
    Case("output_name_build_log", flags("--output_name", "build.log"), "name of another artifact"),
    Case("output_name_quant_dir", flags("--output_name", "quant"), "name of another artifact"),
    Case("output_name_empty", flags("--output_name", ""), ("--output_name: ''", "is not valid")),
    Case("output_name_evaluation_json", cfg(lambda e: {**_good(e), "output_name": "evaluation.json",
                                                       "evaluation": _evaluation(e)}),
         ("output_name: 'evaluation.json' is the name of another artifact", "evaluation report")),
    Case("output_name_trial_json", flags("--output_name", "trial.json"), ("--output_name: 'trial.json'", "sweep")),
    Case("output_name_sweep_json", flags("--output_name", "sweep.json"), ("--output_name: 'sweep.json'", "sweep")),
    Case("output_name_cache_dir", flags("--output_name", "cache"), ("--output_name: 'cache'", "calibration cache")),
    Case("output_name_case_folded", flags("--output_name", "Build_Config.JSON"), "(build_config.json, the effective"),
    Case("output_name_staging", flags("--output_name", ".pulsar-staging-1"), "staging folders"),
    Case("calib_dangling_symlink", data_dir(_dangling_sample), ("9.npy", "cannot read this calibration file")),
    Case("calib_fifo", data_dir(_fifo_sample), ("5.npy", "not a regular file")),
    Case("model_is_text", _model_is_text, "m.onnx"),
    Case("input_sample_dir_missing", flags("--quant.precision_analysis", "--quant.input_sample_dir", "nope"),
         "quant.input_sample_dir: 'nope' does not exist"),
    Case("compiler_sample_dir_missing", flags("--compiler.check", "1", "--compiler.input_sample_dir", "nope"),
         "compiler.input_sample_dir: 'nope' does not exist"),
    # -- user text printed literally ---------------------------------------------------------------
    Case("layer_name_markup", cfg(_quant(layer_configs=[{"layer_name": "[/][bold]x", "data_type": "U16"}])),
         "'[/][bold]x' is not a layer"),
    Case("layer_name_escape", cfg(_quant(layer_configs=[{"layer_name": "\x1b[31mred\x07", "data_type": "U16"}])),
         "'\\x1b[31mred\\x07' is not a layer"),
    Case("tensor_name_markup", cfg(_entry_fields(tensor_name="[red]image[/red]")), "'[red]image[/red]' is not an"),
    Case("flag_value_markup", flags("--quant.calibration_method", "[/]"), "--quant.calibration_method: '[/]'"),
    # -- lenient JSON, JSON5 and prototxt: a mistake is still one line with its line and column -------
    Case("json_trailing_garbage", text("c.json", lambda e: json.dumps(_good(e)) + "\n,}\n"),
         "c.json: invalid JSON at line 2 column 2: unexpected '}'"),
    Case("json_guide_style_missing_comma", text("c.json", lambda e: '{\n"npu_mode": "NPU1", # one core\n'
                                                '"quant": {"calibration_method": "MSE",}\n"compiler": {}\n}\n'),
         "c.json: invalid JSON at line 4 column 1"),
    Case("json5_duplicate_unquoted_key", text("c.json", lambda e: json.dumps(_good(e))[:-1]
                                              + ", npu_mode: 'NPU1', npu_mode: 'NPU2',}"), "npu_mode: duplicate key"),
    Case("json5_int_40_digits", text("c.json", lambda e: json.dumps(_good(e))[:-1] + ", compiler: {check: "
                                     + "1" * 40 + ",},}"), "compiler.check: an integer with 40 digits"),
    Case("prototxt_missing_brace", text("c.prototxt", lambda e: _proto_good(e) + "compiler {\n  check: 1\n"),
         ("c.prototxt: invalid prototxt at line 11 column 1", "missing '}'")),
    Case("prototxt_unterminated_string", text("c.prototxt", lambda e: _proto_good(e) + 'output_name: "m.pulsar\n'),
         ("invalid prototxt at line 9 column 14", "without its closing quote")),
    Case("prototxt_duplicate_key", text("c.prototxt", lambda e: "npu_mode: NPU1\n" + _proto_good(e)
                                        + "npu_mode: NPU2\n"), "npu_mode: duplicate key (line 10)"),
    Case("prototxt_int_40_digits", text("c.prototxt", lambda e: _proto_good(e) + "compiler { check: " + "3" * 40
                                        + " }\n"), "compiler.check: an integer with 40 digits"),
    Case("prototxt_section_twice", text("c.prototxt", lambda e: _proto_good(e) + "quant { calibration_method: MSE }\n"),
         "quant: duplicate key (line 9)"),
    Case("prototxt_nan_percentile", text("c.prototxt", lambda e: _proto_good(e)[:-2] + "  calibration_method: "
                                         "Percentile calibration_percentile: nan\n}\n"),
         "quant.calibration_percentile: nan is not a finite number"),
    Case("prototxt_unknown_field", text("c.prototxt", lambda e: _proto_good(e).replace(
        "calibration_size: 8", "calibraton_size: 8")), ("quant.input_configs[0].calibraton_size: unknown field",
                                                        'did you mean "calibration_size"')),
    # -- no silent acceptance (a field set while its switch is off warns: tests/config/test_switch_warnings.py) --
    Case("layer_range_end_before_start", cfg(_quant(layer_configs=[
        {"start_tensor_names": ["res"], "end_tensor_names": ["r1"], "data_type": "U16"}])),
         ("quant.layer_configs[0].end_tensor_names", "does not follow")),
    Case("layer_range_same_tensor", cfg(_quant(layer_configs=[
        {"start_tensor_names": ["res"], "end_tensor_names": ["res"], "data_type": "U16"}])), "does not follow"),
    Case("layer_two_precisions_by_name", cfg(_quant(layer_configs=[
        {"layer_name": "conv2", "data_type": "U16"}, {"layer_names": ["conv2", "fc"], "data_type": "S8"}])),
         ("quant.layer_configs[1]", "'conv2'", "different precision")),
    Case("layer_two_precisions_by_op", cfg(_quant(layer_configs=[
        {"op_type": "Conv", "data_type": "U16"}, {"op_types": ["Conv"], "data_type": "U8"}])), "different precision"),
    Case("calibration_mean_numpy", cfg(_entry_fields(calibration_mean=[0.5, 0.5, 0.5])),
         "calibration_mean: only acts on calibration_format Image"),
    Case("calibration_std_binary", data_dir(lambda c: [_noise(i).tofile(c / f"{i}.bin") for i in range(2)],
                                            calibration_format="Binary", calibration_std=[2.0]),
         "calibration_std: only acts on calibration_format Image"),
    Case("npu_analysis_without_end_to_end", cfg(_quant(precision_analysis=True, precision_analysis_mode="NPUBackend")),
         "EndToEnd"),
    Case("whole_model_option_in_a_range_flag", flags("--compiler.sub_configs", json.dumps(
        [{"start_tensor_names": ["r1"], "end_tensor_names": ["r2"], "disable_ir_fix": True}])),
         "--compiler.sub_configs[0].disable_ir_fix: true is not accepted"),
    Case("lsq_with_adaround", flags("--quant.enable_lsq", "--quant.enable_adaround"),
         ("--quant.enable_lsq", "enable one of them")),
    Case("image_std_zero", data_dir(_image_data, calibration_format="Image", calibration_std=[1.0, 0.0, 1.0]),
         "calibration_std"),
    # -- flags are named -----------------------------------------------------------------------------
    Case("flag_bad_enum", flags("--quant.calibration_method", "kl"), ("--quant.calibration_method", "did you mean")),
    Case("flag_out_of_range", flags("--quant.calibration_percentile", "10"), "--quant.calibration_percentile"),
    Case("flag_bad_json", flags("--quant.layer_configs", '[{"op_type": "Conv", "op_type": "Relu"}]'),
         "--quant.layer_configs[0].op_type: duplicate key"),
    Case("flag_unknown_value_type", flags("--compiler.check", "1.5"), "--compiler.check: '1.5' is not an integer"),
    # -- processors and target profiles (checked before anything is written) -------------------------
    Case("processor_bad_csc", cfg(_with_sections(input_processors=[{"tensor_name": "image", "src_format": "YUV420SP"}])),
         "input_processors[0]"),
    Case("processor_unknown_output", cfg(_with_sections(output_processors=[{"tensor_name": "logit"}])),
         "output_processors[0].tensor_name"),
    Case("processor_bad_perm", cfg(_with_sections(output_processors=[{"tensor_name": "logits", "dst_perm": [0, 0]}])),
         "output_processors[0].dst_perm"),
    Case("target_profile_missing", cfg(_with_sections(target_hardware="nope.yaml")), "nope.yaml does not exist"),
    Case("target_profile_bad_yaml", _profile("cores: [1, 2\n"), "not valid YAML"),
    Case("target_profile_alias_bomb", _profile("x:\n" + _bomb() + "\n"), "alias bomb"),
    Case("target_profile_nan", _profile("name: X\ncores: 2\nclock_mhz: .nan\n"), "nan is not a finite number"),
    Case("target_profile_duplicate", _profile("cores: 2\ncores: 4\n"), "cores: duplicate key"),
    Case("target_profile_npu_mode", cfg(_with_sections(target_hardware="VNPU-S", npu_mode="NPU4")), "NPU4"),
]




@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("hostile_build")
    env = Env(tiny["model"], tiny["calib"])
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda c: run_case(root, env, c), CASES))
    return {case.id: (proc, before, d) for case, proc, before, d in done}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_build_fails_cleanly(results: dict[str, tuple], case: Case) -> None:
    proc, before, d = results[case.id]
    assert_clean_failure(proc, case.needle, before, d)
