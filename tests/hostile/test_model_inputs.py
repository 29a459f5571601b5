"""Hostile model files for `pulsar build`: a model path that does not exist (named after where it came
from: ``--input`` or the config's ``input``) and model inputs of a type pulsar cannot feed (text,
bfloat16), named at load time rather than later as a calibration dtype mismatch.

Every case runs the real command in a directory of its own and must fail cleanly (exit 2, one
``error:`` line, no traceback, nothing created or changed), and a failed load is not logged as done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.hostile.harness import Case, Snapshot, assert_clean_failure, run_cli

Setup = Callable[[Path, dict[str, Path]], list[str]]


def _model(path: Path, extra_input: onnx.ValueInfoProto) -> Path:
    """Relu on a float image, plus ``extra_input`` (unused: its type alone must be refused)."""
    graph = helper.make_graph([helper.make_node("Relu", ["image"], ["out"], name="relu")], "typed",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8]), extra_input],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 8, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _config(d: Path, **top: object) -> Path:
    """A config that calibrates every input from a folder of float samples (so only the type is wrong)."""
    (d / "calib").mkdir()
    np.save(d / "calib" / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    entries = [{"tensor_name": name, "calibration_dataset": "calib", "calibration_format": "Numpy"}
               for name in ("image", "text")]
    (d / "c.json").write_text(json.dumps({"quant": {"input_configs": entries}, **top}))
    return d / "c.json"


def _typed(elem_type: int, name: str = "text") -> Setup:
    def setup(d: Path, tiny: dict[str, Path]) -> list[str]:
        _model(d / "m.onnx", helper.make_tensor_value_info(name, elem_type, [1, 4]))
        _config(d)
        return ["build", "--input", "m.onnx", "--output_dir", "out", "--config", "c.json"]
    return setup


def _missing_flag(d: Path, tiny: dict[str, Path]) -> list[str]:
    return ["build", "--input", "nope.onnx", "--output_dir", "out"]


def _missing_in_config(d: Path, tiny: dict[str, Path]) -> list[str]:
    _config(d, input="nope.onnx")
    return ["build", "--output_dir", "out", "--config", "c.json"]


def _directory_flag(d: Path, tiny: dict[str, Path]) -> list[str]:
    (d / "model.onnx").mkdir()
    return ["build", "--input", "model.onnx", "--output_dir", "out"]


CASES = [
    Case("input_is_text", _typed(TensorProto.STRING),
         ("m.onnx", "input 'text' is tensor(string)", "pulsar feeds numeric tensors only", "token ids")),
    Case("input_is_bfloat16", _typed(TensorProto.BFLOAT16, "x"),
         ("m.onnx", "input 'x' is tensor(bfloat16)", "numeric tensors only", "Cast")),
    Case("input_is_complex", _typed(TensorProto.COMPLEX64, "z"), ("input 'z' is tensor(complex64)",)),
    Case("model_missing_from_flag", _missing_flag, ("model file nope.onnx does not exist", "check --input")),
    Case("model_missing_from_config", _missing_in_config,
         ("model file nope.onnx does not exist", "check `input` in the config")),
    Case("model_is_a_directory_from_flag", _directory_flag, ("model.onnx is not a file", "point --input at")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_model_fails_cleanly(case: Case, tiny: dict[str, Path], tmp_path: Path) -> None:
    args = case.setup(tmp_path, tiny)
    before = Snapshot.of(tmp_path)
    proc = run_cli(args, tmp_path)
    assert_clean_failure(proc, case.needle, before, tmp_path)
    assert "load model done" not in proc.stderr, proc.stderr  # a failed load is not "done"
    assert proc.stdout == "", proc.stdout


def test_corpus_is_distinct() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
