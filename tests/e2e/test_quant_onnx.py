"""model_type QuantONNX: a QDQ model from another tool (or an earlier pulsar build) keeps its scales."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import pulsar
from pulsar.core.ort_options import reference_session_options


def test_pulsar_qdq_model_round_trips_with_its_scales(tmp_path, tiny, tiny_config):
    first = pulsar.build(tiny["model"], tmp_path / "first", tiny_config, {"quant.calibration_method": "MinMax"},
                         quiet=True)
    again = pulsar.build(first.quantized_model, tmp_path / "again", tiny_config,
                         {"model_type": "QuantONNX", "quant.calibration_method": "KL", "compiler.check": 1},
                         quiet=True)
    a = json.loads(first.quant_config.read_text())["tensors"]
    b = json.loads(again.quant_config.read_text())["tensors"]
    assert set(a) <= set(b)
    for name, tq in a.items():
        assert np.allclose(tq["scale"], b[name]["scale"], rtol=1e-6), name  # KL did not replace them
        assert tq["zero_point"] == b[name]["zero_point"] and tq["dtype"] == b[name]["dtype"], name


def test_onnxruntime_qdq_model_is_imported(tmp_path, tiny, tiny_config):
    samples = [np.load(p) for p in sorted(Path(tiny["calib"]).glob("*.npy"))]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(samples)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"image": x}

    ort_qdq = tmp_path / "ort_qdq.onnx"
    quantize_static(str(tiny["model"]), str(ort_qdq), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    res = pulsar.build(ort_qdq, tmp_path / "out", tiny_config, {"model_type": "QuantONNX", "compiler.check": 2},
                       quiet=True)
    log = (tmp_path / "out" / "build.log").read_text()
    assert "QuantONNX input:" in log and "keep their imported scales" in log
    tensors = json.loads(res.quant_config.read_text())["tensors"]
    assert any(v["dtype"] == "S8" and v["kind"] == "activation" for v in tensors.values())  # ORT's S8 kept
    # Same grids as onnxruntime's model: the outputs agree closely.
    want = ort.InferenceSession(str(ort_qdq), reference_session_options()).run(None, {"image": samples[0]})[0]
    got = pulsar.Session(res.compiled_model).run({"image": samples[0]})["logits"]
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_a_float_model_as_quant_onnx_is_an_error(tmp_path, tiny, tiny_config):
    import pytest

    from pulsar.errors import PulsarError

    with pytest.raises(PulsarError, match="no QuantizeLinear / DequantizeLinear"):
        pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {"model_type": "QuantONNX"}, quiet=True)
