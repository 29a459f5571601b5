"""Compiler stage: processors attached, the QDQ graph lowered to NPU integer programs and CPU
subgraphs (pulsar/compiler/lower), the performance estimated on the target profile, everything
packaged into the compiled model (pulsar/core/container.py). The build then runs it in the simulator:
compiler.check (pulsar/runtime/check.py) and the NPUBackend precision analysis (pulsar/runtime/analysis.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from pulsar import __version__
from pulsar.compiler.cost import estimate_model
from pulsar.compiler.lower import LoweredModel, LowerOptions, fallback_report, lower_qdq_model
from pulsar.compiler.lower.model import SubRange
from pulsar.compiler.op_counts import (
    OpCounts,
    count_rows,
    processor_reason,
    processor_side,
    reconcile,
    subgraph_rows,
)
from pulsar.compiler.targets import load_profile
from pulsar.compiler.trace import (
    SPLIT_COLUMNS,
    SUMMARY_COLUMNS,
    chrome_trace,
    compression_summary,
    split_rows,
    summary_rows,
    tile_plans,
)
from pulsar.compiler.variants import Lowered, build_variants, merge, metadata_for
from pulsar.config.sub_configs import PER_RANGE
from pulsar.context import BuildContext
from pulsar.core.container import package, tensor_infos
from pulsar.core.custom_ops import plugin_files
from pulsar.core.handoff import QuantResult
from pulsar.core.variants import Variant
from pulsar.frontend.processors import attach_input_processors, attach_output_processors
from pulsar.quant.samples import calibration_normalization
from pulsar.ui import show, table

if TYPE_CHECKING:
    from pulsar.config.generated import CompilerConfig

log = logging.getLogger(__name__)


def attach_processors(ctx: BuildContext, qmodel: onnx.ModelProto, notes: list[str] | None = None) -> onnx.ModelProto:
    """Put input_processors in front of and output_processors behind the quantized graph, so the
    compiled model takes the deployed input (the QDQ artifact keeps the model's own format);
    ``notes`` collects (and logs) one line per processed tensor (the compiled model's metadata)."""
    cfg = ctx.cfg
    model, lines = attach_input_processors(qmodel, cfg.input_processors, calibration_normalization(cfg, qmodel))
    model, out_lines = attach_output_processors(model, cfg.output_processors)
    if notes is not None:  # the first lowering's lines (variants repeat them at their shapes)
        for line in lines + out_lines:
            log.info("processor: %s", line)
        notes.extend(lines + out_lines)
    return model


_RANGE_KEYS = ("start_tensor_names", "end_tensor_names", "sub_configs")


def sub_ranges(compiler: CompilerConfig) -> list[SubRange]:
    """compiler.sub_configs as lowering ranges; an option a sub-config leaves unset inherits the
    top-level compiler option (the schema does not fill sub-config defaults for that reason). The
    options in PER_RANGE act on the range's subgraphs: lowering, batches, estimate, compiler.check."""
    top = {f.name: getattr(compiler, f.name) for f in dataclasses.fields(compiler) if f.name not in _RANGE_KEYS}
    out = []
    for i, sc in enumerate(compiler.sub_configs):
        own = {k: getattr(sc, k, None) for k in top if getattr(sc, k, None) is not None}
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in {**top, **own}.items()}
        out.append(SubRange(f"sub{i}", list(sc.start_tensor_names), list(sc.end_tensor_names), options))
        # the config refuses or resets what cannot act per range (pulsar/config/sub_configs.py): never silent
        ignored = sorted(k for k, v in own.items() if k not in PER_RANGE and v != top[k])
        if ignored:
            log.warning("compiler.sub_configs[%d]: %s cannot act per range; the compiler section's value acts on "
                        "the whole model", i, ", ".join(ignored))
    return out


def _show_sub_configs(lowered: LoweredModel, subs: list[SubRange]) -> None:
    for sg in lowered.subgraphs:
        k = sg.options.get("sub_config")
        if k is None:
            continue
        sub = subs[k]
        log.info("sub_config %s (%s -> %s): NPU subgraph %s, %d ops, lut_items_in_bits %s, check %s", sub.name,
                 ", ".join(sub.start_tensor_names), ", ".join(sub.end_tensor_names), sg.name, len(sg.graph.node),
                 sub.options.get("lut_items_in_bits"), sub.options.get("check"))


def _show_placement(ctx: BuildContext, lowered: LoweredModel, qmodel: onnx.ModelProto, deployed: onnx.ModelProto,
                    placement: dict[str, tuple[str, str]] | None) -> OpCounts:
    """The CPU fallbacks, and the op counts reconciled with the quantization placement (every difference
    named); processor ops get their own reason (layer_configs cannot select them)."""
    sides = processor_side(qmodel, deployed)
    lowered.fallbacks = [dataclasses.replace(f, reason=processor_reason(sides[f.node])) if f.node in sides else f
                         for f in lowered.fallbacks]
    counts = reconcile(lowered, qmodel, deployed, placement)
    log.info("compiled: %s", counts.headline())
    # the quantization's own CPU ops were shown with their reasons in "Ops on the CPU"; this table holds
    # what the compiler decided itself (every CPU op is in the metadata's cpu_fallbacks)
    placed_cpu = {n for n, (device, _) in (placement or {}).items() if device == "CPU"}
    rows = fallback_report(dataclasses.replace(lowered, fallbacks=[f for f in lowered.fallbacks
                                                                   if f.node not in placed_cpu]))
    if rows:
        show(table("Ops kept on the CPU by the compiler", ["op", "nodes", "why"], rows), quiet=ctx.quiet)
    if counts.moves or any(counts.processor_ops.values()):
        show(table("Op counts: quantization placement -> compiled model", ["ops", "NPU", "CPU", "why"],
                   count_rows(counts)), quiet=ctx.quiet)
    show(table("Subgraphs in execution order", ["subgraph", "ops", "model ops", "why the counts differ"],
               subgraph_rows(counts)), quiet=ctx.quiet)
    return counts


def _estimate(ctx: BuildContext, lowered: LoweredModel, trace_name: str = "npu_perf_trace.json",
              show_table: bool = True) -> dict[str, Any]:
    """Cost-model estimate of the NPU subgraphs on the target; the Chrome trace with compiler.npu_perf."""
    cfg = ctx.cfg
    profile = load_profile(cfg.target_hardware)
    est = estimate_model(lowered.subgraphs, profile, cfg.npu_mode, cfg.compiler.ddr_bw_limit,
                         tile_mode=cfg.compiler.enable_tile_mode, slice_mode=cfg.compiler.enable_slice_mode,
                         soft_compression=cfg.compiler.enable_data_soft_compression)
    plans = tile_plans(est)
    if show_table:
        rows = [["-" if r[k] is None else f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k])
                 for k in SUMMARY_COLUMNS] for r in summary_rows(est)]
        show(table(f"Performance estimate: {profile.name}, {cfg.npu_mode} (a model, not a measurement)",
                   list(SUMMARY_COLUMNS), rows), quiet=ctx.quiet)
        split = split_rows(est)
        if split:
            show(table(f"Layers larger than {profile.name}'s on-chip memory ({profile.onchip_memory_kib:g} KiB): "
                       "tiled / sliced (compiler.enable_tile_mode / enable_slice_mode) or spilled to DDR",
                       list(SPLIT_COLUMNS), split), quiet=ctx.quiet)
        for p in plans:
            log.info("%s mode: %s split into %d pieces along axis %d", p["mode"], p["layer"], len(p["tiles"]),
                     p["axis"])
    if cfg.compiler.npu_perf:
        trace = chrome_trace(est, ctx.path("compiler", trace_name))
        ctx.artifacts[f"NPU performance trace {trace_name} (chrome://tracing, Perfetto)"
                      if trace_name != "npu_perf_trace.json"
                      else "NPU performance trace (chrome://tracing, Perfetto)"] = trace
    out = {"target": profile.name, "npu_mode": cfg.npu_mode, "cycles": int(est.cycles),
           "time_ms": round(float(est.time_ms), 6), "macs": int(est.macs)}
    if plans:  # the schedule of the split layers, in the compiled model's metadata
        out["tiling"] = plans
    packed = compression_summary(est)
    if packed is not None:  # compiler.enable_data_soft_compression: weight bytes per layer, raw and as stored
        out["soft_compression"] = packed
        if show_table:
            log.info("data soft compression: NPU weights %s -> %s bytes in DDR (ratio %.3f, %d of %d layers "
                     "compressed)", f"{packed['raw_bytes']:,}", f"{packed['stored_bytes']:,}", packed["ratio"],
                     sum(x["stored_bytes"] < x["raw_bytes"] for x in packed["layers"]), len(packed["layers"]))
    return out


