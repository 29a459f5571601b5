"""Automatic scale refinement (on unless ``quant.disable_auto_refine_scale``): the input scale of
every weighted layer is tightened to the range that minimises its quantization error.

Why only the inputs of weighted layers (Conv, ConvTranspose, Gemm, MatMul with a constant weight)?
Such a layer sums many products of its input, so what reaches its output is the total error energy
of the input, and the MSE-optimal clipping range (a little clipping of rare extremes for a finer
step on the bulk) is what minimises it. Values that flow on unchanged (residual streams, attention
scores, the inputs of lookup tables and Concat) keep the calibrated range: there a rare large value
is often the signal itself. Measured on the PP-OCRv4 recognizer with MinMax: MSE everywhere loses
exact-match lines, MSE on weighted-layer inputs only gains them; MobileNetV2 gains too.

Depthwise convolutions (8-bit input grids) go one step further: the input takes the tighter of its
MSE-optimal and its Percentile range. A depthwise output channel reads one input channel only, so
its error is that channel's own rounding error relative to its own signal, not an average over
channels; after BatchNorm folding the channels' ranges differ by orders of magnitude, and the MSE
optimum of the pooled histogram is set by the few wide channels, leaving the step coarse for the
many narrow ones. The percentile range follows the bulk of the values instead. This is a rule on
the op, not on the model: measured on the PP-OCRv4 recognizer, MobileNetV2 and the PP-OCR
direction classifier (every one has depthwise convolutions), on two draws of evaluation data each,
it gains exact-match lines and top-1 agreement everywhere (``python -m bench.bench_quant``); the
same tightening on other convolution inputs, on MatMul inputs or with a KL range does not. The
layer's own output error on calibration data (the float layer against the layer fed the quantized
input) was tried as the chooser between MinMax / MSE / Percentile / KL and picked MSE for most
tensors: it does not see this effect, which shows only further down the network.

Refinement only ever shrinks the calibrated range (the result lies inside it), so a method that
already clips (Percentile, KL) is not widened.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import onnx

from pulsar.quant.observers import compute_range
from pulsar.quant.ops import WEIGHTED_OPS
from pulsar.quant.plan import QuantPlan
from pulsar.quant.scheme import BITS, DTYPES

log = logging.getLogger(__name__)


def weighted_layer_inputs(model: onnx.ModelProto, plan: QuantPlan) -> set[str]:
    """Activations (scale owners) read by a weighted layer, directly or through passive ops sharing
    their grid."""
    weights = {w.tensor for w in plan.weights}
    owners: dict[str, set[str]] = defaultdict(set)
    for node in model.graph.node:
        if node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in weights:
            data = node.input[0]
            if data in plan.dtypes:
                owners[plan.dominator(data)].add(node.name)
    return set(owners)


def _is_depthwise(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """A Conv with more than one group and one input channel per group."""
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    weight = inits.get(node.input[1]) if len(node.input) > 1 else None
    return node.op_type == "Conv" and group > 1 and weight is not None and len(weight.dims) > 1 and weight.dims[1] == 1


def depthwise_only_inputs(model: onnx.ModelProto, plan: QuantPlan) -> set[str]:
    """Activations (scale owners) whose every weighted reader is a depthwise convolution."""
    weights = {w.tensor for w in plan.weights}
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[bool]] = defaultdict(list)
    for node in model.graph.node:
        if node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in weights:
            data = node.input[0]
            if data in plan.dtypes:
                readers[plan.dominator(data)].append(_is_depthwise(node, inits))
    return {name for name, depthwise in readers.items() if all(depthwise)}


DEPTHWISE_PERCENTILE = 99.99


def refine_input_ranges(model: onnx.ModelProto, plan: QuantPlan, stats: dict[str, Any],
                        ranges: dict[str, tuple[float, float]]) -> list[str]:
    """Shrink ``ranges`` (in place) of weighted-layer inputs to their MSE-optimal range, and of 8-bit
    depthwise-conv inputs to the tighter of that and their Percentile range; return the tensors whose
    range changed."""
    changed, depthwise_changed = [], 0
    depthwise = depthwise_only_inputs(model, plan)
    for name in sorted(weighted_layer_inputs(model, plan)):
        if name not in ranges or name not in stats:
            continue
        dtype = plan.dtypes[name]
        signed = DTYPES[dtype][2]
        grid = {"num_bits": BITS[dtype], "signed": signed, "symmetric": signed}
        lo, hi = ranges[name]
        lo_m, hi_m = compute_range(stats[name], "MSE", **grid)
        new = (max(lo, lo_m), min(hi, hi_m))
        if name in depthwise and BITS[dtype] <= 8:
            lo_p, hi_p = compute_range(stats[name], "Percentile", percentile=DEPTHWISE_PERCENTILE, **grid)
            tighter = (max(new[0], lo_p), min(new[1], hi_p))
            depthwise_changed += tighter != new
            new = tighter
        if new != (lo, hi):
            ranges[name] = new
            changed.append(name)
    log.info("auto refine scale: %d weighted-layer input ranges tightened to their MSE optimum "
             "(%d depthwise-conv inputs further to their %g percentile)", len(changed), depthwise_changed,
             DEPTHWISE_PERCENTILE)
    return changed
