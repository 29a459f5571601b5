"""Silero VAD 6.2.3 (``silero_vad.onnx`` of the silero-vad wheel): an ``If`` on the sample-rate input
with an STFT-conv encoder and an LSTM decoder in each branch; recurrent state input / output.

Run as its package's ``OnnxWrapper`` does: 16 kHz audio in chunks of 512 samples, each prefixed by
the last 64 samples of the previous one (``input`` [1, 576]), ``state`` [2, 1, 128] carried from
chunk to chunk, ``sr`` = 16000 (int64 scalar); output ``output`` [1, 1] speech probability.
Data: English sentences spoken by espeak-ng (several voices, speeds, gains) at random offsets in
4 s of silence and noise (one clip in eight is noise only). Calibration feeds are chunks of
calibration clips with the state the float model carries into them. Metric: agreement of the
per-chunk decision (probability > 0.5) with float, and the mean |probability - float|.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, package_file
from bench.zoo._data import speech_clips

TITLE = "Silero VAD v6.2 (If + LSTM)"
PACKAGE = "silero-vad==6.2.3"
WHEEL_FILE = "silero_vad/data/silero_vad.onnx"
METRIC = "per-chunk speech decision (p > 0.5) agreement with float, 32 ms chunks"
KEYS = ("frame_agree", "prob_mae")
CHUNK, CONTEXT = 512, 64
STATE_IN, STATE_OUT = {"state": (2, 1, 128)}, {"state": "stateN"}
PROB = "output"
EXTRA: dict[str, np.ndarray] = {"sr": np.array(16000, np.int64)}


# Fixing the shapes in the file and re-inferring breaks the If branches in onnxruntime ("LSTM: First
# input tensor must have rank 3"), so the model is used as shipped and pulsar fixes the shapes.
# The deployment runs at 16 kHz: ``sr`` is fixed by const_processors (no longer a model input), so the If
# folds to its 16 kHz branch and the LSTM inside it gets its shapes.
CONFIG = {"input_shapes": f"input:1x{CHUNK + CONTEXT};state:2x1x128",
          "const_processors": [{"name": "sr", "data": [16000]}]}


def float_model(cache: Path) -> Path:
    return package_file("silero_vad", "data/silero_vad.onnx", PACKAGE)


def stream(run: Runner, audio: np.ndarray, state_in: dict[str, tuple[int, ...]], state_out: dict[str, str],
           prob: str, extra: dict[str, np.ndarray], visit: Callable[[Feed], None] | None = None) -> np.ndarray:
    """Speech probability of each 512-sample chunk of ``audio``, state carried as the package does;
    ``visit`` sees every feed (for calibration)."""
    state = {k: np.zeros(s, np.float32) for k, s in state_in.items()}
    context = np.zeros(CONTEXT, np.float32)
    probs = []
    for i in range(len(audio) // CHUNK):
        chunk = audio[i * CHUNK : (i + 1) * CHUNK]
        feed = {"input": np.concatenate([context, chunk])[None].astype(np.float32), **state, **extra}
        if visit is not None:
            visit(feed)
        out = run(feed)
        probs.append(float(np.asarray(out[prob]).ravel()[0]))
        state = {k: np.asarray(out[state_out[k]], np.float32).reshape(s) for k, s in state_in.items()}
        context = chunk[-CONTEXT:]
    return np.asarray(probs)


def calib_from(model: Path, n: int, state_in: dict, state_out: dict, prob: str, extra: dict) -> list[Feed]:
    """``n`` feeds drawn evenly from the float model's runs over the calibration clips."""
    from bench.bench_zoo import ort_runner

    feeds: list[Feed] = []
    run = ort_runner(model)
    for clip in speech_clips(max(2, n // 16), "calib"):
        stream(run, clip, state_in, state_out, prob, extra, lambda f: feeds.append({k: v.copy() for k, v in f.items()}))
    idx = np.linspace(0, len(feeds) - 1, n).round().astype(int)
    return [feeds[i] for i in idx]


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return calib_from(model, n, STATE_IN, STATE_OUT, PROB, EXTRA)


N_EVAL, N_NPU = 12, 12  # clips of 4 s (125 chunks each); the simulator takes about 0.2 s a clip


def eval_items(n: int, model: Path) -> list[np.ndarray]:
    """``n`` clips of 4 s (125 chunks each)."""
    return speech_clips(n, "eval")


def predict(run: Runner, items: list[np.ndarray]) -> list[np.ndarray]:
    return [stream(run, clip, STATE_IN, STATE_OUT, PROB, EXTRA) for clip in items]


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    p, r = np.concatenate(pred), np.concatenate(ref)
    return {"frame_agree": float(np.mean((p > 0.5) == (r > 0.5))), "prob_mae": float(np.abs(p - r).mean()),
            "speech_frac": float(np.mean(p > 0.5))}
