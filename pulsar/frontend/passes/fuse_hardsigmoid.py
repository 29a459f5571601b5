"""``Clip(a * x + b, 0, 1)`` and ``Relu6(x + 3) / 6`` -> ``HardSigmoid(alpha, beta)``.

Paddle writes hard-sigmoid gates (SE blocks, PP-LCNet) as an affine map into a clipped range; one
HardSigmoid is what the quantizer and the NPU treat as a single activation. A HardSigmoid whose
input is itself an affine map of a private tensor absorbs that map into alpha / beta. A bare
``Clip(x, 0, 1)`` is left alone: a Clip is cheaper and fuses into the producing op on the NPU.
"""

from __future__ import annotations

import onnx
from onnx import helper

from pulsar.frontend.passes.clip_gate import Gate, read_gate, unit_range
from pulsar.frontend.passes.pattern import FusionContext, run_fusion
from pulsar.frontend.passes.poly import Expr, consts_fit, forward_match, var
from pulsar.frontend.passes.registry import register_pass


def _scale(expr: Expr, gate: Gate, g: str) -> float | None:
    """``s`` if ``expr == s * gate`` and ``s * gate`` saturates at 0 and 1."""
    if set(expr.poly) != {var(g)}:
        return None
    s = expr.poly[var(g)]
    return s if unit_range(s, gate) else None


def _match(ctx: FusionContext, node: onnx.NodeProto) -> bool:
    g = node.output[0]
    gate = read_gate(ctx, node)
    if gate is None:
        return False
    # If ``g`` is read elsewhere, only the zero-step candidate (the gate itself) can match.
    found = forward_match(ctx, g, {gate.x, g}, lambda e: _scale(e, gate, g) is not None)
    if found is None:
        return False
    expr, final = found
    if not gate.inner.nodes and final is None:
        return False  # already a plain HardSigmoid / Clip(x, 0, 1)
    if not (consts_fit(ctx, gate.inner, gate.x) and consts_fit(ctx, expr, gate.x)):
        return False
    s = expr.poly[var(g)]
    remove = [*gate.inner.nodes, node, *expr.nodes]
    out = final.output[0] if final is not None else g
    fused = helper.make_node(
        "HardSigmoid",
        [gate.x],
        [out],
        name=ctx.node_name(remove, "HardSigmoid"),
        alpha=float(s * gate.a),
        beta=float(s * gate.b),
    )
    return ctx.fuse(remove, [fused])


@register_pass("fuse_hardsigmoid")
def fuse_hardsigmoid(model: onnx.ModelProto) -> bool:
    return run_fusion(model, ("Clip", "HardSigmoid"), _match, "HardSigmoid")
