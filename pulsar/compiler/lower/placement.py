"""Decide, op by op, what runs on the NPU and what stays in float on the CPU.

A compute op goes to the NPU when every data input is a dequantized integer tensor (or a constant
its rule folds), every output feeds exactly one QuantizeLinear (possibly through one fused Relu /
Clip, or through a lookup-table chain of element-wise ops that becomes one table) and its rule
accepts it. The result is a list of *units*: one per NPU op (the op, its fused activation or chain
and its output Qs, lowered to integer nodes) and one per CPU node (compute ops, the QuantizeLinear
of float tensors, the DequantizeLinear of integer tensors that float ops read).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from pulsar.compiler.lower.model import Fallback, LowerOptions, SubRange
from pulsar.compiler.lower.qdq_graph import ACTIVATION_TYPES, QdqGraph, QParams
from pulsar.compiler.lower.rules import LowerCtx, Operand, Unsupported, clamp_of, find_rule, relu_clip_bounds
from pulsar.compiler.lower.rules.floating import lower_float
from pulsar.compiler.lower.rules.lut import LUT_FUNCS, SCALAR_OPS, lower_lut_chain
from pulsar.core.handoff import node_lut_bits
from pulsar.core.opdefs import fused_activations
from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.graph import DEFAULT_DOMAINS, node_inputs
from pulsar.quant.ops import MANUAL_OPS

log = logging.getLogger(__name__)

_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
_FUSABLE = fused_activations()  # Relu / Clip: folded into the producer's out_min / out_max


@dataclass
class Unit:
    kind: str                       # "npu" | "cpu"
    index: int                      # topological position of its op (scheduling tie-break)
    nodes: list[onnx.NodeProto]     # QDQ nodes it stands for: op, fused Relu / Clip or chain, output Qs
    needs: list[str]                # tensors it reads that other units (or the model inputs) produce
    makes: list[str]                # tensors it writes
    ctx: LowerCtx | None = None     # npu: the integer program
    dq_nodes: list[onnx.NodeProto] = field(default_factory=list)  # npu: the DQs it reads through
    sub: int | None = None          # npu: index of the compiler.sub_configs range it belongs to


def topological_nodes(g: QdqGraph) -> list[onnx.NodeProto]:
    """Nodes in a topological order, keeping the file's order where it already is one."""
    available = {i.name for i in g.graph.input} | set(g.inits) | {""}
    producers = set(g.producer)
    pending = list(g.graph.node)
    order: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for n in pending:
            if all(i in available or i not in producers for i in node_inputs(n)):
                order.append(n)
                available.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError("the QDQ graph has a cycle")
        pending = rest
    return order


def classify(g: QdqGraph, name: str) -> tuple[Operand, onnx.NodeProto | None]:
    """How an op input is fed: (operand, the DequantizeLinear it comes through or None)."""
    if not name:
        return Operand("", "absent"), None
    if name in g.inits:
        return Operand(name, "const", value=g.const(name)), None
    p = g.producer.get(name)
    if p is not None and g.is_dq(p):
        q = g.qparams(p)
        if q is not None:
            if p.input[0] in g.inits:
                return Operand(name, "qconst", q, g.const(p.input[0])), p
            return Operand(name, "act", q), p
    et = g.elem_type(name)
    return Operand(name, "float" if et is None or et in _FLOATS else "runtime"), None


def _manual(op: str) -> str:
    return (f"{op} is a manual op kept in float on the CPU; select it in quant.layer_configs with data_type U16 "
            "to move it to the NPU")


def _chainable(g: QdqGraph, node: onnx.NodeProto, tensor: str) -> bool:
    """Whether ``node`` is an element-wise function of ``tensor`` alone (a table op, a Relu / Clip,
    or arithmetic with a constant scalar): a link of a lookup-table chain."""
    outs = [o for o in node.output if o]
    if len(outs) != 1 or list(node.input).count(tensor) != 1:
        return False
    others = [classify(g, i)[0] for i in node.input if i != tensor]
    if any(o.kind not in ("const", "qconst", "absent") for o in others):
        return False
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    if (domain, node.op_type) in LUT_FUNCS:
        return node.input[0] == tensor
    return not domain and node.op_type in SCALAR_OPS and len(node.input) == 2 and others[0].value is not None \
        and np.asarray(others[0].value).size == 1


