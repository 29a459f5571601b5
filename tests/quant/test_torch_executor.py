"""The torch executor: ONNX ops against onnxruntime, fake quantization against QuantizeLinear /
DequantizeLinear, straight-through and LSQ gradients."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from pulsar.quant.graph import QuantGraph
from pulsar.quant.plan import QuantPlan
from pulsar.quant.torch_exec import QuantExecutor, unsupported_ops
from pulsar.quant.torch_exec.fake_quant import fake_quant, lsq_grad_factor, rectified_sigmoid
from tests.tiny_model import make_tiny_cnn


def _float_exe(model: onnx.ModelProto) -> QuantExecutor:
    return QuantExecutor(QuantGraph(model, QuantPlan(), {}, {}))


def _compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    want = sess.run(names, feeds)
    exe = _float_exe(model)
    got = exe.run(range(len(exe.nodes)), {k: torch.from_numpy(v) for k, v in feeds.items()}, names, quant=False)
    for n, w in zip(names, want, strict=True):
        assert got[n].shape == w.shape, n
        np.testing.assert_allclose(got[n].numpy(), w, atol=atol, rtol=1e-5, err_msg=n)


def test_tiny_cnn_float_matches_onnxruntime(tmp_path) -> None:
    model = onnx.load(make_tiny_cnn(tmp_path / "t.onnx"))
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    _compare(model, {"image": x})


# one small graph per op family, written as text (attributes at their defaults and set)
_CASES = {
    "conv_asym_pads_stride_group": ("float[1,4,9,9] x", "float[1,4,5,5] y", """
        w = Constant <value = float[4,2,3,3] {W}> ()
        y = Conv <pads = [1, 0, 2, 1], strides = [2, 2], group = 2> (x, w)""".replace("W", ",".join(["0.1"] * 72))),
    "gemm_trans": ("float[2,3] x", "float[2,4] y", """
        b = Constant <value = float[4,3] {1,2,3,4,5,6,7,8,9,10,11,12}> ()
        c = Constant <value = float[4] {1,2,3,4}> ()
        y = Gemm <transB = 1, alpha = 0.5, beta = 2.0> (x, b, c)"""),
    "layernorm_softmax_matmul": ("float[2,5,8] x", "float[2,5,5] y", """
        g = Constant <value = float[8] {1,2,1,2,1,2,1,2}> ()
        b = Constant <value = float[8] {0,1,0,1,0,1,0,1}> ()
        n = LayerNormalization <axis = -1, epsilon = 0.001> (x, g, b)
        p = Constant <value = int64[3] {0, 2, 1}> ()
        t = Transpose <perm = [0, 2, 1]> (n)
        m = MatMul (n, t)
        y = Softmax <axis = -1> (m)"""),
    "activations": ("float[1,6,4] x", "float[1,6,4] y", """
        a = HardSwish (x)
        b = HardSigmoid <alpha = 0.3, beta = 0.4> (a)
        lo = Constant <value = float {-0.5}> ()
        hi = Constant <value = float {0.7}> ()
        c = Clip (b, lo, hi)
        d = Sigmoid (x)
        e = Mul (c, d)
        f = Relu (x)
        y = Add (e, f)"""),
    "shapes": ("float[1,6,4,2] x", "float[2,8] y", """
        s = Constant <value = int64[3] {0, -1, 4}> ()
        r = Reshape (x, s)
        st = Constant <value = int64[1] {1}> ()
        en = Constant <value = int64[1] {5}> ()
        ax = Constant <value = int64[1] {1}> ()
        sl = Slice (r, st, en, ax)
        q = Constant <value = int64[1] {0}> ()
        z = Squeeze (sl, q)
        u = Unsqueeze (z, q)
        c = Concat <axis = 1> (u, u)
        f = Flatten <axis = 1> (c)
        s2 = Constant <value = int64[2] {2, 16}> ()
        y0 = Reshape (f, s2)
        a1 = Constant <value = int64[2] {0, 8}> ()
        b1 = Constant <value = int64[2] {2, 16}> ()
        y = Slice (y0, a1, b1)"""),
    "pools": ("float[1,3,9,9] x", "float[1,3,1,1] y", """
        a = AveragePool <kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1]> (x)
        m = MaxPool <kernel_shape = [2, 2], strides = [2, 2], ceil_mode = 1> (a)
        y = GlobalAveragePool (m)"""),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_ops_match_onnxruntime(case: str) -> None:
    inp, out, body = _CASES[case]
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
        g ({inp}) => ({out}) {{ {body} }}""")
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    _compare(model, {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)})


