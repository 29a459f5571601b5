"""RapidOCR 3.10.0's PP-OCRv6 small text detector (``PP-OCRv6_det_small.onnx``, Paddle export, opset
11): a DBNet-style dense predictor, one text-probability map at input resolution.

Input ``x`` [1, 3, 320, 320] BGR, ``(x / 255 - 0.5) / 0.5`` (rapidocr's ``DetPreProcess``); output
[1, 1, 320, 320] probabilities. Data: pages of English words (CPython documentation) in DejaVu
fonts at random sizes, half on paper, half on faded photo crops; calibration and evaluation pages
use disjoint words and photo halves. Metric: cosine of the probability map with float, and IoU of
the text mask at rapidocr's binarization threshold 0.3 with float's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, fix_input_shapes, package_file
from bench.zoo._data import Part, text_page

TITLE = "PP-OCRv6 small text detector (dense map)"
PACKAGE = "rapidocr==3.10.0"
WHEEL_FILE = "rapidocr/models/PP-OCRv6_det_small.onnx"
METRIC = "probability-map cosine and text-mask IoU (p > 0.3) vs float"
KEYS = ("mask_iou", "map_cos")
SIZE = 320  # at 480 onnxruntime's Entropy calibrator takes 144 s
N_EVAL, N_NPU = 40, 40


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("rapidocr", "models/PP-OCRv6_det_small.onnx", PACKAGE),
                            cache / f"ppocrv6_det_small_{SIZE}.onnx", {"x": [1, 3, SIZE, SIZE]})


def _pages(n: int, part: Part) -> list[np.ndarray]:
    rng = np.random.default_rng(20 if part == "calib" else 21)
    return [text_page(rng, part, SIZE, SIZE, photo_bg=i % 2 == 1) for i in range(n)]


def preprocess(rgb: np.ndarray) -> np.ndarray:
    bgr = rgb[:, :, ::-1].astype(np.float32)
    return np.ascontiguousarray(((bgr / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None])


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"x": preprocess(p)} for p in _pages(n, "calib")]


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    return _pages(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[np.ndarray]:
    return [next(iter(run({"x": preprocess(p)}).values()))[0, 0] for p in items]


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    p, r = np.stack(pred).astype(np.float64), np.stack(ref).astype(np.float64)
    cos = (p * r).sum((1, 2)) / np.maximum(np.linalg.norm(p, axis=(1, 2)) * np.linalg.norm(r, axis=(1, 2)), 1e-12)
    pm, rm = p > 0.3, r > 0.3
    return {"mask_iou": float((pm & rm).sum() / max((pm | rm).sum(), 1)), "map_cos": float(cos.mean()),
            "text_frac": float(pm.mean())}
