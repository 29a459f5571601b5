"""openWakeWord 0.5.1's speech embedding model (Google's ``speech_embedding`` converted with tf2onnx,
opset 13): 20 Conv + LeakyReLU + Max layers over a log-mel window.

Input ``input_1`` [1, 76, 32, 1]: 76 frames of 32 mel bands (0.76 s) from the package's own
``melspectrogram.onnx`` (run in float, as pre-processing) with its transform ``x / 10 + 2``, windows
every 8 frames, as ``AudioFeatures._get_embeddings`` does on 16-bit PCM; output ``conv2d_19``
[1, 1, 1, 96] the embedding the wake-word heads read. Data: espeak-ng speech in silence / noise
(see :mod:`bench.zoo._data`). Metric: cosine of each window's embedding with float.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, cosines, fix_input_shapes, package_file
from bench.zoo._data import Part, speech_clips

TITLE = "openWakeWord speech embedding"
PACKAGE = "openwakeword==0.5.1"
WHEEL_FILE = "openwakeword/resources/models/embedding_model.onnx"
METRIC = "embedding cosine with float, per 0.76 s window"
KEYS = ("cos_mean", "cos_min")
WINDOW, STEP = 76, 8


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("openwakeword", "resources/models/embedding_model.onnx", PACKAGE),
                            cache / "oww_embedding.onnx", {"input_1": [1, WINDOW, 32, 1]})


@functools.cache
def _melspec():
    import onnxruntime as ort

    path = package_file("openwakeword", "resources/models/melspectrogram.onnx", PACKAGE)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def windows(audio: np.ndarray) -> list[np.ndarray]:
    """The package's mel windows of one clip: [1, 76, 32, 1] float32 each."""
    pcm = (np.clip(audio, -1, 1) * 32767).astype(np.int16).astype(np.float32)[None]
    spec = np.squeeze(_melspec().run(None, {"input": pcm})[0]) / 10 + 2
    return [spec[i : i + WINDOW][None, :, :, None].astype(np.float32)
            for i in range(0, spec.shape[0] - WINDOW + 1, STEP)]


def _windows(n: int, part: Part) -> list[np.ndarray]:
    out = [w for clip in speech_clips(max(1, n // 20 + 1), part) for w in windows(clip)]
    idx = np.linspace(0, len(out) - 1, min(n, len(out))).round().astype(int)
    return [out[i] for i in idx]


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"input_1": w} for w in _windows(n, "calib")]


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    return _windows(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[np.ndarray]:
    return [run({"input_1": w})["conv2d_19"].ravel() for w in items]


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    c = cosines(pred, ref)
    return {"cos_mean": float(c.mean()), "cos_min": float(c.min())}
