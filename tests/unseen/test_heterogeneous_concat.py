"""A detector head that concatenates pixel box coordinates with 0-1 class scores: the default build
keeps the scores (the Concat moves to 16 bits from the calibration statistics), and when a user forces
it back to 8 bits the build warns naming the output, the slices and the fix, while the whole-tensor
cosine still reads >= 0.999; the precision table names the worst slice and the layer_configs fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from onnx import helper

from tests.cli_fork import run_pulsar
from tests.unseen.helpers import build_and_run, calib_config, cosine, init, save, vi

A = 64  # anchors (8 x 8 positions)
C = 6   # classes


def detector_head(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["f0"], name="stem", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["f0"], ["f"], name="stem_relu"),
        helper.make_node("Conv", ["f", "wb", "bb"], ["box0"], name="box_conv", kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["box0"], ["box1"], name="box_sig"),
        helper.make_node("Mul", ["box1", "stride"], ["box2"], name="box_scale"),     # pixels: 0 .. 640
        helper.make_node("Conv", ["f", "wc", "bc"], ["cls0"], name="cls_conv", kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["cls0"], ["cls1"], name="cls_sig"),            # scores: 0 .. 1
        helper.make_node("Reshape", ["box2", "shape_b"], ["box"], name="box_flat"),
        helper.make_node("Reshape", ["cls1", "shape_c"], ["cls"], name="cls_flat"),
        helper.make_node("Concat", ["box", "cls"], ["y"], name="head_concat", axis=1),
    ]
    inits = [init("w0", rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * 0.3), init("b0", np.zeros(8, np.float32)),
             init("wb", rng.normal(size=(4, 8, 1, 1)).astype(np.float32) * 0.5), init("bb", np.zeros(4, np.float32)),
             init("wc", rng.normal(size=(C, 8, 1, 1)).astype(np.float32)),
             init("bc", np.full(C, -3.0, np.float32)),  # mostly low scores, a few high: a detector's
             init("stride", np.float32(640.0)),
             init("shape_b", np.array([1, 4, A], np.int64)), init("shape_c", np.array([1, C, A], np.int64))]
    return save(tmp / "head.onnx", nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4 + C, A])], inits)


def _samples(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(1, 3, 8, 8)).astype(np.float32) * 1.5 for _ in range(n)]


def test_default_keeps_class_scores_beside_box_coordinates(tmp_path: Path) -> None:
    model = detector_head(tmp_path)
    cfg = calib_config(tmp_path, {"x": _samples(16, 1)})
    x = _samples(1, 99)[0]
    outs = build_and_run(model, tmp_path / "out", cfg, {"x": x})
    qcfg = json.loads((tmp_path / "out" / "quant" / "quant_config.json").read_text())
    assert qcfg["tensors"]["y"]["dtype"] == "U16"
    ref = outs["float"][0]
    for mode in ("qdq", "npu"):
        scores, want = outs[mode][0][:, 4:], ref[:, 4:]
        assert cosine(scores, want) > 0.999, mode
        # the 8-bit sigmoid upstream limits them, not the join: a few of its steps at most
        assert np.abs(scores - want).max() < 0.05 and np.abs(scores - want).mean() < 0.01, mode
        assert np.array_equal(scores > 0.25, want > 0.25) or np.mean((scores > 0.25) != (want > 0.25)) < 0.01


def test_flattened_slices_are_found_where_the_tensor_cosine_is_0999(tmp_path: Path) -> None:
    model = detector_head(tmp_path)
    cfg = calib_config(tmp_path, {"x": _samples(16, 1)}, precision_analysis=True,
                       layer_configs=[{"layer_name": "head_concat", "data_type": "U8"}])
    x = _samples(1, 99)[0]
    outs = build_and_run(model, tmp_path / "lib", cfg, {"x": x})
    ref, npu = outs["float"][0], outs["npu"][0]
    assert cosine(npu, ref) >= 0.999  # the whole tensor looks fine ...
    assert cosine(npu[:, 4:], ref[:, 4:]) < 0.9  # ... while the scores are gone
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = run_pulsar(["build", "--input", str(model), "--config",
                   str(tmp_path / "cfg.json"), "--output_dir", str(tmp_path / "cli")],
                   timeout=300, env={"COLUMNS": "400", **_env()})
    assert r.returncode == 0, r.stderr
    warn = [line for line in r.stderr.splitlines() if "output 'y'" in line]
    assert warn, r.stderr
    assert "along axis 1" in warn[0] and '"layer_name": "head_concat", "data_type": "U16"' in warn[0]
    bad = warn[0].split("([")[1].split("])")[0]
    assert {int(i) for i in bad.split(", ")} <= set(range(4, 4 + C))  # only class rows are named
    table = (tmp_path / "cli" / "quant" / "debug" / "precision_analysis_slices.txt").read_text()
    row = next(line for line in table.splitlines() if line.startswith("head_concat"))
    assert "axis 1 [" in row and '{"layer_name": "head_concat", "data_type": "U16"}' in row


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_check_3_fails_a_slice_the_whole_tensor_hides() -> None:
    """compiler.check 3 on an integer output: rows 4.. off by many steps, the tensor's cosine >= 0.999."""
    from types import SimpleNamespace

    from pulsar.runtime.check import CODES, verdict

    rng = np.random.default_rng(0)
    want = np.concatenate([rng.integers(20000, 60000, size=(1, 4, A)), rng.integers(0, 40, size=(1, C, A))],
                          axis=1).astype(np.uint16)
    got = want.copy()
    got[:, 4:] = 0  # the class rows flattened
    c = SimpleNamespace(check_cosine_simularity=0.999)
    assert cosine(got.astype(np.float64), want.astype(np.float64)) >= 0.999
    why = verdict(3, got, want, {"y": CODES}, "y", c)
    assert why is not None and why.startswith("slice axis 1 [") and "while the whole tensor passes" in why
    near = want.copy()
    near[:, 4:] = np.maximum(near[:, 4:].astype(np.int64) - 1, 0).astype(np.uint16)  # one step: rounding only
    assert verdict(3, near, want, {"y": CODES}, "y", c) is None


