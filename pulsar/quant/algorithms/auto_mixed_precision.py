"""Automatic mixed precision: raise the layers that lose the most to 16 bits, within a budget.

Sensitivity comes from the PerLayer precision analysis: the cosine a layer loses on its own (float
inputs, quantized output). Candidates are the quantized compute layers that touch an 8-bit tensor,
most sensitive first;
the search scores the end-to-end output cosine of the QDQ model with the top 1, 2, 4, ... layers
raised (cheap: calibration statistics are reused, only the export and a few runs repeat) and keeps
the smallest set that reaches ``target_cosine``, or the best within ``max_16bit_layers``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx

from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.quant.analysis import analyze
from pulsar.quant.analysis.metrics import Accumulator, slice_aware_cosine
from pulsar.quant.ops import COMPUTE_OPS as _OP_COMPUTE
from pulsar.quant.qdq import output_steps

log = logging.getLogger(__name__)

# ops the search may raise to 16 bits: those that compute (see OpRule.mixed_precision)
COMPUTE_OPS = _OP_COMPUTE


@dataclass
class Trial:
    layers: list[str]
    cosine: float


def end_to_end_cosine(float_model: onnx.ModelProto, qmodel: onnx.ModelProto,
                      samples: list[dict[str, np.ndarray]]) -> float:
    """Mean over outputs of the QDQ model's output cosine with the float model's (mean over samples),
    where an output with a slice that lost most of its signal scores that slice's cosine instead
    (:func:`pulsar.quant.analysis.metrics.slice_aware_cosine`): a detector whose class-score rows are
    flattened must not look 0.999 good because its box rows dominate the tensor."""
    f = inference_session(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    q = inference_session(qmodel.SerializeToString(), reference_session_options(),
                          providers=["CPUExecutionProvider"])
    names = [o.name for o in q.get_outputs()]
    steps = output_steps(qmodel)
    accs = {n: Accumulator() for n in names}
    for s in samples:
        for n, a, b in zip(names, f.run(names, s), q.run(names, s), strict=True):
            accs[n].add(a, b)
    return float(np.mean([slice_aware_cosine(accs[n], steps.get(n)) for n in names])) if names else 1.0


def ranked_layers(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, samples: list[dict[str, np.ndarray]],
                  candidates: set[str], progress: Callable[[int], None] | None = None) -> list[tuple[str, float]]:
    """(layer, cosine lost by that layer on its own) for the candidates, largest loss first.

    The loss is the PerLayer deficit ``1 - cosine``: the layer fed float inputs, its output quantized
    against the float one. The end-to-end drop at a layer looked attractive but is dominated by the
    noise carried in from earlier layers: a quantized network is chaotic enough that on a few samples
    it ranks layers no better than chance (measured on the PP-OCRv4 recognizer: its 8 worst raised
    gave 0.975 exact match, the PerLayer 8 worst 0.995, float level)."""
    rows = analyze(float_model, qmodel, samples, method="PerLayer", progress=progress)
    scored = [(r.node, 1.0 - float(np.nan_to_num(r.cosine, nan=0.0))) for r in rows if r.node in candidates]
    return sorted(scored, key=lambda t: (-t[1], t[0]))


def _sizes(max_layers: int, candidates: int) -> list[int]:
    """Trial sizes 1, 2, 4, ... then the budget (or every candidate)."""
    top = min(max_layers, candidates)
    sizes, k = [], 1
    while k < top:
        sizes.append(k)
        k *= 2
    sizes.append(top)
    return list(dict.fromkeys(s for s in sizes if s > 0))


class _Task(Protocol):
    def __call__(self, done: int) -> None: ...

    def finish(self) -> None: ...


def search(float_model: onnx.ModelProto, export: Callable[[list[str]], onnx.ModelProto],
           samples: list[dict[str, np.ndarray]], candidates: set[str], *, max_layers: int,
           target_cosine: float, new_task: Callable[[str, int | None], _Task] | None = None,
           ) -> tuple[list[str], list[Trial], list[tuple[str, float]]]:
    """Return the layers to raise, every trial scored, and the sensitivity ranking.

    ``new_task(description, total)`` (see :mod:`pulsar.utils.progress`) shows the ranking (per sample)
    and the trials (one tick each, the 8-bit baseline included) as they run."""
    base = export([])
    rank_task = new_task(f"auto mixed precision: ranking layers ({len(samples)} sample{'s' if len(samples) != 1 else ''})", len(samples)) \
        if new_task else None
    ranking = ranked_layers(float_model, base, samples, candidates, progress=rank_task)
    sizes = _sizes(max_layers, len(ranking))
    trial_task = new_task(f"auto mixed precision: trials (up to {len(sizes) + 1})", len(sizes) + 1) \
        if new_task else None
    trials = [Trial([], end_to_end_cosine(float_model, base, samples))]
    if trial_task:
        trial_task(1)
    for k in sizes:
        if target_cosine and trials[-1].cosine >= target_cosine:
            break
        layers = [name for name, _ in ranking[:k]]
        trials.append(Trial(layers, end_to_end_cosine(float_model, export(layers), samples)))
        log.info("auto mixed precision: %d layer(s) at 16 bits -> end-to-end cosine %.6f", k, trials[-1].cosine)
        if trial_task:
            trial_task(len(trials))
    if trial_task:
        trial_task.finish()
    reached = [t for t in trials if target_cosine and t.cosine >= target_cosine]
    best = min(reached, key=lambda t: len(t.layers)) if reached else max(trials, key=lambda t: t.cosine)
    return best.layers, trials, ranking
