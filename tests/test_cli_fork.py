"""The forked ``pulsar`` commands of the CLI tests (tests/cli_fork.py) report what a plain subprocess
reports: exit status, stdout and stderr byte for byte, working directory, environment, stdin, PYTHONPATH,
a timeout, and a command killed by a signal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_fork import run_pulsar


def _plain(args: list[str], cwd: Path, env: dict[str, str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pulsar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.mark.parametrize("args", [
    ["--version"],
    ["build", "--help"],
    ["build", "--input", "missing.onnx", "--output_dir", "out"],  # one error line, exit 2
    ["run", "--model", "m", "--output_dir", "o", "--batch_size", "ten"],
    ["config", "validate", "c.yaml"],  # reads a file relative to the working directory
    ["no-such-command"],
])
def test_a_forked_command_reports_what_a_subprocess_reports(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "c.yaml").write_text("quant:\n  calibration_method: KL\n  unknown_field: 3\n")
    env = {**os.environ, "COLUMNS": "97"}
    plain = _plain(args, tmp_path, env)
    forked = run_pulsar(args, tmp_path, env=env, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.args == plain.args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_cwd_environment_stdin_and_pythonpath_are_the_commands_own(tmp_path: Path) -> None:
    """A dataset plugin found through the working directory and PYTHONPATH, reading the environment: the
    build's error line carries what the plugin saw."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper_mod.py").write_text("VALUE = 'from-pythonpath'\n")
    (tmp_path / "plug.py").write_text(
        "import os, sys, helper_mod\n"
        "raise ValueError(f\"{helper_mod.VALUE} {os.environ['PULSAR_FORK_PROBE']} {os.getcwd()}\")\n")
    (tmp_path / "c.json").write_text(json.dumps({"quant": {"input_configs": [
        {"tensor_name": "DEFAULT", "calibration_dataset": "plug.py:samples"}]}}))
    from tests.tiny_model import make_tiny_cnn

    model = make_tiny_cnn(tmp_path / "m.onnx")
    env = {**os.environ, "PULSAR_FORK_PROBE": "probe-42", "PYTHONPATH": str(lib), "COLUMNS": "400"}
    args = ["build", "--input", str(model), "--output_dir", "out", "--config", "c.json"]
    plain = _plain(args, tmp_path, env)
    forked = run_pulsar(args, tmp_path, env=env, timeout=120, stdin="ignored\n")
    assert forked.returncode == plain.returncode == 2, forked.stderr
    errors = [[ln for ln in p.stderr.splitlines() if ln.startswith("error:")] for p in (forked, plain)]
    assert errors[0] == errors[1] and len(errors[0]) == 1, forked.stderr
    assert f"from-pythonpath probe-42 {tmp_path}" in errors[0][0]
    assert "PULSAR_FORK_PROBE" not in os.environ  # the test process is untouched


def test_a_timeout_and_a_signal_are_reported_as_subprocess_does(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "die.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    from tests.tiny_model import make_tiny_cnn

    model = make_tiny_cnn(tmp_path / "m.onnx")
    for name in ("hang", "die"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"quant": {"input_configs": [
            {"tensor_name": "DEFAULT", "calibration_dataset": f"{name}.py:samples"}]}}))
    args = ["build", "--input", str(model), "--output_dir", "out", "--config"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_pulsar([*args, "hang.json"], tmp_path, timeout=3)
    killed = run_pulsar([*args, "die.json"], tmp_path, timeout=120)
    assert killed.returncode == _plain([*args, "die.json"], tmp_path, dict(os.environ)).returncode == -9
