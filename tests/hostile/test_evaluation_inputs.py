"""Hostile inputs for a build's ``evaluation`` section: metric plugins that end, kill or mislead their
process, and labels that cannot be right.

Every case runs the real ``pulsar build`` in a directory of its own and must fail cleanly: exit 2, one
``error:`` line naming the field / file / plugin, no traceback, nothing created or changed except what
a failed build may leave (``out/build_failed.log``, the calibration cache). A plugin runs in a child
process, so one that exits or is killed mid-evaluation still leaves no staging folder and no lock.
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
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.hostile.harness import Case, assert_clean_failure, run_case, run_cli

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow

SAMPLES = 8  # the tiny calibration set, used as evaluation data too


@dataclass(frozen=True)
class Env:
    model: Path  # the tiny CNN: image [1, 3, 16, 16] -> logits [1, 10]
    calib: Path  # its 8 Numpy samples
    seg: Path  # a one-Conv segmenter: image [1, 3, 16, 16] -> scores [1, 4, 16, 16]


Setup = Callable[[Path, Env], list[str]]


def _entry(env: Env) -> dict[str, Any]:
    return {"tensor_name": "image", "calibration_dataset": str(env.calib), "calibration_format": "Numpy",
            "calibration_size": SAMPLES}


def _build(d: Path, env: Env, evaluation: dict[str, Any], *, model: Path | None = None, **extra: Any) -> list[str]:
    cfg = {"quant": {"input_configs": [_entry(env)]}, "evaluation": evaluation, **extra}
    (d / "c.json").write_text(json.dumps(cfg))
    return ["build", "--input", str(model or env.model), "--output_dir", "out", "--config", "c.json"]


def plugin(body: str, function: str = "metric") -> Setup:
    """A plugin file ``plug.py`` in the case directory, named by a relative path."""

    def setup(d: Path, env: Env) -> list[str]:
        (d / "plug.py").write_text(body)
        return _build(d, env, {"metric": f"plug.py:{function}"})

    return setup


def labels(metric: str, make: Callable[[Path], None], *, seg: bool = False, **evaluation: Any) -> Setup:
    """A built-in metric on the calibration samples with the labels file ``make`` writes."""

    def setup(d: Path, env: Env) -> list[str]:
        make(d / "labels.npy")
        ev = {"metric": metric, "input_configs": [{**_entry(env), "calibration_size": -1}],
              "labels": "labels.npy", **evaluation}
        return _build(d, env, ev, model=env.seg if seg else None)

    return setup


def _save(values: Any, dtype: Any = None) -> Callable[[Path], None]:
    return lambda path: np.save(path, np.asarray(values, dtype))


def _huge_header(path: Path) -> None:
    """A valid .npy header claiming 10^12 int64 labels, followed by 16 bytes."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
        f.write(b"\0" * 16)


def _objects(path: Path) -> None:
    np.save(path, np.array([{"label": 1}] * SAMPLES, dtype=object), allow_pickle=True)


def _nan_masks(path: Path) -> None:
    masks = np.zeros((SAMPLES, 16, 16), np.float32)
    masks[3, 2, 2] = np.nan
    np.save(path, masks)


def _with_processors(d: Path, env: Env) -> list[str]:
    ev = {"metric": "top1_agreement", "input_configs": [{**_entry(env), "calibration_size": -1}]}
    procs = [{"tensor_name": "image", "src_layout": "NHWC", "src_dtype": "U8", "tensor_format": "RGB",
              "src_format": "RGB"}]
    return _build(d, env, ev, input_processors=procs)


