"""Chrome trace (chrome://tracing, Perfetto) of the estimated NPU schedule, and a summary table.

Why a trace: a per-op timeline shows at a glance which layers dominate and whether they wait on
memory, which a total alone hides. Times come from the cost model's cycle counts at the profile
clock (cycles / MHz = microseconds); they are estimates, not measurements.

One process per NPU subgraph, one thread per compute unit (MAC array, vector unit, DMA), one
complete (``"ph": "X"``) event per op. Ops run back to back, so events never overlap. An op that
tile / slice mode split has one more event per piece on the "tiles" thread, inside the op's span
(the span shared by output bytes), naming the layer, the piece, its shape and its bytes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pulsar.compiler.cost import ModelEstimate, OpEstimate
from pulsar.utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

# unit -> (tid, thread name); views share the DMA lane (they are zero-length unless they flush)
UNITS: dict[str, tuple[int, str]] = {
    "mac": (1, "MAC array"),
    "vector": (2, "vector unit"),
    "dma": (3, "DMA / data movement"),
    "none": (3, "DMA / data movement"),
}
TILES = (4, "tiles (tile / slice mode)")


def _op_args(op: OpEstimate) -> dict[str, Any]:
    w = op.workload
    args: dict[str, Any] = {
        "op_type": op.op_type,
        "bound": op.bound,
        "cycles": op.cycles,
        "compute_cycles": op.compute_cycles,
        "memory_cycles": op.memory_cycles,
        "macs": w.macs,
        "elementwise_ops": w.elementwise_ops,
        "bytes_read": w.bytes_read,
        "weight_bytes": w.weight_bytes,
        "bytes_written": w.bytes_written,
        "ddr_bytes": op.ddr_bytes,
        "operand_bits": w.operand_bits,
        "schedule": op.schedule,
    }
    if op.weights is not None:  # soft compression on: the weights as stored in DDR
        args.update(weight_stored_bytes=op.weights.stored, weight_encoding=op.weights.encoding,
                    decompress_cycles=op.weights.decompress_cycles)
    if op.tiling is not None:
        args.update(tiles=op.tiling.n, split_axis=op.tiling.axis, working_set_bytes=op.tiling.working_set,
                    spill_cycles=op.spill_cycles)
    if w.note:
        args["note"] = w.note
    return args


def trace_events(estimate: ModelEstimate) -> list[dict[str, Any]]:
    """Metadata events naming processes / threads, then one "X" event per op."""
    mhz = estimate.profile.clock_mhz
    events: list[dict[str, Any]] = []
    for pid, sg in enumerate(estimate.subgraphs, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{sg.name} (NPU {sg.npu_mode}, {sg.cores} core(s))"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        lanes = {UNITS[op.workload.unit] for op in sg.ops} | ({TILES} if any(op.tiling for op in sg.ops) else set())
        for tid, label in sorted(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        for op in sg.ops:
            start = sg.start_cycle + op.start_cycle
            events.append({
                "name": op.name, "cat": op.op_type, "ph": "X", "pid": pid, "tid": UNITS[op.workload.unit][0],
                "ts": start / mhz, "dur": op.cycles / mhz, "args": _op_args(op),
            })
            events.extend(_tile_events(op, pid, start, mhz))
    return events


def _tile_events(op: OpEstimate, pid: int, start: int, mhz: float) -> list[dict[str, Any]]:
    """One event per piece of a split op, back to back inside the op's span."""
    if op.tiling is None:
        return []
    total = sum(t.out_bytes for t in op.tiling.tiles) or 1
    out, at = [], float(start)
    for tile in op.tiling.tiles:
        dur = op.cycles * tile.out_bytes / total
        out.append({"name": f"{op.name} [{op.tiling.mode} {tile.index}]", "cat": f"{op.op_type}/{op.tiling.mode}",
                    "ph": "X", "pid": pid, "tid": TILES[0], "ts": at / mhz, "dur": dur / mhz,
                    "args": {"layer": op.name, "mode": op.tiling.mode, "tile": tile.index, "axis": op.tiling.axis,
                             "range": [tile.start, tile.stop], "shape": list(tile.shape),
                             "in_bytes": tile.in_bytes, "out_bytes": tile.out_bytes,
                             "weight_bytes": tile.weight_bytes}})
        at += dur
    return out


