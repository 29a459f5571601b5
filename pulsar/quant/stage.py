"""Quantization stage: calibration statistics (one streaming pass, cached), activation ranges,
QDQ export to quant/quantized.onnx and the per-tensor quant/quant_config.json."""

from __future__ import annotations

import hashlib
import json
import logging
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.config.semantic import check_layer_configs
from pulsar.context import BuildContext
from pulsar.core.handoff import QuantResult
from pulsar.frontend.patch import apply_op_processors
from pulsar.quant.algorithms import auto_mixed_precision
from pulsar.quant.algorithms.auto_mixed_precision import COMPUTE_OPS
from pulsar.quant.algorithms.bulk_range import widen_flattened
from pulsar.quant.algorithms.easy_quant import easy_quant, update_params
from pulsar.quant.algorithms.refine_scale import weighted_layer_inputs
from pulsar.quant.algorithms.smooth_quant import apply_smooth_quant
from pulsar.quant.algorithms.table_inputs import widen_table_inputs
from pulsar.quant.analysis import analyze, precision_table, worst_rows, write_mermaid, write_table
from pulsar.quant.analysis.table import publish_slices
from pulsar.quant.calibrate import Reference, collect_statistics
from pulsar.quant.calibration_set import DeferredStats, fused_away
from pulsar.quant.datasets import CalibrationData, DatasetConfig, InputSpec
from pulsar.quant.graph import QuantGraph
from pulsar.quant.in_ir import model_ranges
from pulsar.quant.joins import join_presets
from pulsar.quant.layer_configs import resolve_layer_precision, show_layer_config_table
from pulsar.quant.layer_tuning import resolve_layer_tuning
from pulsar.quant.model_check import SLICE_CHECK_SAMPLES, QuantCheck, check_quantized_model
from pulsar.quant.plan import QuantPlan, make_plan
from pulsar.quant.precision import DEFAULT_DTYPE, HIGHEST_DTYPE, NodePrecision
from pulsar.quant.ranges import RangeInputs, activation_ranges
from pulsar.quant.samples import Samples, check_sample_dirs, open_sample_dir
from pulsar.quant.scheme import BITS, TensorQuant
from pulsar.quant.shifts import shift_presets
from pulsar.quant.statistics_file import load_statistics_file, write_statistics
from pulsar.ui import plural, show, table
from pulsar.utils.atomic import atomic_write_bytes, atomic_write_text
from pulsar.utils.jsonrows import dumps_rows
from pulsar.utils.progress import counted, progress_task, progress_tasks

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig, InputProcessor, QuantConfig

log = logging.getLogger(__name__)

def _processor_for(cfg: BuildConfig, name: str) -> InputProcessor | None:
    match = [p for p in cfg.input_processors if p.tensor_name == name]
    match = match or [p for p in cfg.input_processors if p.tensor_name == "DEFAULT"]
    return match[0] if match else None


def input_specs(cfg: BuildConfig, model: onnx.ModelProto) -> list[InputSpec]:
    """What each model input expects, including the color format / layout Image data is turned into."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = tuple(d.dim_value for d in t.shape.dim)
        proc = _processor_for(cfg, vi.name)
        layout = proc.tensor_layout if proc and proc.tensor_layout else "NCHW"
        fmt = proc.tensor_format if proc and proc.tensor_format else "AutoColorSpace"
        if fmt == "AutoColorSpace":
            channels = shape[1] if layout == "NCHW" and len(shape) == 4 else (shape[-1] if shape else 3)
            fmt = "GRAY" if channels == 1 else "BGR"
        specs.append(InputSpec(vi.name, shape, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type), fmt, layout))
    return specs


def open_calibration(ctx: BuildContext, model: onnx.ModelProto) -> CalibrationData:
    configs = [DatasetConfig(ic.tensor_name, ic.calibration_dataset, ic.calibration_format, ic.calibration_size,
                             tuple(ic.calibration_mean or ()), tuple(ic.calibration_std or ()),
                             field_path=f"quant.input_configs[{i}]")
               for i, ic in enumerate(ctx.cfg.quant.input_configs)]
    data = CalibrationData(input_specs(ctx.cfg, model), configs)
    rows = [(d["input"], list(d["shape"]), d["dataset"], d["format"], d["tensor_format"], list(d["mean"]),
             list(d["std"]), d["samples"]) for d in data.describe()]
    show(table("Quant Config Table", ["Input", "Shape", "Dataset", "Data Format", "Tensor Format", "Mean", "Std",
                                      "Samples"], rows), quiet=ctx.quiet)
    return data


def calibration_tensors(model: onnx.ModelProto) -> list[str]:
    """Every float activation, quantized or not in this build: statistics then do not depend on the
    method or the mixed-precision setting, so the cache serves every later build of this model + data."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    floats = {v.name for v in [*g.input, *g.output, *g.value_info]
              if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    names = [i.name for i in g.input if i.name not in inits]
    names += [o for n in g.node for o in n.output if o]
    return [n for n in names if n in floats]


