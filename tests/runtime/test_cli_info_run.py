"""`pulsar info` and `pulsar run` through the real command: results on stdout, logs on stderr."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import pulsar
from pulsar.core.container import load_compiled
from tests.hostile.harness import assert_clean_failure, run_cli


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory) -> Path:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "input_processors": [{"tensor_name": "image", "tensor_layout": "NCHW", "src_layout": "NHWC"}]}
    return pulsar.build(tiny["model"], tmp_path_factory.mktemp("cli") / "out", cfg, quiet=True).compiled_model


def test_info_prints_the_summary_on_stdout(model, tmp_path):
    proc = run_cli(["info", str(model)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    meta = load_compiled(model).metadata
    for needle in [str(model), "pulsar-compiled-model version 3", f"pulsar {pulsar.__version__}", "(verified)",
                   "VNPU-M", "NPU1", str(meta["config_hash"]), "tiny.onnx", "MinMax",
                   f"{meta['estimate']['cycles']:,} cycles",  # type: ignore[index]
                   "image", "float32", "1x16x16x3", "NHWC", "logits", "1x10",
                   "npu_0", "NPU", "QConv", "cpu_0", "CPU", "QuantizeLinear", "Ops kept on the CPU"]:
        assert needle in out, needle
    digest = next(p.value for p in onnx.load(str(model)).metadata_props if p.key == "pulsar.checksum")
    assert digest in out
    assert "error" not in proc.stderr.lower()


def test_info_on_a_damaged_file_is_one_line(model, tmp_path):
    bad = tmp_path / "bad.pulsar"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    bad.write_bytes(bytes(raw))
    proc = run_cli(["info", str(bad)], tmp_path)
    assert_clean_failure(proc, (str(bad), "rebuild"))
    assert proc.stdout == ""


def test_run_prints_outputs_and_time_per_sample(model, tmp_path):
    for i in range(2):
        (tmp_path / "in" / f"s{i}").mkdir(parents=True)
        np.save(tmp_path / "in" / f"s{i}" / "image.npy", np.full((1, 16, 16, 3), i, np.float32))
    (tmp_path / "list.txt").write_text("s0\ns1\n")
    proc = run_cli(["run", "--model", str(model), "--input_dir", "in", "--list", "list.txt", "--output_dir", "o"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("logits" in ln and "1x10" in ln and "float32" in ln for ln in lines), proc.stdout
    assert "2 samples in" in lines[-1] and "ms per sample (NPUBackend)" in lines[-1] and "o/<sample>/" in lines[-1]
    assert re.search(r"after a \d+\.\d ms warm-up run \(not counted\)", lines[-1]), lines[-1]
    assert "wrote 2 output file(s)" in proc.stderr  # logs stay on stderr
    assert sorted(p.relative_to(tmp_path / "o").as_posix() for p in (tmp_path / "o").rglob("*.npy")) == \
        ["s0/logits.npy", "s1/logits.npy"]


def test_info_of_a_model_with_little_metadata(tmp_path):
    """A file written by package_qdq_model with no build metadata still summarises (missing fields: '-')."""
    from rich.console import Console

    from pulsar.compiler.package import package_qdq_model
    from pulsar.runtime.info import model_summary
    from tests.runtime.test_session import qdq_conv_model

    path = package_qdq_model(qdq_conv_model(), tmp_path / "m.pulsar", {})
    console = Console(record=True, width=300, file=open(os.devnull, "w"))  # noqa: SIM115
    for t in model_summary(path):
        console.print(t)
    text = console.export_text()
    console.file.close()
    assert re.search(r"target hardware\s+│ -\s", text) and "images" in text and "2x3x16x16" in text and "npu_0" in text


def test_run_times_the_warm_up_apart_and_shows_per_sample_shapes(model, tmp_path):
    """A file of 4 samples run with --batch_size 4: the table shows one sample's output shape (not the
    stacked 4x10), the time per sample leaves out the warm-up run, which is printed apart, and a
    single sample reads "1 sample"."""
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "image.npy", np.ones((4, 16, 16, 3), np.float32))
    proc = run_cli(["run", "--model", str(model), "--input_dir", "in", "--batch_size", "4", "--output_dir", "o"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if "logits" in ln]
    assert rows and "1x10" in rows[0] and "4x10" not in proc.stdout, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    m = re.search(r"4 samples in ([\d.]+) s: ([\d.]+) ms per sample \(NPUBackend\), after a ([\d.]+) ms warm-up", last)
    assert m, last
    assert abs(float(m.group(2)) - 1000 * float(m.group(1)) / 4) < 1.0  # the warm-up is not in the total
    assert np.load(tmp_path / "o" / "logits.npy").shape == (4, 10)  # the file holds every sample
    one = run_cli(["run", "--model", str(model), "--random_input", "--output_dir", "o1"], tmp_path)
    assert one.returncode == 0 and "1 sample in" in one.stdout and "1 samples" not in one.stdout, one.stdout
