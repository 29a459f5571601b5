"""SmoothQuant on real graphs run in onnxruntime: exact in float, flatter activations, lower
simulated U8 / S8 quantization error, and the documented threshold rule."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError
from pulsar.quant.algorithms.smooth_quant import SmoothReport, apply_smooth_quant

SEQ, D, HID, OUT = 16, 32, 64, 16


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _model(nodes, inits, inputs, outputs, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def transformer_like(outlier: float = 50.0, seed: int = 0) -> onnx.ModelProto:
    """LayerNorm -> Q / K / V MatMuls on one input; LayerNorm -> Reshape -> Gemm -> Gemm.

    ``outlier`` scales two LayerNorm gammas per norm and two output rows of the first Gemm: the
    activation outliers SmoothQuant is for.
    """
    rng = np.random.default_rng(seed)
    g1, g2 = rng.uniform(0.5, 1.5, D), rng.uniform(0.5, 1.5, D)
    g1[[3, 17]] *= outlier
    g2[[5, 20]] *= outlier
    b1 = rng.uniform(-2.0, 2.0, HID)
    w1 = rng.uniform(-1, 1, (HID, D)) / np.sqrt(D)
    w1[[7, 40]] *= outlier
    b1[[7, 40]] *= outlier
    inits = [
        _init("g1", g1), _init("beta1", rng.uniform(-0.5, 0.5, D)),
        _init("g2", g2), _init("beta2", rng.uniform(-0.5, 0.5, D)),
        *(_init(f"W{n}", rng.uniform(-1, 1, (D, D)) / np.sqrt(D)) for n in "qkv"),
        numpy_helper.from_array(np.array([SEQ, D], np.int64), "shape2d"), _init("B1", w1), _init("C1", b1),
        _init("B2", rng.uniform(-1, 1, (HID, OUT)) / np.sqrt(HID)), _init("C2", rng.uniform(-0.1, 0.1, OUT)),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g1", "beta1"], ["h"], name="ln1", axis=-1),
        *(helper.make_node("MatMul", ["h", f"W{n}"], [n], name=f"{n}_proj") for n in "qkv"),
        helper.make_node("Add", ["q", "k"], ["qk"], name="add_qk"),
        helper.make_node("Add", ["qk", "v"], ["attn"], name="add_v"),
        helper.make_node("LayerNormalization", ["attn", "g2", "beta2"], ["h2"], name="ln2", axis=-1),
        helper.make_node("Reshape", ["h2", "shape2d"], ["r"], name="reshape"),
        helper.make_node("Gemm", ["r", "B1", "C1"], ["fc1"], name="fc1", transB=1),
        helper.make_node("Gemm", ["fc1", "B2", "C2"], ["y"], name="fc2"),
    ]
    return _model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, D])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SEQ, OUT]),
                   helper.make_tensor_value_info("attn", TensorProto.FLOAT, [1, SEQ, D])])


def samples(n: int = 8, seed: int = 1, name: str = "x", shape=(1, SEQ, D)) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def run(model: onnx.ModelProto, feeds, names: list[str] | None = None) -> list[list[np.ndarray]]:
    """Outputs (or the named intermediate tensors) of ``model`` for every feed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if names:
        del m.graph.output[:]
        m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return [sess.run(None, f) for f in feeds]


def assert_same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feeds) -> None:
    for ra, rb in zip(run(a, feeds), run(b, feeds), strict=True):
        for x, y in zip(ra, rb, strict=True):
            assert x.shape == y.shape
            assert np.abs(x - y).max() <= 1e-4 * np.abs(x).max(), np.abs(x - y).max()


def by_layer(reports: list[SmoothReport]) -> dict[str, SmoothReport]:
    return {r.layer: r for r in reports}


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def weight(model: onnx.ModelProto, lin: onnx.NodeProto) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == lin.input[1]))


# ------------------------------------------------------------ simulated U8 / S8 quantization
def fake_quant_error(model: onnx.ModelProto, layers: list[str], calib, test) -> float:
    """Mean relative error of each linear layer's product when its input is U8 per tensor
    (min / max over ``calib``) and its weight S8 symmetric per output channel."""
    xs = [node(model, n).input[0] for n in layers]
    calib_x, test_x = run(model, calib, xs), run(model, test, xs)
    errors = []
    for k, name in enumerate(layers):
        lin = node(model, name)
        lo = min(0.0, min(float(c[k].min()) for c in calib_x))
        hi = max(0.0, max(float(c[k].max()) for c in calib_x))
        scale = (hi - lo) / 255.0
        zp = np.round(-lo / scale)
        w = weight(model, lin).astype(np.float64)
        if lin.op_type == "Gemm" and any(a.name == "transB" and a.i for a in lin.attribute):
            w = w.T  # [K, N]: output channels are the columns
        w_scale = np.abs(w).max(axis=0) / 127.0
        wq = np.clip(np.round(w / w_scale), -127, 127) * w_scale
        for x in (t[k].astype(np.float64) for t in test_x):
            xq = (np.clip(np.round(x / scale) + zp, 0, 255) - zp) * scale
            ref = x @ w
            errors.append(np.linalg.norm(xq @ wq - ref) / np.linalg.norm(ref))
    return float(np.mean(errors))


