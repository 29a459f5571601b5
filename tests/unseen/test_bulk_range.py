"""A heavy-tailed tensor (a power spectrum: most values tiny, a few huge) whose 8-bit step rounds most
of its values to zero is stored at 16 bits; a ReLU output (exact zeros, resolved values) stays 8-bit. On a
small audio front end (frames -> Conv -> x^2 -> Sqrt -> Conv), the default build then keeps the quiet
frames that an 8-bit grid flattens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from onnx import helper

from pulsar.quant.algorithms.bulk_range import flattened, widen_flattened
from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.plan import QuantPlan
from tests.unseen.helpers import build_and_run, calib_config, init, save, vi


def _stats(x: np.ndarray) -> TensorStats:
    s = TensorStats.empty()
    s.update(x)
    return s


def test_power_spectrum_goes_to_16_bits_and_relu_stays() -> None:
    rng = np.random.default_rng(0)
    power = (rng.normal(size=200_000) * np.exp(rng.normal(size=200_000) * 1.5)) ** 2
    relu = np.maximum(rng.normal(size=200_000) * 2.0, 0.0)
    stats = {"power": _stats(power.astype(np.float32)), "relu": _stats(relu.astype(np.float32)),
             "view": _stats(power.astype(np.float32))}
    assert flattened(stats["power"], "U8") > 0.5 and flattened(stats["power"], "U16") < 0.1
    assert flattened(stats["relu"], "U8") < 0.1  # exact zeros do not count
    plan = QuantPlan(activations=["power", "relu", "view"], dtypes={"power": "U8", "relu": "U8", "view": "U8"},
                     shared={"view": "power"})
    assert widen_flattened(plan, stats) == ["power"]
    assert plan.dtypes == {"power": "U16", "relu": "U8", "view": "U16"}  # the passive view follows
    plan = QuantPlan(activations=["power"], dtypes={"power": "U8"})
    assert widen_flattened(plan, stats, {"power"}) == [] and plan.dtypes["power"] == "U8"  # layer_configs


def _front_end(tmp: Path) -> Path:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "k"], ["spec"], name="stft", kernel_shape=[64], strides=[32]),
             helper.make_node("Mul", ["spec", "spec"], ["power"], name="square"),
             helper.make_node("Sqrt", ["power"], ["mag"], name="magnitude"),
             helper.make_node("Conv", ["mag", "w", "b"], ["y"], name="proj", kernel_shape=[1])]
    return save(tmp / "fe.onnx", nodes, [vi("x", [1, 1, 1024])], [vi("y", [1, 8, 31])],
                [init("k", (rng.normal(size=(16, 1, 64)) * 0.2).astype(np.float32)),
                 init("w", (rng.normal(size=(8, 16, 1)) * 0.3).astype(np.float32)),
                 init("b", np.zeros(8, np.float32))])


def _audio(rng: np.random.Generator) -> np.ndarray:
    """Speech-like: a quiet background with a loud burst somewhere (gain spans 40 dB)."""
    x = rng.normal(size=(1, 1, 1024)) * 0.01
    start = int(rng.integers(0, 768))
    x[..., start:start + 256] *= 100
    return x.astype(np.float32)


def test_quiet_frames_survive_the_square_law(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    model = _front_end(tmp_path)
    cfg = calib_config(tmp_path, {"x": [_audio(rng) for _ in range(16)]})
    x = _audio(np.random.default_rng(99))
    outs = build_and_run(model, tmp_path / "out", cfg, {"x": x})
    log = (tmp_path / "out" / "build.log").read_text()
    assert "bulk: 1 heavy-tailed" in log or "bulk:" in log
    assert json.loads((tmp_path / "out" / "quant" / "quant_config.json").read_text())["tensors"]["power"]["dtype"] \
        == "U16"
    ref, npu = outs["float"][0], outs["npu"][0]
    quiet = np.abs(ref).max(axis=1) < 0.5 * np.abs(ref).max()  # frames away from the burst
    err = np.abs(npu - ref)[:, :, quiet[0]].mean() / np.abs(ref[:, :, quiet[0]]).mean()
    assert err < 0.5  # MinMax leaves the quiet frames' magnitudes at zero: relative error ~1
