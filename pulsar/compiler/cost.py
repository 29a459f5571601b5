"""Roofline-style cost model of pulsar's virtual NPU: cycles per op of an integer body graph.

Why a model and not a simulator: users pick a target, ``npu_mode`` and a DDR cap before they have
hardware, and need to know which layers dominate and whether they are limited by arithmetic or by
memory traffic. The model is deliberately simple and documented (docs/targets.md), so its numbers
can be reasoned about; they are estimates, not measurements.

Per op (executed one after the other, no overlap between ops):

- ``Workload``: MACs, elementwise (vector) operations, activation bytes read, weight bytes, bytes
  written and operand width, from the op's attributes and the body's ``value_info`` shapes, by a
  rule registered per op type (``@cost_rule``). Unknown ops get one vector op per output element
  and a note.
- compute cycles = MACs / (MACs per cycle for the operand width * cores)
  + vector ops * (bits / 8) / (vector ops per cycle * cores).
- DDR bytes: weights always come from DDR. A tensor lives in DDR when it is a graph input, or when
  its producer did not fit on chip; an op fits when its activation inputs + outputs <= on-chip
  memory. A fitting op reads only its DDR-resident inputs from DDR and writes only graph outputs
  to DDR; an op that does not fit streams all its inputs and outputs through DDR.
- memory cycles = DDR bytes / (bandwidth / clock), bandwidth = min(profile, ddr_bw_limit if > 0).
- cycles = max(compute, memory) + the profile's fixed per-op overhead; ``bound`` says which side
  won. Pure views (Reshape, Squeeze, ...) are free unless they must flush a graph output to DDR.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper

from pulsar.compiler.targets.profile import TargetProfile, cores_for, load_profile
from pulsar.errors import PulsarError

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class OpEstimate:
    name: str
    op_type: str
    cycles: int
    compute_cycles: int
    memory_cycles: int
    bound: str
    start_cycle: int
    ddr_bytes: int
    workload: Workload


@dataclass
class SubgraphEstimate:
    """One NPU subgraph; ``start_cycle`` is its offset in the whole model's sequential schedule."""

    name: str
    profile: str
    npu_mode: str
    cores: int
    clock_mhz: float
    ddr_bandwidth_gbps: float
    ops: list[OpEstimate]
    notes: list[str] = field(default_factory=list)
    start_cycle: int = 0

    @property
    def cycles(self) -> int:
        return sum(op.cycles for op in self.ops)

    @property
    def time_ms(self) -> float:
        return self.cycles / (self.clock_mhz * 1e3)

    @property
    def macs(self) -> int:
        return sum(op.workload.macs for op in self.ops)

    @property
    def ddr_bytes(self) -> int:
        return sum(op.ddr_bytes for op in self.ops)

    @property
    def bytes(self) -> int:
        """All bytes the ops touch (on chip or DDR): activations read, weights, outputs."""
        return sum(o.workload.bytes_read + o.workload.weight_bytes + o.workload.bytes_written for o in self.ops)

    @property
    def tops(self) -> float:
        """Achieved tera-ops per second (1 MAC = 2 ops) over the estimated time."""
        return 2.0 * self.macs / (self.time_ms * 1e-3) / 1e12 if self.cycles else 0.0

    @property
    def bound_share(self) -> dict[str, float]:
        """Fraction of the cycles spent in compute-bound and in memory-bound ops."""
        total = self.cycles or 1
        return {b: sum(o.cycles for o in self.ops if o.bound == b) / total for b in ("compute", "memory")}


@dataclass
class ModelEstimate:
    profile: TargetProfile
    npu_mode: str
    cores: int
    ddr_bandwidth_gbps: float
    subgraphs: list[SubgraphEstimate]
    not_estimated: list[str] = field(default_factory=list)

    @property
    def cycles(self) -> int:
        return sum(s.cycles for s in self.subgraphs)

    @property
    def time_ms(self) -> float:
        return self.cycles / (self.profile.clock_mhz * 1e3)

    @property
    def macs(self) -> int:
        return sum(s.macs for s in self.subgraphs)

    @property
    def ddr_bytes(self) -> int:
        return sum(s.ddr_bytes for s in self.subgraphs)

    @property
    def tops(self) -> float:
        return 2.0 * self.macs / (self.time_ms * 1e-3) / 1e12 if self.cycles else 0.0


# --------------------------------------------------------------------------- tensor facts


class _Tensors:
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
        return self.numel(name) * self.itemsize(name)

    def bits(self, name: str) -> int:
        return 8 * self.itemsize(name)

    def activations(self, node: onnx.NodeProto) -> list[str]:
        return [i for i in node.input if i and i not in self.weights]


