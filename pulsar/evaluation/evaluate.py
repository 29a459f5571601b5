"""``evaluation``: check the section before the build writes, score the three models after it compiled.

Built-in metrics stream the evaluation data (``evaluation.input_configs``, the calibration formats)
through the float, QDQ and compiled models one sample at a time; a plugin gets each model as a
session in the deployed input format and reads its own data, in a child process
(:mod:`pulsar.evaluation.isolated`). The figures go to the console, ``build.log`` and ``evaluation.json``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from pulsar.errors import PulsarError
from pulsar.evaluation.deployed import deployed_sessions
from pulsar.evaluation.isolated import check_plugin, score_plugin
from pulsar.evaluation.labels import check_labels, output_shape, read_labels
from pulsar.evaluation.metrics import BUILTINS
from pulsar.evaluation.plugins import is_plugin
from pulsar.evaluation.sessions import CompiledSession, MetricSession, OrtSession
from pulsar.quant.datasets import CalibrationData, DatasetConfig
from pulsar.quant.stage import input_specs
from pulsar.ui import show, table
from pulsar.utils.atomic import atomic_write_text

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig, EvaluationConfig

log = logging.getLogger(__name__)
MODELS = ("float", "qdq", "npu")  # the keys of evaluation.json, in the order they are scored


def _configs(ev: EvaluationConfig) -> list[DatasetConfig]:
    return [DatasetConfig(ic.tensor_name, ic.calibration_dataset, ic.calibration_format, ic.calibration_size,
                          tuple(ic.calibration_mean or ()), tuple(ic.calibration_std or ()),
                          field_path=f"evaluation.input_configs[{i}]") for i, ic in enumerate(ev.input_configs)]


def check_evaluation(cfg: BuildConfig, model: onnx.ModelProto) -> None:
    """Every mistake in ``evaluation`` before anything is written: the metric, its data and labels."""
    ev = cfg.evaluation
    if not ev.metric:
        for name in ("input_configs", "labels", "output"):
            if getattr(ev, name):
                raise PulsarError(f"evaluation.{name} is set but evaluation.metric is empty; name a metric "
                                  f"({', '.join(BUILTINS)} or module:function) or remove evaluation.{name}")
        return
    if is_plugin(ev.metric):
        for name in ("input_configs", "labels", "output"):
            if getattr(ev, name):
                raise PulsarError(f"evaluation.{name}: a plugin metric reads its own data; remove evaluation.{name} "
                                  "or use a built-in metric")
        check_plugin(ev.metric)  # imported in a child process: its exit or crash is one error line
        return
    if ev.metric not in BUILTINS:
        raise PulsarError(f"evaluation.metric: {ev.metric!r} is not a built-in metric ({', '.join(BUILTINS)}) nor "
                          "a plugin 'module:function' / 'file.py:function'")
    if not ev.input_configs:
        raise PulsarError(f"evaluation.input_configs: the built-in metric {ev.metric} needs evaluation data; add "
                          "entries like quant.input_configs (tensor_name, calibration_dataset, calibration_format)")
    if cfg.input_processors:
        raise PulsarError("evaluation.metric: the built-in metrics feed the model's own input format (the evaluation "
                          "data's) to every model, and input_processors give the compiled model another one; use a "
                          "plugin metric (it gets all three models in the deployed format) or remove "
                          "input_processors")
    outputs = [o.name for o in model.graph.output]
    if ev.output and ev.output not in outputs:
        raise PulsarError(f"evaluation.output: the model has no output {ev.output!r}; its outputs are {outputs}")
    data = CalibrationData(input_specs(cfg, model), _configs(ev))
    try:
        acc = BUILTINS[ev.metric]()
        if acc.needs_labels:
            if not ev.labels:
                raise PulsarError(f"evaluation.labels: the metric {ev.metric} needs labels; give a .npy file with "
                                  "one label per sample")
            output = ev.output or outputs[0]
            check_labels(ev.metric, acc, read_labels(ev.labels), ev.labels, len(data), output,
                         output_shape(model, output))
        elif ev.labels:
            raise PulsarError(f"evaluation.labels: the metric {ev.metric} compares with the float model and reads no "
                              "labels; remove evaluation.labels")
    finally:
        data.close()


def run_evaluation(cfg: BuildConfig, model: onnx.ModelProto, float_path: Path, qdq_path: Path, compiled_path: Path,
                   out: Path, quiet: bool = False) -> dict[str, Any]:
    """Score the three models; writes ``out`` (evaluation.json) and returns what it holds."""
    ev = cfg.evaluation
    if is_plugin(ev.metric):  # the plugin in a child process, each model in the deployed format
        values = score_plugin(ev.metric, deployed_sessions(cfg, model, float_path, qdq_path, compiled_path))
        samples = None
    else:
        sessions: dict[str, MetricSession] = {"float": OrtSession(float_path),
                                              "qdq": OrtSession(qdq_path, qdq=True),
                                              "npu": CompiledSession(compiled_path)}
        values, samples = _builtin(cfg, model, sessions)
    result = {"metric": ev.metric, "samples": samples, **values}
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    for k in MODELS:
        log.info("evaluation %s: %s %.6f", ev.metric, k, values[k])
    names = {"float": "float model", "qdq": "QDQ model (onnxruntime)", "npu": "compiled model (NPUBackend)"}
    show(table(f"Evaluation: {ev.metric}" + (f" on {samples} sample{'s' if samples != 1 else ''}" if samples else ""), ["model", ev.metric],
               [(names[k], f"{values[k]:.6f}") for k in MODELS]), quiet=quiet)
    return result


def _builtin(cfg: BuildConfig, model: onnx.ModelProto, sessions: dict[str, MetricSession]) -> tuple[dict[str, float], int]:
    ev = cfg.evaluation
    output = ev.output or model.graph.output[0].name
    accs = {k: BUILTINS[ev.metric]() for k in MODELS}
    labels = read_labels(ev.labels) if accs["float"].needs_labels else None
    data = CalibrationData(input_specs(cfg, model), _configs(ev))
    n = 0
    try:
        for i, feeds in enumerate(data):
            ref = sessions["float"].run(feeds)[output]
            label = labels[i] if labels is not None else None
            for k in MODELS:
                got = ref if k == "float" else sessions[k].run(feeds)[output]
                try:
                    accs[k].add(got, label, ref)
                except ValueError as exc:
                    raise PulsarError(f"evaluation: sample {i}: {exc}; check evaluation.labels") from None
            n += 1
    finally:
        data.close()
    values = {k: accs[k].value() for k in MODELS}
    for k, v in values.items():
        if not np.isfinite(v):
            raise PulsarError(f"evaluation: the {ev.metric} of the {k} model is {v} (its output {output!r} holds "
                              "NaN or inf on some sample); check the evaluation data, or use a plugin metric")
    return values, n
