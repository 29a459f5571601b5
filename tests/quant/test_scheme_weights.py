"""weight_quant: S32 constants keep their sign, all-zero channels get a usable scale, and a NaN / inf
weight is a user error naming the initializer (not a silent garbage cast)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.errors import PulsarError
from pulsar.quant.qdq import constant_quant
from pulsar.quant.scheme import DTYPES, weight_quant


def _dequant(tq, q, axis):
    shape = [1] * q.ndim
    shape[axis] = -1
    return q.astype(np.float64) * np.asarray(tq.scale, np.float64).reshape(shape)


@pytest.mark.parametrize("dtype", ["S8", "S16", "S32"])
def test_per_channel_grid_covers_each_channel_without_overflow(dtype):
    """In float32, 2**31 - 1 rounds to 2**31: every channel's largest value overflowed the int32
    cast ("invalid value encountered in cast") and wrapped to -2**31, flipping its sign."""
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.uniform(0.5, 1.5, (6, 1)), -rng.uniform(0.5, 1.5, (6, 1))]).astype(np.float32)
    w = np.concatenate([w, w * 0.3], axis=1)  # 12 channels of 2 values, max |w| first, positive and negative
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq, q = weight_quant("w", w, 0, dtype)
    qmax = DTYPES[dtype][1]
    # each channel's max |w| lands on quant_max (to the float32 scale's rounding: ~100 codes of 2**31)
    assert (np.abs(q[:, 0].astype(np.int64)) >= qmax * (1 - 1e-7)).all()
    assert np.array_equal(np.sign(q), np.sign(w))
    np.testing.assert_allclose(_dequant(tq, q, 0), w, rtol=1e-6, atol=float(np.max(tq.scale)) / 2 * 1.0001)


def test_layernorm_scale_vector_as_s32_keeps_every_value():
    """The LayerNorm Scale with ln_scale_data_type S32: one value per channel, each on quant_max."""
    gamma = np.random.default_rng(1).uniform(0.5, 1.5, 64).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq, q = constant_quant("ln.scale", gamma, 1e-6, "S32")
    assert (q == DTYPES["S32"][1]).all()
    np.testing.assert_allclose(_dequant(tq, q, 0), gamma, rtol=1e-6)


@pytest.mark.parametrize("threshold", [1e-6, -1])
def test_all_zero_channel_takes_the_widest_channel_scale(threshold):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32)
    w[2] = 0.0
    tq, q = weight_quant("conv.w", w, 0, "S8", refine_threshold=threshold)
    assert tq.scale[2] == tq.scale.max() > 1e-4
    assert not q[2].any()
    # its bias grid (input scale x weight scale) is as coarse as its neighbours', so it fits in int32
    assert tq.scale[2] * 0.01 > 1e-9


def test_all_zero_tensor_gets_a_unit_range():
    tq, q = weight_quant("zeros", np.zeros((3, 2), np.float32), 0, "S8", refine_threshold=-1)
    np.testing.assert_allclose(tq.scale, np.full(3, 1 / 127, np.float32))
    assert not q.any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_a_user_error_naming_the_initializer(bad):
    w = np.ones((4, 2), np.float32)
    w[1, 1] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(PulsarError, match=r'initializer "fc\.w" holds 1 NaN / inf value\(s\) out of 8'):
            weight_quant("fc.w", w, 0, "S8")


def _layernorm_model(path, gamma=None):
    """LayerNormalization (gamma: 16 values, default uniform in [0.5, 1.5]) -> MatMul, opset 17."""
    rng = np.random.default_rng(3)
    gamma = rng.uniform(0.5, 1.5, 16) if gamma is None else gamma
    inits = [numpy_helper.from_array(np.asarray(gamma).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "beta"),
             numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), "w")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w"], ["y"], name="proj")]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_build_with_s32_layernorm_scale_matches_the_float_model(tmp_path):
    """transformer_opt_level 1 with ln_scale_data_type S32: the quantized model used to carry every
    LayerNorm gamma negated, so its output was the float one with the sign flipped."""
    model = _layernorm_model(tmp_path / "ln.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    xs = [np.random.default_rng(i).standard_normal((1, 8, 16)).astype(np.float32) for i in range(4)]
    for i, x in enumerate(xs):
        np.save(calib / f"{i}.npy", x)
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 4}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = pulsar.build(model, tmp_path / "out", cfg, {"quant.transformer_opt_level": 1,
                                                          "quant.ln_scale_data_type": "S32"}, quiet=True)
    want = ort.InferenceSession(str(model)).run(None, {"x": xs[0]})[0]
    got = ort.InferenceSession(str(res.quantized_model)).run(None, {"x": xs[0]})[0]
    cosine = float(np.dot(want.ravel(), got.ravel()) / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99, cosine
