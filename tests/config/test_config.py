"""Schema, loading, defaults, overrides and typed config objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pulsar.config import ConfigError, load_build_config
from pulsar.config.dump import dump_config
from pulsar.config.loader import read_config_file, strip_json_comments
from pulsar.config.model import to_dict
from pulsar.config.overrides import parse_overrides
from pulsar.config.schema import default_config, leaves, load_schema
from pulsar.config.support import check_supported
from pulsar.errors import PulsarError

REPO = Path(__file__).resolve().parents[2]


def test_schema_is_valid_2020_12_and_linked_from_repo_root():
    from jsonschema import Draft202012Validator

    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"].endswith("2020-12/schema")
    assert json.loads((REPO / "schemas" / "build_config.schema.json").read_text()) == schema


def test_every_object_forbids_unknown_keys():
    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and not path.endswith("CompilerOptions"):
                # CompilerOptions is a mixin: its users (compiler, sub_configs) close it with unevaluatedProperties
                assert node.get("additionalProperties") is False or node.get("unevaluatedProperties") is False, path
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(load_schema(), "#")


def test_config_reference_fields_are_covered():
    """Spot-check the field list: every section's documented fields are present."""
    flags = {leaf.flag for leaf in leaves()}
    for f in ["--quant.calibration_method", "--quant.finetune_lr", "--quant.device", "--compiler.static_batch_sizes",
              "--compiler.check_cosine_simularity", "--onnx_opt.save_tensors_data", "--input_shapes",
              "--npu_mode", "--target_hardware", "--compiler.check_tensor_black_list", "--quant.layer_configs"]:
        assert f in flags
    defs = load_schema()["$defs"]
    assert {"InputQuantConfig", "LayerConfig", "InputProcessor", "OutputProcessor", "ConstProcessor",
            "OpProcessor", "SubConfig"} <= set(defs)


def test_defaults_are_complete_and_valid():
    cfg = default_config()
    assert cfg["quant"]["calibration_method"] == "MinMax"
    assert cfg["compiler"]["check_rtol"] == 1e-5
    assert cfg["quant"]["refine_weight_threshold"] == 1e-6
    assert check_supported(cfg) == []


def test_json_comments_are_stripped_but_not_inside_strings():
    text = '{\n  # a comment\n  "a": "x # not a comment", // another\n  "b": "http://x"\n}'
    assert json.loads(strip_json_comments(text)) == {"a": "x # not a comment", "b": "http://x"}


@pytest.mark.parametrize("fmt", ["json", "yaml", "toml"])
def test_default_dump_roundtrips_in_every_format(tmp_path, fmt):
    path = tmp_path / f"cfg.{fmt}"
    path.write_text(dump_config(default_config(), fmt))
    assert read_config_file(path) == default_config()


def test_example_configs_agree_across_formats():
    for name in ("mobilenetv2", "ocr_rec"):
        loaded = [read_config_file(REPO / "configs" / f"{name}.{ext}") for ext in ("json", "yaml", "toml")]
        assert loaded[0] == loaded[1] == loaded[2]
        load_build_config(REPO / "configs" / f"{name}.json", require_io=False)


def test_precedence_command_line_over_file_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"quant": {"calibration_method": "MSE"}, "npu_mode": "NPU2"}))
    eff = load_build_config(path, {"quant.calibration_method": "KL", "input": "m.onnx", "output_dir": "o"})
    assert eff.cfg.quant.calibration_method == "KL"      # command line
    assert eff.cfg.npu_mode == "NPU2"                    # file
    assert eff.cfg.compiler.check_atol == 0              # default
    assert to_dict(eff.cfg) == eff.data


def test_typed_config_rejects_unknown_attributes():
    eff = load_build_config({}, require_io=False)
    with pytest.raises(AttributeError):
        _ = eff.cfg.quant.calibration_methd  # noqa: B018


def test_overrides_parse_types_lists_and_bare_bools():
    ov, other = parse_overrides(["--compiler.static_batch_sizes", "1", "2", "4", "--onnx_opt.enable_onnxsim",
                                 "--onnx_opt.model_check", "0", "--quant.smooth_quant_strength=0.5",
                                 "--compiler.check_tensor_black_list", "conv.*", "relu_[0-9]+",
                                 "--quant.refine_weight_threshold", "-1", "--config", "x.json"],
                                extra_flags={"--config": "value"})
    assert ov == {"compiler.static_batch_sizes": [1, 2, 4], "onnx_opt.enable_onnxsim": True,
                  "onnx_opt.model_check": False, "quant.smooth_quant_strength": 0.5,
                  "compiler.check_tensor_black_list": ["conv.*", "relu_[0-9]+"],
                  "quant.refine_weight_threshold": -1.0}
    assert other == {"--config": "x.json"}
    assert parse_overrides(["--compiler.static_batch_sizes", "1,2"])[0] == {"compiler.static_batch_sizes": [1, 2]}


