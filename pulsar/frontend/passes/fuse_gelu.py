"""GELU written out in primitives -> onnxruntime's ``com.microsoft`` Gelu / FastGelu.

Exporters spell GELU as ``x * 0.5 * (1 + Erf(x / sqrt 2))`` (exact) or
``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (tanh approximation) in any ordering of the
multiplies. Five to nine nodes become one, which the quantizer sees as a single activation instead of
a chain of requantized arithmetic. The default domain has Gelu only from opset 20 while pulsar stays
on opset 17, so the contrib ops are emitted: ``Gelu`` is the erf form and ``FastGelu`` (without
bias) computes ``x * (0.5 + 0.5 tanh(x (0.7978845608 + 0.0356774081 x^2)))``, the tanh form.
onnx shape inference does not know that domain, so each new output gets a value_info.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx
from onnx import helper

from pulsar.frontend.passes.pattern import MS_DOMAIN, SCALE_RTOL, FusionContext, ensure_opset, run_fusion
from pulsar.frontend.passes.poly import (
    Poly,
    PolyReader,
    consts_fit,
    forward_match,
    matches,
    mono,
    single_variable,
    var,
)
from pulsar.frontend.passes.registry import register_pass

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # 0.7978845608
CUBIC = 0.044715


def _erf_argument(x: str) -> Poly:
    return {var(x): 1.0 / math.sqrt(2.0)}


def _tanh_argument(x: str) -> Poly:
    return {var(x): SQRT_2_OVER_PI, var(x, 3): SQRT_2_OVER_PI * CUBIC}


# Erf / Tanh node -> (fused op, the polynomial in x its input must be)
_FORMS: dict[str, tuple[str, Callable[[str], Poly]]] = {
    "Erf": ("Gelu", _erf_argument),
    "Tanh": ("FastGelu", _tanh_argument),
}


def _match(ctx: FusionContext, node: onnx.NodeProto) -> bool:
    fused_op, argument = _FORMS[node.op_type]
    t = node.output[0]
    if not ctx.private(t):
        return False
    inner = PolyReader(ctx).read(node.input[0], top=False)
    x = single_variable(inner)
    if x is None or not ctx.is_float32(x) or not matches(inner.poly, argument(x)):
        return False
    outer: Poly = {var(x): 0.5, mono(x, t): 0.5}  # 0.5 x (1 + t)
    found = forward_match(ctx, t, {x, t}, lambda e: matches(e.poly, outer, SCALE_RTOL))
    if found is None or found[1] is None:
        return False
    expr, final = found
    if not (consts_fit(ctx, inner, x) and consts_fit(ctx, expr, x)):
        return False
    remove = [*inner.nodes, node, *expr.nodes]
    out = final.output[0]
    fused = helper.make_node(fused_op, [x], [out], name=ctx.node_name(remove, fused_op), domain=MS_DOMAIN)
    if not ctx.fuse(remove, [fused]):
        return False
    ctx.annotate_like(out, x)
    return True


@register_pass("fuse_gelu")
def fuse_gelu(model: onnx.ModelProto) -> bool:
    if not run_fusion(model, _FORMS, _match, "GELU"):
        return False
    ensure_opset(model, MS_DOMAIN, 1)
    return True