def chrome_trace(estimate: ModelEstimate, path: str | Path) -> Path:
    """Write the trace JSON to ``path`` (atomically) and return the path."""
    p = estimate.profile
    doc = {
        "traceEvents": trace_events(estimate),
        "displayTimeUnit": "ns",
        "otherData": {
            "generator": "pulsar cost model (estimate, not a measurement)",
            "target_hardware": p.name,
            "profile_source": p.source,
            "npu_mode": estimate.npu_mode,
            "cores": estimate.cores,
            "clock_mhz": p.clock_mhz,
            "ddr_bandwidth_gbps": estimate.ddr_bandwidth_gbps,
            "total_cycles": estimate.cycles,
            "total_ms": estimate.time_ms,
            "macs": estimate.macs,
            "achieved_tops": estimate.tops,
            "not_estimated": list(estimate.not_estimated),
            "weight_bytes": estimate.weight_bytes[0],
            "weight_stored_bytes": estimate.weight_bytes[1],
        },
    }
    out = atomic_write_text(path, json.dumps(doc, indent=1))
    log.debug("wrote NPU trace %s (%d ops)", out, sum(len(s.ops) for s in estimate.subgraphs))
    return out


SUMMARY_COLUMNS = ("subgraph", "ops", "macs", "cycles", "ms", "compute_share", "memory_share")


def summary_rows(estimate: ModelEstimate) -> list[dict[str, Any]]:
    """One row per subgraph (keys ``SUMMARY_COLUMNS``) plus a ``total`` row; CPU subgraphs have None
    for the numbers (not estimated). Shares are fractions of the subgraph's cycles."""
    rows: list[dict[str, Any]] = []
    for sg in estimate.subgraphs:
        share = sg.bound_share
        rows.append({"subgraph": sg.name, "ops": len(sg.ops), "macs": sg.macs, "cycles": sg.cycles,
                     "ms": sg.time_ms, "compute_share": share["compute"], "memory_share": share["memory"]})
    for name in estimate.not_estimated:
        rows.append({"subgraph": f"{name} (cpu, not estimated)", "ops": None, "macs": None, "cycles": None,
                     "ms": None, "compute_share": None, "memory_share": None})
    total = estimate.cycles or 1
    compute = sum(o.cycles for s in estimate.subgraphs for o in s.ops if o.bound == "compute") / total
    rows.append({"subgraph": "total", "ops": sum(len(s.ops) for s in estimate.subgraphs), "macs": estimate.macs,
                 "cycles": estimate.cycles, "ms": estimate.time_ms,
                 "compute_share": compute if estimate.cycles else 0.0,
                 "memory_share": 1.0 - compute if estimate.cycles else 0.0})
    return rows


SPLIT_COLUMNS = ("subgraph", "layer", "schedule", "pieces", "axis", "working set KiB", "DDR KiB", "cycles",
                 "spilled cycles")


def split_rows(estimate: ModelEstimate) -> list[list[str]]:
    """One row per op that does not fit on chip: tiled / sliced (its pieces, their working set, its
    cycles against spilling it) or spilled (tile and slice mode off, or no split fits)."""
    rows = []
    for sg in estimate.subgraphs:
        for op in sg.ops:
            if op.schedule not in ("spill", "tile", "slice"):
                continue
            p = op.tiling
            rows.append([sg.name, op.name, op.schedule, str(p.n) if p else "-", str(p.axis) if p else "-",
                         f"{p.working_set / 1024:.1f}" if p else "-", f"{op.ddr_bytes / 1024:.1f}", f"{op.cycles:,}",
                         f"{op.spill_cycles:,}" if p else f"{op.cycles:,}"])
    return rows


def compression_summary(estimate: ModelEstimate) -> dict[str, Any] | None:
    """Weight bytes raw and as stored, in total and per layer with weights, for the subgraphs with soft
    compression on (the compiled model's metadata); None when no subgraph has it."""
    subgraphs = [sg for sg in estimate.subgraphs if sg.soft_compression]
    if not subgraphs:
        return None
    packed = [(sg.name, op.name, op.weights) for sg in subgraphs for op in sg.ops if op.weights and op.weights.raw]
    layers: list[dict[str, Any]] = [{"subgraph": s, "layer": name, "raw_bytes": w.raw, "stored_bytes": w.stored,
                                     "encoding": w.encoding} for s, name, w in packed]
    raw = sum(w.raw for _, _, w in packed)
    stored = sum(w.stored for _, _, w in packed)
    return {"subgraphs": [sg.name for sg in subgraphs], "raw_bytes": raw, "stored_bytes": stored,
            "ratio": round(stored / raw, 6) if raw else 1.0, "layers": layers}


def tile_plans(estimate: ModelEstimate) -> list[dict[str, Any]]:
    """The split layers' schedules as JSON (the compiled model's metadata): layer, mode, axis and the
    output range of every piece."""
    return [{"subgraph": sg.name, "layer": op.name, "mode": op.tiling.mode, "axis": op.tiling.axis,
             "tiles": [[t.start, t.stop] for t in op.tiling.tiles]}
            for sg in estimate.subgraphs for op in sg.ops if op.tiling is not None]