@pytest.mark.parametrize("args,needle", [
    (["--quant.calibraton_method", "KL"], 'did you mean "--quant.calibration_method"'),
    (["--compiler.check", "two"], "not an integer"),
    (["--onnx_opt.model_check", "maybe"], "not a boolean"),
    (["--quant.layer_configs", "[{"], "not valid JSON"),
])
def test_override_errors_name_the_flag(args, needle):
    with pytest.raises(PulsarError, match=None) as e:
        parse_overrides(args)
    assert needle in str(e.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_build_config({"quant": {"calibration_method": "kl", "calibraton_size": 3,
                                     "input_configs": [{"tensor_name": "x", "calibration_dataset": "d",
                                                        "calibration_size": "32"}]},
                           "compiler": {"static_batch_sizes": [1, 2], "max_dynamic_batch_size": 4}},
                          require_io=False)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 4, text
    assert 'quant.calibration_method: \'kl\' is not one of MinMax, Percentile, MSE, KL, ACIQ_Laplace, ACIQ_Gauss, Std, Mean, WeightedScale, InIR (did you mean "KL"?)' in text
    assert "quant.calibraton_size: unknown field" in text
    assert "quant.input_configs[0].calibration_size: '32' is a string, expected an integer" in text
    assert "exclude each other" in text


def test_layer_config_needs_exactly_one_selector():
    with pytest.raises(ConfigError, match="exactly one selector"):
        load_build_config({"quant": {"layer_configs": [{"op_type": "Add", "layer_name": "a"}]}}, require_io=False)


def test_unimplemented_fields_are_rejected_not_ignored(monkeypatch):
    from pulsar.config import support

    # every feature of this version is built: mark one as not yet, for this test only
    monkeypatch.setattr(support, "RULES", [*support.RULES, support._at_default("compiler.enable_tile_mode")])
    assert support.unavailable_fields() == {"compiler.enable_tile_mode": "not supported by this pulsar version yet"}
    with pytest.raises(ConfigError) as e:
        load_build_config({"quant": {"calibration_percentile": 99.9},
                           "compiler": {"check_tensor_black_list": ["x"], "enable_tile_mode": True}},
                          require_io=False)
    assert [p for p in e.value.problems if "not accepted" in p] == [
        "compiler.enable_tile_mode: true is not accepted: not supported by this pulsar version yet; remove the "
        "field or leave it at its default"]
    load_build_config({"compiler": {"enable_tile_mode": False}}, require_io=False)  # at its default: accepted
    # fields that only act together with a switch are no errors (they warn: tests/config/test_switch_warnings.py)
    assert not any(p.startswith(("quant.calibration_percentile", "compiler.check_tensor_black_list"))
                   for p in e.value.problems)


def test_sub_configs_do_not_get_defaults_filled():
    from pulsar.config.schema import fill_defaults

    full = fill_defaults({"compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"]}]}})
    assert full["compiler"]["sub_configs"][0] == {"start_tensor_names": ["a"], "end_tensor_names": ["b"]}


def test_config_hash_follows_what_changes_the_compiled_model(tmp_path):
    """Where files go and what is only checked or analysed leave the hash alone; a quantization
    setting changes it."""
    from pulsar.config import load_build_config

    base = {"input": "m.onnx", "output_dir": str(tmp_path / "a")}
    h = load_build_config(None, base).hash
    assert load_build_config(None, {**base, "output_dir": str(tmp_path / "b"), "work_dir": "w", "input": "x.onnx",
                                    "output_name": "other.pulsar", "compiler.check": 3,
                                    "quant.precision_analysis": True}).hash == h
    assert load_build_config(None, {**base, "quant.calibration_method": "KL"}).hash != h
    assert load_build_config(None, {**base, "npu_mode": "NPU2"}).hash != h


def test_finetune_fields_need_a_finetune_switch_and_lsq_stands_alone():
    eff = load_build_config({"quant": {"finetune_lr": 0.01, "device": "cuda:0"}}, require_io=False)
    assert eff.data["quant"]["finetune_lr"] == 0.001  # reset: no fine-tuning ran
    assert eff.cfg.quant.device == "cuda:0"  # kept: calibration runs on quant.device too
    assert [w.split(" is set")[0] for w in eff.warnings] == ["quant.finetune_lr"]
    assert all("enable_adaround" in w for w in eff.warnings)
    with pytest.raises(ConfigError) as e:
        load_build_config({"quant": {"enable_lsq": True, "enable_brecq": True}}, require_io=False)
    assert any(p.startswith("quant.enable_lsq") and "enable one of them" in p for p in e.value.problems)
    cfg = load_build_config({"quant": {"enable_adaround": True, "enable_brecq": True, "finetune_lr": 0.01,
                                       "device": "cuda"}}, require_io=False)
    assert cfg.cfg.quant.enable_brecq and cfg.cfg.quant.device == "cuda" and cfg.warnings == ()


def test_finetune_settings_change_the_hash_only_when_fine_tuning_runs():
    base = load_build_config({}, require_io=False).hash
    on = load_build_config({"quant": {"enable_lsq": True}}, require_io=False).hash
    on_more = load_build_config({"quant": {"enable_lsq": True, "finetune_epochs": 7}}, require_io=False).hash
    assert len({base, on, on_more}) == 3
    gpu = load_build_config({"quant": {"device": "cuda:0"}}, require_io=False).hash
    assert gpu != base  # calibration runs on quant.device: its statistics (so the build) may differ
