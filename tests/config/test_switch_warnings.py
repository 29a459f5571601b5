"""Fields that act only with a switch: set while the switch is off, the build goes on with one
warning per field (naming it and the switch) and the field at its default, so build_config.json and
the config hash say what ran. Contradictions stay errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pulsar.config import ConfigError, load_build_config
from pulsar.config.support import SWITCHED, schema_default
from tests.hostile.harness import run_cli

# A value away from the default for every switched field (the switch stays off in the config).
SET: dict[str, Any] = {
    "onnx_opt.simplifier": "onnxslim",
    "quant.calibration_percentile": 99.9,
    "quant.calibration_std_n": 2.5,
    "quant.calibration_momentum": 0.5,
    "quant.calibration_kl_top_n": 3,
    "quant.calibration_weighted_alpha": 0.25,
    "quant.smooth_quant_threshold": 0.3,
    "quant.smooth_quant_strength": 0.9,
    "quant.finetune_epochs": 7,
    "quant.finetune_block_size": 2,
    "quant.finetune_batch_size": 8,
    "quant.finetune_lr": 0.01,
    "quant.finetune_loss_mask": "attention_mask",
    "quant.precision_analysis_method": "EndToEnd",
    "quant.precision_analysis_mode": "NPUBackend",
    "quant.input_sample_dir": "samples",
    "quant.ln_scale_data_type": "S32",
    "quant.auto_mixed_precision.max_16bit_layers": 4,
    "quant.auto_mixed_precision.target_cosine": 0.99,
    "quant.auto_mixed_precision.data_type": "S16",
    "quant.auto_mixed_precision.num_samples": 4,
    "compiler.disable_ir_fix": True,
    "compiler.check_mode": "CheckOutput",
    "compiler.input_sample_dir": "samples",
    "compiler.check_rtol": 0.1,
    "compiler.check_atol": 0.1,
    "compiler.check_cosine_simularity": 0.9,
    "compiler.check_tensor_black_list": ["conv.*"],
    # a range's own check options need the range's check (its own, else inherited; check 0 here)
    "compiler.sub_configs[*].check_mode": "CheckOutput",
    "compiler.sub_configs[*].check_rtol": 0.1,
    "compiler.sub_configs[*].check_atol": 0.1,
    "compiler.sub_configs[*].check_cosine_simularity": 0.9,
    "compiler.sub_configs[*].check_tensor_black_list": ["conv.*"],
    "input_processors[*].padding_constant_value": 3,
}


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    if dotted.startswith("input_processors[*]."):
        return {"input_processors": [{"tensor_name": "x", dotted.split(".", 1)[1]: value}]}
    if dotted.startswith("compiler.sub_configs[*]."):
        return {"compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"],
                                              dotted.rsplit(".", 1)[1]: value}]}}
    out: dict[str, Any] = {}
    node = out
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


def _get(data: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted``; None for a field left unset (one without a schema default)."""
    node: Any = data
    for part in dotted.replace("[*]", ".0").split("."):
        node = node[int(part)] if part.isdigit() else node.get(part)
    return node


def test_every_switched_field_has_a_case():
    assert set(SET) == {n.path for n in SWITCHED}


@pytest.mark.parametrize("need", SWITCHED, ids=[n.path for n in SWITCHED])
def test_switched_off_field_warns_once_and_is_reset(need):
    base = load_build_config(_nested(need.path, schema_default(need.path)) if "[*]" in need.path else {},
                             require_io=False)
    eff = load_build_config(_nested(need.path, SET[need.path]), require_io=False)
    shown = need.path.replace("[*]", "[0]")
    assert len(eff.warnings) == 1, eff.warnings
    warning = eff.warnings[0]
    assert warning.startswith(f"{shown} is set ("), warning
    assert f"has no effect without {need.switch}; ignored" in warning
    assert _get(eff.data, need.path) == schema_default(need.path)
    assert eff.hash == base.hash  # the same build as without the field


