from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N workers share the cores, one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

from tests.tiny_model import make_numpy_calibration, make_tiny_cnn


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny CNN and 8 Numpy calibration samples, shared by the fast end-to-end tests."""
    root = tmp_path_factory.mktemp("tiny")
    return {"model": make_tiny_cnn(root / "tiny.onnx"), "calib": make_numpy_calibration(root / "calib")}


@pytest.fixture()
def tiny_config(tiny: dict[str, Path]) -> dict:
    return {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                         "calibration_format": "Numpy", "calibration_size": 8}]}}
