"""Run models in onnxruntime and compare their outputs.

Used by the transformation check (every pass is verified against the graph before it) and by the
``onnx_opt.model_check`` table. Sessions run with ORT's graph optimizations off so that ORT's own
fusions cannot hide (or cause) a difference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from pulsar.core.plugin_session import inference_session
from pulsar.errors import PulsarError
from pulsar.frontend.graph import graph_input_names

log = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]


def session(model: onnx.ModelProto, *, optimize: bool = False) -> ort.InferenceSession:
    """A CPU session on an in-memory model, graph optimizations off unless asked for (operator-plugin
    nodes run their forward: :func:`pulsar.core.plugin_session.inference_session`)."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    sess: ort.InferenceSession = inference_session(model, options, ["CPUExecutionProvider"], lift_weights=True)
    return sess


def random_samples(model: onnx.ModelProto, count: int = 2, seed: int = 0) -> list[Sample]:
    """Seeded random inputs matching the graph inputs' shapes and dtypes.

    Unknown dims become 1 (first axis) or 32 (others) so that a model with a dynamic batch still
    runs; models whose inputs are fully static (after ``input_shapes``) get exactly their shapes.
    """
    rng = np.random.default_rng(seed)
    by_name = {i.name: i for i in model.graph.input}
    specs = []
    for name in graph_input_names(model.graph):
        ttype = by_name[name].type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(ttype.elem_type or onnx.TensorProto.FLOAT)
        dims = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (1 if axis == 0 else 32)
            for axis, d in enumerate(ttype.shape.dim)
        ]
        specs.append((name, dtype, dims))
    samples = []
    for _ in range(count):
        sample: Sample = {}
        for name, dtype, dims in specs:
            if np.issubdtype(dtype, np.floating):
                sample[name] = rng.standard_normal(dims).astype(dtype)
            elif dtype == np.object_:  # string tensors
                sample[name] = rng.integers(0, 4, dims).astype(str).astype(object)
            elif dtype == np.bool_:
                sample[name] = rng.integers(0, 2, dims).astype(np.bool_)
            else:
                sample[name] = rng.integers(0, 4, dims).astype(dtype)
        samples.append(sample)
    return samples


def run(model: onnx.ModelProto, samples: Sequence[Sample]) -> list[dict[str, np.ndarray]]:
    """Outputs of ``model`` for every sample, by output name."""
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    input_names = {i.name for i in sess.get_inputs()}
    results = []
    for sample in samples:
        feed = {k: v for k, v in sample.items() if k in input_names}
        results.append(dict(zip(names, sess.run(names, feed), strict=True)))
    return results


def diff_stats(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(max |a-b|, that over max(max|a|, 1e-6), cosine similarity); NaNs in the same places match."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        return float("inf"), float("inf"), float("nan")
    if a.size == 0:
        return 0.0, 0.0, 1.0
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):  # strings: equal or not
        same = bool(np.array_equal(a, b))
        return (0.0, 0.0, 1.0) if same else (float("inf"), float("inf"), 0.0)
    a64 = a.astype(np.float64).ravel()
    b64 = b.astype(np.float64).ravel()
    both_nan = np.isnan(a64) & np.isnan(b64)
    a64, b64 = np.where(both_nan, 0.0, a64), np.where(both_nan, 0.0, b64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a64 - b64)
        same_inf = np.isinf(a64) & (a64 == b64)
        diff = np.where(same_inf, 0.0, diff)
        max_abs = float(np.nanmax(diff)) if not np.isnan(diff).any() else float("inf")
        finite_a = a64[np.isfinite(a64)]
        scale = max(float(np.abs(finite_a).max()) if finite_a.size else 0.0, 1e-6)
        denom = float(np.linalg.norm(a64) * np.linalg.norm(b64))
        if max_abs == 0.0:
            cosine = 1.0  # identical: exact, not 1 - rounding
        else:
            cosine = float(np.clip(np.dot(a64, b64) / denom, -1.0, 1.0)) if denom else 0.0
    return max_abs, max_abs / scale, cosine


def compare_outputs(ref: Sequence[dict[str, np.ndarray]], new: Sequence[dict[str, np.ndarray]]) -> list[dict]:
    """Per output of ``ref``: worst max-abs / relative difference and cosine over all samples."""
    rows = []
    for name in ref[0]:
        worst = {"output": name, "max_abs_diff": 0.0, "rel_diff": 0.0, "cosine": 1.0}
        for r, n in zip(ref, new, strict=True):
            if name not in n:
                worst.update(max_abs_diff=float("inf"), rel_diff=float("inf"), cosine=float("nan"))
                break
            max_abs, rel, cos = diff_stats(r[name], n[name])
            worst["max_abs_diff"] = max(worst["max_abs_diff"], max_abs)
            worst["rel_diff"] = max(worst["rel_diff"], rel)
            worst["cosine"] = cos if np.isnan(cos) else min(worst["cosine"], cos)
        rows.append(worst)
    return rows


def compare_models(
    a: onnx.ModelProto, b: onnx.ModelProto, samples: Sequence[Sample] | None = None
) -> list[dict]:
    """Run both models on ``samples`` (random when None) and compare every graph output of ``a``.

    Returns ``{"output", "max_abs_diff", "rel_diff", "cosine"}`` per output, worst case over samples.
    """
    samples = list(samples) if samples is not None else random_samples(a)
    try:
        ref = run(a, samples)
    except Exception as exc:
        raise PulsarError(f"onnxruntime cannot run the reference model: {exc}".splitlines()[0]) from exc
    try:
        new = run(b, samples)
    except Exception as exc:
        raise PulsarError(f"onnxruntime cannot run the compared model: {exc}".splitlines()[0]) from exc
    return compare_outputs(ref, new)
