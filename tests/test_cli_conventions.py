"""CLI conventions: help on stdout with exit 0 and every schema flag in it, usage errors exit 2 with
one error line, results on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pulsar.config.schema import leaves
from pulsar.config.support import unavailable_fields


def _pulsar(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # piped, default width
    return subprocess.run([sys.executable, "-m", "pulsar", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def test_build_help_goes_to_stdout_with_every_flag_whole() -> None:
    proc = _pulsar("build", "--help")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    for leaf in leaves():
        hits = [ln for ln in lines if ln.startswith(f"│ {leaf.flag} ")]
        assert len(hits) == 1, (leaf.flag, hits)  # one row, the flag whole (not folded at 80 columns)
    assert sum("--quant.calibration_method" in ln for ln in lines) == 1  # grep -c -- --quant.calibration_method
    for dotted in unavailable_fields():
        (row,) = [ln for ln in lines if ln.startswith(f"│ --{dotted} ")]
        assert "[not available yet]" in row, row


def test_help_of_every_command_is_on_stdout() -> None:
    for args in (["--help"], ["run", "--help"], ["info", "--help"], ["config", "--help"], ["config", "validate",
                                                                                          "--help"]):
        proc = _pulsar(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "Usage" in proc.stdout and "error:" not in proc.stderr, args


def test_usage_errors_exit_2_with_one_error_line(tmp_path: Path) -> None:
    for args, needle in ((["build"], "needs --input and --output_dir"), ([], "give a command"),
                         (["run"], "--model"), (["run", "--model", "m", "--output_dir", "o", "--bogus"], "--bogus"),
                         (["run", "--model", "m", "--output_dir", "o", "--batch_size", "x"], "--batch_size"),
                         (["info"], "'model'"), (["nosuchcommand"], "nosuchcommand")):
        proc = _pulsar(*args, cwd=tmp_path)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(errors) == 1 and needle in errors[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_config_validate_reports_ok_on_stdout(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"quant": {"calibration_method": "KL"}}))
    proc = _pulsar("config", "validate", str(cfg))
    assert proc.returncode == 0 and f"ok: {cfg} is a valid pulsar build config" in proc.stdout, proc.stderr
