"""The frontend on a torch transformer encoder whose LayerNorm and GELU are spelt out in primitive ops."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from pulsar.frontend.check import run
from pulsar.frontend.loader import load_model
from pulsar.frontend.pass_manager import op_histogram, optimize
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES

torch = pytest.importorskip("torch")

SEQ, D_MODEL, LAYERS = 16, 64, 2
RTOL = 1e-4
FUSIONS = ("fuse_layernorm", "fuse_gelu")


def _rel_diff(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref - got).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    from examples.transformer import transformer_encoder_onnx

    path = transformer_encoder_onnx(tmp_path_factory.mktemp("encoder") / "encoder.onnx", layers=LAYERS)
    original = load_model(path)
    rng = np.random.default_rng(3)
    samples = [{"tokens": rng.standard_normal((1, SEQ, D_MODEL)).astype(np.float32)} for _ in range(3)]
    # The default pipeline, plus the fusions should they be registered but not (yet) default.
    passes = [*DEFAULT_PASSES, *(p for p in FUSIONS if p in PASSES and p not in DEFAULT_PASSES)]
    optimized, records = optimize(original, passes, check=True, samples=samples[:2])
    return {"original": original, "optimized": optimized, "records": records, "samples": samples}


def test_export_spells_the_fused_ops_out(encoder):
    ops = op_histogram(encoder["original"])
    assert "LayerNormalization" not in ops and "Gelu" not in ops
    assert ops["ReduceMean"] == 4 * LAYERS and ops["Erf"] == LAYERS and ops["Softmax"] == LAYERS


def test_optimized_encoder_is_smaller_and_matches(encoder):
    original, optimized = encoder["original"], encoder["optimized"]
    assert len(optimized.graph.node) < len(original.graph.node)
    onnx.checker.check_model(optimized)
    ref = run(original, encoder["samples"])
    new = run(optimized, encoder["samples"])
    for r, n in zip(ref, new, strict=True):
        assert n["features"].shape == (1, SEQ, D_MODEL)
        assert _rel_diff(r["features"], n["features"]) <= RTOL


def test_onnx_export_matches_torch(encoder):
    from examples.transformer import transformer_encoder_module

    module = transformer_encoder_module(layers=LAYERS)
    sample = encoder["samples"][0]["tokens"]
    with torch.no_grad():
        expected = module(torch.from_numpy(sample)).numpy()
    (got,) = run(encoder["optimized"], [{"tokens": sample}])
    assert _rel_diff(expected, got["features"]) <= RTOL


def test_layernorm_is_fused(encoder):
    if "fuse_layernorm" not in PASSES:
        pytest.xfail(
            "frontend pass fuse_layernorm (pulsar/frontend/passes/fuse_layernorm.py) is not registered yet"
        )
    ops = op_histogram(encoder["optimized"])
    assert ops.get("LayerNormalization") == 2 * LAYERS, ops
    assert "ReduceMean" not in ops and "Sqrt" not in ops, ops


def test_gelu_is_fused(encoder):
    if "fuse_gelu" not in PASSES:
        pytest.xfail("frontend pass fuse_gelu (pulsar/frontend/passes/fuse_gelu.py) is not registered yet")
    gelus = [n for n in encoder["optimized"].graph.node if n.op_type == "Gelu"]  # any domain
    assert len(gelus) == LAYERS, op_histogram(encoder["optimized"])
    assert "Erf" not in op_histogram(encoder["optimized"])