def test_a_16_bit_table_reads_a_16_bit_input_up_to_the_op_that_computes_it(tmp_path: Path) -> None:
    """YOLOv8's layout: box and class logits joined and split again before the class Sigmoid. The scores
    join pixel boxes at U16, so the Sigmoid's input, the Split and Concat that carry it and the Convs
    that compute the logits are raised to 16 bits too (an 8-bit input gives a table 256 outputs)."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "wb", "bb"], ["box_logits"], name="box_conv", kernel_shape=[1, 1]),
        helper.make_node("Conv", ["x", "wc", "bc"], ["cls_logits"], name="cls_conv", kernel_shape=[1, 1]),
        helper.make_node("Concat", ["box_logits", "cls_logits"], ["logits"], name="logit_concat", axis=1),
        helper.make_node("Split", ["logits", "split"], ["box_part", "cls_part"], name="split", axis=1),
        helper.make_node("Sigmoid", ["box_part"], ["box_sig"], name="box_sig"),
        helper.make_node("Mul", ["box_sig", "stride"], ["box_px"], name="box_scale"),
        helper.make_node("Sigmoid", ["cls_part"], ["scores"], name="cls_sig"),
        helper.make_node("Reshape", ["box_px", "shape_b"], ["box"], name="box_flat"),
        helper.make_node("Reshape", ["scores", "shape_c"], ["cls"], name="cls_flat"),
        helper.make_node("Concat", ["box", "cls"], ["y"], name="head_concat", axis=1),
    ]
    inits = [init("wb", rng.normal(size=(4, 3, 1, 1)).astype(np.float32)), init("bb", np.zeros(4, np.float32)),
             init("wc", rng.normal(size=(C, 3, 1, 1)).astype(np.float32)), init("bc", np.full(C, -3.0, np.float32)),
             init("split", np.array([4, C], np.int64)), init("stride", np.float32(640.0)),
             init("shape_b", np.array([1, 4, A], np.int64)), init("shape_c", np.array([1, C, A], np.int64))]
    model = save(tmp_path / "yolo.onnx", nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4 + C, A])], inits)
    outs = build_and_run(model, tmp_path / "out", calib_config(tmp_path, {"x": _samples(16, 1)}),
                         {"x": _samples(1, 99)[0]})
    tensors = json.loads((tmp_path / "out" / "quant" / "quant_config.json").read_text())["tensors"]
    for name in ("cls_part", "logits", "cls_logits", "box_logits"):
        assert tensors[name]["dtype"] == "U16", (name, tensors[name]["dtype"])
    scores, want = outs["npu"][0][:, 4:], outs["float"][0][:, 4:]
    assert np.abs(scores - want).max() < 0.015  # 1.5 steps of the output grid (640 / 65535)
