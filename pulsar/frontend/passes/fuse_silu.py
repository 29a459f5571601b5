"""SiLU / Swish in its canonical form: ``Mul(x, Sigmoid(x))``.

Opset 17 has no SiLU op. onnxruntime's only match is ``com.microsoft:QuickGelu`` with alpha = 1,
an opaque contrib op the quantizer and the NPU do not know, whereas Sigmoid and Mul are both
quantizable. So this pass does not fuse into one node: it brings every spelling to the canonical
pair that later stages recognise:

* Paddle's ``x * Sigmoid(x * 1.0)`` (swish with beta = 1): the multiply by one goes;
* ``x / (1 + Exp(-x))`` and ``x * Reciprocal(1 + Exp(-x))``: become ``x * Sigmoid(x)``.

A beta other than one is a different function and is left alone.
"""

from __future__ import annotations

import onnx
from onnx import helper

from pulsar.frontend.passes.pattern import SCALE_RTOL, FusionContext, run_fusion
from pulsar.frontend.passes.poly import PolyReader, consts_fit, forward_match, matches, single_variable, var
from pulsar.frontend.passes.registry import register_pass


def _reads(node: onnx.NodeProto, names: set[str]) -> bool:
    return node.op_type == "Mul" and set(node.input) == names


def _scaled_sigmoid(ctx: FusionContext, node: onnx.NodeProto) -> bool:
    """``Mul(x, Sigmoid(1.0 * x))`` -> ``Mul(x, Sigmoid(x))``."""
    inner = PolyReader(ctx).read(node.input[0], top=False)
    x = single_variable(inner)
    if (
        x is None
        or not inner.nodes
        or not ctx.is_float32(x)
        or not matches(inner.poly, {var(x): 1.0}, SCALE_RTOL)
    ):
        return False
    s = node.output[0]
    mul = ctx.sole_reader(s, "Mul")
    if mul is None or not _reads(mul, {x, s}) or not consts_fit(ctx, inner, x):
        return False
    remove = [*inner.nodes, node]
    sigmoid = helper.make_node("Sigmoid", [x], [s], name=ctx.node_name(remove, "Sigmoid"))
    return ctx.fuse(remove, [sigmoid])


def _exp_form(ctx: FusionContext, node: onnx.NodeProto) -> bool:
    """``x / (1 + Exp(-x))`` or ``x * Reciprocal(1 + Exp(-x))`` -> ``Mul(x, Sigmoid(x))``."""
    inner = PolyReader(ctx).read(node.input[0], top=False)
    x = single_variable(inner)
    e = node.output[0]
    if x is None or not ctx.is_float32(x) or not matches(inner.poly, {var(x): -1.0}, SCALE_RTOL):
        return False
    found = forward_match(ctx, e, {x, e}, lambda ex: matches(ex.poly, {(): 1.0, var(e): 1.0}, SCALE_RTOL))
    if found is None or found[1] is None:
        return False
    denominator, add = found
    d = add.output[0]
    final = ctx.sole_reader(d, "Div", "Reciprocal")
    if final is None:
        return False
    chain = [final]
    if not (final.op_type == "Div" and list(final.input) == [x, d]):  # else: 1 / d, then times x
        one_over = final.op_type == "Reciprocal" or (
            final.input[1] == d and ctx.scalar(final.input[0]) == 1.0
        )
        r = final.output[0]
        mul = ctx.sole_reader(r, "Mul") if one_over else None
        if mul is None or not _reads(mul, {x, r}):
            return False
        final = mul
        chain.append(mul)
    if not (consts_fit(ctx, inner, x) and consts_fit(ctx, denominator, x)):
        return False
    remove = [*inner.nodes, node, *denominator.nodes, *chain]
    s = ctx.tensor_name(f"{x}_sigmoid")
    new = [
        helper.make_node("Sigmoid", [x], [s], name=ctx.node_name(remove, "Sigmoid")),
        helper.make_node("Mul", [x, s], [final.output[0]], name=ctx.node_name(remove, "Mul")),
    ]
    return ctx.fuse(remove, new)


_FORMS = {"Sigmoid": _scaled_sigmoid, "Exp": _exp_form}


@register_pass("fuse_silu")
def fuse_silu(model: onnx.ModelProto) -> bool:
    return run_fusion(model, _FORMS, lambda ctx, node: _FORMS[node.op_type](ctx, node), "SiLU")
