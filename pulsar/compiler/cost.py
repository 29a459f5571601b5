"""Roofline-style cost model of pulsar's virtual NPU: cycles per op of an integer body graph.

Why a model and not a simulator: users pick a target, ``npu_mode`` and a DDR cap before they have
hardware, and need to know which layers dominate and whether they are limited by arithmetic or by
memory traffic. The model is deliberately simple and documented (docs/targets.md), so its numbers
can be reasoned about; they are estimates, not measurements.

Per op (executed one after the other, no overlap between ops):

- ``Workload`` (pulsar/compiler/workload.py): MACs, elementwise (vector) operations, activation
  bytes read, weight bytes, bytes written and operand width, by a rule registered per op type
  (``@cost_rule``). Unknown ops get one vector op per output element and a note.
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import onnx

from pulsar.compiler.targets.profile import TargetProfile, cores_for, load_profile
from pulsar.compiler.workload import Tensors, Workload, op_workload
from pulsar.errors import PulsarError

log = logging.getLogger(__name__)


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
    t = Tensors(graph)
    in_ddr = set(t.graph_inputs)
    ops: list[OpEstimate] = []
    notes: list[str] = []
    cursor = 0
    for node in graph.node:
        w = op_workload(node, t)
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
        if w.float_format:
            mac_rate = profile.float_macs_per_cycle(w.float_format) * cores
            if not mac_rate:
                raise PulsarError(
                    f"{w.name} ({w.op_type}) runs in {w.float_format}, which target {profile.name} does not have "
                    f"({w.float_format.lower()}_macs_per_cycle_per_core is 0 or absent in its profile): pick a target "
                    f"with {w.float_format}, or give the layer an integer data_type (U16) in quant.layer_configs")
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