def _subgraph_times(ctx: BuildContext) -> Callable[[LoweredModel], dict[str, float]]:
    cfg = ctx.cfg
    profile = load_profile(cfg.target_hardware)

    def times(lowered: LoweredModel) -> dict[str, float]:
        est = estimate_model(lowered.subgraphs, profile, cfg.npu_mode, cfg.compiler.ddr_bw_limit,
                             tile_mode=cfg.compiler.enable_tile_mode, slice_mode=cfg.compiler.enable_slice_mode,
                             soft_compression=cfg.compiler.enable_data_soft_compression)
        return {e.name: float(e.time_ms) for e in est.subgraphs}

    return times


def _variant_estimates(ctx: BuildContext, variants: list[Variant], lowered: dict[Variant, Lowered]
                       ) -> dict[Variant, dict[str, Any]]:
    """Estimate (and trace) every variant; one table row each."""
    out, rows = {}, []
    for v in variants:
        name = f"npu_perf_trace_group{v.group}_batch{v.batch}.json"
        est = _estimate(ctx, lowered[v].lowering, name, show_table=False)
        out[v] = est
        rows.append([str(v.group), str(v.batch), f"{est['time_ms']:.4g}", f"{est['time_ms'] / v.batch:.4g}",
                     f"{est['cycles']:,}"])
    show(table("Performance estimate per variant (a model, not a measurement)",
               ["group", "batch", "ms", "ms / sample", "cycles"], rows), quiet=ctx.quiet)
    return out


