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
- An op that does not fit cannot double-buffer: it *spills* (load, compute, store in turn:
  cycles = compute + memory + overhead), unless tile / slice mode splits it into pieces that fit
  (pulsar/compiler/tiling.py): then DMA overlaps compute again (max), the halo rows and weight
  re-reads of the pieces count as DDR bytes, and every piece pays the per-op overhead.
- With data soft compression (pulsar/compiler/compression.py) a layer's weights cost their stored
  (compressed) bytes of DDR traffic, plus the profile's decompression cycles on the compute side; a
  layer whose cycles would not drop (decompression slower than the DDR time saved) stays raw.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import onnx

from pulsar.compiler.compression import LayerWeights, Packed, layer_weights, weight_packing
from pulsar.compiler.targets.profile import TargetProfile, cores_for, load_profile
from pulsar.compiler.tiling import TilePlan, plan
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
    schedule: str = "onchip"            # onchip / spill / tile / slice / view
    tiling: TilePlan | None = None      # the pieces of a tiled or sliced op
    spill_cycles: int = 0               # a split op: what it would cost spilled (tiling off)
    weights: LayerWeights | None = None  # soft compression on: the layer's weights as stored in DDR


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
    soft_compression: bool = False

    @property
    def weight_bytes(self) -> tuple[int, int]:
        """(raw, stored) weight bytes the ops read from DDR (equal without soft compression)."""
        raw = sum(op.workload.weight_bytes for op in self.ops if op.workload.unit != "none")
        stored = sum(op.weights.stored if op.weights else op.workload.weight_bytes
                     for op in self.ops if op.workload.unit != "none")
        return raw, stored

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

    @property
    def weight_bytes(self) -> tuple[int, int]:
        """(raw, stored) weight bytes read from DDR by all NPU subgraphs."""
        pairs = [s.weight_bytes for s in self.subgraphs]
        return sum(r for r, _ in pairs), sum(s for _, s in pairs)


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


def _split_cost(p: TilePlan, w: Workload, in_ddr: set[str], per_cycle: float, compute: int,
                overhead: int, weights: LayerWeights) -> tuple[TilePlan, int, int, int, int]:
    """(plan, DDR bytes, compute, memory cycles, cycles) of a split op: its pieces read the DDR-resident
    inputs (halo rows again), load the weights (again per piece unless resident, each load as stored and
    expanded again) and write the outputs."""
    loads = p.weight_bytes / weights.raw if weights.raw else 1.0
    compute += math.ceil(weights.decompress_cycles * loads)
    ddr = p.read_bytes(in_ddr) + w.bytes_written + math.ceil(weights.stored * loads)
    memory = math.ceil(ddr / per_cycle)
    return p, ddr, compute, memory, max(compute, memory) + overhead * p.n


@dataclass(frozen=True)
class _Timing:
    schedule: str
    split: TilePlan | None
    ddr: int
    compute: int
    memory: int
    cycles: int
    spilled: int


def _timing(w: Workload, schedule: str, act_ddr: int, weights: LayerWeights, compute: int, plans: list[TilePlan],
            in_ddr: set[str], per_cycle: float, overhead: int) -> _Timing:
    """Cycles of one op whose activations cost ``act_ddr`` DDR bytes and whose weights are stored as
    ``weights``; a spilled op takes its cheapest split (``plans``) when there is one that is faster
    than spilling."""
    ddr = act_ddr + weights.stored
    base = compute
    compute += weights.decompress_cycles
    memory = math.ceil(ddr / per_cycle)
    cycles = 0 if w.unit == "none" and ddr == 0 else max(compute, memory) + overhead
    if schedule != "spill":
        return _Timing(schedule, None, ddr, compute, memory, cycles, 0)
    cycles = compute + memory + overhead  # no room to double-buffer: load, compute and store one after the other
    if not plans:
        return _Timing(schedule, None, ddr, compute, memory, cycles, 0)
    split, s_ddr, s_compute, s_memory, s_cycles = min(
        (_split_cost(p, w, in_ddr, per_cycle, base, overhead, weights) for p in plans), key=lambda c: (c[4], c[0].n))
    if s_cycles >= cycles:  # the halo / weight re-reads cost more than the overlap wins: spilling is faster
        return _Timing(schedule, None, ddr, compute, memory, cycles, 0)
    return _Timing(split.mode, split, s_ddr, s_compute, s_memory, s_cycles, cycles)


