"""Fine-tuning against over-fitting a small calibration set: the rollback judges on held-out samples no
training batch draws, and BRECQ trains with QDrop (float values kept at random elements)."""

from __future__ import annotations

from pathlib import Path

import torch

import pulsar
from pulsar.quant.finetune import QDROP
from pulsar.quant.finetune.reconstruct import HELD_FROM, Reconstruction, Settings
from pulsar.quant.torch_exec import QuantExecutor


class _Exe:
    device = torch.device("cpu")


def test_held_out_samples_are_never_trained_on() -> None:
    rec = Reconstruction(_Exe(), Settings("lsq", 10, 4, 1e-3, held_out=True))  # type: ignore[arg-type]
    train, held = rec.split(32)
    assert len(held) == 8 and not set(train) & set(held) and sorted(train + held) == list(range(32))
    assert rec.split(32) == (train, held)                       # deterministic for a seed
    draws = {int(i) for _ in range(200) for i in rec.rng.choice(train, size=4)}
    assert draws <= set(train)
    assert len(rec.split(200)[1]) == 16                         # at most 16 judge
    small_train, small_held = rec.split(HELD_FROM - 1)          # too few: all train, the first judge
    assert small_train == list(range(HELD_FROM - 1)) and small_held == small_train


def test_qdrop_is_on_where_it_measured_a_gain() -> None:
    assert QDROP == {"brecq": 0.5}


def test_qdrop_keeps_float_values_while_training_only(tiny: dict, tmp_path: Path) -> None:
    """The executor's QDrop mixes float and quantized elements of an activation with a gradient on;
    without one (targets, losses, the values kept) every element is quantized."""
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    built = pulsar.build(input=tiny["model"], output_dir=tmp_path / "out", config=cfg, quiet=True)
    exe = QuantExecutor(built.quant_graph)
    name = next(iter(exe.acts))
    scale = float(exe.act_scale(name))
    x = torch.linspace(-300 * scale, 300 * scale, 60001).reshape(1, -1).requires_grad_(True)
    exe.drop = 0.5
    with torch.no_grad():
        q = exe._fq(name, x)
    mixed = exe._fq(name, x)
    moved = q != x
    kept = (mixed == x) & moved
    assert 0.45 < float(kept.sum() / moved.sum()) < 0.55
    # the rest is quantized (torch's fused kernel while training: a tie may land one step off)
    diff = (mixed[~kept] - q[~kept]).abs().detach()
    assert bool((diff <= scale * 1.001).all()) and float((diff > 0).float().mean()) < 0.01
    mixed.sum().backward()  # the gradient flows through both kinds of element
    assert x.grad is not None and bool((x.grad[kept] == 1).all())


_ONE_SAMPLE = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,10] y) {
    a = Conv <pads = [1, 1, 1, 1]> (x, w1)
    r = Relu (a)
    s = Constant <value = int64[2] {1, 256}> ()
    f = Reshape (r, s)
    y = Gemm <transB = 1> (f, w2)
}"""


def test_a_graph_written_for_one_sample_trains_with_qdrop(tmp_path: Path) -> None:
    """A Reshape to [1, ...] cannot take stacked samples: the block runs per sample under vmap, where
    QDrop's random draws must be allowed (they differ per sample)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    m = onnx.parser.parse_model(_ONE_SAMPLE)
    m.graph.initializer.extend([numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32), "w1"),
                                numpy_helper.from_array((rng.standard_normal((10, 256)) * 0.1).astype(np.float32), "w2")])
    src, calib = tmp_path / "m.onnx", tmp_path / "calib"
    onnx.save(m, src)
    calib.mkdir()
    for i in range(8):
        np.save(calib / f"{i}.npy", rng.standard_normal((1, 4, 8, 8)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 8}],
                     "enable_brecq": True, "finetune_epochs": 5, "finetune_block_size": 4}}
    built = pulsar.build(src, tmp_path / "out", cfg, quiet=True)
    assert "block 1/" in (tmp_path / "out" / "build.log").read_text() and built.compiled_model.exists()
