"""Silero VAD v6 as faster-whisper 1.2.1 ships it (``silero_vad_v6.onnx``, PyTorch export, opset
18): no ``If``, explicit LSTM state inputs ``h`` and ``c`` [1, 1, 128].

Input ``input`` [seq, 576] (512-sample chunks at 16 kHz, each prefixed by the previous chunk's
last 64 samples, as faster-whisper's ``SileroVADModel`` builds them); here seq = 1 and ``h`` / ``c``
carried from chunk to chunk (the same recurrence faster-whisper runs over a batch). Output
``speech_probs``. Data and metric as :mod:`bench.zoo.silero_vad`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, fix_input_shapes, package_file
from bench.zoo.silero_vad import CHUNK, CONTEXT, N_EVAL, N_NPU, calib_from, eval_items, score, stream  # noqa: F401

TITLE = "Silero VAD v6 (faster-whisper, LSTM h/c state)"
PACKAGE = "faster-whisper==1.2.1"
WHEEL_FILE = "faster_whisper/assets/silero_vad_v6.onnx"
METRIC = "per-chunk speech decision (p > 0.5) agreement with float, 32 ms chunks"
KEYS = ("frame_agree", "prob_mae")
STATE_IN, STATE_OUT = {"h": (1, 1, 128), "c": (1, 1, 128)}, {"h": "hn", "c": "cn"}
PROB = "speech_probs"


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("faster_whisper", "assets/silero_vad_v6.onnx", PACKAGE),
                            cache / "silero_vad_v6.onnx", {"input": [1, CHUNK + CONTEXT]})


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return calib_from(model, n, STATE_IN, STATE_OUT, PROB, {})


def predict(run: Runner, items: list[np.ndarray]) -> list[np.ndarray]:
    return [stream(run, clip, STATE_IN, STATE_OUT, PROB, {}) for clip in items]
