"""LayerNorm in every spelling the exporters write becomes one ``LayerNormalization`` with the same
outputs: the pattern pass's forms and, through the numeric recogniser, jax2tf / flax's
``max(0, E[x^2] - E[x]^2)`` with ReduceSum * 1/N means, Reciprocal(Sqrt) folded with gamma first,
Keras' ``x * k + (beta - mean * k)``, Pow / Div forms and a Reshape / Expand of the statistics. RMSNorm
and a LayerNorm with its residual sum are not LayerNorms and stay as they are; a quantized build of
the jax2tf form keeps the classifier's outputs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from pulsar.frontend.check import compare_models
from pulsar.frontend.pass_manager import optimize
from tests.unseen.helpers import build_and_run, calib_config, cosine

F = 16
HEADER = """<ir_version: 8, opset_import: ["" : 17]>
ln (float[2, 5, 16] x) => (float[2, 5, 16] y)
<float[16] gamma = {g}, float[16] beta = {b}, float eps = {{1e-5}}, float inv_n = {{0.0625}},
 float two = {{2.0}}, float one = {{1.0}}, float zero = {{0.0}}, float n = {{16.0}}, int64[1] ax = {{-1}},
 int64[3] stat_shape = {{2, 5, 1}}, int64[3] full = {{2, 5, 16}}>
"""

SPELLINGS = {
    # jax2tf / flax: E[x^2] - E[x]^2 clamped at 0, means as ReduceSum * 1/N, rsqrt * gamma before (x - mean)
    "flax_e_x2": """{
  s = ReduceSum<keepdims=1>(x, ax)
  m = Mul(s, inv_n)
  xx = Mul(x, x)
  s2 = ReduceSum<keepdims=1>(xx, ax)
  m2 = Mul(s2, inv_n)
  mm = Mul(m, m)
  v0 = Sub(m2, mm)
  v = Max(zero, v0)
  ve = Add(v, eps)
  r = Sqrt(ve)
  ir = Reciprocal(r)
  k = Mul(ir, gamma)
  d = Sub(x, m)
  t = Mul(d, k)
  y = Add(t, beta)
}""",
    # the same with keepdims=0 statistics reshaped and expanded back (what jax2tf's BroadcastTo leaves)
    "flax_broadcast": """{
  s = ReduceSum<keepdims=0>(x, ax)
  m0 = Div(s, n)
  xx = Pow(x, two)
  s2 = ReduceSum<keepdims=0>(xx, ax)
  m20 = Div(s2, n)
  mm = Mul(m0, m0)
  v0 = Sub(m20, mm)
  v = Max(v0, zero)
  vr = Reshape(v, stat_shape)
  ve = Add(vr, eps)
  r = Sqrt(ve)
  ir = Div(one, r)
  mr = Reshape(m0, stat_shape)
  me = Expand(mr, full)
  d = Sub(x, me)
  t0 = Mul(d, ir)
  t = Mul(t0, gamma)
  y = Add(t, beta)
}""",
    # PyTorch / Paddle: (x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta
    "pow_div": """{
  m = ReduceMean<axes=[-1]>(x)
  d = Sub(x, m)
  p = Pow(d, two)
  v = ReduceMean<axes=[-1]>(p)
  ve = Add(v, eps)
  r = Sqrt(ve)
  q = Div(d, r)
  t = Mul(q, gamma)
  y = Add(t, beta)
}""",
    # TF / Keras tf.nn.batch_normalization: x * k + (beta - mean * k), k = gamma * rsqrt(var + eps)
    "keras": """{
  m = ReduceMean<axes=[-1]>(x)
  d = Sub(x, m)
  p = Mul(d, d)
  v = ReduceMean<axes=[-1]>(p)
  ve = Add(v, eps)
  r = Sqrt(ve)
  ir = Reciprocal(r)
  k = Mul(ir, gamma)
  xk = Mul(x, k)
  mk = Mul(m, k)
  sh = Sub(beta, mk)
  y = Add(xk, sh)
}""",
    # TF's moments: variance as mean(x^2) - mean(x)^2 through ReduceMean, gamma folded after
    "moments_e_x2": """{
  m = ReduceMean<axes=[-1]>(x)
  xx = Mul(x, x)
  m2 = ReduceMean<axes=[-1]>(xx)
  mm = Pow(m, two)
  v = Sub(m2, mm)
  ve = Add(v, eps)
  r = Sqrt(ve)
  d = Sub(x, m)
  q = Div(d, r)
  t = Mul(gamma, q)
  y = Add(beta, t)
}""",
}

# flax LayerNorm(reduction_axes=1) as jax2tf writes it: statistics over the middle axis, gamma / beta along it
MIDDLE_HEADER = """<ir_version: 8, opset_import: ["" : 17]>
ln (float[2, 16, 5] x) => (float[2, 16, 5] y)
<float[1, 16, 1] gamma = {g}, float[1, 16, 1] beta = {b}, float eps = {{1e-5}}, float inv_n = {{0.0625}},
 float zero = {{0.0}}, int64[1] ax = {{1}}>
