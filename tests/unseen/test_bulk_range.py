"""A heavy-tailed tensor (a power spectrum: most values tiny, a few huge) whose MinMax step rounds most
of its values to zero takes its KL range; a ReLU output (exact zeros, resolved values) keeps MinMax. On a
small audio front end (frames -> Conv -> x^2 -> Sqrt -> Conv), the default build then keeps the quiet
frames that MinMax flattens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import helper

from pulsar.quant.algorithms.bulk_range import keep_bulk, rounded_to_zero
from pulsar.quant.observers import compute_range
from pulsar.quant.observers.histogram import TensorStats
from tests.unseen.helpers import build_and_run, calib_config, init, save, vi


def _stats(x: np.ndarray) -> TensorStats:
    s = TensorStats.empty()
    s.update(x)
    return s


def test_power_spectrum_takes_kl_and_relu_keeps_minmax() -> None:
    rng = np.random.default_rng(0)
    power = (rng.normal(size=200_000) * np.exp(rng.normal(size=200_000) * 1.5)) ** 2
    relu = np.maximum(rng.normal(size=200_000) * 2.0, 0.0)
    stats = {"power": _stats(power.astype(np.float32)), "relu": _stats(relu.astype(np.float32))}
    ranges = {k: compute_range(s, "MinMax") for k, s in stats.items()}
    assert rounded_to_zero(stats["power"], *ranges["power"], 256) > 0.5
    assert rounded_to_zero(stats["relu"], *ranges["relu"], 256) < 0.1  # exact zeros do not count
    before = dict(ranges)
    assert keep_bulk(stats, ranges, ["power", "relu"], num_bits=8, signed=False) == ["power"]
    assert ranges["relu"] == before["relu"]
    assert ranges["power"][1] < before["power"][1] / 4
    assert ranges["power"] == compute_range(stats["power"], "KL")


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
    assert "bulk range" in log and "power" in log
    ref, npu = outs["float"][0], outs["npu"][0]
    quiet = np.abs(ref).max(axis=1) < 0.5 * np.abs(ref).max()  # frames away from the burst
    err = np.abs(npu - ref)[:, :, quiet[0]].mean() / np.abs(ref[:, :, quiet[0]]).mean()
    assert err < 0.5  # MinMax leaves the quiet frames' magnitudes at zero: relative error ~1