def _cache_key(model: onnx.ModelProto, data: CalibrationData, q: QuantConfig,
               digest: tuple[onnx.ModelProto, Any] | None = None) -> str:
    """Model bytes + data + statistics settings. ``digest``: (model, sha256 of its bytes) from the
    frontend, used when it is this very model (a 90 MB model costs 0.2 s to serialize and hash)."""
    h = digest[1].copy() if digest is not None and digest[0] is model else hashlib.sha256(model.SerializeToString())
    h.update(data.fingerprint().encode())
    h.update(f"bins={q.calibration_bins} momentum={q.calibration_momentum!r}".encode())
    if q.calibration_histogram_values:  # 0 (every value): the key as before the field
        h.update(f" binned={q.calibration_histogram_values}".encode())
    return h.hexdigest()[:24]


def check_dtypes(qmodel: onnx.ModelProto, params: dict[str, TensorQuant]) -> int:
    """``quant.check: 1``: every quantized tensor's Q/DQ pair carries the dtype its config says."""
    inits = {t.name: t for t in qmodel.graph.initializer}
    checked = 0
    for n in qmodel.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        name = n.output[0] if not n.output[0].endswith("/dq") else n.output[0][:-3]
        tq = params.get(name)
        zp = inits.get(n.input[2]) if len(n.input) > 2 else None
        if tq is None or zp is None:
            raise RuntimeError(f"quant check: DequantizeLinear {n.name} has no quant config")
        got = onnx.helper.tensor_dtype_to_np_dtype(zp.data_type)
        if np.dtype(got) != np.dtype(tq.np_dtype):
            raise RuntimeError(f"quant check: {name} is {got} in the model but {tq.dtype} in the quant config")
        checked += 1
    missing = [t for t in params if f"{t}/DequantizeLinear" not in {n.name for n in qmodel.graph.node}]
    if missing:
        raise RuntimeError(f"quant check: no Q/DQ for {missing[:3]}")
    return checked


NPU_ANALYSIS_SAMPLES = 32


def analysis_samples(ctx: BuildContext) -> Samples:
    """quant.input_sample_dir, else the calibration data, as the model's own inputs. The directory holds
    the deployed inputs (what pulsar run and compiler.input_sample_dir take), converted here through the
    input_processors; see :mod:`pulsar.quant.samples`."""
    sample_dir = ctx.cfg.quant.input_sample_dir
    if not sample_dir:
        return cast("Samples", ctx.calibration)
    return open_sample_dir("quant.input_sample_dir", sample_dir, ctx.cfg, ctx.float_model)


def run_precision_analysis(ctx: BuildContext, qmodel: onnx.ModelProto, qjson: dict[str, Any]) -> None:
    """quant.precision_analysis: per-layer cosine / MSE / SQNR of the QDQ model against the float one."""
    method = ctx.cfg.quant.precision_analysis_method
    samples = analysis_samples(ctx)
    with progress_task(ctx.stages, f"precision analysis ({method} Reference, {len(samples)} sample{'s' if len(samples) != 1 else ''})",
                       len(samples)) as task:
        rows = analyze(ctx.float_model, qmodel, samples, method=method, quant_json=qjson, progress=task)
    title = f"Quant Precision Table [{method} Reference]"
    show(precision_table(rows, title), quiet=ctx.quiet)
    tpath, mpath = ctx.path("quant", "debug", "precision_analysis_table.txt"), ctx.path("quant", "debug",
                                                                                       "precision_analysis.mmd")
    write_table(rows, tpath, title=title)
    spath = ctx.path("quant", "debug", "precision_analysis_slices.txt")
    publish_slices(rows, spath, title, ctx.quiet)
    ctx.artifacts["precision analysis per slice"] = spath
    write_mermaid(ctx.float_model, rows, mpath)
    worst = ", ".join(f"{r.node} ({r.cosine:.4f})" for r in worst_rows(rows, 5))
    log.info("precision analysis: lowest cosine %s", worst)
    ctx.artifacts["precision analysis table"] = tpath
    ctx.artifacts["precision analysis graph (mermaid)"] = mpath