# --------------------------------------------------------------------------------------- tests
def test_smoothing_is_exact_and_absorbed_upstream():
    model, calib = transformer_like(), samples()
    smoothed, reports = apply_smooth_quant(model, calib, alpha=0.6, threshold=0.2)
    onnx.checker.check_model(smoothed)
    assert_same_outputs(model, smoothed, samples(4, seed=7))
    r = by_layer(reports)
    assert list(r) == ["q_proj", "k_proj", "v_proj", "fc1", "fc2"]
    assert all(x.smoothed for x in reports)
    # One s for the three projections, taken by the LayerNorm; the others by LN2 / the first Gemm.
    assert {r[n].absorbed_into for n in ("q_proj", "k_proj", "v_proj")} == {"ln1"}
    assert len({r[n].max_scale for n in ("q_proj", "k_proj", "v_proj")}) == 1
    assert (r["fc1"].absorbed_into, r["fc2"].absorbed_into) == ("ln2", "fc1")
    assert [n.op_type for n in smoothed.graph.node] == [n.op_type for n in model.graph.node]  # no Mul
    assert r["q_proj"].outlier_ratio > 20 and r["q_proj"].input == "h"
    assert model.graph.node[0].input[1] == "g1"  # the caller's model is untouched
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]),
                                  numpy_helper.to_array(transformer_like().graph.initializer[0]))


def test_activation_spread_shrinks_and_quantization_error_drops():
    model, calib, test = transformer_like(), samples(), samples(4, seed=7)
    smoothed, reports = apply_smooth_quant(model, calib)
    for x, layer in (("h", "q_proj"), ("r", "fc1"), ("fc1", "fc2")):
        before = np.max([np.abs(t[0]).reshape(-1, t[0].shape[-1]).max(0) for t in run(model, calib, [x])], 0)
        after = np.max([np.abs(t[0]).reshape(-1, t[0].shape[-1]).max(0) for t in run(smoothed, calib, [x])], 0)
        ratio_before, ratio_after = before.max() / np.median(before), after.max() / np.median(after)
        assert ratio_before == pytest.approx(by_layer(reports)[layer].outlier_ratio, rel=1e-5)
        assert ratio_after < ratio_before / 3, (x, ratio_before, ratio_after)
    layers = ["q_proj", "k_proj", "v_proj", "fc1", "fc2"]
    plain, smooth = fake_quant_error(model, layers, calib, test), fake_quant_error(smoothed, layers, calib, test)
    assert smooth < 0.5 * plain, (plain, smooth)


def test_threshold_rule_is_monotone():
    model, calib = transformer_like(outlier=4.0), samples()
    previous: set[str] = set()
    ratios: dict[str, float] = {}
    for threshold in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0):
        smoothed, reports = apply_smooth_quant(model, calib, threshold=threshold)
        assert_same_outputs(model, smoothed, calib[:2])
        chosen = {r.layer for r in reports if r.smoothed}
        assert previous <= chosen
        for r in reports:
            assert r.smoothed == (threshold > 0 and r.outlier_ratio >= 1 / threshold)
            assert (r.max_scale == 1.0) or r.smoothed
            ratios[r.layer] = r.outlier_ratio
        previous = chosen
        if threshold == 0.0:
            assert chosen == set()
    assert previous == set(ratios)  # threshold 1 smooths every candidate
    assert len({round(v, 3) for v in ratios.values()}) >= 3  # the layers really differ in ratio


def residual_chain() -> onnx.ModelProto:
    """MatMul + bias -> Transpose -> MatMul (absorbed into the first); LayerNorm feeding both a
    MatMul and a residual Add (a Mul must be inserted); Conv 3x3 -> Conv 1x1 (absorbed) and
    Relu -> Conv 1x1 (inserted Mul on the channel axis 1)."""
    rng = np.random.default_rng(3)
    w0 = rng.uniform(-1, 1, (D, D))
    w0[:, [2, 9]] *= 40
    gamma = rng.uniform(0.5, 1.5, D)
    gamma[[4, 11]] *= 40
    cw = rng.uniform(-1, 1, (8, 3, 3, 3))
    cw[[1, 6]] *= 40
    inits = [_init("W0", w0), _init("b0", rng.uniform(-1, 1, D)), _init("W1", rng.uniform(-1, 1, (D, D))),
             _init("gamma", gamma), _init("beta", rng.uniform(-1, 1, D)), _init("W2", rng.uniform(-1, 1, (D, D))),
             _init("CW", cw), _init("CB", rng.uniform(-1, 1, 8)), _init("PW", rng.uniform(-1, 1, (4, 8, 1, 1))),
             _init("PW2", rng.uniform(-1, 1, (4, 3, 1, 1)))]
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["m0"], name="mm0"),
        helper.make_node("Add", ["m0", "b0"], ["a0"], name="bias0"),
        helper.make_node("Transpose", ["a0"], ["t0"], name="tr", perm=[1, 0, 2]),
        helper.make_node("MatMul", ["t0", "W1"], ["y1"], name="mm1"),
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "W2"], ["m2"], name="mm2"),
        helper.make_node("Add", ["n", "m2"], ["y2"], name="residual"),
        helper.make_node("Conv", ["img", "CW", "CB"], ["c0"], name="conv3x3", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c0", "PW"], ["y3"], name="pointwise"),
        helper.make_node("Relu", ["img"], ["rl"], name="relu"),
        helper.make_node("Conv", ["rl", "PW2"], ["y4"], name="pointwise_relu"),
    ]
    f = TensorProto.FLOAT
    return _model(nodes, inits,
                  [helper.make_tensor_value_info("x", f, [1, SEQ, D]), helper.make_tensor_value_info("img", f, [1, 3, 6, 6])],
                  [helper.make_tensor_value_info(n, f, s) for n, s in (("y1", [SEQ, 1, D]), ("y2", [1, SEQ, D]),
                                                                      ("y3", [1, 4, 6, 6]), ("y4", [1, 4, 6, 6]))])


