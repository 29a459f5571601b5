"""``Exp(x - ReduceMax(x)) / ReduceSum(Exp(...))`` over one axis -> ``Softmax(axis)``.

TF and hand-written attention export softmax as five primitives; as one Softmax the quantizer and
the NPU's table-based kernel treat it as a unit. The form without the max subtraction is fused too:
Softmax is shift-invariant, and the fused op is the more stable of the two.
"""

from __future__ import annotations

import onnx
from onnx import helper

from pulsar.frontend.graph import DEFAULT_DOMAINS
from pulsar.frontend.passes.pattern import FusionContext, opset, run_fusion
from pulsar.frontend.passes.registry import register_pass


def _axis(ctx: FusionContext, node: onnx.NodeProto, x: str) -> int | None:
    """The single axis a keepdims Reduce* node reduces, normalized when the rank is known."""
    found = ctx.reduce_axes(node)
    rank = ctx.rank(x)
    if found is None or not found[1]:
        return None
    axes = found[0]
    if axes is None:
        return 0 if rank == 1 else None
    if len(axes) != 1:
        return None
    axis = axes[0]
    if rank is None:
        return axis
    return axis % rank if -rank <= axis < rank else None


def _normalizer(ctx: FusionContext, e: str, total: str) -> list[onnx.NodeProto] | None:
    """``e / total`` or ``e * Reciprocal(total)``: the nodes from ``total`` to the result."""
    node = ctx.sole_reader(total, "Div", "Reciprocal")
    if node is None:
        return None
    if node.op_type == "Div":
        return [node] if list(node.input) == [e, total] else None
    mul = ctx.sole_reader(node.output[0], "Mul")
    if mul is None or set(mul.input) != {e, node.output[0]}:
        return None
    return [node, mul]


def _match(ctx: FusionContext, exp: onnx.NodeProto) -> bool:
    e, x = exp.output[0], exp.input[0]
    front: list[onnx.NodeProto] = []
    max_axis = None
    sub = ctx.node(x, "Sub") if ctx.private(x) else None
    top = ctx.node(sub.input[1], "ReduceMax") if sub is not None else None
    if sub is not None and top is not None and top.input[0] == sub.input[0] and ctx.private(top.output[0]):
        x = sub.input[0]
        max_axis = _axis(ctx, top, x)
        if max_axis is None:
            return False
        front = [top, sub]
    readers = ctx.readers.get(e, [])
    if e in ctx.outputs or len(readers) != 2 or not ctx.is_float32(x):
        return False
    total_node = next((r for r in readers if r.op_type == "ReduceSum" and r.domain in DEFAULT_DOMAINS), None)
    if total_node is None or total_node.input[0] != e:
        return False
    axis = _axis(ctx, total_node, x)
    if axis is None or (front and axis != max_axis):
        return False
    back = _normalizer(ctx, e, total_node.output[0])
    if back is None or not ctx.only_read_by(e, [total_node, back[-1]]):
        return False
    remove = [*front, exp, total_node, *back]
    fused = helper.make_node(
        "Softmax", [x], [back[-1].output[0]], name=ctx.node_name(remove, "Softmax"), axis=axis
    )
    return ctx.fuse(remove, [fused])


@register_pass("fuse_softmax")
def fuse_softmax(model: onnx.ModelProto) -> bool:
    if opset(model) < 13:  # Softmax flattens to 2-D before opset 13
        return False
    return run_fusion(model, ("Exp",), _match, "Softmax")
