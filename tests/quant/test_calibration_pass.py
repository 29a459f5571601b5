"""The calibration pass's speed paths change nothing: the overlapped pass, the float outputs it keeps for
the build's check, the fused tensors it leaves out, and sessions that get their weights as OrtValues."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar.api
from pulsar.core.ort_weights import LIFT_BYTES, session_with_lifted_weights
from pulsar.quant import calibrate
from pulsar.quant.calibrate import Reference, collect_statistics, load_statistics
from pulsar.quant.calibration_set import DeferredStats
from pulsar.quant.observers.histogram import TensorStats
from tests.quant.test_calibrate import NAMES, _model, _samples
from tests.tiny_model import make_numpy_calibration, make_tiny_cnn


def _shaped() -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(_model())


def test_overlapped_pass_equals_one_sample_at_a_time(monkeypatch) -> None:
    model = _shaped()
    fetch = [n for n in NAMES if n != "x"]
    # static shapes: one sample's activations are known before the pass (4 tensors of 1x{4,4,3,3}x8x8)
    assert calibrate._activation_bytes(model, fetch) == (4 + 4 + 3 + 3) * 64 * 4
    assert calibrate._activation_bytes(_model(), fetch) is None  # no shapes: unknown, not overlapped
    overlapped = collect_statistics(model, NAMES, _samples())
    monkeypatch.setattr(calibrate, "_OVERLAP_BYTES", 0)
    sequential = collect_statistics(model, NAMES, _samples())
    assert overlapped.keys() == sequential.keys()
    for name in NAMES:
        assert overlapped[name] == sequential[name], name  # every count, extreme and histogram bin


def test_reference_keeps_the_float_outputs_of_the_first_samples() -> None:
    samples = _samples(5)
    ref = Reference(["add_out", "not_fetched"], 3)
    assert not ref.complete
    collect_statistics(_shaped(), NAMES, samples, reference=ref)
    assert ref.complete and len(ref.outputs) == len(ref.inputs) == 3
    sess = ort.InferenceSession(_model().SerializeToString(), providers=["CPUExecutionProvider"])
    for feed, kept, sample in zip(ref.inputs, ref.outputs, samples, strict=False):
        np.testing.assert_array_equal(feed["x"], sample["x"])  # the sample these outputs belong to
        assert set(kept) == {"add_out"}
        np.testing.assert_allclose(kept["add_out"], sess.run(["add_out"], sample)[0], rtol=1e-5, atol=1e-6)
    few = Reference(["add_out"], 8)  # fewer samples than asked for: all of them, and the pass is complete
    collect_statistics(_shaped(), NAMES, samples, reference=few)
    assert few.usable and len(few.outputs) == len(samples) == 5
    # a budget of about one sample (x and add_out, 768 B each): the second overflows it, nothing is kept
    small = Reference(["add_out"], 8, budget=2 * 768 + 1)
    collect_statistics(_shaped(), NAMES, samples, reference=small)
    assert small.complete and small.dropped and not small.usable and small.inputs == small.outputs == []


def test_deferred_statistics_are_collected_on_first_read() -> None:
    calls: list[list[str]] = []
    full = collect_statistics(_model(), NAMES, _samples())

    def fill(names: list[str]) -> dict[str, TensorStats]:
        calls.append(names)
        return {n: full[n] for n in names}

    stats = DeferredStats({n: full[n] for n in ("x", "relu_out")}, ["conv_out", "proj", "relu_out"], fill)
    assert "conv_out" in stats and "missing" not in stats and calls == []  # membership alone runs nothing
    assert stats.get("x") is full["x"] and calls == []
    assert stats["conv_out"] == full["conv_out"]
    assert calls == [["conv_out", "proj"]]  # every deferred tensor in one pass, once
    assert stats.get("proj") == full["proj"] and calls == [["conv_out", "proj"]]
    with pytest.raises(KeyError):
        stats["missing"]


def _build(tmp_path: Path, name: str, **quant: object) -> Path:
    model = make_tiny_cnn(tmp_path / "tiny.onnx")
    calib = make_numpy_calibration(tmp_path / "calib", n=6)
    out = tmp_path / name
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}], **quant}}
    pulsar.api.build(input=str(model), output_dir=str(out), config=cfg, quiet=True)
    return out


def test_fused_tensors_are_left_out_and_change_nothing(tmp_path: Path) -> None:
    lean = _build(tmp_path, "lean")
    full = _build(tmp_path, "full", save_statistics=True)  # the statistics file holds every activation
    (cached,) = (lean / "cache").glob("calib_stats_*.npz")
    collected = set(load_statistics(cached))
    everything = set(json.loads((full / "quant" / "statistics.json").read_text())["tensors"])
    fused = everything - collected
    quantized = set(json.loads((lean / "quant" / "quant_config.json").read_text())["tensors"])
    # the Conv outputs fused into their Relu (the BatchNorm folded into the first Conv) have no range
    assert fused and not fused & quantized
    assert collected <= everything
    for artifact in ("quant/quantized.onnx", "quant/quant_config.json"):
        assert (lean / artifact).read_bytes() == (full / artifact).read_bytes(), artifact


def _big_weight_model(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    n = 160  # 160 x 160 float32: 100 KiB, over the lift threshold
    w = numpy_helper.from_array(rng.normal(0, 0.1, (n, n)).astype(np.float32), "W")
    small = numpy_helper.from_array(rng.normal(0, 0.1, (n,)).astype(np.float32), "b")
    assert len(w.raw_data) >= LIFT_BYTES > len(small.raw_data)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], [w, small])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def test_session_with_lifted_weights_runs_like_a_plain_one() -> None:
    model = _big_weight_model(17)
    x = np.random.default_rng(2).normal(size=(2, 160)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    lifted = session_with_lifted_weights(model, ort.SessionOptions(), ["CPUExecutionProvider"], ["h"])
    assert [o.name for o in lifted.get_outputs()] == ["y", "h"]  # the extra output, its type inferred
    y, h = lifted.run(None, {"x": x})
    np.testing.assert_array_equal(y, plain.run(None, {"x": x})[0])
    np.testing.assert_allclose(h, x @ numpy_helper.to_array(model.graph.initializer[0]), rtol=1e-5, atol=1e-6)


def test_opset_conversion_without_copying_weights_equals_the_converter(tmp_path: Path) -> None:
    from onnx import version_converter

    from pulsar.frontend.loader import convert_opset

    model = _big_weight_model(11)
    ours = convert_opset(model, tmp_path / "big.onnx")
    theirs = version_converter.convert_version(model, ours.opset_import[0].version)
    assert ours.opset_import[0].version > 11
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_quant_check_runs_in_a_helper_thread_and_join_raises_its_error() -> None:
    import threading

    from pulsar.errors import PulsarError
    from pulsar.quant.model_check import QuantCheck

    seen: list[str] = []
    ok = QuantCheck.start(lambda: seen.append(threading.current_thread().name))
    ok.join()
    assert seen and seen[0].startswith("pulsar-quant-check")

    def fails() -> None:
        raise PulsarError("onnxruntime failed running the quantized model")

    bad = QuantCheck.start(fails)
    with pytest.raises(PulsarError, match="quantized model"):
        bad.join()
    bad.join()  # joined once: nothing left to raise
    failing_build = QuantCheck.start(fails)
    failing_build.settle()  # the build fails for another reason: waits, keeps the other error
    assert failing_build.future is None


def test_cache_key_from_the_frontend_digest_equals_hashing_the_model() -> None:
    import hashlib
    from types import SimpleNamespace

    from pulsar.quant.stage import _cache_key

    model = _model()
    data = SimpleNamespace(fingerprint=lambda: "files:6")
    q = SimpleNamespace(calibration_bins=4096, calibration_momentum=0.9, calibration_histogram_values=0)
    plain = _cache_key(model, data, q)  # type: ignore[arg-type]
    digest = (model, hashlib.sha256(model.SerializeToString()))
    assert _cache_key(model, data, q, digest) == plain  # type: ignore[arg-type]
    other = _model(outputs=["proj"])  # a digest of another model object is not used
    assert _cache_key(other, data, q, digest) == _cache_key(other, data, q) != plain  # type: ignore[arg-type]


def test_cache_keeps_what_it_has_and_collects_only_the_rest(tmp_path: Path, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="pulsar")
    samples = _samples(4)
    full = collect_statistics(_model(), NAMES, samples)
    collect_statistics(_model(), ["x", "proj"], samples, cache_dir=tmp_path, cache_key="k")
    caplog.clear()
    both = collect_statistics(_model(), ["proj", "relu_out"], samples, cache_dir=tmp_path, cache_key="k")
    assert "cache holds 1 of the 2 tensors" in caplog.text
    assert list(both) == ["proj", "relu_out"] and all(both[n] == full[n] for n in both)
    assert set(load_statistics(tmp_path / "calib_stats_k.npz")) == {"x", "proj", "relu_out"}  # the union


def test_reference_copies_the_samples_it_keeps() -> None:
    buffer = np.zeros([1, 3, 8, 8], np.float32)

    def refilled():  # a data set plugin that hands out one buffer, refilled for every sample
        for s in _samples(3):
            buffer[...] = s["x"]
            yield {"x": buffer}

    ref = Reference(["add_out"], 3)
    collect_statistics(_shaped(), NAMES, refilled(), reference=ref)
    for kept, sample in zip(ref.inputs, _samples(3), strict=True):
        np.testing.assert_array_equal(kept["x"], sample["x"])


def test_weights_onnxruntime_cannot_view_stay_in_the_model() -> None:
    """bfloat16 (like float8 and 4-bit) weights come back from onnx as ml_dtypes arrays, which onnxruntime
    builds no OrtValue from: a 128 KiB one stays in the proto and the session runs as a plain one."""
    rng = np.random.default_rng(3)
    n = 256
    bits = (rng.normal(size=n * n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w = onnx.TensorProto(name="W", data_type=TensorProto.BFLOAT16, dims=[n, n], raw_data=bits.tobytes())
    nodes = [helper.make_node("Cast", ["W"], ["wf"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "bf16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    assert len(w.raw_data) >= LIFT_BYTES
    x = rng.normal(size=(1, n)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    lifted = session_with_lifted_weights(model, ort.SessionOptions(), ["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(lifted[0], plain[0])