def show_placement(ctx: BuildContext, plan: QuantPlan) -> None:
    """Why each op runs where it does: CPU ops grouped by op type and reason, with the fix."""
    ops = {n.name: n.op_type for n in ctx.float_model.graph.node}
    groups: dict[tuple[str, str], int] = {}
    for name, (device, why) in plan.placement.items():
        if device == "CPU":
            groups[(ops[name], why)] = groups.get((ops[name], why), 0) + 1
    npu = sum(1 for d, _ in plan.placement.values() if d == "NPU")
    log.info("placement: %d of %d ops on the NPU, %d on the CPU (reasons per node in quant_config.json)", npu,
             len(plan.placement), len(plan.placement) - npu)
    if groups:
        rows = [(op, n, why) for (op, why), n in sorted(groups.items(), key=lambda kv: -kv[1])]
        show(table("Ops on the CPU", ["op type", "count", "why / how to move it"], rows), quiet=ctx.quiet)


def plan_kw(q: QuantConfig) -> dict[str, Any]:
    return {"optimize": not q.disable_quant_optimization, "ln_scale_dtype": q.ln_scale_data_type}


def planned(model: onnx.ModelProto, precision: dict[str, NodePrecision], stats: dict[str, Any],
            q: QuantConfig) -> QuantPlan:
    """The plan of ``precision``, heavy-tailed 8-bit tensors raised to 16 bits (:mod:`bulk_range`);
    the outputs of nodes a layer_configs entry chose keep what it says."""
    plan = make_plan(model, precision, **plan_kw(q))
    chosen = {o for n in model.graph.node if precision.get(n.name, NodePrecision()).explicit for o in n.output}
    refined = set() if q.disable_auto_refine_scale else weighted_layer_inputs(model, plan)
    widen_flattened(plan, stats, chosen, refined)
    widen_table_inputs(model, plan, chosen)
    return plan


def _raised(precision: dict[str, NodePrecision], layers: list[str], dtype: str,
            fused_into: dict[str, str] | None = None) -> dict[str, NodePrecision]:
    """``layers`` (and the Relu / Clip fused into them, which own their output) at 16 bits."""
    out = dict(precision)
    for name in layers:
        for node in (name, (fused_into or {}).get(name)):
            if node:
                out[node] = NodePrecision(dtype, weight_data_type="S16")
    return out


def run_auto_mixed_precision(ctx: BuildContext, precision: dict[str, NodePrecision], stats: dict[str, Any],
                             export_kw: dict[str, Any], range_inputs: RangeInputs) -> dict[str, NodePrecision]:
    """quant.auto_mixed_precision: raise the most sensitive layers to 16 bits within the budget and
    write the resulting layer_configs for the user to keep."""
    amp, model = ctx.cfg.quant.auto_mixed_precision, ctx.float_model
    samples = list(islice(iter(ctx.calibration), amp.num_samples))
    ops = {n.name: n.op_type for n in model.graph.node}
    base = planned(model, precision, stats, ctx.cfg.quant)
    narrow = {t for t, d in base.dtypes.items() if BITS[d] == 8}
    weighted = {w.node for w in base.weights}
    touches = {n.name for n in model.graph.node if n.name in weighted or narrow & {*n.input, *n.output}}
    # a link inside a fused lookup-table chain touches no 8-bit tensor: raising it changes nothing
    candidates = {n for n in base.quantized_nodes if ops[n] in COMPUTE_OPS and not precision[n].explicit
                  and n in touches}
    producer = {o: n.name for n in model.graph.node for o in n.output}
    fused_into = {producer[t]: act for t, act in base.fused.items()}

    def export(layers: list[str]) -> onnx.ModelProto:
        raised = _raised(precision, layers, amp.data_type, fused_into)
        plan = planned(model, raised, stats, ctx.cfg.quant)
        trial = RangeInputs(tuning=range_inputs.tuning, in_ir=range_inputs.in_ir, edited=range_inputs.edited)
        ranges = activation_ranges(stats, plan, ctx.cfg.quant, model, trial)
        return QuantGraph.calibrated(model, plan, raised, ranges, **export_kw, tuning=trial.tuning).to_qdq()

    with progress_tasks(ctx.stages) as new_task:
        layers, trials, ranking = auto_mixed_precision.search(model, export, samples, candidates,
                                                              max_layers=amp.max_16bit_layers,
                                                              target_cosine=amp.target_cosine, new_task=new_task)
    show(table("Auto mixed precision (end-to-end output cosine vs float)", ["16-bit layers", "cosine", "layers"],
               [(len(t.layers), f"{t.cosine:.6f}", ", ".join(t.layers[:6]) + (" ..." if len(t.layers) > 6 else ""))
                for t in trials]), quiet=ctx.quiet)
    named = [n for layer in layers for n in (layer, fused_into.get(layer)) if n]
    entry = {"layer_names": named, "data_type": amp.data_type, "weight_data_type": "S16"} if layers else None
    path = ctx.path("quant", "auto_mixed_precision.json")
    atomic_write_text(path, json.dumps({
        "layer_configs": [entry] if entry else [],
        "trials": [{"layers": t.layers, "cosine": t.cosine} for t in trials],
        "sensitivity": [{"layer": n, "cosine_lost": c} for n, c in ranking],
    }, indent=1))
    ctx.artifacts["auto mixed precision (layer_configs to keep)"] = path
    log.info("auto mixed precision: %d layer(s) raised to %s; layer_configs written to %s", len(layers),
             amp.data_type, path)
    return _raised(precision, layers, amp.data_type, fused_into)


