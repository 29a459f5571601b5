"""Python API with the CLI's semantics: ``build`` and ``run_model`` (``Session`` for in-process use)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsar.config import load_build_config
from pulsar.context import BuildContext
from pulsar.errors import PulsarError
from pulsar.preflight import preflight
from pulsar.recompile import RecompilePlan, copy_quant_artifacts, plan_recompile, recompile_preflight
from pulsar.runtime.runner import run_model
from pulsar.ui import Stages, build_log, setup_logging, show, table
from pulsar.utils.atomic import atomic_write_text, background_writes, settle_writes
from pulsar.utils.malloc import tuned_allocator
from pulsar.utils.outdir import BuildOutput, check_dir_path
from pulsar.utils.scratch import use_scratch
from pulsar.utils.signals import terminate_as_interrupt

if TYPE_CHECKING:
    import onnx

    from pulsar.compiler.stage import CompilerOutput

log = logging.getLogger(__name__)

__all__ = ["BuildResult", "build", "check_build", "run_model"]


@dataclass
class BuildResult:
    output_dir: Path
    compiled_model: Path
    quantized_model: Path
    quant_config: Path
    optimized_model: Path
    config: dict[str, Any]
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # the quantized graph in memory (pulsar.quant.graph.QuantGraph): what the torch executor and tests run
    quant_graph: Any = field(default=None, repr=False, compare=False)


def build(input: str | Path | None = None, output_dir: str | Path | None = None,
          config: str | Path | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None, *,
          quiet: bool = False, debug: bool = False) -> BuildResult:
    """Build a compiled model. ``overrides`` use dotted keys like the CLI: ``{"quant.calibration_method": "KL"}``;
    ``input`` / ``output_dir`` are shorthands for the ``input`` / ``output_dir`` overrides.

    Nothing is written until every check that needs no artifact has passed (:mod:`pulsar.preflight`);
    then the build runs in a locked staging folder inside ``output_dir`` and its artifacts replace
    the previous ones only when it succeeds (:mod:`pulsar.utils.outdir`). SIGTERM stops it like Ctrl-C."""
    setup_logging(quiet=quiet, debug=debug)
    overrides = dict(overrides or {})
    if input is not None:
        overrides["input"] = str(input)
    if output_dir is not None:
        overrides["output_dir"] = str(output_dir)
    t0 = time.perf_counter()
    with build_log() as blog, terminate_as_interrupt(), tuned_allocator():
        plan = plan_recompile(config, overrides)  # model_type QuantModel / QuantAxModel, else None
        eff = plan.eff if plan else load_build_config(config, overrides)
        cfg = eff.cfg
        out = Path(cfg.output_dir)
        check_dir_path(out, "output_dir")
        if cfg.work_dir:
            check_dir_path(Path(cfg.work_dir), "work_dir")
        ctx = BuildContext(cfg=cfg, data=eff.data, config_hash=plan.config_hash if plan else eff.hash, output_dir=out,
                           work_dir=Path(cfg.work_dir) if cfg.work_dir else out, stages=Stages(quiet), quiet=quiet,
                           source_model=plan.source_model if plan else None)
        log.info("pulsar build: %s -> %s for %s %s (config hash %s)", cfg.input, out, cfg.target_hardware,
                 cfg.npu_mode, ctx.config_hash)
        if cfg.model_type == "QuantONNX":
            from pulsar.quant.import_qdq import strip_qdq

            ctx.import_quant = strip_qdq
        try:
            if plan is not None:
                return _recompile(ctx, plan, blog, t0)
            original, calibration = preflight(ctx)
            try:
                with BuildOutput(out) as target:
                    ctx.output_dir, ctx.final_output_dir = target.staging, out
                    blog.open(target.staging / "build.log")
                    with use_scratch(target.staging), background_writes():  # every write in place before commit
                        result = _run_stages(ctx, original, calibration, t0)
                    target.commit()
            finally:
                calibration.close()
        except PulsarError as e:
            log.debug("build failed: %s", e)  # the CLI prints it; build_failed.log keeps it too
            raise
    return result


def check_build(config: str | Path | dict[str, Any] | None, overrides: dict[str, Any]) -> Any:
    """Every check a build makes before it writes anything (config, output and work dirs, model, data,
    evaluation), without building; returns the effective config. A sweep runs it for each trial
    before the first."""
    plan = plan_recompile(config, overrides)
    eff = plan.eff if plan else load_build_config(config, overrides)
    cfg = eff.cfg
    out = Path(cfg.output_dir)
    check_dir_path(out, "output_dir")
    if cfg.work_dir:
        check_dir_path(Path(cfg.work_dir), "work_dir")
    ctx = BuildContext(cfg=cfg, data=eff.data, config_hash=eff.hash, output_dir=out,
                       work_dir=Path(cfg.work_dir) if cfg.work_dir else out, stages=Stages(quiet=True), quiet=True)
    if plan is not None:
        recompile_preflight(ctx, plan.source)
        return eff
    if cfg.model_type == "QuantONNX":
        from pulsar.quant.import_qdq import strip_qdq

        ctx.import_quant = strip_qdq
    _, calibration = preflight(ctx)
    calibration.close()
    return eff


def _run_compiled(ctx: BuildContext, qmodel: onnx.ModelProto, compiled: CompilerOutput, analysis: bool = True) -> None:
    """The runs of the compiled model in the simulator that belong to the compile step: every subgraph
    loads in its runtime (both modes), compiler.check, then the NPUBackend precision analysis (both lower the QDQ model again as the compiler did)."""
    from pulsar.runtime.validate import check_loadable

    cfg = ctx.cfg
    check_loadable(compiled.path, ctx.shown(compiled.path))
    # a sub_configs range may turn the check on for itself (check: 2 on one range, 0 at the top level)
    if cfg.compiler.check or any(s.options.get("check") for s in compiled.sub_configs):
        from pulsar.runtime.check import check_compiled

        check_compiled(ctx, compiled.path, compiled.deployed, compiled.sub_configs, compiled.cpu_nodes,
                       compiled.variants)
    if analysis and cfg.quant.precision_analysis and cfg.quant.precision_analysis_mode == "NPUBackend":
        from pulsar.runtime.analysis import run_npu_backend_analysis

        qjson = json.loads(ctx.path("quant", "quant_config.json").read_text())
        run_npu_backend_analysis(ctx, qmodel, qjson, ctx.analysis_samples, compiled.sub_configs, compiled.cpu_nodes)


def _run_stages(ctx: BuildContext, original: Any, calibration: Any, t0: float) -> BuildResult:
    from pulsar.compiler.stage import run_compiler
    from pulsar.frontend.stage import run_frontend
    from pulsar.quant.stage import run_quant

    data = ctx.data
    cfg_path = atomic_write_text(ctx.path("build_config.json"), json.dumps(data, indent=2) + "\n")
    ctx.artifacts["effective config"] = cfg_path
    st = ctx.stages
    ctx.calibration = calibration
    with st.stage("frontend (graph optimization)"):
        ctx.model = run_frontend(ctx, original)
    with st.stage("quantization"):
        try:
            settle_writes(wait=False)  # a background write refused by now fails the build now
            quantized = run_quant(ctx)
        except BaseException:
            if ctx.quant_check is not None:  # started before the failure: nothing may run on after it
                ctx.quant_check.settle()
            raise
    with st.stage("compile"):
        try:
            settle_writes(wait=False)
            compiled = run_compiler(ctx, quantized)
        except Exception:
            ctx.quant_check.join()  # the quant stage's run of its model went on meanwhile: its error first
            raise
        except BaseException:  # an interrupt stays the interrupt
            ctx.quant_check.settle()
            raise
        ctx.quant_check.join()
        _run_compiled(ctx, quantized.qdq_model, compiled)
    if ctx.cfg.evaluation.metric:
        from pulsar.evaluation.evaluate import run_evaluation

        with st.stage("evaluation"):
            settle_writes()  # the evaluation reads the three models from their files
            path = ctx.path("evaluation.json")
            run_evaluation(ctx.cfg, original, ctx.path("frontend", "optimized.onnx"),
                           ctx.path("quant", "quantized.onnx"), compiled.path, path, ctx.quiet)
            ctx.artifacts["evaluation"] = path
    return _finish(ctx, compiled, t0)


def _recompile(ctx: BuildContext, plan: RecompilePlan, blog: Any, t0: float) -> BuildResult:
    """``model_type: QuantModel``: the earlier build's quantized model compiled again with this config's
    compiler settings; no frontend, no calibration (:mod:`pulsar.recompile`)."""
    from pulsar.compiler.stage import run_compiler

    quantized = recompile_preflight(ctx, plan.source)
    out = ctx.output_dir
    with BuildOutput(out) as target:
        ctx.output_dir, ctx.final_output_dir = target.staging, out
        blog.open(target.staging / "build.log")
        with use_scratch(target.staging), background_writes():
            ctx.artifacts["effective config"] = atomic_write_text(ctx.path("build_config.json"),
                                                                  json.dumps(ctx.data, indent=2) + "\n")
            copy_quant_artifacts(ctx, plan.source)
            with ctx.stages.stage("compile"):
                compiled = run_compiler(ctx, quantized)
                _run_compiled(ctx, quantized.qdq_model, compiled, analysis=False)
            result = _finish(ctx, compiled, t0)
        target.commit()
    return result


def _finish(ctx: BuildContext, compiled: CompilerOutput, t0: float) -> BuildResult:
    """The artifact and stage-time tables, and the result."""
    settle_writes()  # every artifact listed is in place
    st = ctx.stages
    data = ctx.data
    ctx.artifacts["build log"] = ctx.path("build.log")
    show(table("Artifacts", ["artifact", "path"], [(k, str(ctx.shown(v))) for k, v in ctx.artifacts.items()]),
         quiet=ctx.quiet)
    rows = [(k, f"{v:.2f}") for k, v in st.times.items()] + [("total", f"{time.perf_counter() - t0:.2f}")]
    show(table("Stage times (s)", ["stage", "seconds"], rows), quiet=ctx.quiet)
    final = ctx.final_output_dir or ctx.output_dir
    return BuildResult(output_dir=final, compiled_model=ctx.shown(compiled.path),
                       quantized_model=final / "quant" / "quantized.onnx",
                       quant_config=final / "quant" / "quant_config.json",
                       optimized_model=final / "frontend" / "optimized.onnx", config=data,
                       stage_seconds=dict(st.times), quant_graph=ctx.quant_graph)
