"""Frontend stage: load, fix shapes, check config names, optimize, write frontend/optimized.onnx."""

from __future__ import annotations

import hashlib
import logging
from itertools import islice
from pathlib import Path

import onnx

from pulsar.config.semantic import check_against_model
from pulsar.context import BuildContext
from pulsar.core.custom_ops import check_known_ops, load_plugins
from pulsar.core.external_data import save_with_external_data
from pulsar.errors import PulsarError
from pulsar.frontend.loader import load_model
from pulsar.frontend.pass_manager import compare_models, log_records, optimize_deferred, optimized_again
from pulsar.frontend.patch import apply_const_processors, apply_op_processors
from pulsar.frontend.report import frontend_report_rows, summarize
from pulsar.frontend.shapes import apply_input_shapes, infer_shapes, parse_input_shapes, require_static_inputs
from pulsar.frontend.simplify import DEFAULT_SIMPLIFIER, simplify
from pulsar.ui import show, table
from pulsar.utils.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

# the calibration pass keeps the inputs and float outputs of its first 8 samples up to 64 MiB (the
# quant stage's Reference); a check whose 2 samples hold more than a quarter of that would find none kept
DEFER_BYTES = 16 << 20


def load_and_check(ctx: BuildContext) -> onnx.ModelProto:
    """Load the model with ``input_shapes`` applied and validate every config name against it."""
    cfg = ctx.cfg
    load_plugins(cfg.op_plugins, "op_plugins")  # before loading: the checker needs their ops' schemas
    model = load_model(cfg.input)
    check_known_ops(model, f"model {cfg.input}")
    shapes = parse_input_shapes(cfg.input_shapes)
    if shapes:
        model = apply_input_shapes(model, shapes)
    require_static_inputs(model)
    if ctx.import_quant is not None:  # QuantONNX: the quant stage takes the Q/DQ pairs apart first
        model, ctx.imported = ctx.import_quant(model)
    check_against_model(cfg, model)
    for line in apply_const_processors(model, cfg.const_processors) + apply_op_processors(model, cfg.op_processors):
        log.info("patched %s", line)
    return infer_shapes(model, in_place=True)  # loaded here: ours to change


def run_frontend(ctx: BuildContext, original: onnx.ModelProto) -> onnx.ModelProto:
    opt = ctx.cfg.onnx_opt
    samples = list(islice(iter(ctx.calibration), 2)) if ctx.calibration is not None else None
    ctx.check_samples = samples or []
    model = original
    before = summarize(model)
    rows = []  # (pass, iterations, seconds) of what changed the graph, the simplifier first
    if opt.enable_onnxsim:
        if ctx.imported:
            raise PulsarError(
                "onnx_opt.enable_onnxsim: a QuantONNX model's imported scales are bound to its tensor "
                "names, which a simplifier folds away; set `onnx_opt.enable_onnxsim: false`"
            )
        simplified = simplify(
            model, opt.simplifier or DEFAULT_SIMPLIFIER, model_name=Path(ctx.cfg.input).name,
            check=not opt.disable_transformation_check, samples=samples,
        )  # fmt: skip
        model = simplified.model
        if simplified.fallback is None:
            rows.append((simplified.tool, 1, f"{simplified.seconds:.2f}"))
    records = []
    if ctx.imported:
        log.info("QuantONNX input: graph passes skipped so the imported scales keep their tensors")
    if not ctx.imported and not opt.disable_onnx_optimization:
        # the check of the optimized graph waits for the calibration pass, which runs that graph on the
        # same samples (the quant stage settles it), unless the model_check table below runs it now
        # anyway, the graph the replay would start from is a simplified copy (kept alive only for it),
        # or the samples and outputs it holds meanwhile are large (the pass would not keep them either)
        defer = model is original and not opt.model_check
        model, records, pending = optimize_deferred(model, check=not opt.disable_transformation_check,
                                                    samples=samples)
        if pending is not None and (not defer or pending.held_bytes() > DEFER_BYTES):
            settled = pending.settle()
            model = optimized_again(settled, model)
            records = list(settled[1].values()) if settled is not None else records
        else:
            ctx.frontend_check = pending
        log_records(records)
    else:
        model = infer_shapes(model)  # optimize() ends with it
    show(table("Frontend report", ["op type / total", "before", "after"], frontend_report_rows(before, summarize(model))),
         quiet=ctx.quiet)
    rows += [(r.name, r.changed_iterations, f"{r.seconds:.2f}") for r in records if r.changed_iterations]
    if rows:
        show(table("Passes that changed the graph", ["pass", "iterations", "seconds"], rows), quiet=ctx.quiet)
    if opt.model_check:
        rows = compare_models(original, model, samples)
        show(
            table(
                "Model check: optimized vs original",
                ["output", "max abs diff", "rel diff", "cosine"],
                [
                    (r["output"], f"{r['max_abs_diff']:.3g}", f"{r['rel_diff']:.3g}", f"{r['cosine']:.6f}")
                    for r in rows
                ],
            ),
            quiet=ctx.quiet,
        )
    path = ctx.path("frontend", "optimized.onnx")
    if opt.save_tensors_data:  # the weights in optimized.onnx.data: a small graph file, no 2 GiB limit
        files = save_with_external_data(model, path)
        if len(files) > 1:
            ctx.artifacts["optimized model tensors data"] = files[1]
        log.info("onnx_opt.save_tensors_data: %s written with %s", path.name,
                 f"its tensors in {files[1].name}" if len(files) > 1 else "no tensor large enough to move out")
    else:
        data = model.SerializeToString()
        atomic_write_bytes(path, data, background=True)  # written while quantization runs
        # the bytes' digest, while they exist: the calibration cache key hashes this model
        ctx.float_digest = (model, hashlib.sha256(data))
    ctx.artifacts["optimized float model"] = path
    return model