# --------------------------------------------------------------------------- workload rules

Rule = Callable[[onnx.NodeProto, _Tensors], dict[str, Any]]
_RULES: dict[str, Rule] = {}


def cost_rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Register the workload rule of ``op_types``; it returns Workload fields other than bytes."""

    def register(fn: Rule) -> Rule:
        for op in op_types:
            _RULES[op] = fn
        return fn

    return register


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _out_elems(node: onnx.NodeProto, t: _Tensors) -> int:
    return sum(t.numel(o) for o in node.output if o)


def _act_bits(node: onnx.NodeProto, t: _Tensors) -> int:
    return max([t.bits(i) for i in t.activations(node)] or [8])


@cost_rule("QConv")
def _conv(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    # w: [Cout, Cin/group, k...]; every output element sums Cin/group * prod(k) products.
    w = t.dims(node.input[1])
    return {"macs": t.numel(node.output[0]) * math.prod(w[1:]), "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


@cost_rule("QConvTranspose")
def _conv_transpose(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    # w: [Cin, Cout/group, k...]; every input element scatters into Cout/group * prod(k) outputs.
    w = t.dims(node.input[1])
    return {"macs": t.numel(node.input[0]) * math.prod(w[1:]), "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


@cost_rule("QMatMul")
def _matmul(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    a = t.dims(node.input[0])
    k = a[-1] if a else 1
    return {"macs": t.numel(node.output[0]) * k, "unit": "mac",
            "operand_bits": max(t.bits(node.input[0]), t.bits(node.input[1]))}


def _per_output(ops_per_element: int) -> Rule:
    def rule(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
        return {"elementwise_ops": ops_per_element * _out_elems(node, t)}

    return rule


# zero-point subtraction, multiply(s), add, rounding shift, clamp, in vector-unit operations
cost_rule("QAdd")(_per_output(4))
cost_rule("QMul")(_per_output(4))
cost_rule("Requantize")(_per_output(3))


@cost_rule("QLut")
def _lut(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    per = 2 if not _attr(node, "step_bits", 0) else 5  # interpolation: 2 loads, sub, mul, shift
    return {"elementwise_ops": per * _out_elems(node, t)}


@cost_rule("QAvgPool")
def _avgpool(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    window = math.prod(_attr(node, "kernel_shape", [1]))
    return {"elementwise_ops": t.numel(node.output[0]) * (window + 3)}


@cost_rule("QReduceMean")
def _reduce_mean(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.input[0]) + 3 * t.numel(node.output[0])}


@cost_rule("QSoftmax")
def _softmax(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    return {"elementwise_ops": 6 * t.numel(node.input[0])}  # max, sub, lookup, sum, mul, divide


@cost_rule("QLayerNorm")
def _layernorm(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    x = t.dims(node.input[0])
    rows = math.prod(x[:-1]) if x else 1
    # centre, square, sum, divide, scale, shift, add, clamp per element; ~32 steps of isqrt per row
    return {"elementwise_ops": 10 * t.numel(node.input[0]) + 32 * rows}


@cost_rule("MaxPool")
def _maxpool(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.output[0]) * math.prod(_attr(node, "kernel_shape", [1]))}


@cost_rule("GlobalMaxPool", "ReduceMax")
def _reduce_max(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    return {"elementwise_ops": t.numel(node.input[0])}


@cost_rule("Transpose", "Concat", "Slice", "Split", "Pad", "Resize", "Gather", "DepthToSpace",
           "SpaceToDepth", "Expand", "Tile")
def _copy(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    bits = max([t.bits(o) for o in node.output if o] or [8])
    return {"elementwise_ops": _out_elems(node, t), "unit": "dma", "operand_bits": bits}


@cost_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Constant")
def _view(node: onnx.NodeProto, t: _Tensors) -> dict[str, Any]:
    return {"unit": "none"}


def _workload(node: onnx.NodeProto, t: _Tensors) -> Workload:
    rule = _RULES.get(node.op_type)
    notes = []
    if rule is None:
        part: dict[str, Any] = {"elementwise_ops": _out_elems(node, t)}
        notes.append(f"no cost rule for {node.domain or 'ai.onnx'}:{node.op_type}, estimated as one vector op "
                     "per output element")
    else:
        part = rule(node, t)
    part.setdefault("operand_bits", _act_bits(node, t))
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
    t = _Tensors(graph)
    return [_workload(node, t) for node in graph.node]


# --------------------------------------------------------------------------- estimates


def _check_limit(ddr_bw_limit_gbps: float) -> float:
    value = float(ddr_bw_limit_gbps)
    if not math.isfinite(value) or value < 0:
        raise PulsarError(f"compiler.ddr_bw_limit must be >= 0 GB/s (0 = unlimited), got {ddr_bw_limit_gbps!r}")
    return value


def _as_profile(profile: TargetProfile | str) -> TargetProfile:
    return profile if isinstance(profile, TargetProfile) else load_profile(profile)


def _effective_bw(profile: TargetProfile, limit: float) -> float:
    return min(profile.ddr_bandwidth_gbps, limit) if limit > 0 else profile.ddr_bandwidth_gbps


def estimate(graph: onnx.GraphProto, profile: TargetProfile | str, npu_mode: str = "NPU1",
             ddr_bw_limit_gbps: float = 0.0, *, name: str | None = None) -> SubgraphEstimate:
    """Sequential schedule of ``graph``'s nodes (in order) on ``profile`` with ``npu_mode``'s cores."""
    profile = _as_profile(profile)
    cores = cores_for(profile, npu_mode)
    limit = _check_limit(ddr_bw_limit_gbps)
    per_cycle = profile.ddr_bytes_per_cycle(limit)
    t = _Tensors(graph)
    in_ddr = set(t.graph_inputs)
    ops: list[OpEstimate] = []
    notes: list[str] = []
    cursor = 0
    for node in graph.node:
        w = _workload(node, t)
        if w.note:
            notes.append(f"{w.name}: {w.note}")
        acts = t.activations(node)
        outs = [o for o in node.output if o]
        if w.unit == "none":
            if any(i in in_ddr for i in acts):
                in_ddr.update(outs)
            ddr = sum(t.nbytes(o) for o in outs if o in t.graph_outputs and o not in in_ddr)
        elif w.bytes_read + w.bytes_written <= profile.onchip_bytes:
            ddr = sum(t.nbytes(i) for i in acts if i in in_ddr)
            ddr += sum(t.nbytes(o) for o in outs if o in t.graph_outputs)
        else:  # spills: everything streams through DDR, and its outputs live there
            ddr = w.bytes_read + w.bytes_written
            in_ddr.update(outs)
        if w.unit != "none":
            ddr += w.weight_bytes
        mac_rate = profile.macs_per_cycle(w.operand_bits) * cores
        vec_rate = profile.vector_ops_per_cycle_per_core * cores
        compute = math.ceil(w.macs / mac_rate) + math.ceil(w.elementwise_ops * max(1, w.operand_bits // 8) / vec_rate)
        memory = math.ceil(ddr / per_cycle)
        free = w.unit == "none" and ddr == 0
        cycles = 0 if free else max(compute, memory) + profile.op_overhead_cycles
        bound = "compute" if compute >= memory else "memory"
        ops.append(OpEstimate(w.name, w.op_type, cycles, compute, memory, bound, cursor, ddr, w))
        cursor += cycles
    est = SubgraphEstimate(name=name or graph.name or "npu", profile=profile.name, npu_mode=npu_mode, cores=cores,
                           clock_mhz=profile.clock_mhz, ddr_bandwidth_gbps=_effective_bw(profile, limit),
                           ops=ops, notes=notes)
    log.debug("estimate %s on %s/%s: %d ops, %d cycles, %.3f ms", est.name, profile.name, npu_mode,
              len(ops), est.cycles, est.time_ms)
    return est


def estimate_model(subgraphs: Iterable[Any], profile: TargetProfile | str, npu_mode: str = "NPU1",
                   ddr_bw_limit_gbps: float = 0.0) -> ModelEstimate:
    """Estimate every NPU subgraph (``Subgraph(name, kind, graph, options)``) back to back; CPU ones
    are listed in ``not_estimated`` (their time depends on the host, which no profile describes)."""
    profile = _as_profile(profile)
    cores = cores_for(profile, npu_mode)
    limit = _check_limit(ddr_bw_limit_gbps)
    done: list[SubgraphEstimate] = []
    skipped: list[str] = []
    cursor = 0
    for sg in subgraphs:
        if sg.kind != "npu":
            skipped.append(sg.name)
            continue
        est = estimate(sg.graph, profile, npu_mode, limit, name=sg.name)
        est.start_cycle = cursor
        cursor += est.cycles
        done.append(est)
    return ModelEstimate(profile=profile, npu_mode=npu_mode, cores=cores,
                         ddr_bandwidth_gbps=_effective_bw(profile, limit), subgraphs=done, not_estimated=skipped)
