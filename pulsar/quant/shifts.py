"""Max subtraction over large values: ``x - ReduceMax(x)`` kept in float when ``x`` spans far more than the difference.

Hand-written softmax, log-softmax and log-sum-exp subtract the row maximum before ``Exp``. The
difference is small (a few units) while ``x`` itself may be large (logits of 10^4): quantized over
its own range, ``x`` has a step far wider than the whole difference, and ``x - max(x)`` comes out
as noise. Computing the subtraction and its maximum in float (on the CPU) gives the later ops the
exact difference, quantized over its own narrow range: the treatment attention masks get
(:mod:`pulsar.quant.attention`), decided here from the calibrated ranges because small logits
quantize well and should stay on the NPU.

The same measurement guards attention's ``P x V``: its outputs are weighted averages of the rows of
V, so a V spanning far more than the outputs holds large values the probabilities never pick (masked
positions); its 8-bit step would swallow the values that do count, so that MatMul runs at 16 bits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from pulsar.quant.attention import masked_scores
from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.precision import NodePrecision

SHIFT_OPS = {"ReduceMax", "ReduceMin"}
# |x| against |x - max(x)| at which the 8-bit step of x (|x| / 127 for a signed range) exceeds
# 1/16 of the difference's range: beyond it the subtraction is mostly rounding noise
SHIFT_RATIO = 8.0


@dataclass(frozen=True)
class MaxShift:
    sub: str      # the Sub node
    reduce: str   # the ReduceMax / ReduceMin of the same tensor
    source: str   # x
    output: str   # x - max(x)


def max_shifts(model: onnx.ModelProto) -> list[MaxShift]:
    """Every ``Sub(x, ReduceMax(x))`` (or ReduceMin) in the graph."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out = []
    for n in model.graph.node:
        if n.op_type != "Sub" or len(n.input) < 2:
            continue
        r = producer.get(n.input[1])
        if r is not None and r.op_type in SHIFT_OPS and r.input and r.input[0] == n.input[0]:
            out.append(MaxShift(n.name, r.name, n.input[0], n.output[0]))
    return out


def weighted_sums(model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """(MatMul, values, output) of every ``MatMul(probabilities, values)`` whose first input comes from
    a masked Softmax (possibly through shape ops and a masked fill): attention's P x V over a mask. An
    unmasked diffuse head also has a V wider than its averages (by about sqrt(tokens)); that is no
    reason for 16 bits, so only a Softmax whose input carries a recognised mask counts."""
    masked = {m.path[-1] for m in masked_scores(model) if m.path}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    passes = {"Reshape", "Transpose", "Identity", "Where", "Cast", "Dropout"}
    inits = {t.name for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.input[1] in inits:
            continue
        stack, found = [n.input[0]], False
        seen: set[str] = set()
        while stack and not found and len(seen) < 16:
            p = producer.get(stack.pop())
            if p is None or p.name in seen:
                continue
            seen.add(p.name)
            found = p.op_type == "Softmax" and p.input[0] in masked
            if p.op_type in passes:
                stack.extend(i for i in p.input if i and i not in inits)
        if found:
            out.append((n.name, n.input[1], n.output[0]))
    return out


def _span(s: TensorStats | None) -> float:
    return 0.0 if s is None or s.count == 0 else max(abs(s.min), abs(s.max))


def shift_presets(model: onnx.ModelProto, stats: Mapping[str, TensorStats],
                  precision: Mapping[str, NodePrecision]) -> dict[str, NodePrecision]:
    """node -> FP32 for the max subtractions whose input spans more than ``SHIFT_RATIO`` times their
    difference; nodes a ``layer_configs`` entry chose keep that choice."""
    out: dict[str, NodePrecision] = {}
    for m in max_shifts(model):
        big, small = _span(stats.get(m.source)), _span(stats.get(m.output))
        if big <= SHIFT_RATIO * max(small, 1e-12) or big == 0.0:
            continue
        why = (f"x - max(x) over large values (x spans {big:.4g}, the difference {small:.4g}): computed in float "
               "so the difference keeps its precision (a layer_configs entry overrides it)")
        for name in (m.sub, m.reduce):
            if not precision[name].explicit and precision[name].data_type != "FP32":
                out[name] = NodePrecision("FP32", why=why)
    for node, values, output in weighted_sums(model):
        big, small = _span(stats.get(values)), _span(stats.get(output))
        prec = precision[node]
        if big > SHIFT_RATIO * max(small, 1e-12) and not prec.explicit and prec.data_type in ("U8", "S8"):
            out[node] = prec.widened("U16", (
                f"attention P x V whose values span {big:.4g} while the weighted sums span {small:.4g} (the large "
                "values are masked out): 16-bit so the values that count keep their precision"))
    return out
