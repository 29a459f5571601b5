"""bench.bench_speed: its model registry (the issue's six models or their stand-ins), the CPU flags
line, and the calibration files both quantizers read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import bench_speed


def test_six_models_with_the_two_stand_ins() -> None:
    assert list(bench_speed.MODELS) == ["mbv2", "ocr_rec", "ocr_det", "minilm", "yolov8n", "picodet"]
    assert "YOLOX" in bench_speed.MODELS["yolov8n"].title
    assert "EfficientNet-Lite0" in bench_speed.MODELS["picodet"].title


def test_cpu_flags_keep_only_the_int8_relevant_ones() -> None:
    name, flags = bench_speed.cpu_flags()
    assert name
    assert all(f == "avx2" or f.startswith("avx512") or "vnni" in f for f in flags)


def test_calibration_files_hold_the_same_arrays_for_both(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    feeds = [{"x:0": rng.standard_normal((1, 3)).astype(np.float32)} for _ in range(3)]
    configs, npz = bench_speed.calibration_files(feeds, tmp_path)
    (cfg,) = configs
    assert cfg["tensor_name"] == "x:0" and cfg["calibration_size"] == 3
    numpy_files = sorted(Path(cfg["calibration_dataset"]).glob("*.npy"))
    for i, (f, z) in enumerate(zip(numpy_files, npz, strict=True)):
        assert np.array_equal(np.load(f), feeds[i]["x:0"])
        assert np.array_equal(np.load(z)["x:0"], feeds[i]["x:0"])


def test_unknown_model_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench_speed.main(["--models", "nosuch", "--no-sim", "--no-build"])