def test_unsupported_ops_are_named() -> None:
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[2] x) => (float[2] y) { y = com.example.Frobnicate (x) }""")
    assert unsupported_ops(model) == ["Frobnicate ()"]


@pytest.mark.parametrize(("dtype", "zp", "per_channel"), [(np.uint8, 128, False), (np.int8, 0, True),
                                                           (np.uint16, 30000, False), (np.int16, 0, True)])
def test_fake_quant_is_quantize_dequantize_linear(dtype: type, zp: int, per_channel: bool) -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 40)) * 4).astype(np.float32)
    scale = np.array([0.02, 0.05, 0.5], np.float32) if per_channel else np.float32(0.03)
    x[0, :5] = np.float32(scale if not per_channel else scale[0]) * np.array([0.5, 1.5, 2.5, -0.5, -1.5])  # ties
    zps = np.full(scale.shape, zp, dtype) if per_channel else np.array(zp, dtype)
    axis = 0 if per_channel else None
    wide = np.dtype(dtype).itemsize == 2
    domain = "com.microsoft" if wide else ""
    attrs = {"axis": 0} if per_channel else {}
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain=domain, **attrs),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], domain=domain, **attrs)],
        "qdq", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 40])],
        [numpy_helper.from_array(np.asarray(scale), "s"), numpy_helper.from_array(zps, "z")])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if wide else [])
    model = helper.make_model(graph, opset_imports=opsets)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    info = np.iinfo(dtype)
    got = fake_quant(torch.from_numpy(x), torch.from_numpy(np.asarray(scale)),
                     torch.from_numpy(zps.astype(np.float32)), int(info.min), int(info.max), axis)
    np.testing.assert_array_equal(got.numpy(), want)


def test_straight_through_and_lsq_gradients() -> None:
    x = torch.tensor([0.26, 0.74, 10.0, -10.0], requires_grad=True)
    s = torch.tensor(0.5, requires_grad=True)
    y = fake_quant(x, s, torch.tensor(0.0), -8, 7, None)
    y.sum().backward()
    assert x.grad is not None and s.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [1, 1, 0, 0])  # clipped elements pass no gradient
    # d y / d s: round(x/s) - x/s inside the range, q_max / q_min at the clips (LSQ)
    expected = (round(0.52) - 0.52) + (round(1.48) - 1.48) + 7 + -8
    assert float(s.grad) == pytest.approx(expected, abs=1e-6)
    assert lsq_grad_factor(100, 127) == pytest.approx(1 / np.sqrt(12700))


def test_rectified_sigmoid_reaches_zero_and_one() -> None:
    h = rectified_sigmoid(torch.tensor([-20.0, 0.0, 20.0]))
    assert h.tolist() == [0.0, pytest.approx(0.5), 1.0]


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("learned_scale", [False, True])
def test_training_fake_quant_has_the_reference_gradients(axis: int | None, learned_scale: bool) -> None:
    """While training, torch's fused fake-quantize kernels stand in for the QuantizeLinear arithmetic:
    the same values here, and the same straight-through / clipping / LSQ scale gradients as the
    step-by-step reference (run in float64, where the fused kernels are not used)."""
    torch.manual_seed(0)
    x = torch.randn(8, 8, 5, 5) * 3
    shape = () if axis is None else (8,)
    s, z = torch.rand(shape) + 0.05, torch.zeros(shape)
    weights = torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape)
    xa, sa = x.clone().requires_grad_(True), s.clone().requires_grad_(learned_scale)
    ya = fake_quant(xa, sa, z, -128, 127, axis)
    (ya * weights.float()).sum().backward()
    xd, sd = x.double().requires_grad_(True), s.double().requires_grad_(learned_scale)
    yd = fake_quant(xd, sd, z.double(), -128, 127, axis)
    (yd * weights).sum().backward()
    assert xa.grad is not None and xd.grad is not None
    torch.testing.assert_close(ya.detach().double(), yd.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(xa.grad.double(), xd.grad, rtol=0, atol=0)
    if learned_scale:
        assert sa.grad is not None and sd.grad is not None
        torch.testing.assert_close(sa.grad.double(), sd.grad, rtol=1e-5, atol=0)


def test_sqrt_of_zero_passes_no_nan_gradient() -> None:
    """A magnitude sqrt(x^2 + y^2) of a silent input: the gradient at 0 is 0, not inf x 0 = NaN, so the
    weights upstream still train (Silero VAD's STFT magnitude turned every LSQ parameter into NaN)."""
    from pulsar.quant.torch_exec.ops import TORCH_OPS, Call

    w = torch.tensor([0.0, 0.5, -1.0], requires_grad=True)
    x = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    y = TORCH_OPS["Sqrt"](Call({}, [(x * w) ** 2]))[0]
    torch.testing.assert_close(y.detach(), (x * w.detach()).abs())
    y.sum().backward()
    assert w.grad is not None and bool(torch.isfinite(w.grad).all())
    torch.testing.assert_close(w.grad, torch.tensor([0.0, 2.0, -1.0]))
