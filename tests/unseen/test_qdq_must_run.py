"""A build never exits 0 with a QDQ model that onnxruntime cannot run, and onnxruntime refusing a model
at run time is one ``error:`` line naming the node, exit 2, in ``pulsar build``, ``pulsar run`` and
``compiler.check``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from tests.cli_fork import run_pulsar
from tests.unseen.helpers import calib_config, init, save, vi


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_pulsar([*args], timeout=300)


def _flatten_gemm(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], name="fc")]
    return save(tmp / "m.onnx", nodes, [vi("x", [1, 4, 6])], [vi("y", [1, 5])],
                [init("w", rng.normal(size=(24, 5)).astype(np.float32)), init("b", np.zeros(5, np.float32))])


def test_a_quantized_model_that_cannot_run_fails_the_build_naming_the_node(tmp_path: Path) -> None:
    model = _flatten_gemm(tmp_path)
    cfg = calib_config(tmp_path, {"x": [np.random.default_rng(i).normal(size=(1, 4, 6)).astype(np.float32)
                                        for i in range(4)]})
    cfg["quant_op_processors"] = [{"op_name": "flat", "attrs": {"axis": 2}}]  # [1, 4, 6] -> [4, 6]: fc breaks
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = _cli("build", "--input", str(model), "--config", str(tmp_path / "cfg.json"), "--output_dir",
             str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: onnxruntime failed running the quantized model quant/quantized.onnx at node "), last
    assert "quant_op_processors" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "quant" / "quantized.onnx").exists()
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def _gather_model(tmp: Path) -> Path:
    """Gather with indices given as a model input: an index out of range fails in onnxruntime at run time."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gather", ["r", "idx"], ["g"], name="pick", axis=1),
             helper.make_node("Mul", ["g", "two"], ["y"], name="mul")]
    return save(tmp / "g.onnx", nodes, [vi("x", [1, 10]), vi("idx", [2], TensorProto.INT64)], [vi("y", [1, 2])],
                [init("two", np.float32(2.0))])


def test_pulsar_run_names_the_node_onnxruntime_refuses(tmp_path: Path) -> None:
    model = _gather_model(tmp_path)
    rng = np.random.default_rng(0)
    samples = {"x": [rng.normal(size=(1, 10)).astype(np.float32) for _ in range(4)],
               "idx": [np.array([1, 3], np.int64) for _ in range(4)]}
    (tmp_path / "cfg.json").write_text(json.dumps(calib_config(tmp_path, samples)))
    out = tmp_path / "out"
    r = _cli("build", "--input", str(model), "--config", str(tmp_path / "cfg.json"), "--output_dir", str(out))
    assert r.returncode == 0, r.stderr
    feeds = tmp_path / "feeds"
    feeds.mkdir()
    np.save(feeds / "x.npy", samples["x"][0])
    np.save(feeds / "idx.npy", np.array([1, 100], np.int64))
    for mode in ("Reference", "NPUBackend"):
        r = _cli("run", "--model", str(out / "compiled.pulsar"), "--input_dir", str(feeds), "--output_dir",
                 str(tmp_path / f"run_{mode}"), "--mode", mode)
        assert r.returncode == 2, (mode, r.stderr)
        assert "Traceback" not in r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: onnxruntime failed running") and "'pick'" in last and "idx=100" in last, last


def test_compiler_check_and_evaluation_name_the_node_onnxruntime_refuses(tmp_path: Path) -> None:
    """compiler.check on an input sample dir, and evaluation data, holding an index out of range."""
    model = _gather_model(tmp_path)
    rng = np.random.default_rng(0)
    samples = {"x": [rng.normal(size=(1, 10)).astype(np.float32) for _ in range(4)],
               "idx": [np.array([1, 3], np.int64) for _ in range(4)]}
    cfg = calib_config(tmp_path, samples)
    bad = tmp_path / "bad"
    (bad / "x").mkdir(parents=True)
    (bad / "idx").mkdir()
    np.save(bad / "x" / "0.npy", samples["x"][0])
    np.save(bad / "idx" / "0.npy", np.array([1, 100], np.int64))
    sample_dir = tmp_path / "sample"
    sample_dir.mkdir()
    np.save(sample_dir / "x.npy", samples["x"][0])
    np.save(sample_dir / "idx.npy", np.array([100, 1], np.int64))
    cases = {
        "check": {**cfg, "compiler": {"check": 3, "input_sample_dir": str(sample_dir)}},
        "evaluation": {**cfg, "evaluation": {"metric": "cosine", "input_configs": [
            {"tensor_name": n, "calibration_dataset": str(bad / n), "calibration_format": "Numpy"}
            for n in ("x", "idx")]}},
    }
    for name, c in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(c))
        r = _cli("build", "--input", str(model), "--config", str(tmp_path / f"{name}.json"), "--output_dir",
                 str(tmp_path / name))
        assert r.returncode == 2, (name, r.stderr)
        assert "Traceback" not in r.stderr, name
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "'pick'" in last and "idx=100" in last, (name, last)