"""

NOT_LAYERNORM = {
    "rmsnorm": """{
  xx = Mul(x, x)
  m2 = ReduceMean<axes=[-1]>(xx)
  ve = Add(m2, eps)
  r = Sqrt(ve)
  q = Div(x, r)
  y = Mul(q, gamma)
}""",
}


def _model(body: str) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    g = ", ".join(f"{v:.4f}" for v in rng.uniform(0.5, 1.5, F))
    b = ", ".join(f"{v:.4f}" for v in rng.normal(size=F) * 0.3)
    model = onnx.parser.parse_model(HEADER.format(g="{" + g + "}", b="{" + b + "}") + body)
    onnx.checker.check_model(model)
    return model


def _samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [{"x": (rng.normal(size=(2, 5, F)) * rng.uniform(0.5, 3) + rng.uniform(-2, 2)).astype(np.float32)}
            for _ in range(3)]


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_each_spelling_becomes_one_layernormalization(name: str) -> None:
    model = _model(SPELLINGS[name])
    fused, _ = optimize(model, check=True, samples=_samples())
    ops = Counter(n.op_type for n in fused.graph.node)
    assert ops == Counter({"LayerNormalization": 1}), ops
    for row in compare_models(model, fused, _samples()):
        assert row["rel_diff"] <= 1e-4, row
    ln = fused.graph.node[0]
    eps = next(a.f for a in ln.attribute if a.name == "epsilon")
    assert eps == pytest.approx(1e-5, rel=1e-3)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}
    gamma = [t.name for t in _model(SPELLINGS[name]).graph.initializer if t.name == "gamma"][0]
    assert np.array_equal(inits[ln.input[1]].ravel(), onnx.numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == gamma)))  # the model's own gamma, exactly


@pytest.mark.parametrize("name", sorted(NOT_LAYERNORM))
def test_what_is_not_a_layernorm_stays(name: str) -> None:
    model = _model(NOT_LAYERNORM[name])
    fused, _ = optimize(model, check=True, samples=_samples())
    assert "LayerNormalization" not in {n.op_type for n in fused.graph.node}


def test_a_layernorm_beside_its_residual_fuses_without_the_sum() -> None:
    body = SPELLINGS["flax_e_x2"].replace("  y = Add(t, beta)\n}", "  ln = Add(t, beta)\n  y = Add(ln, x)\n}")
    model = _model(body)
    fused, _ = optimize(model, check=True, samples=_samples())
    assert Counter(n.op_type for n in fused.graph.node) == Counter({"LayerNormalization": 1, "Add": 1})


def test_quantized_flax_layernorm_classifier_keeps_its_outputs(tmp_path: Path) -> None:
    """The jax2tf spelling in front of a Gemm classifier: built at defaults, NPU top-1 agrees with float."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(7)
    model = _model(SPELLINGS["flax_e_x2"])
    g = model.graph
    w = numpy_helper.from_array((rng.normal(size=(F, 10)) * 0.5).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros((1, 10), np.float32), "bias")
    g.initializer.extend([w, b])
    g.node.extend([helper.make_node("Reshape", ["y", "flat"], ["y2"]),
                   helper.make_node("Gemm", ["y2", "w", "bias"], ["logits"])])
    g.initializer.append(numpy_helper.from_array(np.array([10, F], np.int64), "flat"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [10, 10]))
    path = tmp_path / "cls.onnx"
    onnx.save(model, path)
    samples = [(rng.normal(size=(2, 5, F)) * rng.uniform(0.2, 20) + rng.uniform(-30, 30)).astype(np.float32)
               for _ in range(24)]
    outs = build_and_run(path, tmp_path / "out", calib_config(tmp_path, {"x": samples[:16]}), {"x": samples[20]})
    ref, npu = outs["float"][0], outs["npu"][0]
    assert cosine(npu, ref) > 0.99
    assert np.mean(npu.argmax(1) == ref.argmax(1)) >= 0.9


def test_a_middle_axis_layernorm_becomes_transposes_around_one() -> None:
    rng = np.random.default_rng(4)
    g = ", ".join(f"{v:.4f}" for v in rng.uniform(0.5, 1.5, F))
    b = ", ".join(f"{v:.4f}" for v in rng.normal(size=F) * 0.3)
    model = onnx.parser.parse_model(MIDDLE_HEADER.format(g="{" + g + "}", b="{" + b + "}") + SPELLINGS["flax_e_x2"])
    onnx.checker.check_model(model)
    samples = [{"x": (rng.normal(size=(2, F, 5)) * 2 + 1).astype(np.float32)} for _ in range(3)]
    fused, _ = optimize(model, check=True, samples=samples)
    assert Counter(n.op_type for n in fused.graph.node) == Counter({"LayerNormalization": 1, "Transpose": 2})
    for row in compare_models(model, fused, samples):
        assert row["rel_diff"] <= 1e-4, row


def test_e_x2_form_with_a_large_mean_fuses_past_its_own_cancellation() -> None:
    """E[x^2] - E[x]^2 in float32 loses digits when the mean dwarfs the spread; the fused LayerNorm is
    closer to the exact result than the graph it replaces, and the transformation check lets it."""
    model = _model(SPELLINGS["flax_e_x2"])
    rng = np.random.default_rng(11)
    samples = [{"x": (rng.normal(size=(2, 5, F)) * 0.5 + 30.0).astype(np.float32)} for _ in range(3)]
    fused, _ = optimize(model, check=True, samples=samples)
    assert Counter(n.op_type for n in fused.graph.node) == Counter({"LayerNormalization": 1})
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    x = samples[0]["x"].astype(np.float64)
    exact = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * inits["gamma"] + inits["beta"]
    from pulsar.frontend.check import run

    got_fused, got_orig = run(fused, samples[:1])[0]["y"], run(model, samples[:1])[0]["y"]
    assert np.abs(got_fused - exact).max() <= np.abs(got_orig - exact).max()