def test_switched_on_field_is_kept_without_warning():
    eff = load_build_config({"quant": {"enable_smooth_quant": True, "smooth_quant_strength": 0.9,
                                       "calibration_method": "Percentile", "calibration_percentile": 99.9},
                             "compiler": {"check": 3, "check_cosine_simularity": 0.9, "check_mode": "CheckOutput"},
                             "input_processors": [{"tensor_name": "x", "padding": [1, 1, 1, 1],
                                                   "padding_constant_value": 3}]}, require_io=False)
    assert eff.warnings == ()
    assert eff.cfg.quant.smooth_quant_strength == 0.9 and eff.cfg.quant.calibration_percentile == 99.9
    assert eff.cfg.compiler.check_cosine_simularity == 0.9 and eff.cfg.input_processors[0].padding_constant_value == 3


def test_the_switch_is_the_right_one():
    """check_rtol acts with check 1 only; the black list with a per-layer check only."""
    eff = load_build_config({"compiler": {"check": 3, "check_rtol": 0.1, "check_tensor_black_list": ["a"],
                                          "check_mode": "CheckOutput"}}, require_io=False)
    assert [w.split(" is set")[0] for w in eff.warnings] == ["compiler.check_rtol", "compiler.check_tensor_black_list"]
    assert "compiler.check 1 (all-close)" in eff.warnings[0]
    assert "check_mode CheckPerLayer" in eff.warnings[1]
    assert eff.cfg.compiler.check_mode == "CheckOutput"  # its switch (check 3) is on


def test_warnings_are_logged_once_on_pulsar_config():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("pulsar.config")
    logger.addHandler(handler)
    try:
        eff = load_build_config({"quant": {"smooth_quant_threshold": 0.3, "finetune_epochs": 3}}, require_io=False)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == list(eff.warnings)
    assert all(r.levelno == logging.WARNING for r in records) and len(records) == 2


def test_contradictions_stay_errors():
    for config, needle in [
        ({"quant": {"precision_analysis": True, "precision_analysis_mode": "NPUBackend"}}, "EndToEnd"),
        ({"quant": {"enable_lsq": True, "enable_adaround": True}}, "enable one of them"),
        ({"compiler": {"static_batch_sizes": [1, 2], "max_dynamic_batch_size": 4}}, "exclude each other"),
        ({"compiler": {"sub_configs": [{"start_tensor_names": ["a"], "end_tensor_names": ["b"],
                                        "disable_ir_fix": True}]}}, "acts on the whole graph"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_build_config(config, require_io=False)


def test_a_switched_off_field_does_not_hide_a_contradiction_it_cannot_cause():
    """NPUBackend without precision analysis is not run at all: a warning, not the EndToEnd error."""
    eff = load_build_config({"quant": {"precision_analysis_mode": "NPUBackend"}}, require_io=False)
    assert eff.cfg.quant.precision_analysis_mode == "Reference" and len(eff.warnings) == 1


def test_build_warns_names_the_flag_and_records_the_default(tmp_path: Path, tiny: dict[str, Path]):
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}],
                     "smooth_quant_threshold": 0.3}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    proc = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", "out", "--config", "c.json",
                    "--compiler.check_atol", "0.5"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "has no effect without" in ln]
    assert len(lines) == 2, proc.stderr
    assert "quant.smooth_quant_threshold is set (0.3) but has no effect without quant.enable_smooth_quant" in lines[0]
    assert "--compiler.check_atol is set (0.5) but has no effect without compiler.check 1" in lines[1]
    assert all(ln.startswith("WARNING") for ln in lines)
    written = json.loads((tmp_path / "out" / "build_config.json").read_text())
    assert written["quant"]["smooth_quant_threshold"] == 0.2 and written["compiler"]["check_atol"] == 0
    assert "smooth_quant_threshold is set" in (tmp_path / "out" / "build.log").read_text()
