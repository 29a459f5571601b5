"""Every long step of a build shows a progress bar on stderr (precision analysis in both methods and
modes, the compiler check in both check modes, the mixed-precision search, SmoothQuant, EasyQuant);
--quiet hides them. The real CLI runs in a subprocess on the tiny model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cli_fork import run_pulsar


def _build(tmp_path: Path, tiny: dict, config: dict, *flags: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(config))
    proc = run_pulsar(["build", "--input", str(tiny["model"]), "--config",
                      str(cfg), "--output_dir", str(tmp_path / "out"), *flags], cwd=tmp_path,
                      timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


CASES = {
    "reference_perlayer_check1_amp": (
        ["--quant.precision_analysis", "true", "--quant.precision_analysis_method", "PerLayer",
         "--compiler.check", "1", "--compiler.check_mode", "CheckOutput", "--quant.auto_mixed_precision.enable",
         "--quant.enable_smooth_quant", "--quant.enable_easy_quant"],
        ["precision analysis (PerLayer Reference, 8 samples)", "compiler check 1 (all-close, CheckOutput, 2 samples)",
         "auto mixed precision: ranking layers (8 samples)", "auto mixed precision: trials",
         "smooth quant: channel ranges (8 samples)", "easy quant: layer scale search", "calibrating (8 samples)"]),
    "npubackend_endtoend_check2_perlayer": (
        ["--quant.precision_analysis", "true", "--quant.precision_analysis_method", "EndToEnd",
         "--quant.precision_analysis_mode", "NPUBackend", "--compiler.check", "2", "--compiler.check_mode",
         "CheckPerLayer"],
        ["precision analysis (EndToEnd NPUBackend, 8 samples)",
         "compiler check 2 (all-equal, CheckPerLayer, 2 samples)"]),
    "reference_endtoend_check3": (
        ["--quant.precision_analysis", "true", "--quant.precision_analysis_method", "EndToEnd",
         "--compiler.check", "3"],
        ["precision analysis (EndToEnd Reference, 8 samples)", "compiler check 3 (cosine, CheckPerLayer, 2 samples)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_long_steps_show_a_progress_bar(tmp_path, tiny, tiny_config, case):
    flags, bars = CASES[case]
    proc = _build(tmp_path, tiny, tiny_config, *flags)
    for description in bars:
        line = next((ln for ln in proc.stderr.splitlines() if description in ln), None)
        assert line is not None, f"no progress bar '{description}' on stderr:\n{proc.stderr}"
        assert "━" in line  # the bar itself, not a log line that happens to hold the words
    assert not any(d in proc.stdout for d in bars)


def test_quiet_hides_every_progress_bar(tmp_path, tiny, tiny_config):
    flags, bars = CASES["reference_perlayer_check1_amp"]
    proc = _build(tmp_path, tiny, tiny_config, *flags, "--quiet")
    assert "━" not in proc.stderr
    assert not any(d in proc.stderr for d in bars)
    assert (tmp_path / "out" / "quant" / "debug" / "precision_analysis_table.txt").is_file()