def _chain_samples(n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((1, SEQ, D)).astype(np.float32),
             "img": rng.standard_normal((1, 3, 6, 6)).astype(np.float32)} for _ in range(n)]


def test_walks_through_bias_and_transpose_inserts_mul_otherwise():
    model, calib = residual_chain(), _chain_samples()
    smoothed, reports = apply_smooth_quant(model, iter(calib), threshold=1.0)  # a one-shot iterator
    onnx.checker.check_model(smoothed)
    assert_same_outputs(model, smoothed, _chain_samples(3))
    r = by_layer(reports)
    assert set(r) == {"mm0", "mm1", "mm2", "pointwise", "pointwise_relu"}
    assert r["mm1"].absorbed_into == "mm0" and r["mm1"].input == "t0"
    assert r["pointwise"].absorbed_into == "conv3x3" and r["pointwise"].op_type == "Conv"
    muls = {n.name: n for n in smoothed.graph.node if n.op_type == "Mul"}
    assert set(muls) == {r["mm2"].absorbed_into, r["pointwise_relu"].absorbed_into, r["mm0"].absorbed_into}
    mul = muls[r["mm2"].absorbed_into]
    assert mul.input[0] == "n" and node(smoothed, "mm2").input[0] == mul.output[0]
    assert node(smoothed, "residual").input[0] == "n"  # the residual still reads the unsmoothed tensor
    order = [n.name for n in smoothed.graph.node]
    assert order.index(mul.name) < order.index("mm2")
    conv_mul = muls[r["pointwise_relu"].absorbed_into]
    scale = numpy_helper.to_array(next(t for t in smoothed.graph.initializer if t.name == conv_mul.input[1]))
    assert scale.shape == (3, 1, 1)
    assert any(vi.name == mul.output[0] and vi.type.tensor_type.elem_type == TensorProto.FLOAT
               for vi in smoothed.graph.value_info)

    kept, reports = apply_smooth_quant(model, calib, threshold=1.0, insert_mul=False)
    assert_same_outputs(model, kept, calib[:2])
    assert not any(n.op_type == "Mul" for n in kept.graph.node)
    assert {r.layer for r in reports if r.smoothed} == {"mm1", "pointwise"}
    assert all(r.absorbed_into == "" and r.max_scale == 1.0 for r in reports if not r.smoothed)


def test_bad_arguments_are_user_errors():
    model = transformer_like()
    with pytest.raises(PulsarError, match="smooth_quant_strength"):
        apply_smooth_quant(model, samples(1), alpha=1.5)
    with pytest.raises(PulsarError, match="smooth_quant_threshold"):
        apply_smooth_quant(model, samples(1), threshold=-0.1)
    with pytest.raises(PulsarError, match="no samples"):
        apply_smooth_quant(model, [])
    with pytest.raises(PulsarError, match="'x'"):
        apply_smooth_quant(model, samples(1, name="tokens"))


def test_torch_transformer_encoder(tmp_path):
    pytest.importorskip("torch")
    from examples.transformer import transformer_encoder_onnx
    from pulsar.frontend.loader import load_model
    from pulsar.frontend.pass_manager import optimize

    model, _ = optimize(load_model(transformer_encoder_onnx(tmp_path / "enc.onnx")))
    feeds = samples(4, name="tokens", shape=(1, 16, 64))
    plain, reports = apply_smooth_quant(model, feeds)  # random weights: no outliers at the default
    assert len(reports) == 8 and not any(r.smoothed for r in reports)
    assert {r.op_type for r in reports} == {"MatMul", "Gemm"}
    smoothed, reports = apply_smooth_quant(model, feeds, threshold=1.0)
    assert all(r.smoothed for r in reports)
    assert_same_outputs(model, smoothed, samples(2, seed=9, name="tokens", shape=(1, 16, 64)))
