"""An op of an FP16 / BF16 layer -> the same standard op on tensors of that format in the NPU program.

The op keeps its ONNX type and attributes; its tensors are float16 / bfloat16 (the simulator's float
kernels compute in float32 and round each output once, docs/integer_semantics.md "Float layers").
At the layer's border the integer grids are converted: ``Dequantize`` (integers -> the format) for an
input on an integer grid, ``Quantize`` (the format -> integers, round half to even, saturate) for an
output an integer op reads. Constants are stored in the format.
"""

from __future__ import annotations

import numpy as np

from pulsar.compiler.lower.qdq_graph import QParams
from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported
from pulsar.core.float_ops import FLOAT_FORMATS, FLOAT_OPS, FORMAT_OF_ELEM

_FLOAT_CONST_TYPES = (np.float16, np.float32, np.float64)


def lower_float(ctx: LowerCtx, elem: int) -> None:
    """Emit the op in float format ``elem`` with its border conversions."""
    fmt = FORMAT_OF_ELEM[elem]
    np_type = FLOAT_FORMATS[fmt][1]
    if ctx.op not in FLOAT_OPS or ctx.node.domain not in ("", "ai.onnx"):
        raise Unsupported(f"{ctx.op} has no {fmt} kernel on the NPU")
    inputs: list[str] = []
    for i, op in enumerate(ctx.inputs):
        if op.kind == "absent":
            inputs.append("")
        elif op.kind == "act":
            assert op.q is not None
            inputs.append(op.q.name if op.q.is_float else _dequantize(ctx, op.q, i, elem))
        elif op.kind == "qconst":
            assert op.q is not None and op.value is not None
            if op.q.is_float:
                inputs.append(ctx.use_init(op.q.name))
            else:  # an integer constant read by a float layer: its real value, in the format
                inputs.append(ctx.add_init(f"c{i}", op.q.dequantize(op.value).astype(np.float32).astype(np_type)))
        elif op.kind == "const":
            value = np.asarray(op.value)
            if value.dtype.type in _FLOAT_CONST_TYPES:
                inputs.append(ctx.add_init(f"c{i}", value.astype(np.float32).astype(np_type)))
            else:  # shapes, axes, indices: as they are
                inputs.append(ctx.use_init(op.name))
        else:
            raise Unsupported(f"{ctx.op} input '{op.name}' is not on the NPU")
    outputs: list[str] = []
    converts: list[tuple[str, QParams, int]] = []
    for k, q in enumerate(ctx.outputs):
        if q.is_float:
            if q.elem_type != elem:
                raise Unsupported(f"{ctx.op} mixes float formats ({fmt} and {FORMAT_OF_ELEM[q.elem_type]})")
            outputs.append(q.name)
        else:
            tmp = ctx.declare(f"{ctx.name}/out{k}", elem, ctx.out_shape(k))
            outputs.append(tmp)
            converts.append((tmp, q, k))
    attrs = {a.name: a for a in ctx.node.attribute}
    node = ctx.emit(ctx.op, inputs, outputs, domain="")
    node.attribute.extend(attrs.values())
    for tmp, q, k in converts:
        lo, hi = ctx.clamps[k]
        ctx.emit("Quantize", [tmp], [q.name], suffix=f"quantize{k}", scale=float(np.float32(q.s)), out_zp=q.zp,
                 out_min=int(lo), out_max=int(hi), to=q.elem_type)


def _dequantize(ctx: LowerCtx, q: QParams, i: int, elem: int) -> str:
    if not q.per_tensor:
        raise Unsupported(f"{ctx.op} input '{q.name}' is quantized per channel")
    shape = ctx.in_shape(i)
    out = ctx.declare(f"{ctx.name}/in{i}", elem, shape)
    ctx.emit("Dequantize", [q.name], [out], suffix=f"dequantize{i}", x_zp=q.zp, scale=float(np.float32(q.s)),
             to=elem)
    return out
