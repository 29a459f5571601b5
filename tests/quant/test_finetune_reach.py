"""Fine-tuning on graphs with ops that pass no gradient, or that torch cannot run: what cannot train is
known from the graph before calibration, such blocks stay calibrated (logged per block), and the
build is refused, before calibration, only when no block can train."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

import pulsar
from pulsar.errors import PulsarError
from pulsar.quant.finetune import check_finetune, trainable_blocks
from pulsar.quant.torch_exec import TORCH_OPS, QuantExecutor

W = ",".join(["0.1", "-0.2", "0.3", "0.05"] * 4)
# conv a -> block 1; conv b's output reaches y only through ArgMax (an index: no gradient)
_MIXED = f"""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y, float[1,1,8,8] k) {{
    w1 = Constant <value = float[4,4,1,1] {{{W}}}> ()
    w2 = Constant <value = float[4,4,1,1] {{{W}}}> ()
    a = Conv (x, w1)
    y = Relu (a)
    b = Conv (y, w2)
    i = ArgMax <axis = 1, keepdims = 1> (b)
    k = Cast <to = 1> (i)
}}"""
# every weight reaches the output only through an index
_BLOCKED = f"""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,1,8,8] k) {{
    w1 = Constant <value = float[4,4,1,1] {{{W}}}> ()
    a = Conv (x, w1)
    i = ArgMax <axis = 1, keepdims = 1> (a)
    k = Cast <to = 1> (i)
}}"""


def _model(text: str) -> onnx.ModelProto:
    """The parsed graph as the frontend hands it over: named nodes, constants as initializers."""
    m = onnx.parser.parse_model(text)
    keep = []
    for n in m.graph.node:
        if n.op_type == "Constant":
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            m.graph.initializer.append(t)
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    for i, n in enumerate(m.graph.node):
        n.name = n.name or f"n{i}"
    return onnx.shape_inference.infer_shapes(m)


def _q(**kw: object) -> SimpleNamespace:
    base = {"enable_adaround": False, "enable_brecq": True, "enable_lsq": False, "finetune_block_size": 1,
            "finetune_loss_mask": ""}
    return SimpleNamespace(**{**base, **kw})


def test_reach_keeps_the_weights_a_gradient_reaches() -> None:
    m = _model(_MIXED)
    weights = {n.input[1]: n.name for n in m.graph.node if n.op_type == "Conv"}
    blocks, notes = trainable_blocks(m, weights, _q())
    trained = [w for b in blocks for w in b.weights]
    assert "w1" in trained and "w2" not in trained
    assert any("w2" in line and "ArgMax" in line for line in notes), notes
    # AdaRound's objective is each layer's own output: both weights train
    blocks, notes = trainable_blocks(m, weights, _q(enable_brecq=False, enable_adaround=True))
    assert sorted(w for b in blocks for w in b.weights) == ["w1", "w2"] and not notes


def test_no_trainable_block_is_refused_naming_the_op() -> None:
    with pytest.raises(PulsarError, match=r"quant\.enable_brecq: no block .*ArgMax"):
        check_finetune(_model(_BLOCKED), _q())
    check_finetune(_model(_BLOCKED), _q(enable_brecq=False))  # fine-tuning off: nothing to check


def _calib(root: Path, n: int = 4) -> Path:
    folder = root / "calib"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        np.save(folder / f"{i}.npy", rng.standard_normal((1, 4, 8, 8)).astype(np.float32))
    return folder


def _cfg(calib: Path, **quant: object) -> dict:
    return {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                         "calibration_format": "Numpy", "calibration_size": 4}], **quant}}


def test_refusal_comes_before_calibration(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_model(_BLOCKED), src)
    calib = _calib(tmp_path)
    # an unreadable calibration sample: calibration would fail on it, so the refusal comes first
    (calib / "2.npy").write_bytes(b"not numpy")
    with pytest.raises(PulsarError, match="no block of this model can be trained"):
        pulsar.build(src, tmp_path / "out", _cfg(calib, enable_brecq=True), quiet=True)


def test_blocked_block_stays_calibrated_and_the_rest_trains(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_model(_MIXED), src)
    calib = _calib(tmp_path)
    with caplog.at_level(logging.INFO, logger="pulsar"):
        built = pulsar.build(src, tmp_path / "out", _cfg(calib, enable_brecq=True, finetune_epochs=5,
                                                         finetune_block_size=1), quiet=True)
    text = caplog.text
    assert "no gradient reaches w2" in text and "ArgMax" in text, text
    assert "stays calibrated" in text
    assert built.compiled_model.exists()


def test_ops_torch_cannot_run_go_through_onnxruntime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with no torch function runs in onnxruntime: the same values, no gradient through it."""
    src = tmp_path / "m.onnx"
    onnx.save(_model(_MIXED), src)
    built = pulsar.build(src, tmp_path / "out", _cfg(_calib(tmp_path)), quiet=True)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32))
    exe = QuantExecutor(built.quant_graph)
    nodes = range(len(exe.nodes))
    want = exe.run(nodes, {"x": x}, ["y", "k"], quant=True)
    monkeypatch.delitem(TORCH_OPS, "ArgMax")
    monkeypatch.delitem(TORCH_OPS, "Relu")
    exe = QuantExecutor(built.quant_graph)
    assert {exe.nodes[i].op_type for i in exe.fallback} == {"ArgMax", "Relu"}
    got = exe.run(nodes, {"x": x}, ["y", "k"], quant=True)
    for k in ("y", "k"):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
