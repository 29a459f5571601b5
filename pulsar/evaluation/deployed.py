"""The three models a plugin scores, all in the compiled model's input and output format.

The compiled model starts with ``input_processors`` and ends with ``output_processors`` (uint8 RGB NHWC
pixels in, for configs/mobilenetv2.json); the float and QDQ artifacts keep the model's own format. A
plugin gets all three in the deployed format, so one function scores each: the same processors (the
ONNX ops the compiler attaches) are put in front of and behind the float and QDQ models before they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pulsar.evaluation.sessions import CompiledSession, MetricSession, OrtSession

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig


def deployed_sessions(cfg: BuildConfig, model: onnx.ModelProto, float_path: Path, qdq_path: Path,
                      compiled_path: Path) -> dict[str, MetricSession]:
    """``float``, ``qdq`` and ``npu`` sessions that take the deployed inputs and give the deployed outputs."""
    return {"float": _onnx(cfg, model, float_path, qdq=False), "qdq": _onnx(cfg, model, qdq_path, qdq=True),
            "npu": CompiledSession(compiled_path)}


def _onnx(cfg: BuildConfig, model: onnx.ModelProto, path: Path, *, qdq: bool) -> OrtSession:
    if not cfg.input_processors and not cfg.output_processors:
        return OrtSession(path, qdq=qdq)
    from pulsar.frontend.processors import attach_input_processors, attach_output_processors
    from pulsar.quant.samples import calibration_normalization

    onnx_model = onnx.load(str(path))
    onnx_model, _ = attach_input_processors(onnx_model, cfg.input_processors, calibration_normalization(cfg, model))
    onnx_model, _ = attach_output_processors(onnx_model, cfg.output_processors)
    return OrtSession(onnx_model.SerializeToString(), qdq=qdq, name=path)
