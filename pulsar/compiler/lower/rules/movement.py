"""Passive ops (no arithmetic) run as the standard ONNX op on the integer tensor; a Requantize
follows (or, for ops that enlarge the data, precedes) when the output grid is not the input's.
Concat requantizes each mismatched input to the output grid; Pad pads with the zero point."""

from __future__ import annotations

import numpy as np
import onnx

from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported, elem_np, full_range, quantize_real, rule
from pulsar.core.opdefs import enlarging_ops

# ops that produce more data than they read: requantize their (smaller) input instead of the output
_ENLARGING = enlarging_ops()


def _copy(ctx: LowerCtx, inputs: list[str], outputs: list[str], *, suffix: str | None = None) -> None:
    node = onnx.NodeProto()
    node.CopyFrom(ctx.node)
    del node.input[:]
    del node.output[:]
    node.input.extend(inputs)
    node.output.extend(outputs)
    node.name = ctx.name if suffix is None else f"{ctx.name}/{suffix}"
    ctx.nodes.append(node)


def _side_inputs(ctx: LowerCtx, start: int) -> list[str]:
    """Shape-like inputs (Reshape shape, Slice starts, ...): constants kept under their own names."""
    names = []
    for i in range(start, len(ctx.node.input)):
        op = ctx.operand(i)
        if op.kind == "absent":
            names.append("")
        elif op.kind == "const":
            names.append(ctx.use_init(op.name))
        else:
            raise Unsupported(f"{ctx.op} input '{op.name}' is computed at run time; the NPU needs it constant")
    return names


def lower_passive(ctx: LowerCtx, side: list[str] | None = None) -> None:
    """The op on input 0's integers; Requantize where an output grid or clamp differs."""
    xq = ctx.act(0)
    side = _side_inputs(ctx, 1) if side is None else side
    if len([o for o in ctx.node.output if o]) != len(ctx.outputs):
        raise Unsupported(f"{ctx.op} with an unused output")
    exact = [xq.same_grid(q) and ctx.clamps[i] == full_range(q) for i, q in enumerate(ctx.outputs)]
    if all(exact):
        _copy(ctx, [xq.name, *side], [q.name for q in ctx.outputs])
        return
    if ctx.op == "Identity":
        ctx.requantize(xq, ctx.out(), ctx.clamps[0], xq.name, ctx.out().name, None, None)
        return
    if ctx.op in _ENLARGING and len(ctx.outputs) == 1:
        yq = ctx.out()
        pre = f"{ctx.name}/requant_in0"
        ctx.requantize(xq, yq, ctx.clamps[0], xq.name, pre, ctx.in_shape(0), "requant_in0")
        _copy(ctx, [pre, *side], [yq.name])
        return
    outputs = []
    for i, q in enumerate(ctx.outputs):
        outputs.append(q.name if exact[i] else ctx.declare(f"{q.name}/pre", xq.elem_type, ctx.out_shape(i)))
    _copy(ctx, [xq.name, *side], outputs)
    for i, q in enumerate(ctx.outputs):
        if not exact[i]:
            suffix = "requant_out" if len(ctx.outputs) == 1 else f"requant_out{i}"
            ctx.requantize(xq, q, ctx.clamps[i], outputs[i], q.name, None, suffix)


@rule("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split", "DepthToSpace",
      "SpaceToDepth", "Gather", "Identity", "Expand", "Tile")
def lower_movement(ctx: LowerCtx) -> None:
    lower_passive(ctx)


@rule("Resize")
def lower_resize(ctx: LowerCtx) -> None:
    if ctx.attr_str("mode", "nearest") != "nearest":
        raise Unsupported(f"Resize mode {ctx.attr_str('mode', 'nearest')} is not supported by the NPU (nearest only)")
    if ctx.attr_str("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        raise Unsupported("Resize tf_crop_and_resize is not supported by the NPU")
    side = _side_inputs(ctx, 1)
    scales = ctx.const_value(2, "scales") if len(ctx.node.input) > 2 else None
    sizes = ctx.operand(3).kind if len(ctx.node.input) > 3 else "absent"
    if ctx.g.opset >= 13 and scales is not None and np.asarray(scales).size and sizes == "absent":
        # integer sizes instead of float scales when they mean the same grid (exact integer ratios)
        x_shape, y_shape = np.array(ctx.in_shape(0)), np.array(ctx.out_shape())
        if np.array_equal(x_shape * np.asarray(scales, dtype=np.float64), y_shape):
            side = ["", "", ctx.add_init("sizes", y_shape.astype(np.int64))]
    lower_passive(ctx, side)


@rule("Pad")
def lower_pad(ctx: LowerCtx) -> None:
    if ctx.attr_str("mode", "constant") != "constant":
        raise Unsupported(f"Pad mode {ctx.attr_str('mode', 'constant')} is not supported by the NPU (constant only)")
    if ctx.g.opset < 11:
        raise Unsupported("Pad before opset 11 (pads as attributes)")
    xq = ctx.act(0)
    value = ctx.const_value(2, "constant_value") if len(ctx.node.input) > 2 else None
    real = 0.0 if value is None or np.asarray(value).size == 0 else float(np.asarray(value).reshape(-1)[0])
    pad_q = np.array(quantize_real(xq, real), dtype=elem_np(xq.elem_type))
    pads = ctx.operand(1)
    if pads.kind != "const":
        raise Unsupported(f"Pad pads '{pads.name}' are computed at run time; the NPU needs them constant")
    side = [ctx.use_init(pads.name), ctx.add_init("value", pad_q)]
    if len(ctx.node.input) > 3 and ctx.node.input[3]:
        axes = ctx.operand(3)
        if axes.kind != "const":
            raise Unsupported(f"Pad axes '{axes.name}' are computed at run time; the NPU needs them constant")
        side.append(ctx.use_init(axes.name))
    lower_passive(ctx, side)


@rule("Concat")
def lower_concat(ctx: LowerCtx) -> None:
    yq = ctx.out()
    clamp = ctx.clamps[0]
    inputs = []
    for i, name in enumerate(ctx.node.input):
        op = ctx.operand(i)
        if op.is_const:
            values = np.clip(quantize_real(yq, op.real()), clamp[0], clamp[1]).astype(elem_np(yq.elem_type))
            inputs.append(ctx.add_init(f"const_in{i}", values))
            continue
        xq = ctx.act(i)
        if xq.same_grid(yq) and clamp == full_range(yq):
            inputs.append(xq.name)
            continue
        tensor = f"{ctx.name}/requant_in{i}"
        ctx.requantize(xq, yq, clamp, xq.name, tensor, ctx.shape(name), f"requant_in{i}")
        inputs.append(tensor)
    _copy(ctx, inputs, [yq.name])
