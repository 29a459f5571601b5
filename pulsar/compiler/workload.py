"""What each op of an integer body does, independent of the target: the input of the cost model.

A ``Workload`` counts MACs, elementwise (vector) operations, activation bytes read, weight bytes,
bytes written and the operand width of one op, from its attributes and the body's ``value_info``
shapes. A rule registered per op type (``@cost_rule``) supplies the arithmetic; ops without a rule
count one vector op per output element, with a note. pulsar/compiler/cost.py turns workloads into
cycles on a target profile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import helper


@dataclass(frozen=True)
class Workload:
    """What one op does, independent of the target. ``unit``: mac / vector / dma / none (a view)."""

    name: str
    op_type: str
    macs: int = 0
    elementwise_ops: int = 0
    bytes_read: int = 0
    weight_bytes: int = 0
    bytes_written: int = 0
    operand_bits: int = 8
    unit: str = "vector"
    note: str = ""
    float_format: str = ""   # FP16 / BF16: an op of a float layer (its MACs at that format's rate)



# --------------------------------------------------------------------------- tensor facts


_PACKED = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


class Tensors:
    """Shapes, element types and weight-ness of a body's tensors; records what it could not know."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.shape: dict[str, tuple[int, ...]] = {}
        self.elem: dict[str, int] = {}
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            tt = vi.type.tensor_type
            if tt.elem_type:
                self.elem[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                self.shape[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        self.weights = set()
        consts = [(t.name, t) for t in graph.initializer]
        consts += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value"]
        for name, tensor in consts:
            self.weights.add(name)
            self.shape[name] = tuple(tensor.dims)
            self.elem[name] = tensor.data_type
        self.graph_inputs = {i.name for i in graph.input} - self.weights
        self.graph_outputs = {o.name for o in graph.output}
        self.unknown: set[str] = set()

    def dims(self, name: str) -> tuple[int, ...]:
        shape = self.shape.get(name)
        if shape is None or any(d < 0 for d in shape):
            self.unknown.add(name)
            return tuple(max(d, 1) for d in shape or ())
        return shape

    def numel(self, name: str) -> int:
        return math.prod(self.dims(name))

    def itemsize(self, name: str) -> int:
        elem = self.elem.get(name)
        if not elem:
            self.unknown.add(name)
            return 1
        return helper.tensor_dtype_to_np_dtype(elem).itemsize

    def nbytes(self, name: str) -> int:
        if self.elem.get(name) in _PACKED:  # 4-bit weights: two per byte, in the file and in DDR
            return (self.numel(name) + 1) // 2
        return self.numel(name) * self.itemsize(name)

    def bits(self, name: str) -> int:
        return 4 if self.elem.get(name) in _PACKED else 8 * self.itemsize(name)

    def activations(self, node: onnx.NodeProto) -> list[str]:
        return [i for i in node.input if i and i not in self.weights]


# --------------------------------------------------------------------------- workload rules

Rule = Callable[[onnx.NodeProto, Tensors], dict[str, Any]]
# body op type -> its rule: one per op the simulator has a kernel for (tests/compiler/test_int_ops.py)
COST_RULES: dict[str, Rule] = {}


def cost_rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Register the workload rule of ``op_types``; it returns Workload fields other than bytes."""

    def register(fn: Rule) -> Rule:
        for op in op_types:
            if op in COST_RULES:
                raise ValueError(f"cost rule {op!r} registered twice")
            COST_RULES[op] = fn
        return fn

    return register


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _out_elems(node: onnx.NodeProto, t: Tensors) -> int:
    return sum(t.numel(o) for o in node.output if o)


def _act_bits(node: onnx.NodeProto, t: Tensors) -> int:
    return max([t.bits(i) for i in t.activations(node)] or [8])


@cost_rule("QConv")
def _conv(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    # w: [Cout, Cin/group, k...]; every output element sums Cin/group * prod(k) products.
    w = t.dims(node.input[1])
    return {"macs": t.numel(node.output[0]) * math.prod(w[1:]), "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


@cost_rule("QConvTranspose")
def _conv_transpose(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    # w: [Cin, Cout/group, k...]; every input element scatters into Cout/group * prod(k) outputs.
    w = t.dims(node.input[1])
    return {"macs": t.numel(node.input[0]) * math.prod(w[1:]), "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


@cost_rule("QMatMul")
def _matmul(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    a = t.dims(node.input[0])
    k = a[-1] if a else 1
    return {"macs": t.numel(node.output[0]) * k, "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


def _per_output(ops_per_element: int) -> Rule:
    def rule(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
        return {"elementwise_ops": ops_per_element * _out_elems(node, t)}

    return rule


# zero-point subtraction, multiply(s), add, rounding shift, clamp, in vector-unit operations
cost_rule("QAdd")(_per_output(4))
cost_rule("QMul")(_per_output(4))
cost_rule("Requantize")(_per_output(3))


@cost_rule("QLut")
def _lut(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    per = 2 if not _attr(node, "step_bits", 0) else 5  # interpolation: 2 loads, sub, mul, shift
    return {"elementwise_ops": per * _out_elems(node, t)}


@cost_rule("QAvgPool")
def _avgpool(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    window = math.prod(_attr(node, "kernel_shape", [1]))
    return {"elementwise_ops": t.numel(node.output[0]) * (window + 3)}


@cost_rule("QReduceMean")
def _reduce_mean(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.input[0]) + 3 * t.numel(node.output[0])}


@cost_rule("QSoftmax")
def _softmax(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": 6 * t.numel(node.input[0])}  # max, sub, lookup, sum, mul, divide


@cost_rule("QLayerNorm")
def _layernorm(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    x = t.dims(node.input[0])
    rows = math.prod(x[:-1]) if x else 1
    # centre, square, sum, divide, scale, shift, add, clamp per element; ~32 steps of isqrt per row
    return {"elementwise_ops": 10 * t.numel(node.input[0]) + 32 * rows}


@cost_rule("MaxPool")
def _maxpool(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.output[0]) * math.prod(_attr(node, "kernel_shape", [1]))}


@cost_rule("GlobalMaxPool", "ReduceMax")
def _reduce_max(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.input[0])}


@cost_rule("Transpose", "Concat", "Slice", "Split", "Pad", "Resize", "Gather", "DepthToSpace",
           "SpaceToDepth", "Expand", "Tile")
def _copy(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    bits = max([t.bits(o) for o in node.output if o] or [8])
    return {"elementwise_ops": _out_elems(node, t), "unit": "dma", "operand_bits": bits}


@cost_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Constant")
def _view(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"unit": "none"}


# ops of FP16 / BF16 layers (pulsar/core/float_ops.py) and their border conversions
@cost_rule("MatMul", "Gemm")
def _float_matmul(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    a = t.dims(node.input[0])
    k = (a[-2] if _attr(node, "transA", 0) else a[-1]) if a else 1
    return {"macs": t.numel(node.output[0]) * k, "unit": "mac", "operand_bits": 16}


cost_rule("Add", "Sub", "Mul", "Div", "Relu", "Neg", "Abs")(_per_output(1))
cost_rule("Exp", "Sqrt", "Tanh", "Sigmoid", "Erf", "Pow")(_per_output(4))  # a polynomial / a few iterations each
cost_rule("Gelu")(_per_output(6))
cost_rule("Dequantize", "Quantize")(_per_output(3))


@cost_rule("Softmax")
def _float_softmax(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": 8 * t.numel(node.input[0])}  # max, sub, exp (~4), sum, divide


@cost_rule("LayerNormalization")
def _float_layernorm(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": 8 * t.numel(node.input[0])}  # mean, centre, square, mean, rsqrt, scale, shift


@cost_rule("ReduceMean")
def _float_reduce_mean(node: onnx.NodeProto, t: Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.input[0]) + t.numel(node.output[0])}


_FLOAT_ELEMS = {onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16"}


def _float_format(node: onnx.NodeProto, t: Tensors) -> str:
    """FP16 / BF16 when the node computes in a float format (any float16 / bfloat16 operand)."""
    for name in [*node.input, *node.output]:
        fmt = _FLOAT_ELEMS.get(t.elem.get(name, 0)) if name else None
        if fmt:
            return fmt
    return ""


def op_workload(node: onnx.NodeProto, t: Tensors) -> Workload:
    """The workload of one node (``t``: the facts of its graph)."""
    rule = COST_RULES.get(node.op_type)
    notes = []
    if rule is None:
        part: dict[str, Any] = {"elementwise_ops": _out_elems(node, t)}
        notes.append(f"no cost rule for {node.domain or 'ai.onnx'}:{node.op_type}, estimated as one vector op "
                     "per output element")
    else:
        part = rule(node, t)
    part.setdefault("operand_bits", _act_bits(node, t))
    part.setdefault("float_format", _float_format(node, t))
    if part.get("unit") == "none":
        read = weights = written = 0
    else:
        read = sum(t.nbytes(i) for i in t.activations(node))
        weights = sum(t.nbytes(i) for i in node.input if i and i in t.weights)
        written = sum(t.nbytes(o) for o in node.output if o)
    missing = sorted(n for n in [*node.input, *node.output] if n in t.unknown)
    if missing:
        notes.append(f"shape / type of {', '.join(missing)} unknown (no value_info); counted as 1 element")
    name = node.name or f"{node.op_type}:{node.output[0] if node.output else '?'}"
    return Workload(name=name, op_type=node.op_type, bytes_read=read, weight_bytes=weights,
                    bytes_written=written, note="; ".join(notes), **part)


def workloads(graph: onnx.GraphProto) -> list[Workload]:
    """The workload of every node of ``graph``, in node order."""
    t = Tensors(graph)
    return [op_workload(node, t) for node in graph.node]
