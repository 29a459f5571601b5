"""``auto_pad`` SAME_UPPER / SAME_LOWER / VALID on convolutions and pooling (PaddlePaddle / TF exports;
PP-OCRv6's detector has a SAME MaxPool) becomes explicit pads: the build runs the passive MaxPool on
the NPU and every mode matches float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.unseen.helpers import build_and_run, calib_config, cosine, init, save, vi


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_auto_pad_becomes_explicit_and_builds(tmp_path: Path, mode: str) -> None:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], strides=[2, 2],
                              auto_pad=mode),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[1, 1],
                              auto_pad=mode),
             helper.make_node("AveragePool", ["p"], ["y"], name="avg", kernel_shape=[3, 3], strides=[2, 2],
                              auto_pad=mode)]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [1, 3, 15, 15])], [vi("y", [1, 8, None, None])],
                [init("w", (rng.normal(size=(8, 3, 3, 3)) * 0.3).astype(np.float32)),
                 init("b", np.zeros(8, np.float32))])
    xs = [rng.normal(size=(1, 3, 15, 15)).astype(np.float32) for _ in range(8)]
    outs = build_and_run(path, tmp_path / "out", calib_config(tmp_path, {"x": xs}), {"x": xs[0]})
    optimized = onnx.load(tmp_path / "out" / "frontend" / "optimized.onnx")
    assert not any(a.name == "auto_pad" for n in optimized.graph.node for a in n.attribute)
    for m in ("qdq", "npu"):
        assert outs[m][0].shape == outs["float"][0].shape
        assert cosine(outs[m][0], outs["float"][0]) > 0.995, m