def _output_chain(g: QdqGraph, node: onnx.NodeProto,
                  cpu_nodes: Container[str] = ()) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]] | str:
    """(element-wise ops between the op and its QuantizeLinear, the QuantizeLinear of each output) or
    why the outputs are not quantized. The chain is one fused Relu / Clip, or the links of a
    lookup-table chain (single-output ops only)."""
    outs = list(node.output)
    while outs and not outs[-1]:
        outs.pop()
    if not outs or not all(outs):
        return "an optional output in the middle is left out"
    chain: list[onnx.NodeProto] = []
    qs = []
    for o in outs:
        cur = o
        while True:
            if cur in g.output_names:
                return f"output '{cur}' is a model output kept in float"
            users = g.consumers.get(cur, [])
            if len(users) == 1 and g.is_q(users[0]) and users[0].input[0] == cur:
                qs.append(users[0])
                break
            if len(outs) == 1 and len(users) == 1 and users[0].name not in cpu_nodes and _chainable(g, users[0], cur):
                chain.append(users[0])
                cur = users[0].output[0]
                continue
            return f"output '{o}' is not quantized (FP32 layer)"
    return chain, qs


def _try_npu(g: QdqGraph, node: onnx.NodeProto, index: int, options: LowerOptions) -> Unit | str:
    op = node.op_type
    if options.npu_ops is not None and op not in options.npu_ops:
        return f"{op} is not in the NPU op list (npu_ops)"
    classified = [classify(g, i) for i in node.input]
    operands = [c[0] for c in classified]
    float_unit = _try_float(g, node, index, classified)
    if float_unit is not None:
        return float_unit
    rule = find_rule(node)
    if rule is None:
        return f"{op} is not supported by the NPU; it runs in float on the CPU"
    manual = op in MANUAL_OPS
    for o in operands:
        if o.kind == "float":
            return _manual(op) if manual else \
                f"input '{o.name}' is not quantized (FP32 layer, or its producer runs in float on the CPU)"
        if o.kind == "runtime":
            return f"input '{o.name}' is computed at run time (the NPU needs it constant)"
    if not any(o.kind == "act" for o in operands):
        return "no quantized activation input (constant subgraph)"
    chain = _output_chain(g, node, options.cpu_nodes)
    if isinstance(chain, str):
        return _manual(op) if manual else chain
    links, qs = chain
    outside = [n.op_type for n in links if options.npu_ops is not None and n.op_type not in options.npu_ops]
    if outside and not (len(links) == 1 and links[0].op_type in _FUSABLE):
        return f"{op} is followed by {outside[0]}, which is not in the NPU op list (npu_ops)"
    outputs = []
    for q in qs:
        qp = g.qparams(q)
        if qp is None or not qp.per_tensor or qp.elem_type not in ACTIVATION_TYPES:
            return f"output '{q.input[0]}' is not on a per-tensor 8 / 16-bit grid"
        if g.static_shape(qp.name) is None:
            return f"the shape of '{q.input[0]}' is not static"
        outputs.append(qp)
    clamps = [(q.qmin, q.qmax) for q in outputs]
    try:
        fused = len(links) == 1 and links[0].op_type in _FUSABLE and links[0].domain in DEFAULT_DOMAINS
        if fused:
            lo, hi = relu_clip_bounds(g, links[0])
            if lo > hi:
                return "Clip with min > max"
            clamps[0] = clamp_of(outputs[0], lo, hi)
        own_lut = node_lut_bits(node)
        ctx = LowerCtx(node, g, operands, outputs, clamps,
                       lut_items_in_bits=options.lut_items_in_bits if own_lut is None else own_lut)
        if links and not fused:
            tensors = [node.output[0], *(n.output[0] for n in links[:-1])]
            link_ctxs = [LowerCtx(n, g, [Operand(i, "chain") if i == t else classify(g, i)[0] for i in n.input], [], [])
                         for n, t in zip(links, tensors, strict=True)]
            lower_lut_chain(ctx, link_ctxs)
        else:
            rule(ctx)
    except Unsupported as exc:
        return str(exc)
    needs = list(dict.fromkeys(o.q.name for o in operands if o.kind == "act" and o.q is not None))
    feeding = classified + [classify(g, i) for n in links for i in n.input]  # links may read quantized constants
    dqs = list({dq.name: dq for _, dq in feeding if dq is not None}.values())
    nodes = [node, *links, *qs]
    return Unit("npu", index, nodes, needs, [q.output[0] for q in qs], ctx, dqs)


