"""The build's run of its own QDQ model: it must load and run in onnxruntime (Q/DQ as float math), and
no output slice may lose its signal to a step the rest of the tensor sets.

The session opens (and a model onnxruntime rejects fails) in the quant stage; the runs over the
samples then go on in a helper thread while the compiler lowers the model (onnxruntime releases the
GIL), and the build joins them before it publishes anything (:class:`QuantCheck`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice

import numpy as np
import onnx
import onnxruntime as ort

from pulsar.context import BuildContext
from pulsar.core.ort_errors import ort_guard
from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.quant.analysis.metrics import Accumulator, flattened_slices
from pulsar.quant.qdq import output_steps

log = logging.getLogger(__name__)

SLICE_CHECK_SAMPLES = 8
# float outputs the check compares (the calibration pass keeps float32 ones only: others run here)
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                          onnx.TensorProto.BFLOAT16})


@dataclass
class QuantCheck:
    """The runs of :func:`check_quantized_model`, in a helper thread; :meth:`join` waits for them and
    raises their error (a build joins before it publishes, and when a later stage fails: the check's
    error names the quantized model, the likelier cause)."""

    future: Future[None] | None = None

    @classmethod
    def start(cls, runs: Callable[[], None]) -> QuantCheck:
        pool = ThreadPoolExecutor(1, thread_name_prefix="pulsar-quant-check")
        try:
            return cls(pool.submit(runs))
        finally:
            pool.shutdown(wait=False)

    def join(self) -> None:
        future, self.future = self.future, None
        if future is not None:
            future.result()

    def settle(self) -> None:
        """Wait for the runs and drop their error: the build is failing for another reason, which is
        the one to report (and nothing may still run once the build returns)."""
        future, self.future = self.future, None
        if future is not None:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001  reported below, not raised
                log.debug("quantized-model check after a failed build: %s", exc)


def _options() -> ort.SessionOptions:
    """Q/DQ as float math, on one core less than the machine has: the compiler works on the other."""
    opts = reference_session_options()
    opts.intra_op_num_threads = max(1, (os.cpu_count() or 1) - 1)
    return opts


def check_quantized_model(ctx: BuildContext, qmodel: onnx.ModelProto, patched: bool) -> Callable[[], None]:
    """Every build runs its own QDQ model in onnxruntime (Q/DQ as float math) on a few calibration
    samples before writing it: a build never ends with a quant/quantized.onnx that cannot run. The
    outputs are compared with the float model's per slice (channel and last-axis index), and a slice
    that lost most of its signal is a warning naming the tensor, the slice and the layer_configs fix.

    Everything that reads ``qmodel`` or the build's data happens now; the returned function does the
    runs and the warnings on what it was given (see :class:`QuantCheck`)."""
    kept = ctx.float_reference
    floats = {o.name for o in ctx.float_model.graph.output if o.type.tensor_type.elem_type in _FLOAT_TYPES}
    if kept is not None and kept.usable and all(floats <= out.keys() for out in kept.outputs):  # from the pass
        samples, refs = kept.inputs[:SLICE_CHECK_SAMPLES], kept.outputs[:SLICE_CHECK_SAMPLES]
    else:
        samples, refs = list(islice(iter(ctx.calibration), SLICE_CHECK_SAMPLES)), None
    fix = ("check the quant_op_processors patch of that node" if patched else
           "keep that node's layer in float with a quant.layer_configs entry "
           '{"layer_name": ..., "data_type": "FP32"} and report the model to pulsar')
    what = "running the quantized model quant/quantized.onnx"
    with ort_guard(what, fix):
        qsess = inference_session(qmodel, _options(), providers=["CPUExecutionProvider"],
                                  lift_weights=True)
    wanted = {i.name for i in qsess.get_inputs()}
    names = [o.name for o in qsess.get_outputs()]
    if refs is None:  # the statistics came from the cache or a file: run the float model here
        fsess = inference_session(ctx.float_model, _options(), providers=["CPUExecutionProvider"],
                                  lift_weights=True)
        refs = (dict(zip(names, fsess.run(names, {k: v for k, v in s.items() if k in wanted}), strict=True))
                for s in samples)
    producers = {o: n.name for n in ctx.float_model.graph.node for o in n.output}
    steps = output_steps(qmodel)

    def runs() -> None:
        accs = {n: Accumulator() for n in names}
        for sample, ref in zip(samples, refs, strict=True):
            feeds = {k: v for k, v in sample.items() if k in wanted}
            with ort_guard(what, fix):
                got = qsess.run(names, feeds)
            for n, value in zip(names, got, strict=True):
                r = ref.get(n)  # a non-float output is not kept: nothing to compare
                if r is not None and np.issubdtype(r.dtype, np.floating) and r.shape == value.shape:
                    accs[n].add(r, value)
        for line in slice_warnings(accs, steps, producers):
            log.warning("%s", line)

    return runs


def slice_warnings(accs: dict[str, Accumulator], steps: dict[str, float], producers: dict[str, str]) -> list[str]:
    """One line per output axis whose grid flattens slices (:func:`flattened_slices`): which slices,
    how their values compare with the step, and the layer_configs entry that keeps them."""
    lines = []
    for name, acc in accs.items():
        for axis in sorted(acc.slices):
            bad = flattened_slices(acc, axis, steps.get(name))
            if not bad:
                continue
            worst = bad[0]
            layer = producers.get(name, name)
            idx = ", ".join(str(t.index) for t in sorted(bad, key=lambda t: t.index)[:12])
            more = " ..." if len(bad) > 12 else ""
            lines.append(
                f"output '{name}': {len(bad)} of {worst.size} slices along axis {axis} ([{idx}{more}]) are flattened "
                f"by its quantization step {steps[name]:.4g} (worst: index {worst.index}, values of RMS "
                f"{worst.rms:.3g}, {worst.sqnr_db:.1f} dB SQNR, cosine {worst.cosine:.3f}; whole tensor cosine "
                f"{acc.cosine:.4f}): the rest of the tensor sets the step. Likely fix: quant.layer_configs "
                f'{{"layer_name": "{layer}", "data_type": "U16"}} (or split the output)')
    return lines
