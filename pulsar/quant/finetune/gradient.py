"""Which weights of a block a gradient can reach, known from the graph before anything runs.

A block trains only weights whose layer output reaches the block's objective through ops that pass
a gradient. Integer, boolean and index results (comparisons, ArgMax, Shape, a Cast to an integer
type), piecewise-constant ops (Round, Floor, Sign) and nodes that run in onnxruntime (no torch
function) stop it; so do the index / shape inputs of data-movement ops (a Gather's indices, a
Reshape's shape, a Where's condition). A block with no reachable weight stays calibrated; the build
is refused before calibration only when no block of the model can train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from pulsar.core.custom_ops import node_op
from pulsar.quant.finetune.blocks import Block
from pulsar.quant.torch_exec.ops import TORCH_OPS

NO_GRAD_OPS = frozenset({
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "IsNaN", "IsInf",
    "ArgMax", "ArgMin", "Shape", "Size", "NonZero", "Round", "Floor", "Ceil", "Sign", "ConstantOfShape", "Range",
    "OneHot", "EyeLike", "Unique", "NonMaxSuppression", "Hardmax", "BitShift", "BitwiseAnd", "BitwiseOr",
    "BitwiseXor", "BitwiseNot", "BitCast", "QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
    "ConvInteger", "QLinearConv", "QLinearMatMul", "TfIdfVectorizer", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Mod",
})
# op type -> input positions that carry indices, shapes or conditions (no gradient through them)
NO_GRAD_INPUTS: dict[str, frozenset[int]] = {
    "Where": frozenset({0}), "Gather": frozenset({1}), "GatherElements": frozenset({1}),
    "GatherND": frozenset({1}), "ScatterElements": frozenset({1}), "ScatterND": frozenset({1}),
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 3}), "Resize": frozenset({1, 2, 3}), "TopK": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), "Split": frozenset({1}), "CumSum": frozenset({1}), "Compress": frozenset({1}),
    "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}), "ReduceProd": frozenset({1}), "ReduceL2": frozenset({1}),
    "ReduceL1": frozenset({1}), "ReduceSumSquare": frozenset({1}), "ReduceLogSumExp": frozenset({1}),
}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}


def passes_gradient(node: onnx.NodeProto) -> bool:
    """Whether the node's outputs can carry a gradient at all."""
    plugin = node_op(node)
    if plugin is not None:  # an operator plugin's op: gradients only through its torch_forward
        return plugin.torch_forward is not None
    if node.op_type in NO_GRAD_OPS or node.op_type not in TORCH_OPS:
        return False
    if node.op_type in ("Cast", "CastLike"):
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        return node.op_type == "CastLike" or to in _FLOAT_TYPES
    return True


def blocking_op(node: onnx.NodeProto) -> str:
    plugin = node_op(node)
    why = ("operator plugin op without torch_forward" if plugin is not None else
           "runs in onnxruntime" if node.op_type not in TORCH_OPS else "no gradient")
    return f"{node.op_type} ({node.name}: {why})"


@dataclass
class Reach:
    trainable: list[str] = field(default_factory=list)        # weights a gradient reaches
    stopped: list[str] = field(default_factory=list)          # weights it does not
    blocked_by: list[str] = field(default_factory=list)       # the ops that stopped it


def reach(model: onnx.ModelProto, block: Block, targets: list[str], weight_node: dict[str, str]) -> Reach:
    """Trace, inside the block, from each weight's layer to the objective's ``targets``."""
    nodes = [model.graph.node[i] for i in block.nodes]
    by_name = {n.name: n for n in nodes}
    out = Reach()
    want = set(targets)
    for w in block.weights:
        layer = by_name.get(weight_node.get(w, ""))
        if layer is None or not passes_gradient(layer):
            out.stopped.append(w)
            if layer is not None:
                out.blocked_by.append(blocking_op(layer))
            continue
        live = set(layer.output)
        blockers: list[str] = []
        for n in nodes:
            if n is layer:
                continue
            skip = NO_GRAD_INPUTS.get(n.op_type, frozenset())
            if any(t in live for k, t in enumerate(n.input) if k not in skip):
                if passes_gradient(n):
                    live.update(o for o in n.output if o)
                else:
                    blockers.append(blocking_op(n))
        if live & want:
            out.trainable.append(w)
        else:
            out.stopped.append(w)
            out.blocked_by.extend(blockers)
    out.blocked_by = list(dict.fromkeys(out.blocked_by))
    return out
