"""NudeNet 3.4.2's detector: a YOLOv8n (ultralytics export, opset 17) at 320 x 320, 18 classes.

Output ``output0`` [1, 22, 2100]: per anchor (cx, cy, w, h) in input pixels, then 18 sigmoid class
scores in 0..1, the two concatenated (the case where one scale for the whole tensor wastes most of
its range on one half). Pre-processing as nudenet's ``_read_image``: pad right / bottom to a square
(black), resize to 320, RGB, / 255. Post-processing as its ``_postprocess``: best class per anchor,
score >= 0.2, then class-agnostic NMS (score >= 0.25, IoU 0.45). Metric: box F1 at IoU 0.5 with the
same class, quantized boxes against float boxes, over crops of photos with faces and objects
(calibration: other photos).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from bench.zoo import Detections, Feed, Runner, box_f1, fix_input_shapes, nms, package_file
from bench.zoo._data import Part

TITLE = "NudeNet YOLOv8n detector"
PACKAGE = "nudenet==3.4.2"
WHEEL_FILE = "nudenet/320n.onnx"
METRIC = "box F1 @ IoU 0.5, same class, vs float boxes"
KEYS = ("box_f1",)
SIZE = 320
# 100 crops hold about 64 float boxes, where one box moves F1 by 1.5 points (fine-tuning's gains read
# -2.8 to +1.9 there); 300 hold about 204 (bench_finetune: every algorithm then at or above the default)
N_EVAL, N_NPU = 300, 300
# Disjoint photos (the people are near the photos' centres, so halves would cut them away): every
# evaluation photo shows a face or an object the detector finds; calibration has a face too.
PHOTOS = {"eval": ("astronaut", "camera", "chelsea", "coffee"),
          "calib": ("grace_hopper", "clock", "rocket", "motorcycle_left", "china", "flower", "coins")}


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("nudenet", "320n.onnx", PACKAGE), cache / "nudenet_320n.onnx",
                            {"images": [1, 3, SIZE, SIZE]})


def _images(n: int, part: Part) -> list[np.ndarray]:
    """Full-frame photo crops (random scale, position, mirror); a third cut to a landscape or portrait aspect (then padded)."""
    from examples import assets

    rng = np.random.default_rng(7 if part == "calib" else 8)
    out = []
    for i, img in enumerate(assets.photo_crops(n, 5 + len(part), SIZE, part="all", photos=PHOTOS[part])):
        if i % 3 == 1:
            img = img[: int(SIZE * rng.uniform(0.6, 0.9))]
        elif i % 3 == 2:
            img = img[:, : int(SIZE * rng.uniform(0.6, 0.9))]
        out.append(np.ascontiguousarray(img))
    return out


def preprocess(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    side = max(h, w)
    pad = np.zeros((side, side, 3), np.uint8)
    pad[:h, :w] = img
    x = np.asarray(Image.fromarray(pad).resize((SIZE, SIZE), Image.BILINEAR), np.float32) / 255.0
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def postprocess(out: np.ndarray) -> Detections:
    rows = np.asarray(out, np.float32)[0].T  # [2100, 22]
    cls_scores = rows[:, 4:]
    cls, score = cls_scores.argmax(1), cls_scores.max(1)
    keep = score >= 0.25  # nudenet keeps >= 0.2, then NMSBoxes drops < 0.25
    xywh, cls, score = rows[keep, :4], cls[keep], score[keep]
    boxes = np.stack([xywh[:, 0] - xywh[:, 2] / 2, xywh[:, 1] - xywh[:, 3] / 2,
                      xywh[:, 0] + xywh[:, 2] / 2, xywh[:, 1] + xywh[:, 3] / 2], 1)
    idx = nms(boxes, score, 0.45)
    return boxes[idx], cls[idx], score[idx]


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"images": preprocess(img)} for img in _images(n, "calib")]


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    return _images(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[Detections]:
    return [postprocess(run({"images": preprocess(img)})["output0"]) for img in items]


def score(pred: list[Detections], ref: list[Detections]) -> dict[str, float]:
    return box_f1(pred, ref)
