"""Python API with the CLI's semantics: ``build`` and ``run_model`` (``Session`` for in-process use)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsar.config import load_build_config
from pulsar.context import BuildContext
from pulsar.errors import PulsarError
from pulsar.runtime.runner import run_model
from pulsar.ui import Stages, log_file, setup_logging, show, table
from pulsar.utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

__all__ = ["BuildResult", "build", "run_model"]


@dataclass
class BuildResult:
    output_dir: Path
    compiled_model: Path
    quantized_model: Path
    quant_config: Path
    optimized_model: Path
    config: dict[str, Any]
    stage_seconds: dict[str, float] = field(default_factory=dict)


def build(input: str | Path | None = None, output_dir: str | Path | None = None,
          config: str | Path | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None, *,
          quiet: bool = False, debug: bool = False) -> BuildResult:
    """Build a compiled model. ``overrides`` use dotted keys like the CLI: ``{"quant.calibration_method": "KL"}``;
    ``input`` / ``output_dir`` are shorthands for the ``input`` / ``output_dir`` overrides."""
    setup_logging(quiet=quiet, debug=debug)
    overrides = dict(overrides or {})
    if input is not None:
        overrides["input"] = str(input)
    if output_dir is not None:
        overrides["output_dir"] = str(output_dir)
    eff = load_build_config(config, overrides)
    cfg = eff.cfg
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise PulsarError(f"output_dir: '{out}' exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    ctx = BuildContext(cfg=cfg, data=eff.data, config_hash=eff.hash, output_dir=out,
                       work_dir=Path(cfg.work_dir) if cfg.work_dir else out, stages=Stages(quiet), quiet=quiet)
    t0 = time.perf_counter()
    with log_file(out / "build.log"):
        try:
            return _run_stages(ctx, eff.data, t0)
        except PulsarError as e:
            log.debug("build failed: %s", e)  # the CLI prints it; build.log keeps it too
            raise


def _run_stages(ctx: BuildContext, data: dict[str, Any], t0: float) -> BuildResult:
    from pulsar.compiler.stage import run_compiler
    from pulsar.frontend.stage import load_and_check, run_frontend
    from pulsar.quant.stage import open_calibration, run_quant

    cfg_path = atomic_write_text(ctx.path("build_config.json"), json.dumps(data, indent=2) + "\n")
    ctx.artifacts["effective config"] = cfg_path
    log.info("pulsar build: %s -> %s for %s %s (config hash %s)", ctx.cfg.input, ctx.output_dir,
             ctx.cfg.target_hardware, ctx.cfg.npu_mode, ctx.config_hash)
    st = ctx.stages
    if ctx.cfg.model_type == "QuantONNX":
        from pulsar.quant.import_qdq import strip_qdq

        ctx.import_quant = strip_qdq
    with st.stage("load model"):
        original = load_and_check(ctx)
    with st.stage("calibration data"):
        ctx.calibration = open_calibration(ctx, original)
    try:
        with st.stage("frontend (graph optimization)"):
            ctx.model = run_frontend(ctx, original)
        with st.stage("quantization"):
            qmodel = run_quant(ctx)
    finally:
        ctx.calibration.close()
    with st.stage("compile"):
        compiled = run_compiler(ctx, qmodel)
    ctx.artifacts["build log"] = ctx.path("build.log")
    show(table("Artifacts", ["artifact", "path"], [(k, str(v)) for k, v in ctx.artifacts.items()]), quiet=ctx.quiet)
    rows = [(k, f"{v:.2f}") for k, v in st.times.items()] + [("total", f"{time.perf_counter() - t0:.2f}")]
    show(table("Stage times (s)", ["stage", "seconds"], rows), quiet=ctx.quiet)
    return BuildResult(output_dir=ctx.output_dir, compiled_model=compiled,
                       quantized_model=ctx.path("quant", "quantized.onnx"),
                       quant_config=ctx.path("quant", "quant_config.json"),
                       optimized_model=ctx.path("frontend", "optimized.onnx"), config=data,
                       stage_seconds=dict(st.times))