def run_smooth_quant(ctx: BuildContext) -> None:
    """quant.enable_smooth_quant: migrate activation outliers into the weights (exact in float), before
    calibration, so statistics and the QDQ model are those of the smoothed graph."""
    q = ctx.cfg.quant
    n = len(ctx.calibration)
    with progress_task(ctx.stages, f"smooth quant: channel ranges ({n} sample{'s' if n != 1 else ''})", n) as task:
        ctx.model, reports = apply_smooth_quant(ctx.float_model, counted(ctx.calibration, task),
                                                alpha=q.smooth_quant_strength, threshold=q.smooth_quant_threshold)
    rows = [(r.layer, r.op_type, f"{r.outlier_ratio:.1f}", "yes" if r.smoothed else "no",
             r.absorbed_into or "-", f"{r.max_scale:.3g}") for r in reports]
    show(table("SmoothQuant", ["layer", "op", "outlier ratio", "smoothed", "1/s absorbed into", "max scale"], rows),
         quiet=ctx.quiet)
    log.info("smooth quant: %d of %d candidate layers smoothed (alpha %.2f, threshold %.2f)",
             sum(r.smoothed for r in reports), len(reports), q.smooth_quant_strength, q.smooth_quant_threshold)


def run_easy_quant(ctx: BuildContext, qg: QuantGraph) -> None:
    """quant.enable_easy_quant: per-layer search of output and weight scales maximising the cosine with
    the float layer (arXiv 2006.16669), on up to 8 calibration samples; the scales found are written
    into the quantized graph."""
    samples = list(islice(iter(ctx.calibration), 8))
    with progress_task(ctx.stages, f"easy quant: layer scale search ({len(samples)} sample{'s' if len(samples) != 1 else ''})", None) as task:
        searched, rows = easy_quant(ctx.float_model, qg.to_qdq(), samples, progress=task)
    changed = update_params(qg.params, searched)
    # the weights as the search rounded them (its own float32 division): the export keeps those integers
    inits = {t.name: t for t in searched.graph.initializer}
    for w in qg.plan.weights:
        if w.tensor in changed:
            tq = qg.params[w.tensor]
            q = numpy_helper.to_array(inits[f"{w.tensor}/q"]).astype(np.float64)
            shape = [-1 if i == tq.axis else 1 for i in range(q.ndim)] if tq.axis is not None else []
            qg.set_weight(w.tensor, q * np.asarray(tq.scale, np.float64).reshape(shape))
    qg.rederive_biases(ctx.cfg.quant.refine_weight_threshold)
    show(table("EasyQuant (per-layer cosine vs float)", ["layer", "before", "after", "output scale x", "weight scale x"],
               [(r.layer, f"{r.cosine_before:.6f}", f"{r.cosine_after:.6f}", f"{r.act_factor:.3f}",
                 f"{r.weight_factor:.3f}") for r in rows]), quiet=ctx.quiet)
    log.info("easy quant: %d layers searched, %d scales changed", len(rows), len(changed))


def uses_in_ir(q: QuantConfig) -> bool:
    return q.calibration_method == "InIR" or any(lc.calibration_method == "InIR" for lc in q.layer_configs)


