"""``quant.precision_analysis_mode: NPUBackend``: the Quant Precision Table from the bit-exact
simulator instead of float QDQ math.

The QDQ model (the model's own inputs, no processors) is lowered and simulated; every quantized
tensor ``T`` the NPU computes exists as its integer ``T/q``, which is dequantized with the scale and
zero point of quant_config.json and compared with the float model's ``T`` (end to end: the whole
integer network runs, as on the device). Tensors computed on the CPU in float are compared as they
are. Same table, same mermaid graph as the Reference mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from pulsar.compiler.lower import LowerOptions
from pulsar.compiler.lower.model import SubRange
from pulsar.context import BuildContext
from pulsar.core.plugin_session import inference_session
from pulsar.errors import PulsarError
from pulsar.quant.analysis import LayerPrecision, precision_table, worst_rows, write_mermaid, write_table
from pulsar.quant.analysis.metrics import Accumulator
from pulsar.quant.analysis.table import publish_slices
from pulsar.runtime.check import lowered_session
from pulsar.ui import plural, show
from pulsar.utils.progress import progress_task

log = logging.getLogger(__name__)


def _dequantize(q: np.ndarray, entry: dict[str, Any]) -> np.ndarray:
    scale = np.asarray(entry["scale"], np.float64)
    zp = np.asarray(entry["zero_point"], np.float64)
    return (q.astype(np.float64) - zp) * scale


def _float_values(model: onnx.ModelProto, names: list[str]) -> ort.InferenceSession:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(typed[n] for n in names if n in typed and n not in have)
    return inference_session(m.SerializeToString(), providers=["CPUExecutionProvider"])


def npu_backend_rows(ctx: BuildContext, qmodel: onnx.ModelProto, qjson: dict[str, Any],
                     samples: Iterable[dict[str, np.ndarray]],
                     sub_configs: list[SubRange] | None = None, cpu_nodes: dict[str, str] | None = None,
                     progress: Callable[[int], None] | None = None) -> list[LayerPrecision]:
    """One row per float-model layer whose output the simulated model computes. The QDQ model is lowered
    as the compiled model is: ``sub_configs`` ranges with their own options, ``cpu_nodes`` (the ops the
    quantization placed on the CPU) kept there. ``progress(n)`` is called after the n-th sample."""
    options = LowerOptions(lut_items_in_bits=ctx.cfg.compiler.lut_items_in_bits, sub_configs=list(sub_configs or []),
                           cpu_nodes=dict(cpu_nodes or {}))
    sim = lowered_session(qmodel, ctx.path("quant", "debug", "npu_backend_analysis.pulsar"), options)
    tensors = qjson.get("tensors", {})
    layers = [(n.name or f"{n.op_type}_{i}", n, n.output[0]) for i, n in enumerate(ctx.model.graph.node)
              if n.output and n.output[0]]
    fsess = _float_values(ctx.model, [t for _, _, t in layers])
    fnames = [o.name for o in fsess.get_outputs()]
    accs: dict[str, Accumulator] = {}
    shapes: dict[str, tuple] = {}
    count = 0
    for k, sample in enumerate(samples):
        feeds = {i.name: sample[i.name] for i in sim.inputs if i.name in sample}
        if len(feeds) != len(sim.inputs):
            raise PulsarError(f"precision analysis: sample {k} lacks inputs {[i.name for i in sim.inputs]}")
        got = sim.run_all(feeds)
        ref = dict(zip(fnames, fsess.run(fnames, feeds), strict=True))
        for _, _, t in layers:
            if t not in ref:
                continue
            if f"{t}/q" in got and t in tensors:
                value = _dequantize(got[f"{t}/q"], tensors[t])
            elif t in got and got[t].dtype.kind == "f":
                value = got[t]
            else:
                continue  # lives only inside a fused NPU op
            accs.setdefault(t, Accumulator()).add(ref[t], value.reshape(ref[t].shape))
            shapes.setdefault(t, tuple(int(d) for d in ref[t].shape))
        count += 1
        if progress is not None:
            progress(count)
    if not count:
        raise PulsarError("precision analysis: no samples were given; pass at least one input sample")
    return [LayerPrecision(name, n.op_type, t, shapes[t], "FP32", str(tensors.get(t, {}).get("dtype", "FP32")),
                           accs[t].cosine, accs[t].mse, accs[t].sqnr_db, accs[t].worst_slice)
            for name, n, t in layers if t in accs]


def run_npu_backend_analysis(ctx: BuildContext, qmodel: onnx.ModelProto, qjson: dict[str, Any],
                             samples: list[dict[str, np.ndarray]], sub_configs: list[SubRange] | None = None,
                             cpu_nodes: dict[str, str] | None = None) -> None:
    what = f"precision analysis (EndToEnd NPUBackend, {plural(len(samples), 'sample')})"
    with progress_task(ctx.stages, what, len(samples)) as task:
        rows = npu_backend_rows(ctx, qmodel, qjson, samples, sub_configs, cpu_nodes, progress=task)
    title = "Quant Precision Table [EndToEnd NPUBackend]"
    show(precision_table(rows, title), quiet=ctx.quiet)
    tpath = ctx.path("quant", "debug", "precision_analysis_table.txt")
    mpath = ctx.path("quant", "debug", "precision_analysis.mmd")
    write_table(rows, tpath, title=title)
    spath = ctx.path("quant", "debug", "precision_analysis_slices.txt")
    publish_slices(rows, spath, title, ctx.quiet)
    ctx.artifacts["precision analysis per slice"] = spath
    write_mermaid(ctx.model, rows, mpath)
    log.info("precision analysis (NPUBackend): lowest cosine %s",
             ", ".join(f"{r.node} ({r.cosine:.4f})" for r in worst_rows(rows, 5)))
    ctx.artifacts["precision analysis table"] = tpath
    ctx.artifacts["precision analysis graph (mermaid)"] = mpath
