"""The bias of a Gemm (or of a MatMul + Add turned into one) in every broadcastable shape is quantized
in its own shape: ``[N]``, ``[1, N]`` (jax2tf writes this), ``[M, N]``, ``[1]`` and a scalar. The QDQ model
runs in onnxruntime and every mode agrees with float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from pulsar.quant.scheme import bias_quant, requantize
from tests.unseen.helpers import build_and_run, calib_config, cosine, init, save, vi

M, K, N = 4, 24, 12


@pytest.mark.parametrize("shape", [(N,), (1, N), (M, N), (1,), ()], ids=["N", "1xN", "MxN", "1", "scalar"])
def test_gemm_bias_of_any_broadcastable_shape(tmp_path: Path, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(K, N)).astype(np.float32) * 0.2
    b = (rng.normal(size=shape) * 0.5).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="gemm"), helper.make_node("Relu", ["g"], ["y"])]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [M, K])], [vi("y", [M, N])], [init("w", w), init("b", b)])
    xs = [rng.normal(size=(M, K)).astype(np.float32) for _ in range(8)]
    outs = build_and_run(path, tmp_path / "out", calib_config(tmp_path, {"x": xs}), {"x": xs[0]})
    qmodel = onnx.load(tmp_path / "out" / "quant" / "quantized.onnx")
    stored = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    if "b/q" in stored:  # quantized: int32 in the bias's own shape
        assert stored["b/q"].shape == shape and stored["b/q"].dtype == np.int32
    for mode in ("qdq", "npu"):
        assert outs[mode][0].shape == (M, N)
        assert cosine(outs[mode][0], outs["float"][0]) > 0.995, mode


def test_bias_quant_keeps_the_shape_and_the_values() -> None:
    w_scale = np.linspace(0.01, 0.02, N).astype(np.float32)
    for shape in [(N,), (1, N), (M, N), (1,), ()]:
        b = np.random.default_rng(1).normal(size=shape).astype(np.float32)
        tq, q = bias_quant("b", b, 0.05, w_scale)
        assert q.shape == b.shape
        back = (requantize(tq, b).astype(np.float64) * (np.asarray(tq.scale, np.float64).reshape(
            [-1 if i == tq.axis else 1 for i in range(b.ndim)]) if tq.axis is not None else tq.scale))
        assert np.allclose(back, b, atol=float(np.max(tq.scale)))


def test_fine_tuning_reads_a_row_bias(tmp_path: Path) -> None:
    """LSQ's fake-quantized bias follows the bias's own channel axis ([1, N] runs along axis 1)."""
    rng = np.random.default_rng(2)
    w, b = rng.normal(size=(K, N)).astype(np.float32) * 0.2, rng.normal(size=(1, N)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="gemm"), helper.make_node("Relu", ["g"], ["y"])]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [M, K])], [vi("y", [M, N])], [init("w", w), init("b", b)])
    xs = [rng.normal(size=(M, K)).astype(np.float32) for _ in range(8)]
    cfg = calib_config(tmp_path, {"x": xs}, enable_lsq=True, finetune_epochs=3)
    outs = build_and_run(path, tmp_path / "out", cfg, {"x": xs[0]})
    assert cosine(outs["npu"][0], outs["float"][0]) > 0.995
