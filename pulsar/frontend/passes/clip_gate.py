"""Read a Clip / HardSigmoid node as ``clip(a * x + b, lo, hi)`` for the HardSwish / HardSigmoid fusions.

Paddle and TF spell hard activations with Relu6 (a Clip with bounds as inputs, or as attributes in
old opsets) around ``x + 3``; a HardSigmoid is the same shape with its own alpha / beta. One affine
description lets both fusions compare whatever form they meet against the target formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from pulsar.frontend.graph import attr
from pulsar.frontend.passes.pattern import SCALE_RTOL, FusionContext, close
from pulsar.frontend.passes.poly import Expr, PolyReader, affine, single_variable

_FLT_MAX = 3.4028234663852886e38


@dataclass
class Gate:
    """``node(x) == clip(a * x + b, lo, hi)``; ``inner`` holds the arithmetic before the node."""

    node: onnx.NodeProto
    x: str
    a: float
    b: float
    lo: float
    hi: float
    inner: Expr


def _clip_bounds(ctx: FusionContext, node: onnx.NodeProto) -> tuple[float, float] | None:
    if attr(node, "min") is not None or attr(node, "max") is not None:  # opset < 11
        return float(attr(node, "min", -_FLT_MAX)), float(attr(node, "max", _FLT_MAX))
    bounds = []
    for index, default in ((1, -math.inf), (2, math.inf)):
        name = node.input[index] if len(node.input) > index else ""
        value = ctx.scalar(name) if name else default
        if value is None:
            return None
        bounds.append(value)
    return bounds[0], bounds[1]


def read_gate(ctx: FusionContext, node: onnx.NodeProto) -> Gate | None:
    """The gate a Clip / HardSigmoid computes from a float32 tensor ``x``, or None."""
    inner = PolyReader(ctx).read(node.input[0], top=False)
    x = single_variable(inner)
    line = affine(inner, x) if x is not None else None
    if line is None or x is None or not ctx.is_float32(x):
        return None
    a, b = line
    if node.op_type == "Clip":
        bounds = _clip_bounds(ctx, node)
        if bounds is None:
            return None
        return Gate(node, x, a, b, bounds[0], bounds[1], inner)
    if node.op_type == "HardSigmoid":
        alpha, beta = float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))
        return Gate(node, x, alpha * a, alpha * b + beta, 0.0, 1.0, inner)
    return None


def unit_range(scale: float, gate: Gate) -> bool:
    """``scale * gate`` saturates at 0 and 1, as HardSigmoid does."""
    return scale > 0 and abs(scale * gate.lo) <= SCALE_RTOL and close(scale * gate.hi, 1.0, SCALE_RTOL)