def _finetune_asked(q: QuantConfig) -> bool:
    """pulsar.quant.finetune.finetune_enabled, read without importing that package (and torch)."""
    return bool(q.enable_adaround or q.enable_brecq or q.enable_lsq)


def calibrate(ctx: BuildContext, model: onnx.ModelProto, precision: dict[str, NodePrecision]) -> dict[str, Any]:
    """Statistics of the float pass over the calibration data (:mod:`pulsar.quant.calibration_set`:
    tensors fused away in the plan of ``precision`` come later, if at all); the pass keeps the float
    outputs of the first samples for :func:`check_quantized_model`."""
    q, data = ctx.cfg.quant, ctx.calibration
    everything = calibration_tensors(model)
    # the statistics file holds every activation; otherwise the fused ones wait until something reads them
    deferred = set() if q.save_statistics else fused_away(model, precision, **plan_kw(q))
    ctx.float_reference = Reference([o.name for o in model.graph.output], SLICE_CHECK_SAMPLES)
    kw: dict[str, Any] = {"num_bins": q.calibration_bins, "momentum": q.calibration_momentum,
                          "sample_cap": q.calibration_histogram_values,
                          "cache_dir": ctx.work_dir / "cache", "cache_key": _cache_key(model, data, q, ctx.float_digest),
                          "device": q.device}  # quant.device: cuda runs the float pass in torch there
    with ctx.stages.progress() as bar:
        task = bar.add_task(f"calibrating ({plural(len(data), 'sample')})", total=len(data))
        stats = collect_statistics(model, [t for t in everything if t not in deferred], data,
                                   progress=lambda n: bar.update(task, completed=n), reference=ctx.float_reference,
                                   **kw)

    def fill(names: list[str]) -> dict[str, Any]:  # no progress bar: a reader may be inside a live one
        return collect_statistics(model, names, data, **kw)  # the cache keeps what it has and adds these

    return DeferredStats(stats, deferred, fill)


def settle_frontend_check(ctx: BuildContext, model: onnx.ModelProto | None) -> None:
    """The frontend's check of its optimized graph (:class:`pulsar.frontend.pass_manager.PendingCheck`),
    settled with the float outputs the calibration pass kept where they are that graph's (``model`` is
    the graph checked) on the check samples; otherwise (None) the check runs the graph itself."""
    pending, ctx.frontend_check = ctx.frontend_check, None
    if pending is None:
        return
    kept = None
    if model is not None and model is pending.model:
        kept = _kept_outputs(ctx.float_reference, pending.samples, list(pending.ref[0]) if pending.ref else [])
    pending.settle(kept)


def _kept_outputs(ref: Reference | None, samples: list[dict[str, Any]], outputs: list[str]) -> list[dict[str, Any]] | None:
    """The ``outputs`` ``ref`` kept for ``samples``; None unless it kept every one of them (the pass
    fetches float tensors only, and none whose statistics the cache holds) for exactly these inputs (a
    data set plugin may stream other samples on a second pass)."""
    if ref is None or len(ref.outputs) < len(samples):
        return None
    for sample, feed, got in zip(samples, ref.inputs, ref.outputs, strict=False):
        if any(name not in got for name in outputs):
            return None
        if any(name not in sample or not np.array_equal(sample[name], value) for name, value in feed.items()):
            return None
    return ref.outputs[: len(samples)]


def _statistics(ctx: BuildContext) -> tuple[onnx.ModelProto, dict[str, NodePrecision], Any, dict[str, tuple[float, float]]]:
    """The checks of the quant config against the float model, smooth quant, then the statistics (the
    calibration pass or the statistics file): (model, precision, statistics, hand-edited ranges)."""
    q = ctx.cfg.quant
    check_sample_dirs(ctx.cfg, ctx.float_model)
    if _finetune_asked(q):  # pulsar.quant.finetune imports torch (3 s): only a fine-tuning build loads it
        from pulsar.quant.finetune import check_finetune

        check_finetune(ctx.float_model, q)  # before anything expensive: what fine-tuning can train
    if q.enable_smooth_quant:
        run_smooth_quant(ctx)
    model = ctx.float_model
    edited: dict[str, tuple[float, float]] = {}
    check_layer_configs(ctx.cfg, model)
    precision = resolve_layer_precision(q.layer_configs, model, highest_mix_precision=q.highest_mix_precision,
                                        transformer_opt_level=q.transformer_opt_level)
    if q.statistics_file:
        stats, edited = load_statistics_file(Path(cast(str, q.statistics_file)), calibration_tensors(model),
                                             (q.calibration_bins, q.calibration_momentum))
    else:
        stats = calibrate(ctx, model, precision)
    return model, precision, stats, edited


