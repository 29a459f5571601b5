"""Faults around a build: SIGTERM in the middle, a second build into the same directory, a full or
read-only file system, and the permissions and contents of what a build leaves behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.hostile.harness import Snapshot, assert_clean_failure, run_cli

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow

SHAPE = (1, 3, 16, 16)


def _config(calib: Path, **extra: object) -> dict:
    return {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(calib),
                                         "calibration_format": "Numpy", "calibration_size": -1}]}, **extra}


def _many_samples(folder: Path, n: int) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        np.save(folder / f"{i:04d}.npy", rng.standard_normal(SHAPE).astype(np.float32))
    return folder


def _wait_for(predicate, timeout: float = 90.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def test_sigterm_mid_build_and_a_second_build_into_the_same_dir(tmp_path: Path, tiny: dict[str, Path]) -> None:
    """A build is frozen (SIGSTOP) as soon as its staging folder exists; a second build into the
    same directory fails at once naming it; SIGTERM then stops the first cleanly: exit 2, one line,
    no artifact, no staging folder, no lock file."""
    calib = _many_samples(tmp_path / "calib", 600)
    (tmp_path / "c.json").write_text(json.dumps(_config(calib)))
    out = tmp_path / "out"
    before = Snapshot.of(tmp_path)
    argv = [sys.executable, "-m", "pulsar", "build", "--input", str(tiny["model"]), "--output_dir", "out",
            "--config", "c.json"]
    first = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "COLUMNS": "400"})
    try:
        staged = _wait_for(lambda: out.is_dir() and any(out.glob(".pulsar-staging-*")) or first.poll() is not None)
        assert staged and first.poll() is None, "the build ended before its staging folder was seen"
        os.kill(first.pid, signal.SIGSTOP)
        assert any(out.glob(".pulsar-staging-*")), "stopped after the build committed; make it slower"

        second = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", "out", "--config", "c.json"],
                         tmp_path)
        assert_clean_failure(second, ("in use by another pulsar build", f"pid {first.pid}", "pulsar build"))

        os.kill(first.pid, signal.SIGTERM)
        os.kill(first.pid, signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
    proc = subprocess.CompletedProcess(argv, first.returncode, stdout, stderr)
    assert_clean_failure(proc, "terminated (SIGTERM)", before, tmp_path)
    assert not list(out.glob(".pulsar-*")), list(out.iterdir())
    assert (out / "build_failed.log").is_file()


@contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'}); needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_disk(tmp_path: Path, tiny: dict[str, Path]) -> None:
    """A 20 kB file system fills up in the middle of the build: one line naming the file and the
    cause, and the output directory holds no artifact."""
    (tmp_path / "c.json").write_text(json.dumps(_config(tiny["calib"])))
    with _tmpfs(tmp_path / "disk", "size=20k") as disk:
        before = Snapshot.of(tmp_path)
        proc = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", str(disk / "out"), "--config",
                        "c.json"], tmp_path)
        assert_clean_failure(proc, ("cannot write", "No space left on device"), before, tmp_path, "disk/out")
        left = {p.relative_to(disk).as_posix() for p in disk.rglob("*") if p.is_file()}
        assert not {p for p in left if not p.startswith(("out/cache/", "out/build_failed.log"))}, left


def test_read_only_file_system(tmp_path: Path, tiny: dict[str, Path]) -> None:
    (tmp_path / "c.json").write_text(json.dumps(_config(tiny["calib"])))
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        before = Snapshot.of(tmp_path)
        proc = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", str(ro / "out"), "--config",
                        "c.json"], tmp_path)
        assert_clean_failure(proc, ("output_dir", "read-only file system"), before, tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_artifacts_respect_the_umask(tmp_path: Path, tiny: dict[str, Path], umask: int) -> None:
    (tmp_path / "c.json").write_text(json.dumps(_config(tiny["calib"])))

    def under_umask(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", f'umask {umask:03o} && exec "$0" -m pulsar "$@"', sys.executable, *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    proc = under_umask("build", "--input", str(tiny["model"]), "--output_dir", "out", "--config", "c.json")
    assert proc.returncode == 0, proc.stderr
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert {"compiled.pulsar", "quantized.onnx", "optimized.onnx", "build_config.json", "build.log"} <= \
        {p.name for p in files}
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    run = under_umask("run", "--model", "out/compiled.pulsar", "--random_input", "--output_dir", "res")
    assert run.returncode == 0, run.stderr
    outs = list((tmp_path / "res").rglob("*.npy"))
    assert outs and all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in outs)


def test_rebuild_replaces_every_artifact_and_a_failed_one_keeps_the_last_good_build(
        tmp_path: Path, tiny: dict[str, Path]) -> None:
    """Artifacts of an earlier build never mix with a later one: a build with precision analysis
    and another output_name, then a plain one, leaves only the plain build's files; a failing build
    after it changes nothing but build_failed.log."""
    (tmp_path / "c.json").write_text(json.dumps(_config(tiny["calib"])))
    base = ["build", "--input", str(tiny["model"]), "--output_dir", "out", "--config", "c.json"]
    first = run_cli([*base, "--quant.precision_analysis", "--output_name", "old.pulsar"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "out/quant/debug/precision_analysis_table.txt").is_file()
    second = run_cli(base, tmp_path)
    assert second.returncode == 0, second.stderr
    out = tmp_path / "out"
    assert not (out / "old.pulsar").exists() and not (out / "quant" / "debug").exists()
    assert (out / "compiled.pulsar").is_file()
    good = Snapshot.of(out)
    bad = run_cli([*base, "--quant.layer_configs", '[{"layer_name": "nope", "data_type": "U16"}]'], tmp_path)
    assert bad.returncode == 2
    after = Snapshot.of(out)
    assert {k: v for k, v in after.files.items() if not k.startswith(("build_failed.log", "cache/"))} == \
        {k: v for k, v in good.files.items() if not k.startswith("cache/")}
    again = run_cli(base, tmp_path)
    assert again.returncode == 0 and not (out / "build_failed.log").exists()


def _named_model(path: Path, name: str) -> Path:
    """A one-Conv model whose input and layer names hold rich markup and a terminal escape."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    node = helper.make_node("Conv", [name, "w"], ["y"], name=f"conv{name}", pads=[1, 1, 1, 1])
    relu = helper.make_node("Relu", ["y"], ["out"], name="relu")
    graph = helper.make_graph([node, relu], "named", [helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                                                     [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_names_with_markup_and_escapes_are_printed_literally(tmp_path: Path) -> None:
    name = "[bold red]x[/]\x1b[2J"
    model = _named_model(tmp_path / "m.onnx", name)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(2):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32))
    conf = {"quant": {"input_configs": [{"tensor_name": name, "calibration_dataset": str(calib),
                                         "calibration_format": "Numpy"}], "precision_analysis": True}}
    (tmp_path / "c.json").write_text(json.dumps(conf))
    proc = run_cli(["build", "--input", str(model), "--output_dir", "out", "--config", "c.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "\x1b" not in text  # no escape sequence reaches the terminal (not a terminal: no colours either)
    assert "[bold red]x[/]\\x1b[2J" in text  # the Quant Config Table and precision table show it as written
    log = (tmp_path / "out" / "build.log").read_text()
    assert "\x1b" not in log and "[bold red]x[/]\\x1b[2J" in log


def test_piped_tables_and_progress_bars_are_not_cut(tmp_path: Path) -> None:
    """Without COLUMNS and without a terminal, a long tensor name stays whole in every table, every
    progress bar is printed whole (description, bar, count, time: wider than 80 columns), and one
    sample is "1 sample" everywhere."""
    name = "feature_" + uuid.uuid4().hex * 3  # 104 characters, wider than 80 columns on its own
    model = _named_model(tmp_path / "m.onnx", name)
    calib = tmp_path / "calib"
    calib.mkdir()
    np.save(calib / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    conf = {"quant": {"input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": str(calib),
                                         "calibration_format": "Numpy"}], "precision_analysis": True},
            "compiler": {"check": 3}}
    (tmp_path / "c.json").write_text(json.dumps(conf))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "pulsar", "build", "--input", str(model), "--output_dir", "out",
                           "--config", "c.json"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stderr.splitlines() if "conv" + name in ln]
    assert rows, proc.stderr  # the precision table's operator column holds the whole layer name
    assert all("…" not in r for r in rows)
    for description in ("calibrating (1 sample)", "precision analysis (PerLayer Reference, 1 sample)",
                        "compiler check 3 (cosine, CheckPerLayer, 1 sample)"):
        bar = [ln for ln in proc.stderr.splitlines() if ln.startswith(description + " ")]
        assert len(bar) == 1 and re.fullmatch(r"━+ 1/1 \d+:\d\d:\d\d", bar[0][len(description) + 1:]), proc.stderr
    assert "1 samples" not in proc.stdout + proc.stderr


def test_sigterm_during_pulsar_run(tmp_path: Path, tiny: dict[str, Path]) -> None:
    """pulsar run over a long --list is stopped by SIGTERM: exit 2, one line, no temp file left."""
    (tmp_path / "c.json").write_text(json.dumps(_config(tiny["calib"])))
    built = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", "b", "--config", "c.json"], tmp_path)
    assert built.returncode == 0, built.stderr
    samples = tmp_path / "samples"
    rng = np.random.default_rng(0)
    names = [f"s{i:04d}" for i in range(3000)]
    for n in names:
        (samples / n).mkdir(parents=True)
        np.save(samples / n / "image.npy", rng.standard_normal(SHAPE).astype(np.float32))
    (tmp_path / "list.txt").write_text("\n".join(names) + "\n")
    argv = [sys.executable, "-m", "pulsar", "run", "--model", "b/compiled.pulsar", "--input_dir", "samples",
            "--list", "list.txt", "--output_dir", "res"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: (tmp_path / "res" / "s0000").is_dir() or proc.poll() is not None)
        assert proc.poll() is None, "the run ended before it could be stopped"
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_clean_failure(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), "terminated (SIGTERM)")
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
