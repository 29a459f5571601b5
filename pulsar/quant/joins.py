"""Joins of tensors with unlike ranges: a Concat whose inputs differ by orders of magnitude.

A Concat's output has one scale. A detector head that concatenates pixel box coordinates (0-640)
with class scores (0-1) gets an 8-bit step of 2.5 for both: every score rounds to 0 or 2.5, the
boxes are fine and the output's cosine still reads 0.999. The calibration statistics show it
before anything is quantized: the output's range against each input's. Where the smallest input
would keep fewer than :data:`MIN_LEVELS` of the output grid's levels, the Concat (and so its inputs,
which a 16-bit reader widens) moves to 16 bits; where even 16 bits leave it fewer, the Concat stays
in float on the CPU. A ``layer_configs`` entry naming the node overrides the preset."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.precision import NodePrecision
from pulsar.quant.scheme import BITS

JOIN_OPS = {"Concat"}
# levels of the output grid an input must keep: fewer and its values are mostly rounding (4 bits)
MIN_LEVELS = 16


@dataclass(frozen=True)
class Join:
    node: str
    output_width: float
    narrowest: str     # the input with the smallest range
    input_width: float

    def levels(self, bits: int) -> float:
        """How many steps of a ``bits`` grid over the output's range the narrowest input spans."""
        return self.input_width / self.output_width * (2**bits - 1) if self.output_width else float(2**bits)


def _width(s: TensorStats | None) -> float | None:
    if s is None or s.count == 0:
        return None
    return max(s.max, 0.0) - min(s.min, 0.0)  # every grid holds zero


def joins(model: onnx.ModelProto, stats: Mapping[str, TensorStats]) -> list[Join]:
    """Every join of the graph with its output's range and its narrowest non-constant input's (inputs
    that are exactly zero throughout carry nothing to lose and are left out)."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type not in JOIN_OPS or not n.output:
            continue
        total = _width(stats.get(n.output[0]))
        widths = [(w, i) for i in n.input if i and i not in inits for w in [_width(stats.get(i))] if w]
        if total and widths:
            w, name = min(widths)
            out.append(Join(n.name, total, name, w))
    return out


def join_presets(model: onnx.ModelProto, stats: Mapping[str, TensorStats],
                 precision: Mapping[str, NodePrecision]) -> dict[str, NodePrecision]:
    """node -> U16 (or FP32) for the joins whose narrowest input would keep fewer than MIN_LEVELS
    levels at the node's precision; nodes a ``layer_configs`` entry chose keep that choice."""
    out: dict[str, NodePrecision] = {}
    for j in joins(model, stats):
        prec = precision.get(j.node, NodePrecision())
        if prec.explicit or prec.data_type == "FP32" or j.levels(BITS[prec.data_type]) >= MIN_LEVELS:
            continue
        ratio = j.output_width / j.input_width
        if BITS[prec.data_type] < 16 and j.levels(16) >= MIN_LEVELS:
            out[j.node] = prec.widened("U16", (
                f"join of unlike ranges: input '{j.narrowest}' spans {j.input_width:.4g}, the output "
                f"{j.output_width:.4g} ({ratio:.0f}x); 16-bit so it keeps {j.levels(16):.0f} levels instead of "
                f"{j.levels(BITS[prec.data_type]):.1f} (a layer_configs entry overrides it)"))
        else:
            out[j.node] = NodePrecision("FP32", why=(
                f"join of unlike ranges: input '{j.narrowest}' spans {j.input_width:.4g}, the output "
                f"{j.output_width:.4g} ({ratio:.0f}x), too far apart even for 16 bits: kept in float "
                "(a layer_configs entry overrides it)"))
    return out