def run_quant(ctx: BuildContext) -> QuantResult:
    q = ctx.cfg.quant
    if q.enable_smooth_quant or q.statistics_file:  # no float pass of the optimized graph to take outputs from
        settle_frontend_check(ctx, None)
    try:
        model, precision, stats, edited = _statistics(ctx)
    except Exception:
        settle_frontend_check(ctx, None)  # a frontend pass that broke the graph is named first
        raise
    settle_frontend_check(ctx, model)
    show_layer_config_table(q.layer_configs, ctx.quiet)
    range_inputs = RangeInputs(tuning=resolve_layer_tuning(q.layer_configs, model, q), edited=edited,
                               in_ir=model_ranges(ctx.cfg.input, model, calibration_tensors(model)) if uses_in_ir(q)
                               else {})
    precision = {**precision, **shift_presets(model, stats, precision)}
    precision = {**precision, **join_presets(model, stats, precision)}
    export_kw = {"bias_fp32": q.conv_bias_data_type == "FP32", "refine_weight_threshold": q.refine_weight_threshold}
    if q.auto_mixed_precision.enable:
        precision = run_auto_mixed_precision(ctx, precision, stats, export_kw, range_inputs)
    plan = planned(model, precision, stats, q)
    show_placement(ctx, plan)
    log.info("quantizing %d ops (%d activations, %d weights, %d biases); %d ops stay float",
             len(plan.quantized_nodes), len(plan.activations), len(plan.weights), len(plan.biases),
             len(plan.float_nodes))
    ranges = activation_ranges(stats, plan, q, model, range_inputs)
    if q.save_statistics:  # hand-edited ranges stay edited (no range_by) in the file written again
        by = {k: v for k, v in range_inputs.range_by.items() if k not in edited}
        ctx.artifacts["calibration statistics"] = write_statistics(
            ctx.path("quant", "statistics.json"), stats, {**range_inputs.raw, **edited}, by)
    qg = QuantGraph.calibrated(model, plan, precision, ranges, **export_kw, fixed=ctx.imported,
                               tuning=range_inputs.tuning)
    qg.calibration = range_inputs.used
    if ctx.imported:
        kept = sum(1 for t in qg.params if t in ctx.imported)
        log.info("QuantONNX input: %d tensors keep their imported scales, %d calibrated", kept,
                 len(qg.params) - kept)
    if q.enable_easy_quant:
        run_easy_quant(ctx, qg)
    if _finetune_asked(q):
        from pulsar.quant.finetune import run_finetune

        run_finetune(ctx, qg)
    ctx.quant_graph = qg
    qmodel = qg.to_qdq()
    patched = apply_op_processors(qmodel, ctx.cfg.quant_op_processors, field="quant_op_processors")
    for line in patched:
        log.info("patched quantized graph: %s", line)
    # the outputs on a few samples: the session opens here, the runs go on while the compiler works
    ctx.quant_check = QuantCheck.start(check_quantized_model(ctx, qmodel, bool(patched)))
    if q.check >= 1:
        log.info("quant check: %d quantized tensors have the dtypes of their config", check_dtypes(qmodel, qg.params))
    path = ctx.path("quant", "quantized.onnx")
    atomic_write_bytes(path, qmodel.SerializeToString(), background=True)  # written while the compiler runs
    jpath = ctx.path("quant", "quant_config.json")
    qjson = qg.to_json(q.calibration_method, HIGHEST_DTYPE if q.highest_mix_precision else DEFAULT_DTYPE)
    atomic_write_text(jpath, dumps_rows(qjson))  # one line per tensor and per node
    if q.precision_analysis and q.precision_analysis_mode == "Reference":
        ctx.quant_check.join()  # the analysis would repeat a failure of the check in other words
        run_precision_analysis(ctx, qmodel, qjson)
    elif q.precision_analysis:  # NPUBackend: runs after compilation, on at most this many samples
        ctx.analysis_samples = list(islice(analysis_samples(ctx), NPU_ANALYSIS_SAMPLES))
    ctx.artifacts["quantized model (QDQ ONNX)"] = path
    ctx.artifacts["quant config (per tensor)"] = jpath
    return QuantResult(qmodel, dict(qg.plan.placement))
