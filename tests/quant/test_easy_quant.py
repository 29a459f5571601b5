"""EasyQuant scale search on a small CNN quantized by pulsar's own build, run in real onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.quant.algorithms.easy_quant import EasyQuantReport, easy_quant, update_params
from pulsar.quant.scheme import TensorQuant

SHAPE = (1, 3, 16, 16)
LAYERS = ["conv1", "conv2", "conv3", "fc", "mm"]


def _cnn(path: Path) -> Path:
    """Conv+Relu (fused), Conv+Clip (fused), a plain Conv whose output is quantized, MaxPool / Flatten
    (passive), Gemm with bias, MatMul without."""
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int, s: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name)

    inits = [w("c1.w", 8, 3, 3, 3), w("c1.b", 8, s=0.1), w("c2.w", 16, 8, 3, 3, s=0.2), w("c2.b", 16, s=0.1),
             w("c3.w", 8, 16, 1, 1), w("c3.b", 8, s=0.1), w("fc.w", 12, 128, s=0.1), w("fc.b", 12, s=0.1),
             w("mm.w", 12, 10), numpy_helper.from_array(np.float32(0.0), "lo"),
             numpy_helper.from_array(np.float32(6.0), "hi")]
    nodes = [
        helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "c2.w", "c2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="clip2"),
        helper.make_node("Conv", ["r2", "c3.w", "c3.b"], ["c3"], name="conv3"),
        helper.make_node("MaxPool", ["c3"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["fc"], name="fc", transB=1),
        helper.make_node("MatMul", ["fc", "mm.w"], ["logits"], name="mm"),
    ]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _samples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(SHAPE).astype(np.float32)} for _ in range(n)]


def _build(root: Path, layer_configs: list | None = None) -> dict:
    calib = root / "calib"
    calib.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(_samples(8, 1)):
        np.save(calib / f"{i:03d}.npy", s["x"])
    quant = {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                "calibration_format": "Numpy", "calibration_size": 8}]}
    if layer_configs:
        quant["layer_configs"] = layer_configs
    pulsar.build(_cnn(root / "cnn.onnx"), root / "out", {"quant": quant}, quiet=True)
    return {"float": onnx.load(root / "out" / "frontend" / "optimized.onnx"),
            "qdq": onnx.load(root / "out" / "quant" / "quantized.onnx")}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    models = _build(tmp_path_factory.mktemp("easy_quant"))
    models["calib"] = _samples(8, 1)
    models["eq"], models["reports"] = easy_quant(models["float"], models["qdq"], models["calib"])
    return models


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _run(model: onnx.ModelProto, samples: list[dict], output: str, *, reference: bool) -> np.ndarray:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if output not in {o.name for o in m.graph.output}:
        m.graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, None))
    opts = reference_session_options() if reference else ort.SessionOptions()
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run([output], s)[0] for s in samples])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _mean_output_cosine(float_model: onnx.ModelProto, qdq: onnx.ModelProto, samples: list[dict]) -> float:
    ref = _run(float_model, samples, "logits", reference=False)
    out = _run(qdq, samples, "logits", reference=True)
    return float(np.mean([_cos(a, b) for a, b in zip(ref, out, strict=True)]))


def test_report_per_layer_cosine_never_decreases(built: dict) -> None:
    reports = built["reports"]
    assert all(isinstance(r, EasyQuantReport) for r in reports)
    assert [r.layer for r in reports] == LAYERS
    # fused Relu / Clip: the compared tensor is the activation's output
    assert [r.tensor for r in reports] == ["r1", "r2", "c3", "fc", "logits"]
    for r in reports:
        assert 0.9 < r.cosine_before <= r.cosine_after <= 1.0, r
        assert r.act_factor > 0 and r.weight_factor > 0
    assert any(r.cosine_after > r.cosine_before + 1e-6 for r in reports)
    assert any(r.act_factor != 1.0 for r in reports) and any(r.weight_factor != 1.0 for r in reports)


def test_first_layer_cosine_is_the_exported_models(built: dict) -> None:
    """conv1 reads the graph input, so in the exported model its output is exactly the per-layer
    evaluation: the reported cosine must be what the written scales, W/q and B/q give."""
    ref = _run(built["float"], built["calib"], "r1", reference=False)
    out = _run(built["eq"], built["calib"], "r1", reference=True)
    assert built["reports"][0].cosine_after == pytest.approx(_cos(ref, out), abs=2e-6)
    before = _run(built["qdq"], built["calib"], "r1", reference=True)
    assert built["reports"][0].cosine_before == pytest.approx(_cos(ref, before), abs=2e-6)


def test_whole_model_not_worse_on_held_out_samples(built: dict) -> None:
    held_out = _samples(16, 7)
    orig = _mean_output_cosine(built["float"], built["qdq"], held_out)
    tuned = _mean_output_cosine(built["float"], built["eq"], held_out)
    assert tuned >= orig - 1e-3, (orig, tuned)


def test_exported_model_is_valid(built: dict) -> None:
    onnx.checker.check_model(built["eq"], full_check=True)
    assert [n.name for n in built["eq"].graph.node] == [n.name for n in built["qdq"].graph.node]
    for reference in (True, False):  # float-simulated and onnxruntime's own QDQ kernels
        out = _run(built["eq"], built["calib"][:2], "logits", reference=reference)
        assert out.shape == (2, 10) and np.isfinite(out).all()
    changed = [k for k, v in _inits(built["eq"]).items() if not np.array_equal(v, _inits(built["qdq"])[k])]
    assert changed and all(k.endswith(("/scale", "/q")) for k in changed)


def test_input_model_untouched(built: dict) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(built["qdq"])
    easy_quant(built["float"], built["qdq"], built["calib"][:2], rounds=1)
    assert copy.SerializeToString() == built["qdq"].SerializeToString()


def test_weights_and_biases_stay_consistent(built: dict) -> None:
    q, f = _inits(built["eq"]), _inits(built["float"])
    orig = _inits(built["qdq"])
    for node, act, weight, bias in [("conv1", "x", "c1.w", "c1.b"), ("conv2", "r1", "c2.w", "c2.b"),
                                    ("conv3", "r2", "c3.w", "c3.b"), ("fc", "flat", "fc.w", "fc.b")]:
        w_scale = q[f"{weight}/scale"]
        expect_w = np.clip(np.rint(f[weight] / w_scale.reshape(-1, *[1] * (f[weight].ndim - 1))), -128, 127)
        np.testing.assert_array_equal(q[f"{weight}/q"], expect_w, err_msg=node)
        b_scale = (np.float64(q[f"{act}/scale"]) * w_scale.astype(np.float64)).astype(np.float32)
        np.testing.assert_array_equal(q[f"{bias}/scale"], b_scale, err_msg=node)
        np.testing.assert_array_equal(q[f"{bias}/q"], np.rint(f[bias].astype(np.float64) / b_scale), err_msg=node)
    # the search moved things, so the checks above were not about an unchanged model
    assert not np.array_equal(q["c2.w/scale"], orig["c2.w/scale"]) or not np.array_equal(q["r1/scale"],
                                                                                          orig["r1/scale"])
    np.testing.assert_array_equal(q["r1/zero_point"], orig["r1/zero_point"])  # zero points kept


def _times_three(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    for init in bad.graph.initializer:
        if init.name in names:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(3), init.name))
    return bad


def test_update_params_copies_the_new_scales(built: dict) -> None:
    """The per-tensor parameters quant_config.json is written from follow the searched model."""
    orig, q = _inits(built["qdq"]), _inits(built["eq"])
    params = {"r1": TensorQuant("r1", "U8", orig["r1/scale"], orig["r1/zero_point"]),
              "c2.w": TensorQuant("c2.w", "S8", orig["c2.w/scale"], np.zeros(16, np.int8), axis=0, kind="weight"),
              "absent": TensorQuant("absent", "U8", np.float32(0.5), np.uint8(0))}
    updated = update_params(params, built["eq"])
    assert "absent" not in updated and params["absent"].scale == np.float32(0.5)
    np.testing.assert_array_equal(params["r1"].scale, q["r1/scale"])
    np.testing.assert_array_equal(params["c2.w"].scale, q["c2.w/scale"])
    assert params["c2.w"].scale.shape == (16,) and "c2.w" in updated


def test_passive_ops_follow_the_new_scale(built: dict) -> None:
    """MaxPool and Flatten share c3's grid; when c3's scale moves they move with it, and fc's bias
    (input flat) follows."""
    orig = _inits(built["qdq"])
    assert orig["pool/scale"] == orig["c3/scale"] and orig["flat/scale"] == orig["c3/scale"]
    names = ["c3/scale", "pool/scale", "flat/scale"]
    fixed, reports = easy_quant(built["float"], _times_three(built["qdq"], names), built["calib"])
    q = _inits(fixed)
    assert {r.layer: r for r in reports}["conv3"].act_factor < 0.6
    assert q["c3/scale"] < 0.6 * 3 * orig["c3/scale"]
    assert q["pool/scale"] == q["c3/scale"] and q["flat/scale"] == q["c3/scale"]
    np.testing.assert_array_equal(q["pool/zero_point"], orig["pool/zero_point"])
    np.testing.assert_array_equal(
        q["fc.b/scale"], (np.float64(q["flat/scale"]) * q["fc.w/scale"].astype(np.float64)).astype(np.float32))


def test_a_deliberately_bad_scale_gets_fixed(built: dict) -> None:
    bad = _times_three(built["qdq"], ["r2/scale"])
    fixed, reports = easy_quant(built["float"], bad, built["calib"])
    r = {x.layer: x for x in reports}["conv2"]
    good = {x.layer: x for x in built["reports"]}["conv2"]
    assert 1 - r.cosine_before > 2 * (1 - good.cosine_before)  # the bad scale hurts ...
    assert r.cosine_after >= good.cosine_before  # ... and the search recovers at least the calibrated one
    assert r.act_factor < 0.6
    assert _inits(fixed)["r2/scale"] < 0.6 * _inits(bad)["r2/scale"]
    # conv3 reads r2: its bias follows r2's new scale
    q = _inits(fixed)
    np.testing.assert_array_equal(
        q["c3.b/scale"], (np.float64(q["r2/scale"]) * q["c3.w/scale"].astype(np.float64)).astype(np.float32))
    held_out = _samples(16, 7)
    assert _mean_output_cosine(built["float"], fixed, held_out) > _mean_output_cosine(built["float"], bad, held_out)


def test_sixteen_bit_layers(tmp_path: Path) -> None:
    models = _build(tmp_path, [{"op_type": "Conv", "data_type": "U16"}])
    assert any(n.domain == "com.microsoft" for n in models["qdq"].graph.node)
    calib = _samples(4, 1)
    tuned, reports = easy_quant(models["float"], models["qdq"], calib, rounds=1)
    assert [r.layer for r in reports] == LAYERS
    assert all(r.cosine_after >= r.cosine_before for r in reports)
    assert _inits(tuned)["c3/zero_point"].dtype == np.uint16  # produced by a U16 Conv
    onnx.checker.check_model(tuned)
    assert np.isfinite(_run(tuned, calib, "logits", reference=True)).all()


@pytest.mark.parametrize(("samples", "kwargs", "match"), [
    ([], {}, "no samples"),
    ([{"y": np.zeros(SHAPE, np.float32)}], {}, 'unknown input "y"'),
    ([{"x": np.zeros((1, 3, 8, 8), np.float32)}], {}, 'input "x" is float32'),
    (None, {"grid": [0.5, 0.0]}, "grid"),
    (None, {"rounds": 0}, "rounds"),
])
def test_bad_arguments_are_user_errors(built: dict, samples: list | None, kwargs: dict, match: str) -> None:
    with pytest.raises(PulsarError, match=match):
        easy_quant(built["float"], built["qdq"], built["calib"][:1] if samples is None else samples, **kwargs)