@dataclass
class CompilerOutput:
    """The compiled model and how it was lowered (what compiler.check lowers again)."""

    path: Path
    deployed: onnx.ModelProto  # the quantized graph with the processors attached, as lowered
    sub_configs: list[SubRange]
    cpu_nodes: dict[str, str]  # node -> why the quantization placed it on the CPU
    # every compiled (group, batch) -> its deployed graph (compiler.check 2 lowers each again)
    variants: dict[Variant, onnx.ModelProto] = dataclasses.field(default_factory=dict)


def run_compiler(ctx: BuildContext, quantized: QuantResult) -> CompilerOutput:
    """Lower the quantized graph to NPU integer programs and CPU subgraphs (per batch / shape variant),
    estimate, package."""
    cfg = ctx.cfg
    meta: dict[str, Any] = {
        "target_hardware": cfg.target_hardware,
        "npu_mode": cfg.npu_mode,
        "config_hash": ctx.config_hash,
        "calibration_method": cfg.quant.calibration_method,
        "source_model": ctx.source_model or Path(cfg.input).name,
        "built_by": f"pulsar {__version__}",
    }
    meta["processors"] = []
    subs = sub_ranges(cfg.compiler)
    qmodel, placement = quantized.qdq_model, dict(quantized.placement)
    # the quantization's CPU ops stay on the CPU (e.g. a manual op or an FP32 layer between quantized tensors)
    cpu_nodes = quantized.cpu_nodes()

    def lower(model: onnx.ModelProto, notes: list[str] | None = None) -> tuple[onnx.ModelProto, LoweredModel]:
        deployed = attach_processors(ctx, model, notes)
        lowered = lower_qdq_model(deployed, LowerOptions(lut_items_in_bits=cfg.compiler.lut_items_in_bits,
                                                         sub_configs=subs, cpu_nodes=cpu_nodes))
        for sg in lowered.subgraphs:
            sg.reference = lowered.references.get(sg.name)
            sg.options = {"lut_items_in_bits": cfg.compiler.lut_items_in_bits, **sg.options}
        return deployed, lowered

    deployed, lowered = lower(qmodel, meta["processors"])
    probe = Lowered(Variant(0, 1), deployed, lowered)
    counts = _show_placement(ctx, lowered, qmodel, deployed, placement)
    _show_sub_configs(lowered, subs)
    meta["estimate"] = _estimate(ctx, lowered)
    built = build_variants(cfg, qmodel, probe, lower, _subgraph_times(ctx), subs)
    top = built.lowered[built.order[0]].lowering
    if built.several:
        estimates = _variant_estimates(ctx, built.order, built.lowered)
        meta["estimate"] = estimates[built.order[0]]
        meta.update(metadata_for(built, estimates))
    meta["inputs"] = tensor_infos(top.inputs)
    meta["outputs"] = tensor_infos(top.outputs)
    meta["cpu_fallbacks"] = [{"node": f.node, "op_type": f.op_type, "reason": f.reason} for f in lowered.fallbacks]
    meta["op_counts"] = counts.to_json()
    if plugin_files(qmodel):  # pulsar run loads them (or --op_plugin) to run the plugin ops' CPU nodes
        meta["op_plugins"] = plugin_files(qmodel)
    subgraphs = merge(built) if built.several else lowered.subgraphs
    path = package(subgraphs, inputs=top.inputs, outputs=top.outputs,
                   opset_imports=lowered.opset_imports, metadata=meta, path=ctx.path(cfg.output_name),
                   ir_version=deployed.ir_version)
    ctx.artifacts["compiled model"] = path
    return CompilerOutput(path, deployed, subs, cpu_nodes, {v: built.lowered[v].deployed for v in built.order})