def _try_float(g: QdqGraph, node: onnx.NodeProto, index: int,
               classified: list[tuple[Operand, onnx.NodeProto | None]]) -> Unit | str | None:
    """The unit of an op of an FP16 / BF16 layer (an input or output on a float grid), why it stays on
    the CPU, or None when the op is not a float layer's."""
    operands = [c[0] for c in classified]
    users = [g.consumers.get(o, []) for o in node.output if o]
    out_qs = [u[0] if len(u) == 1 and g.is_q(u[0]) and u[0].input[0] == o else None
              for u, o in zip(users, [o for o in node.output if o], strict=True)]
    grids = [g.qparams(q) for q in out_qs if q is not None] + [o.q for o in operands if o.q is not None]
    elem = next((q.elem_type for q in grids if q is not None and q.is_float), None)
    if elem is None:
        return None
    if any(q is None for q in out_qs):
        return "an output of a float-format layer is a model output kept in float, or read by several ops"
    for o in operands:
        if o.kind == "float":
            return f"input '{o.name}' is not on an NPU grid (its producer runs in float on the CPU)"
        if o.kind == "runtime":
            return f"input '{o.name}' is computed at run time (the NPU needs it constant)"
    outputs = []
    for q in out_qs:
        assert q is not None
        qp = g.qparams(q)
        if qp is None or not qp.per_tensor:
            return f"output '{q.input[0]}' is not on a per-tensor grid"
        if g.static_shape(q.input[0]) is None:
            return f"the shape of '{q.input[0]}' is not static"
        outputs.append(qp)
    ctx = LowerCtx(node, g, operands, outputs, [(q.qmin, q.qmax) for q in outputs])
    try:
        lower_float(ctx, elem)
    except Unsupported as exc:
        return str(exc)
    needs = list(dict.fromkeys(o.q.name for o in operands if o.kind == "act" and o.q is not None))
    dqs = list({dq.name: dq for _, dq in classified if dq is not None}.values())
    qs = [q for q in out_qs if q is not None]
    return Unit("npu", index, [node, *qs], needs, [q.output[0] for q in qs], ctx, dqs)


def _try_conversion(g: QdqGraph, node: onnx.NodeProto, index: int) -> Unit | None:
    """The border of a float layer: a Cast to FP16 / BF16 of a dequantized integer tensor (``Dequantize``)
    or a QuantizeLinear of a value rounded to FP16 / BF16 (``Quantize``), as an NPU unit; None for
    any other Q."""
    src, dq = classify(g, node.input[0])
    out = g.qparams(node)
    if out is not None and out.is_float and src.kind == "qconst" and src.q is not None and not src.q.is_float \
            and dq is not None and src.value is not None:
        return _weight_conversion(g, node, index, src, out, dq)
    if out is None or src.kind != "act" or src.q is None or dq is None or not src.q.per_tensor \
            or out.is_float == src.q.is_float or g.static_shape(node.input[0]) is None:
        return None
    if not out.is_float and out.elem_type not in ACTIVATION_TYPES:
        return None
    ctx = LowerCtx(node, g, [src], [out], [(out.qmin, out.qmax)])
    if out.is_float:
        ctx.emit("Dequantize", [src.q.name], [out.name], x_zp=src.q.zp, scale=float(np.float32(src.q.s)),
                 to=out.elem_type)
    else:
        ctx.emit("Quantize", [src.q.name], [out.name], scale=float(np.float32(out.s)), out_zp=out.zp,
                 out_min=out.qmin, out_max=out.qmax, to=out.elem_type)
    return Unit("npu", index, [node], [src.q.name], [out.name], ctx, [dq])


def _weight_conversion(g: QdqGraph, node: onnx.NodeProto, index: int, src: Operand, out: QParams,
                       dq: onnx.NodeProto) -> Unit:
    """The integer weight of a weight-only float layer, dequantized to its format on the NPU: the
    integers stay in the compiled model (4-bit ones two per byte), scales per channel."""
    assert src.q is not None
    ctx = LowerCtx(node, g, [src], [out], [(out.qmin, out.qmax)])
    weight = ctx.use_init(src.q.name)
    if src.q.per_tensor:
        ctx.emit("Dequantize", [weight], [out.name], x_zp=src.q.zp, scale=float(np.float32(src.q.s)),
                 to=out.elem_type)
    else:
        scales = ctx.add_init("scales", src.q.scale.astype(np.float32))
        zps = ctx.add_init("zero_points", src.q.zero_point.astype(np.int32)) if np.any(src.q.zero_point) else ""
        blocked = {"block_size": src.q.block_size} if src.q.block_size else {}
        ctx.emit("Dequantize", [weight, scales, zps], [out.name], axis=int(src.q.axis or 0), to=out.elem_type,
                 **blocked)
    return Unit("npu", index, [node], [], [out.name], ctx, [dq])


def weight_dq_outputs(g: QdqGraph) -> set[str]:
    """Outputs of the DequantizeLinear of constants: every body that reads one carries its DQ."""
    return {n.output[0] for n in g.graph.node if g.is_weight_dq(n) and n.output[0] not in g.output_names}


def _cpu_unit(g: QdqGraph, node: onnx.NodeProto, index: int, pulled: set[str]) -> Unit:
    needs = [i for i in dict.fromkeys(node_inputs(node)) if i not in g.inits and i not in pulled]
    return Unit("cpu", index, [node], needs, [o for o in node.output if o])


