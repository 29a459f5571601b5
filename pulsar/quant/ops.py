"""Which ONNX ops the NPU quantizes, and where their weights are.

The role of each op type (active / passive / manual, fused activation, table op, foldable scalar,
mixed-precision candidate) is defined once, for every stage, in :mod:`pulsar.core.opdefs`; this module
adds what only the quantizer needs: which inputs are constant weights (with the output-channel axis
used for per-channel scales), which is a bias (int32, scale = input scale x weight scale) and which
inputs carry tensor data. Ops without a role there (Cast, Where, Shape, ...) run in float on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from pulsar.core import opdefs


@dataclass(frozen=True)
class OpRule:
    # input index -> function(node, weight_rank) -> per-channel axis of that weight
    weights: dict[int, Callable[[onnx.NodeProto, int], int]] = field(default_factory=dict)
    bias: int | None = None          # input index of a bias whose scale is in_scale * w_scale
    bias_of: tuple[int, int] = (0, 1)  # (activation input, weight input) that define the bias scale
    fusable_activation: bool = False  # a following Relu / Clip is fused: only its output is quantized
    passive: bool = False  # moves / selects data only: its outputs share input 0's scale (OVERLAPPED)
    data_inputs: tuple[int, ...] | None = (0,)  # inputs carrying tensor data (None: all); the rest
    # (Resize scales, Clip bounds, PRelu slope ...) stay as they are
    manual: bool = False   # on the NPU only when layer_configs asks (see MANUAL_OPS)
    fused: bool = False    # computed inside the producer's requantization (see FUSED_ACTIVATIONS)
    lut: bool = False      # an active element-wise table op: a chain of them is one table (see UNARY_LUT_OPS)
    scalar_at: tuple[int, ...] = ()  # inputs where a float scalar constant may sit (SCALAR_ARITHMETIC)
    mixed_precision: bool = False    # a candidate of the auto mixed-precision search (it computes)


# What only the quant stage knows about an op type: its weights, bias and data inputs.
_PARTS: dict[str, dict[str, Any]] = {}


def _parts(op_types: str | tuple[str, ...], **parts: Any) -> None:
    for op in (op_types,) if isinstance(op_types, str) else op_types:
        _PARTS[op] = parts


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


_parts("Conv", weights={1: lambda n, r: 0}, bias=2, data_inputs=None)
_parts("ConvTranspose", weights={1: lambda n, r: 1}, bias=2, data_inputs=None)
_parts("Gemm", weights={1: lambda n, r: 0 if _attr(n, "transB", 0) else 1}, bias=2, data_inputs=None)
_parts("MatMul", weights={1: lambda n, r: r - 1}, data_inputs=None)
_parts(("Add", "Mul", "Sub", "Concat"), data_inputs=None)


def _rule(d: opdefs.OpDef) -> OpRule:
    """The quant rule of an op pulsar quantizes: its role from the op registry, its weights from _PARTS."""
    return OpRule(**_PARTS.get(d.op_type, {}), fusable_activation=d.absorbs_activation, passive=d.role == "passive",
                  manual=d.role == "manual", fused=d.fused_activation, lut=d.lut and d.role == "active",
                  scalar_at=d.scalar_at, mixed_precision=d.mixed_precision)


# Everything the quant stage knows about an op type, one entry per op type that has a role in
# pulsar/core/opdefs.py (ops of several domains, such as Gelu, share their op type's entry).
OPS: dict[str, OpRule] = {}
for _d in opdefs.OPDEFS.values():
    if _d.role is not None:
        OPS.setdefault(_d.op_type, _rule(_d))
# The ops whose input 1 is a weight quantized per output channel (Conv, ConvTranspose, Gemm, MatMul).
WEIGHTED_OPS = frozenset(op for op, r in OPS.items() if 1 in r.weights)

# Views of the registry, by the question they answer (pulsar/core/opdefs.py has the same, for every stage)
QUANT_OPS: dict[str, OpRule] = {op: r for op, r in OPS.items() if not r.manual}
MANUAL_OPS: dict[str, OpRule] = {op: r for op, r in OPS.items() if r.manual}
# Activations an NPU computes inside the producing op's requantization step.
FUSED_ACTIVATIONS = frozenset(op for op, r in OPS.items() if r.fused)
# Element-wise functions of one tensor that an NPU evaluates as one lookup table: a chain of them
# (HardSwish -> Mul by a scalar -> Add a scalar, the "learnable affine" blocks of PP-LCNet) is a
# single table, so only the chain's output is quantized, not each link.
UNARY_LUT_OPS = frozenset(op for op, r in OPS.items() if r.lut)
SCALAR_ARITHMETIC = {op: r.scalar_at for op, r in OPS.items() if r.scalar_at}  # op -> where the scalar may be
COMPUTE_OPS = frozenset(op for op, r in OPS.items() if r.mixed_precision)


def scalar_operand_input(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> int | None:
    """For Mul / Add / Sub / Div of a tensor and a float scalar constant: the tensor's input index.

    Such an op is a unary function of its tensor input: the scalar is folded into the requantization
    multiplier or a lookup table, never quantized on its own (an S8 scalar would be off by up to 0.4%)."""
    places = SCALAR_ARITHMETIC.get(node.op_type)
    if places is None or len(node.input) != 2:
        return None
    for k in places:
        c = inits.get(node.input[k])
        other = node.input[1 - k]
        if c is not None and other not in inits and c.data_type == onnx.TensorProto.FLOAT \
                and int(np.prod(c.dims, dtype=np.int64)) == 1:
            return 1 - k
    return None


def is_unary_lut(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """Whether ``node`` is an element-wise function of a single tensor (see UNARY_LUT_OPS)."""
    if node.op_type in UNARY_LUT_OPS:
        return node.op_type != "Clip" or all(i in inits or not i for i in node.input[1:])
    return scalar_operand_input(node, inits) is not None