def estimate(graph: onnx.GraphProto, profile: TargetProfile | str, npu_mode: str = "NPU1",
             ddr_bw_limit_gbps: float = 0.0, *, name: str | None = None, tile_mode: bool = False,
             slice_mode: bool = False, soft_compression: bool = False) -> SubgraphEstimate:
    """Sequential schedule of ``graph``'s nodes (in order) on ``profile`` with ``npu_mode``'s cores;
    ``tile_mode`` / ``slice_mode``: split the ops that do not fit on chip (pulsar/compiler/tiling.py);
    ``soft_compression``: weights stored compressed where that is smaller (pulsar/compiler/compression.py)."""
    profile = _as_profile(profile)
    cores = cores_for(profile, npu_mode)
    limit = _check_limit(ddr_bw_limit_gbps)
    per_cycle = profile.ddr_bytes_per_cycle(limit)
    t = Tensors(graph)
    in_ddr = set(t.graph_inputs)
    ops: list[OpEstimate] = []
    notes: list[str] = []
    cursor = 0
    modes = [m for m, on in (("tile", tile_mode), ("slice", slice_mode)) if on]
    packing: dict[str, Packed] | None = weight_packing(graph) if soft_compression else None
    expand_rate = profile.decompress_bytes_per_cycle_per_core * cores
    for node in graph.node:
        w = op_workload(node, t)
        if w.note:
            notes.append(f"{w.name}: {w.note}")
        acts = t.activations(node)
        outs = [o for o in node.output if o]
        schedule = "onchip"
        plans: list[TilePlan] = []
        in_ddr_before = in_ddr
        if w.unit == "none":
            schedule = "view"
            if any(i in in_ddr for i in acts):
                in_ddr.update(outs)
            ddr = sum(t.nbytes(o) for o in outs if o in t.graph_outputs and o not in in_ddr)
        elif w.bytes_read + w.bytes_written <= profile.onchip_bytes:
            ddr = sum(t.nbytes(i) for i in acts if i in in_ddr)
            ddr += sum(t.nbytes(o) for o in outs if o in t.graph_outputs)
        else:  # spills: everything streams through DDR, and its outputs live there
            schedule = "spill"
            ddr = w.bytes_read + w.bytes_written
            in_ddr_before = set(in_ddr)
            in_ddr.update(outs)
            plans = [p for p in (plan(node, w, t, profile.onchip_bytes, m) for m in modes) if p is not None]
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
        raw = LayerWeights(w.weight_bytes, w.weight_bytes) if w.unit != "none" else LayerWeights(0, 0)
        args = (compute, plans, in_ddr_before, per_cycle, profile.op_overhead_cycles)
        timing = _timing(w, schedule, ddr, raw, *args)
        stored = None
        if packing is not None and raw.raw:
            stored = layer_weights(list(node.input), packing, expand_rate)
            packed = _timing(w, schedule, ddr, stored, *args) if stored.compressed else timing
            if packed.cycles > timing.cycles:  # expanding costs more than the DDR time it saves: keep it raw
                stored = raw
            timing = packed if stored.compressed else timing
        bound = "compute" if timing.compute >= timing.memory else "memory"
        ops.append(OpEstimate(w.name, w.op_type, timing.cycles, timing.compute, timing.memory, bound, cursor,
                              timing.ddr, w, timing.schedule, timing.split, timing.spilled, stored))
        cursor += timing.cycles
    est = SubgraphEstimate(name=name or graph.name or "npu", profile=profile.name, npu_mode=npu_mode, cores=cores,
                           clock_mhz=profile.clock_mhz, ddr_bandwidth_gbps=_effective_bw(profile, limit),
                           ops=ops, notes=notes, soft_compression=soft_compression)
    log.debug("estimate %s on %s/%s: %d ops, %d cycles, %.3f ms", est.name, profile.name, npu_mode,
              len(ops), est.cycles, est.time_ms)
    return est


def estimate_model(subgraphs: Iterable[Any], profile: TargetProfile | str, npu_mode: str = "NPU1",
                   ddr_bw_limit_gbps: float = 0.0, *, tile_mode: bool = False,
                   slice_mode: bool = False, soft_compression: bool = False) -> ModelEstimate:
    """Estimate every NPU subgraph (``Subgraph(name, kind, graph, options)``) back to back; CPU ones
    are listed in ``not_estimated`` (their time depends on the host, which no profile describes).
    A subgraph's own ``enable_tile_mode`` / ``enable_slice_mode`` / ``enable_data_soft_compression`` /
    ``ddr_bw_limit`` option (a compiler.sub_configs range) overrides ``tile_mode`` / ``slice_mode`` /
    ``soft_compression`` / ``ddr_bw_limit_gbps``."""
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
        options = getattr(sg, "options", None) or {}
        # a compiler.sub_configs range's subgraph carries the range's own ddr_bw_limit
        est = estimate(sg.graph, profile, npu_mode, options.get("ddr_bw_limit", limit), name=sg.name,
                       tile_mode=bool(options.get("enable_tile_mode", tile_mode)),
                       slice_mode=bool(options.get("enable_slice_mode", slice_mode)),
                       soft_compression=bool(options.get("enable_data_soft_compression", soft_compression)))
        est.start_cycle = cursor
        cursor += est.cycles
        done.append(est)
    return ModelEstimate(profile=profile, npu_mode=npu_mode, cores=cores,
                         ddr_bandwidth_gbps=_effective_bw(profile, limit), subgraphs=done, not_estimated=skipped)
