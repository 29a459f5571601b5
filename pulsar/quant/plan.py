"""Decide what gets quantized: activations to calibrate, weights, biases and constant operands."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from pulsar.core.custom_ops import node_op
from pulsar.core.float_ops import FLOAT_FORMATS, FLOAT_OPS, float_format
from pulsar.errors import PulsarError
from pulsar.quant.ops import (
    FUSED_ACTIVATIONS,
    MANUAL_OPS,
    QUANT_OPS,
    OpRule,
    is_unary_lut,
    scalar_operand_input,
)
from pulsar.quant.precision import NodePrecision
from pulsar.quant.scheme import BITS

FLOAT = onnx.TensorProto.FLOAT


@dataclass
class WeightUse:
    node: str
    input_index: int
    tensor: str
    axis: int
    dtype: str = "S8"
    per_tensor: bool = False   # one scale for the tensor (layer_configs weight_granularity per_tensor)
    group: int = 0             # > 0: a scale per group of this many along ``group_axis`` (weight_group_size)
    group_axis: int = 0        # the input (reduction) axis of the weight


@dataclass
class BiasUse:
    node: str
    tensor: str
    activation: str  # input whose scale, times the weight scale, is the bias scale
    weight: str


@dataclass
class QuantPlan:
    activations: list[str] = field(default_factory=list)   # calibrated, U8 per tensor, in graph order
    constants: list[str] = field(default_factory=list)     # constant operands of Add / Mul / Concat ...
    weights: list[WeightUse] = field(default_factory=list)
    biases: list[BiasUse] = field(default_factory=list)
    fused: dict[str, str] = field(default_factory=dict)    # skipped producer output -> fused activation node
    epilogues: dict[str, str] = field(default_factory=dict)  # 16-bit internal output -> first op of its LUT chain
    quantized_nodes: list[str] = field(default_factory=list)
    float_nodes: list[str] = field(default_factory=list)   # ops this version runs in float
    dtypes: dict[str, str] = field(default_factory=dict)   # activation / constant -> U8 | S8 | U16 | S16
    shared: dict[str, str] = field(default_factory=dict)   # passive op output -> tensor whose scale it shares
    placement: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (NPU | CPU, why)
    symmetric: dict[str, bool] = field(default_factory=dict)   # activation -> forced grid shape (activation_symmetric)
    float_constants: dict[str, str] = field(default_factory=dict)  # constant of a float layer -> FP16 | BF16
    format_nodes: dict[str, str] = field(default_factory=dict)     # node of a float layer -> FP16 | BF16
    # the border of a float layer with integer grids: (node, input index, format) of an input it reads
    # from an integer grid, and output tensor -> format of an output it writes to an integer grid
    float_reads: list[tuple[str, int, str]] = field(default_factory=list)
    float_writes: dict[str, str] = field(default_factory=dict)

    def dominator(self, name: str) -> str:
        """The tensor whose scale ``name`` shares (itself when it has its own)."""
        while name in self.shared:
            name = self.shared[name]
        return name


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _rule_for(node: onnx.NodeProto, prec: NodePrecision, plan: QuantPlan,
              inits: dict[str, onnx.TensorProto]) -> tuple[OpRule | None, str]:
    """Active / passive / manual placement (the Horizon classification): the rule to quantize the
    node with, or None to keep it on the CPU in float, and why."""
    if prec.data_type == "FP32":
        return None, prec.why or "layer_configs data_type FP32"
    if float_format(prec.data_type):
        if node.op_type in FLOAT_OPS and node.domain in ("", "ai.onnx"):
            return FLOAT_RULE, f"{prec.data_type} layer (layer_configs): runs on the NPU in {prec.data_type}"
        return None, (f"{node.op_type} has no {prec.data_type} kernel on the NPU: runs in float on the CPU (the "
                      f"NPU runs {', '.join(sorted(FLOAT_OPS))} in {prec.data_type})")
    scalar_in = scalar_operand_input(node, inits)
    if scalar_in is not None:
        return OpRule(data_inputs=(scalar_in,)), "active: arithmetic with a scalar constant (folded into the rescale)"
    rule = QUANT_OPS.get(node.op_type)
    if rule is not None and rule.passive:
        if node.input and float_format(plan.dtypes.get(node.input[0], "")) and node.op_type in FLOAT_OPS:
            fmt = plan.dtypes[node.input[0]]
            return FLOAT_RULE, f"passive: follows its {fmt} input on the NPU"
        if node.input and node.input[0] in plan.dtypes:
            return rule, "passive: follows its quantized input, shares its scale"
        return None, "passive op whose input comes from a CPU op or a constant; it follows its neighbours"
    if rule is not None:
        return rule, "active"
    if node.op_type in MANUAL_OPS:
        if prec.explicit:
            return MANUAL_OPS[node.op_type], f"manual op moved to the NPU by layer_configs ({prec.data_type})"
        return None, (f"manual op: kept in float on the CPU for accuracy; to quantize it add a layer_configs "
                      f'entry {{"op_type": "{node.op_type}", "data_type": "U16"}}')
    plugin = node_op(node)
    if plugin is not None:
        return None, f"operator plugin op {plugin.name} ({Path(plugin.source).name}): its float forward runs on the CPU"
    return None, "not supported by the NPU: runs on the CPU"


# A float-format layer: every input is data (constants are stored in the format), nothing quantized.
FLOAT_RULE = OpRule()
# ops whose weights an FP16 / BF16 layer with an integer weight_data_type keeps integer (weight-only mode)
WEIGHT_ONLY_OPS = ("MatMul", "Gemm")


def _input_axis(node: onnx.NodeProto, rank: int) -> int:
    """The reduction axis of a MatMul / Gemm weight: K of [.., K, N], or of [N, K] under transB."""
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        return 1
    return max(rank - 2, 0)


def make_plan(model: onnx.ModelProto, precision: dict[str, NodePrecision] | None = None, *,
              optimize: bool = True, ln_scale_dtype: str = "FP32") -> QuantPlan:
    """Walk the (shape-inferred) float graph once and classify every tensor.

    ``precision`` (from ``layer_configs``) gives each node its activation / output / weight dtype;
    FP32 nodes stay float whatever their op type. A tensor takes the widest of its producer's output
    dtype and its quantized readers' data_type (a 16-bit layer reads 16-bit inputs). ``optimize`` False (quant.disable_quant_optimization) turns off
    the quantization-time rewrites: Conv / Gemm + Relu / Clip fusion and passive ops sharing their
    input's scale. ``ln_scale_dtype`` S32 quantizes the Scale of a LayerNormalization on the NPU.
    """
    precision = precision or {}
    default = NodePrecision()
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    types = _elem_types(model)
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    graph_outputs = {o.name for o in g.output}
    plan = QuantPlan()
    seen_const: set[str] = set()
    weight_names: set[str] = set()

    def fusion_target(out: str) -> onnx.NodeProto | None:
        """The single quantized consumer ``out`` may be fused into (None: quantize ``out``)."""
        users = consumers.get(out, [])
        if not optimize or out in graph_outputs or len(users) != 1:
            return None
        nxt = users[0]
        if precision.get(nxt.name, default).data_type in ("FP32", *FLOAT_FORMATS):
            return None
        return nxt if nxt.op_type in FUSED_ACTIVATIONS or is_unary_lut(nxt, inits) else None

    def add_act(name: str, dtype: str, symmetric: bool | None = None) -> None:
        # A fused producer output (Conv feeding its Relu / Clip) lives only inside the fused op.
        if not name or name in inits or name in plan.fused or types.get(name) != FLOAT or dtype == "FP32":
            return
        if name not in plan.dtypes:
            plan.activations.append(name)
            plan.dtypes[name] = dtype
            if symmetric is not None:  # the grid's shape, as the node that first needs the tensor asks
                plan.symmetric[name] = symmetric
        elif float_format(plan.dtypes[name]) != float_format(dtype):
            # A float layer's output read by an integer op, or an integer output read by a float layer:
            # the tensor is on the integer grid, the float layer converts at its border.
            if float_format(plan.dtypes[name]):
                plan.dtypes[name] = dtype
        elif BITS[dtype] > BITS[plan.dtypes[name]]:
            plan.dtypes[name] = dtype  # stored once, at the widest precision its producer or readers need

    for node in g.node:
        prec = precision.get(node.name, default)
        rule, why = _rule_for(node, prec, plan, inits)
        if rule is None:
            plan.float_nodes.append(node.name)
            plan.placement[node.name] = ("CPU", why)
            continue
        plan.quantized_nodes.append(node.name)
        plan.placement[node.name] = ("NPU", why)
        if rule is FLOAT_RULE:
            fmt = prec.data_type if float_format(prec.data_type) else plan.dtypes[node.input[0]]
            plan.format_nodes[node.name] = fmt
            weight_only = node.op_type in WEIGHT_ONLY_OPS and prec.weight_data_type not in (None, "FP32")
            for i, name in enumerate(node.input):
                if name in inits:
                    if inits[name].data_type != FLOAT:
                        continue
                    rule_w = QUANT_OPS[node.op_type].weights if weight_only else {}
                    if i in rule_w and name not in weight_names:
                        # weight-only: integer weights, dequantized to the format on the NPU
                        rank = len(inits[name].dims)
                        axis = rule_w[i](node, rank)
                        plan.weights.append(WeightUse(node.name, i, name, axis, prec.weights, prec.per_tensor_weights,
                                                      prec.weight_group_size or 0, _input_axis(node, rank)))
                        weight_names.add(name)
                        plan.float_reads.append((node.name, i, fmt))
                    elif i not in rule_w:
                        plan.float_constants[name] = fmt
                elif name and name not in plan.dtypes:
                    add_act(name, fmt)  # from a CPU op or a model input: enters in the format
            for out in node.output:
                add_act(out, fmt)
            continue
        if rule.passive:
            src = node.input[0]
            for out in node.output:
                add_act(out, plan.dtypes[src], plan.symmetric.get(src))
                if optimize and out in plan.dtypes and plan.dtypes[out] == plan.dtypes[src]:
                    plan.shared[out] = src
            continue
        if node.op_type == "LayerNormalization" and ln_scale_dtype != "FP32" and len(node.input) > 1 \
                and node.input[1] in inits and node.input[1] not in seen_const:
            seen_const.add(node.input[1])
            plan.constants.append(node.input[1])
            plan.dtypes[node.input[1]] = ln_scale_dtype
        data_idx = range(len(node.input)) if rule.data_inputs is None else rule.data_inputs
        for i in data_idx:
            if i >= len(node.input) or not node.input[i]:
                continue
            name = node.input[i]
            if name in inits:
                if inits[name].data_type != FLOAT:
                    continue
                if i in rule.weights:
                    if prec.weight_group_size and prec.weights != "FP32":
                        raise PulsarError(
                            f"quant.layer_configs: layer '{node.name}' ({node.op_type}, {prec.data_type}) has a "
                            f"weight_group_size; groups are for weight-only layers (data_type FP16 / BF16 with an "
                            "integer weight_data_type): an integer layer accumulates per output channel")
                    if name not in weight_names and prec.weights != "FP32":
                        axis = rule.weights[i](node, len(inits[name].dims))
                        plan.weights.append(WeightUse(node.name, i, name, axis, prec.weights,
                                                      prec.per_tensor_weights))
                        weight_names.add(name)
                elif i == rule.bias:
                    act, w = node.input[rule.bias_of[0]], node.input[rule.bias_of[1]]
                    if act not in inits and w in weight_names:
                        plan.biases.append(BiasUse(node.name, name, act, w))
                elif name not in seen_const:
                    seen_const.add(name)
                    plan.constants.append(name)
                    plan.dtypes[name] = "S16" if BITS[prec.data_type] == 16 else "S8"
            else:
                add_act(name, prec.data_type, prec.activation_symmetric)
        for out in node.output:
            nxt = fusion_target(out)
            if nxt is not None and rule.fusable_activation and nxt.op_type in FUSED_ACTIVATIONS \
                    and fusion_target(nxt.output[0]) is None:
                plan.fused[out] = nxt.name  # a clamp inside the requantization: nothing to quantize
                continue
            if nxt is not None and is_unary_lut(nxt, inits):
                if is_unary_lut(node, inits):
                    plan.fused[out] = nxt.name  # inside a lookup-table chain
                    continue
                if rule.fusable_activation:
                    # The op and the table that follows are one NPU op; the value between them never
                    # leaves it and is kept at 16 bits.
                    plan.epilogues[out] = nxt.name
                    add_act(out, prec.output if BITS[prec.output] == 16 else "U16", prec.activation_symmetric)
                    continue
            add_act(out, prec.output, prec.activation_symmetric)
    for node in g.node:  # where a float layer meets an integer grid, it converts (pulsar/core/float_ops.py)
        fmt = plan.format_nodes.get(node.name)
        if fmt is None:
            continue
        for i, name in enumerate(node.input):
            if name in plan.dtypes and not float_format(plan.dtypes[name]):
                plan.float_reads.append((node.name, i, fmt))
        for out in node.output:
            if out in plan.dtypes and not float_format(plan.dtypes[out]):
                plan.float_writes[out] = fmt
    # A reader may have widened one side of a passive op after the fact: only equal grids are shared.
    plan.shared = {o: i for o, i in plan.shared.items() if plan.dtypes.get(o) == plan.dtypes.get(i)}
    # A constant may be both a weight somewhere and an operand elsewhere: keep it a weight only.
    plan.constants = [c for c in plan.constants if c not in weight_names]
    plan.biases = [b for b in plan.biases if b.tensor not in weight_names and b.tensor not in seen_const]
    return plan
