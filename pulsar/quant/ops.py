"""Which ONNX ops the NPU quantizes, and where their weights are.

A registry instead of if-chains: each quantizable op type says which inputs are constant weights
(with the output-channel axis used for per-channel scales) and which is a bias (int32, scale =
input scale x weight scale). Ops not listed here (Softmax, ReduceMean, Pow, Sqrt, Div, Reshape, ...)
run on float values in this version; the placement work makes that explicit later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx


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
    lut: bool = False      # an element-wise function of one tensor: one lookup table (see UNARY_LUT_OPS)
    scalar_at: tuple[int, ...] = ()  # inputs where a float scalar constant may sit (SCALAR_ARITHMETIC)
    mixed_precision: bool = False    # a candidate of the auto mixed-precision search (it computes)


# Everything the quant stage knows about an op type, one entry per op: adding an op is one call.
OPS: dict[str, OpRule] = {}


def register(op_types: str | tuple[str, ...], rule: OpRule) -> None:
    for op in (op_types,) if isinstance(op_types, str) else op_types:
        OPS[op] = rule


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


_LUT = dict(lut=True)
register("Conv", OpRule(weights={1: lambda n, r: 0}, bias=2, fusable_activation=True, data_inputs=None,
                        mixed_precision=True))
register("ConvTranspose", OpRule(weights={1: lambda n, r: 1}, bias=2, fusable_activation=True, data_inputs=None,
                                 mixed_precision=True))
register("Gemm", OpRule(weights={1: lambda n, r: 0 if _attr(n, "transB", 0) else 1}, bias=2,
                        fusable_activation=True, data_inputs=None, mixed_precision=True))
register("MatMul", OpRule(weights={1: lambda n, r: r - 1}, fusable_activation=True, data_inputs=None,
                          mixed_precision=True))
register(("Add", "Mul"), OpRule(fusable_activation=True, data_inputs=None, scalar_at=(0, 1), mixed_precision=True))
register("Sub", OpRule(fusable_activation=True, data_inputs=None, scalar_at=(1,), mixed_precision=True))
register("Concat", OpRule(data_inputs=None, mixed_precision=True))
register(("Relu", "Clip"), OpRule(fused=True, lut=True))
register(("LeakyRelu", "Elu"), OpRule(lut=True))
register(("Sigmoid", "HardSigmoid", "HardSwish", "Tanh"), OpRule(lut=True, mixed_precision=True))
register("PRelu", OpRule())
register(("AveragePool", "GlobalAveragePool", "Resize"), OpRule(mixed_precision=True))
# Passive ops: no arithmetic, so they need no requantization; they run on the NPU next to quantized
# neighbours and on the CPU next to float ones.
register(("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split", "Pad", "MaxPool",
          "GlobalMaxPool", "DepthToSpace", "SpaceToDepth", "Identity"), OpRule(passive=True))
# Manual ops: the NPU can run them, but at 8 bits they usually cost accuracy (exponentials,
# normalizations, divisions), so they stay on the CPU in float unless a layer_configs entry selects
# them with a quantized data_type. Only the data input and the outputs are quantized then.
register(("Softmax", "LayerNormalization", "Gelu", "FastGelu", "Exp", "Log", "Sqrt", "Reciprocal", "Erf",
          "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "Pow", "InstanceNormalization"), OpRule(manual=True))
register("Div", OpRule(manual=True, scalar_at=(1,)))

# Views of the registry, by the question they answer
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
