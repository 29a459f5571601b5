"""``x * HardSigmoid(x)`` and ``x * Relu6(x + 3) / 6`` -> ``HardSwish``.

MobileNetV3 / PP-LCNet exports (Paddle especially) spell HardSwish as Add, Clip, Mul, Div: four
nodes with three requantization points where the NPU has one activation. Any ordering of the
multiply and the division by 6 (or multiplication by 1/6) is accepted, read as a polynomial.
"""

from __future__ import annotations

import onnx
from onnx import helper

from pulsar.frontend.passes.clip_gate import Gate, read_gate, unit_range
from pulsar.frontend.passes.pattern import SCALE_RTOL, FusionContext, close, opset, run_fusion
from pulsar.frontend.passes.poly import Expr, consts_fit, forward_match, mono
from pulsar.frontend.passes.registry import register_pass


def _is_hardswish(expr: Expr, gate: Gate, g: str) -> bool:
    """``expr == s * x * gate(x)`` with ``s * gate(x) == clip(x / 6 + 0.5, 0, 1)``."""
    term = mono(gate.x, g)
    if set(expr.poly) != {term}:
        return False
    s = expr.poly[term]
    return (
        unit_range(s, gate)
        and close(s * gate.a, 1.0 / 6.0, SCALE_RTOL)
        and close(s * gate.b, 0.5, SCALE_RTOL)
    )


def _match(ctx: FusionContext, node: onnx.NodeProto) -> bool:
    g = node.output[0]
    gate = read_gate(ctx, node)
    if gate is None or not ctx.private(g):
        return False
    found = forward_match(ctx, g, {gate.x, g}, lambda e: _is_hardswish(e, gate, g))
    if found is None or found[1] is None:
        return False
    expr, final = found
    if not (consts_fit(ctx, gate.inner, gate.x) and consts_fit(ctx, expr, gate.x)):
        return False
    remove = [*gate.inner.nodes, node, *expr.nodes]
    fused = helper.make_node(
        "HardSwish", [gate.x], [final.output[0]], name=ctx.node_name(remove, "HardSwish")
    )
    return ctx.fuse(remove, [fused])


@register_pass("fuse_hardswish")
def fuse_hardswish(model: onnx.ModelProto) -> bool:
    if opset(model) < 14:  # no HardSwish before opset 14
        return False
    return run_fusion(model, ("Clip", "HardSigmoid"), _match, "HardSwish")
