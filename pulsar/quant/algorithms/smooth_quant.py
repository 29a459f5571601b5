"""SmoothQuant (Xiao et al. 2022, arXiv 2211.10438): move activation outliers into the weights.

A per-tensor U8 grid wastes most of its levels when a few channels of a linear layer's input are
much larger than the rest. Dividing input channel j by s_j and multiplying row j of the weight by
s_j leaves the float product unchanged while flattening the activation; per-output-channel S8
weights absorb the extra range far better. This runs on the float graph after the frontend and
before calibration, so calibration sees the smoothed tensors.

Layers: MatMul with a constant 2-D weight, Gemm with a constant B, and pointwise (1x1, group 1)
Conv. Every such layer reading the same tensor X (Q / K / V projections) shares one ``s``, built
from the largest weight row over all of them:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha), clipped to [1e-5, 1e5]
    (s_j = 1 for a channel whose activation or weight maximum is 0)

The division by ``s`` is pushed back from X through ops that carry channels unchanged
(Transpose, Identity, Reshape keeping the last dim, Add / Sub of a constant, whose constant is
divided too) into the first op that can take it exactly: LayerNormalization (Scale and B),
Conv / ConvTranspose / Gemm / MatMul with constant weights (their output channels and bias), or a
Mul / Div by a constant. Every tensor on that path must feed nothing else. Where no such op is
found, a Mul by the constant 1/s is inserted in front of the layers. That is exact in float too,
and since pulsar quantizes the Mul like any other op, X itself is still quantized with its
outliers; the layers' own input and their weights are smoothed all the same, which is where the
weight error (multiplied by that input) comes from. On the example torch encoder, where every
layer goes this way, it cut the QDQ output error by 15-18% at threshold 1; ``insert_mul=False``
skips such layers instead.

Which layers are smoothed (``threshold`` = quant.smooth_quant_threshold, 0..1): with m_j the
per-channel max|X_j| over all samples, a layer's ``outlier_ratio`` is max_j m_j / median_j m_j
(>= 1). It is smoothed when ``outlier_ratio >= 1 / threshold``: threshold 0 smooths nothing,
0.2 (the default) needs the largest channel at 5x the median one, 1 smooths every candidate
whose input is not all zero. A larger threshold never smooths fewer layers. Each candidate gets
a :class:`SmoothReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx

from pulsar.errors import PulsarError
from pulsar.frontend.graph import DEFAULT_DOMAINS
from pulsar.quant.algorithms.smooth_quant_rewrite import (
    LINEARS,
    Graph,
    Linear,
    absorb_plan,
    insert_scale_mul,
    scale_weight,
    weight_absmax,
)
from pulsar.quant.calibrate import _make_feed, _session

log = logging.getLogger(__name__)

__all__ = ["SCALE_RANGE", "SmoothReport", "apply_smooth_quant"]

SCALE_RANGE = (1e-5, 1e5)


@dataclass
class SmoothReport:
    layer: str             # the linear node
    op_type: str
    input: str             # the activation X it reads (name in the model given)
    outlier_ratio: float   # max / median of the per-channel max|X|
    smoothed: bool
    max_scale: float       # largest s_j applied (1.0 when not smoothed)
    absorbed_into: str = ""  # node that took the 1/s: a producer or the inserted Mul; "" if none


# ------------------------------------------------------------------------------- statistics
def _channel_absmax(model: onnx.ModelProto, wanted: Iterable[tuple[str, int]],
                    samples: Iterable[dict[str, np.ndarray]]) -> dict[tuple[str, int], np.ndarray]:
    """Running per-channel max|X| (channel = the negative axis) over all samples: one sample alive."""
    g = model.graph
    init_names = {t.name for t in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in init_names}
    dtypes = {n: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for n, i in inputs.items()}
    wanted = list(wanted)
    fetch = list(dict.fromkeys(x for x, _ in wanted if x not in inputs))
    result: dict[tuple[str, int], np.ndarray] = {}

    def update(name: str, arr: np.ndarray) -> None:
        a = np.abs(np.nan_to_num(np.asarray(arr, dtype=np.float64), posinf=0.0, neginf=0.0))
        for x, axis in wanted:
            if x != name or a.ndim < -axis:
                continue
            m = np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1).max(axis=1, initial=0.0)
            prev = result.get((x, axis))
            result[(x, axis)] = m if prev is None or prev.shape != m.shape else np.maximum(prev, m)

    done = 0
    with _session(model, fetch) as session:
        for sample in samples:  # not enumerate(): its reused tuple would keep the last sample alive
            done += 1
            feed = _make_feed(sample, inputs, dtypes, done)
            for name in {x for x, _ in wanted} & feed.keys():
                update(name, feed[name])
            outputs = session.run(fetch, feed) if fetch else []
            del feed, sample
            for k, name in enumerate(fetch):
                update(name, outputs[k])
                outputs[k] = None
            del outputs
    if done == 0:
        raise PulsarError("smooth quant: the calibration data yielded no samples; check "
                          "quant.input_configs[].calibration_dataset and calibration_size")
    return result


def _outlier_ratio(m: np.ndarray) -> float:
    top, median = float(m.max(initial=0.0)), float(np.median(m)) if m.size else 0.0
    if top <= 0.0:
        return 1.0
    return top / median if median > 0.0 else float("inf")


def _scales(act: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = act**alpha / weight ** (1.0 - alpha)
    s = np.where((act > 0) & (weight > 0) & np.isfinite(s), s, 1.0)
    return np.clip(s, *SCALE_RANGE)


# ---------------------------------------------------------------------------------- entry point
def apply_smooth_quant(model: onnx.ModelProto, samples: Iterable[dict[str, np.ndarray]], *,
                       alpha: float = 0.6, threshold: float = 0.2, insert_mul: bool = True
                       ) -> tuple[onnx.ModelProto, list[SmoothReport]]:
    """Smoothed copy of ``model`` (exact in float) and one report per candidate linear layer, in
    graph order.

    ``samples`` (dicts input name -> array, e.g. the calibration data) are streamed once through
    onnxruntime; only per-channel maxima are kept. See the module docstring for the rule.
    """
    if not 0.0 <= alpha <= 1.0:
        raise PulsarError(f"quant.smooth_quant_strength: {alpha} is outside 0..1; use e.g. 0.5")
    if not 0.0 <= threshold <= 1.0:
        raise PulsarError(f"quant.smooth_quant_threshold: {threshold} is outside 0..1; use e.g. 0.2")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gv = Graph(out)
    groups: dict[tuple[str, int], list[Linear]] = {}
    for node in gv.g.node:
        fn = LINEARS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        lin = fn(gv, node) if fn and node.input and node.input[0] not in gv.inits else None
        if lin is not None:
            groups.setdefault((node.input[0], lin.x_axis), []).append(lin)
    if not groups:
        log.info("smooth quant: no MatMul / Gemm / 1x1 Conv with a constant weight; nothing to smooth")
        return out, []
    stats = _channel_absmax(out, groups, samples)
    order = {id(n): k for k, n in enumerate(gv.g.node)}
    reports: list[tuple[int, SmoothReport]] = []
    # Last layers first: a producer that is a smoothed layer itself has then already taken the 1/s
    # of the layers after it when the row maxima of its own weight are read.
    for (x, axis), lins in sorted(groups.items(), key=lambda kv: -order[id(kv[1][0].node)]):
        act = stats.get((x, axis))
        for lin in lins:
            if act is None or act.size != lin.channels:  # e.g. broadcasting MatMul: no channel axis
                reports.append((order[id(lin.node)], _report(lin, x, 1.0, False, 1.0, "")))
        lins = [lin for lin in lins if act is not None and act.size == lin.channels]
        if not lins:
            continue
        ratio = _outlier_ratio(act)
        smooth = threshold > 0.0 and ratio >= 1.0 / threshold and float(act.max()) > 0.0
        target, s = "", np.ones(act.size)
        if smooth:
            s = _scales(act, np.max([weight_absmax(gv, lin) for lin in lins], axis=0), alpha)
            layers = [lin.node for lin in lins]
            plan = absorb_plan(gv, x, axis, s.size, layers)
            if plan is not None:
                edits, target = plan
                for edit in edits:
                    edit(s)
            elif insert_mul:
                target = insert_scale_mul(gv, x, axis, s, layers)
            else:
                smooth, s = False, np.ones_like(s)
            for lin in lins if smooth else []:
                scale_weight(gv, lin, s)
        reports.extend((order[id(lin.node)], _report(lin, x, ratio, smooth, float(s.max()), target))
                       for lin in lins)
    gv.place_pending()
    result = [r for _, r in sorted(reports, key=lambda kr: kr[0])]
    done = [r for r in result if r.smoothed]
    log.info("smooth quant: %d of %d linear layers smoothed (alpha %.2f, outlier ratio >= %s)",
             len(done), len(result), alpha, f"{1 / threshold:.3g}" if threshold > 0 else "inf")
    for r in done:
        log.debug("smooth quant: %s reads %s, outlier ratio %.1f, max s %.3g, 1/s into %s",
                  r.layer, r.input, r.outlier_ratio, r.max_scale, r.absorbed_into)
    return out, result


def _report(lin: Linear, x: str, ratio: float, smoothed: bool, max_scale: float, target: str) -> SmoothReport:
    return SmoothReport(lin.node.name, lin.node.op_type, x, ratio, smoothed, max_scale, target)