def _aliases(g: QdqGraph, sub: SubRange, key: str) -> list[str]:
    """QDQ tensors standing for the float model's tensors named in ``key``: T itself (a dequantized or
    float tensor), ``T/float`` (a compute output before its Q) and ``T/q`` (the integer tensor)."""
    known = set(g.producer) | set(g.consumers)
    out: list[str] = []
    for name in getattr(sub, key):
        found = [a for a in (name, f"{name}/float", f"{name}/q") if a in known]
        if not found:
            raise PulsarError(f"compiler.sub_configs '{sub.name}' {key}: tensor '{name}' is not in the quantized "
                              f"model (the graph optimization fused or removed it){did_you_mean(name, known)}; "
                              "name a tensor of frontend/optimized.onnx")
        out += found
    return out


def range_nodes(g: QdqGraph, sub: SubRange) -> set[str]:
    """Compute nodes (no Q / DQ) on a path from a start tensor to an end tensor of ``sub``."""
    forward: set[str] = set()
    stack = _aliases(g, sub, "start_tensor_names")
    while stack:
        for n in g.consumers.get(stack.pop(), []):
            if n.name not in forward:
                forward.add(n.name)
                stack.extend(o for o in n.output if o)
    backward: set[str] = set()
    stack = _aliases(g, sub, "end_tensor_names")
    while stack:
        n = g.producer.get(stack.pop())
        if n is not None and n.name not in backward:
            backward.add(n.name)
            stack.extend(node_inputs(n))
    return {n.name for n in g.graph.node if n.name in forward & backward and not g.is_q(n) and not g.is_dq(n)}


def sub_config_of(g: QdqGraph, subs: list[SubRange]) -> dict[str, int]:
    """QDQ compute node -> index of the first sub-config range holding it."""
    owner: dict[str, int] = {}
    for k, sub in enumerate(subs):
        nodes = range_nodes(g, sub)
        if not nodes:
            raise PulsarError(f"compiler.sub_configs '{sub.name}': no op lies between {sub.start_tensor_names} and "
                              f"{sub.end_tensor_names}; the end tensors must be computed from the start tensors")
        taken = sorted(n for n in nodes if n in owner)
        if taken:
            log.warning("compiler.sub_configs '%s': %d ops already belong to an earlier sub-config (%s); the "
                        "first one wins", sub.name, len(taken), ", ".join(taken[:3]))
        owner.update({n: k for n in nodes if n not in owner})
    return owner


def place(g: QdqGraph, options: LowerOptions) -> tuple[list[Unit], list[Fallback], dict[str, str]]:
    """Units in topological order, the fallbacks and the compute-node placement."""
    order = topological_nodes(g)
    owner = sub_config_of(g, options.sub_configs)
    per_sub = [dataclasses.replace(options, lut_items_in_bits=s.lut_items_in_bits)
               if s.lut_items_in_bits is not None else options for s in options.sub_configs]
    pulled = weight_dq_outputs(g)
    units: list[Unit] = []
    fallbacks: list[Fallback] = []
    placement: dict[str, str] = {}
    taken: set[str] = set()
    npu_readers: set[str] = set()
    for index, node in enumerate(order):
        if g.is_q(node) and node.name not in taken and options.cpu_nodes.get(node.name) is None:
            conversion = _try_conversion(g, node, index)
            if conversion is not None:
                units.append(conversion)
                taken.add(node.name)
                npu_readers.add(node.name)
                continue
        if node.name in taken or g.is_q(node) or g.is_dq(node):
            continue
        sub = owner.get(node.name)
        decided = options.cpu_nodes.get(node.name)
        if decided is None:
            decided = _try_npu(g, node, index, options if sub is None else per_sub[sub])
        if isinstance(decided, Unit):
            decided.sub = sub
            units.append(decided)
            taken.update(n.name for n in decided.nodes)
            npu_readers.add(node.name)
            placement[node.name] = "npu"
            for n in decided.nodes[1:]:
                if not g.is_q(n):
                    placement[n.name] = "npu"
        else:
            units.append(_cpu_unit(g, node, index, pulled))
            fallbacks.append(Fallback(node.name, node.op_type, decided))
            placement[node.name] = "cpu"
            log.debug("%s (%s) on the CPU: %s", node.name, node.op_type, decided)
    for index, node in enumerate(order):
        if node.name in taken:
            continue
        if g.is_q(node):
            units.append(_cpu_unit(g, node, index, pulled))
        elif g.is_dq(node):
            out = node.output[0]
            if out in pulled:
                continue
            users = g.consumers.get(out, [])
            if out in g.output_names or any(u.name not in npu_readers for u in users):
                units.append(_cpu_unit(g, node, index, pulled))
    units.sort(key=lambda u: u.index)
    return units, fallbacks, placement
