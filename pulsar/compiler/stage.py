"""Compiler stage: package the quantized graph into the compiled model and check it.

In this version the NPU subgraph holds the QDQ graph (float quantize-dequantize); the integer
lowering replaces its body later without changing the container or the loader.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from pulsar import __version__
from pulsar.compiler.package import package_qdq_model
from pulsar.context import BuildContext
from pulsar.errors import PulsarError
from pulsar.frontend.processors import attach_input_processors, attach_output_processors
from pulsar.runtime.io import random_inputs, read_inputs
from pulsar.runtime.session import Session, reference_session_options
from pulsar.ui import show, table

log = logging.getLogger(__name__)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b / (na * nb))


def _check_samples(ctx: BuildContext, session: Session, qmodel: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """compiler.input_sample_dir (deployed format); else calibration samples when the compiled inputs
    are the model's own, else seeded random deployed inputs (processors changed the inputs)."""
    sample_dir = ctx.cfg.compiler.input_sample_dir
    if not sample_dir:
        own = [(i.name, tuple(d.dim_value for d in i.type.tensor_type.shape.dim), i.type.tensor_type.elem_type)
               for i in qmodel.graph.input]
        deployed = [(i.name, tuple(i.shape), onnx.helper.np_dtype_to_tensor_dtype(i.dtype)) for i in session.inputs]
        if own == deployed:
            return ctx.check_samples
        return [random_inputs(session.inputs, seed=i) for i in range(2)]
    root = Path(sample_dir)
    if not root.is_dir():
        raise PulsarError(f"compiler.input_sample_dir: '{sample_dir}' is not a directory")
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    return [read_inputs(d, session.inputs) for d in (subdirs or [root])]


CHECKS = {
    1: ("all-close", lambda a, b, c: bool(np.allclose(a, b, rtol=c.check_rtol, atol=c.check_atol))),
    2: ("all-equal", lambda a, b, c: bool(np.array_equal(a, b))),
    3: ("cosine", lambda a, b, c: _cosine(a, b) >= c.check_cosine_simularity),
}


def check_compiled(ctx: BuildContext, compiled: Path, qmodel: onnx.ModelProto) -> None:
    """``compiler.check``: run the compiled model and compare with the QDQ reference in onnxruntime."""
    c = ctx.cfg.compiler
    session = Session(compiled)
    ref = ort.InferenceSession(qmodel.SerializeToString(), reference_session_options(),
                               providers=["CPUExecutionProvider"])
    samples = _check_samples(ctx, session, ctx.model)
    if not samples:
        raise PulsarError("compiler.check: no samples to check with; set compiler.input_sample_dir")
    name, ok = CHECKS[c.check]
    rows = []
    for i, feed in enumerate(samples):
        got = session.run(feed)
        want = dict(zip([o.name for o in ref.get_outputs()], ref.run(None, feed), strict=True))
        for out, w in want.items():
            g = got[out]
            passed = ok(g, w, c)
            rows.append((i, out, f"{np.abs(g.astype(np.float64) - w).max():.3g}", f"{_cosine(g, w):.6f}",
                         "pass" if passed else "FAIL"))
            if not passed:
                show(table(f"Compiler check ({name})", ["sample", "output", "max abs diff", "cosine", "result"],
                           rows), quiet=ctx.quiet)
                raise PulsarError(f"compiler.check {c.check} ({name}) failed on output '{out}' of sample {i}: "
                                  f"max abs diff {np.abs(g.astype(np.float64) - w).max():.3g}, cosine "
                                  f"{_cosine(g, w):.6f}")
    show(table(f"Compiler check ({name})", ["sample", "output", "max abs diff", "cosine", "result"], rows),
         quiet=ctx.quiet)


def calibration_normalization(cfg: Any, model: onnx.ModelProto) -> dict[str, tuple[list[float], list[float]]]:
    """input -> (calibration_mean, calibration_std): the defaults of input_processors' mean / std."""
    out = {}
    for vi in model.graph.input:
        entries = [c for c in cfg.quant.input_configs if c.tensor_name == vi.name]
        entries = entries or [c for c in cfg.quant.input_configs if c.tensor_name == "DEFAULT"]
        if entries:
            out[vi.name] = (list(entries[0].calibration_mean or []), list(entries[0].calibration_std or []))
    return out


def attach_processors(ctx: BuildContext, qmodel: onnx.ModelProto) -> onnx.ModelProto:
    """Put input_processors in front of and output_processors behind the quantized graph, so the
    compiled model takes the deployed input (the QDQ artifact keeps the model's own format)."""
    cfg = ctx.cfg
    model, lines = attach_input_processors(qmodel, cfg.input_processors, calibration_normalization(cfg, qmodel))
    model, out_lines = attach_output_processors(model, cfg.output_processors)
    for line in lines + out_lines:
        log.info("processor: %s", line)
    return model


def run_compiler(ctx: BuildContext, qmodel: onnx.ModelProto) -> Path:
    cfg = ctx.cfg
    meta: dict[str, Any] = {
        "target_hardware": cfg.target_hardware,
        "npu_mode": cfg.npu_mode,
        "config_hash": ctx.config_hash,
        "calibration_method": cfg.quant.calibration_method,
        "source_model": Path(cfg.input).name,
        "built_by": f"pulsar {__version__}",
    }
    extra = {p.tensor_name: [list(e.shape) for e in p.src_extra_shapes] for p in cfg.input_processors
             if p.src_extra_shapes}
    if extra:
        # Recorded for the runtime / multi-shape compilation; this version compiles the main shape only.
        meta["input_extra_shapes"] = extra
        log.warning("src_extra_shapes recorded in the compiled model's metadata; only the main input shape is "
                    "compiled by this version")
    deployed = attach_processors(ctx, qmodel)
    path = package_qdq_model(deployed, ctx.path(cfg.output_name), meta)
    ctx.artifacts["compiled model"] = path
    if cfg.compiler.check:
        check_compiled(ctx, path, deployed)
    return path