CASES: list[Case] = [
    # -- plugins that end, kill or mislead their process -----------------------------------------------
    Case("plugin_os_exit_at_import", plugin("import os\nos._exit(0)\n"),
         ("evaluation.metric: the plugin plug.py:metric ended its process (exit code 0", "imported")),
    Case("plugin_os_exit_in_call", plugin("import os\ndef metric(session):\n    os._exit(0)\n"),
         ("evaluation.metric", "ended its process (exit code 0", "while it scored the float model")),
    Case("plugin_killed_in_call", plugin("import os, signal\ndef metric(session):\n"
                                         "    os.kill(os.getpid(), signal.SIGKILL)\n"),
         ("evaluation.metric", "was killed by SIGKILL", "while it scored the float model")),
    Case("plugin_sys_exit_at_import", plugin("import sys\nsys.exit(0)\n"),
         "evaluation.metric: importing plug.py raised SystemExit"),
    Case("plugin_returns_string", plugin("def metric(session):\n    return '0.75'\n"),
         "metric() returned str '0.75' on the float model, not a number"),
    Case("plugin_returns_huge_int", plugin("def metric(session):\n    return 10 ** 400\n"),
         ("metric() returned an integer of about 401 digits on the float model", "too large for a float")),
    Case("plugin_returns_bool", plugin("def metric(session):\n    return True\n"),
         "metric() returned bool on the float model, not a number"),
    Case("plugin_returns_inf", plugin("def metric(session):\n    return float('inf')\n"),
         "metric() returned inf on the float model"),
    # -- labels that cannot be right ---------------------------------------------------------------------
    Case("labels_more_than_samples", labels("top1", _save(np.arange(12) % 10)),
         "evaluation.labels: labels.npy holds 12 labels for 8 samples"),
    Case("labels_fewer_than_samples", labels("top5", _save([1, 2, 3])),
         "evaluation.labels: labels.npy holds 3 labels for 8 samples"),
    Case("labels_outside_the_classes", labels("top1", _save([1000, 2000, -5, 7, 1, 2, 3, 4])),
         ("evaluation.labels: labels.npy holds 3 class indices outside 0..9 (-5, 1000, 2000)", "10 classes")),
    Case("labels_header_claims_1e12", labels("top1", _huge_header),
         ("evaluation.labels: labels.npy", "int64 [1000000000000] (8,000,000,000,000 bytes)", "holds 16 bytes",
          "truncated or damaged")),
    Case("labels_pickled_objects", labels("top1", _objects), ("labels.npy holds object values", "np.save")),
    Case("labels_not_npy", labels("top1", lambda p: p.write_text("1,2,3")), "labels.npy is not a plain .npy array"),
    Case("labels_one_hot", labels("top1", _save(np.eye(10)[np.arange(SAMPLES)], np.float32)),
         "needs one integer class index per sample"),
    Case("miou_nan_in_masks", labels("miou", _nan_masks, seg=True),
         ("evaluation.labels: labels.npy holds 1 NaN / inf values (first in sample 3)", "class index per pixel")),
    Case("miou_fractional_masks", labels("miou", _save(np.full((SAMPLES, 16, 16), 0.5), np.float32), seg=True),
         "labels.npy holds fractional values"),
    Case("miou_masks_of_another_size", labels("miou", _save(np.zeros((SAMPLES, 8, 8)), np.int64), seg=True),
         ("labels.npy holds masks of [8, 8] (64 pixels) per sample", "predicts 256 pixels per sample")),
    Case("miou_classes_outside", labels("miou", _save(np.full((SAMPLES, 16, 16), 4), np.int64), seg=True),
         ("class indices outside 0..3", "4 classes (axis 1)")),
    Case("builtin_with_input_processors", _with_processors,
         ("evaluation.metric: the built-in metrics", "use a plugin metric")),
]


def _make_segmenter(path: Path) -> Path:
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["image", "w"], ["scores"], pads=[1, 1, 1, 1])], "seg",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 4, 16, 16])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path




@pytest.fixture(scope="module")
def env(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Env:
    return Env(tiny["model"], tiny["calib"], _make_segmenter(tmp_path_factory.mktemp("seg") / "seg.onnx"))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, env: Env) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("hostile_evaluation")
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda c: run_case(root, env, c), CASES))
    return {case.id: (proc, before, d) for case, proc, before, d in done}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_evaluation_fails_cleanly(results: dict[str, tuple], case: Case) -> None:
    proc, before, d = results[case.id]
    assert_clean_failure(proc, case.needle, before, d)
    assert not list(d.glob("out/.pulsar*")), proc.stderr  # no staging folder, no lock


def test_a_plugin_that_changes_directory_moves_nothing(env: Env, tmp_path: Path) -> None:
    """The plugin chdirs into a folder of its own on every call, with a relative --output_dir: every
    artifact still lands in out/, nothing in the plugin's folder, and the plugin's later calls find
    their relative paths again (the working directory is restored after each call)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data.txt").write_text("0.5")
    (tmp_path / "plug.py").write_text("import os\nos.chdir('elsewhere')\n"
                                      "def metric(session):\n    value = float(open('data.txt').read())\n"
                                      "    os.chdir('elsewhere')\n    return value\n")
    proc = run_cli(_build(tmp_path, env, {"metric": "plug.py:metric"}), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not list((tmp_path / "elsewhere").iterdir())
    got = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert (got["float"], got["qdq"], got["npu"]) == (0.5, 0.5, 0.5)
    assert (tmp_path / "out" / "compiled.pulsar").is_file() and not list((tmp_path / "out").glob(".pulsar*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "data.txt", "elsewhere", "out", "plug.py"]
    assert os.getcwd() != str(tmp_path / "elsewhere")
