"""Everything a build can check before it writes its first file.

The model is loaded and every config name checked against it, the calibration data is opened
(formats, names, file lists), the input / output processors are built once on the float model
(padding, slicing, csc, dtypes and layouts against the real input shapes), the target profile is
read, the sample directories must exist, and the memory one sample needs is compared with what the
machine has. Only then does the build create its output directory: a mistake in any of these
costs the user seconds, not a calibration run, and leaves nothing behind.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pulsar.compiler.targets import cores_for, load_profile
from pulsar.context import BuildContext
from pulsar.errors import PulsarError
from pulsar.frontend.processors import attach_input_processors, attach_output_processors
from pulsar.frontend.stage import load_and_check
from pulsar.quant.datasets import CalibrationData
from pulsar.quant.samples import calibration_normalization, check_sample_dirs
from pulsar.quant.stage import open_calibration

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig

log = logging.getLogger(__name__)

# One sample's inputs may use at most this share of the available memory: calibration and the
# simulator hold a few samples and the activations of the whole network besides.
_INPUT_SHARE = 0.25


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def input_bytes(model: onnx.ModelProto) -> list[tuple[str, list[int], str, int]]:
    """(name, shape, dtype, bytes) of every graph input that is not an initializer."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
        try:
            item = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            item = 4
        out.append((vi.name, dims, onnx.TensorProto.DataType.Name(t.elem_type).lower(), math.prod(dims) * item))
    return out


def check_input_memory(model: onnx.ModelProto, where: str, hint: str) -> None:
    """Refuse input shapes whose buffers alone would not fit in memory, naming the input and size."""
    avail = available_memory()
    if avail is None:
        return
    for name, dims, dtype, size in input_bytes(model):
        if size > _INPUT_SHARE * avail:
            shape = "x".join(map(str, dims))
            raise PulsarError(f"{where}: input '{name}' of shape {shape} {dtype} needs {human_bytes(size)} per "
                              f"sample, this machine has {human_bytes(avail)} available; {hint}")


def check_processors(ctx: BuildContext, model: onnx.ModelProto) -> None:
    """Build input_processors / output_processors on the float model (same inputs and outputs as
    the quantized one): every processor problem is found now, not after calibration."""
    cfg = ctx.cfg
    if not cfg.input_processors and not cfg.output_processors:
        return
    deployed, _ = attach_input_processors(model, cfg.input_processors, calibration_normalization(cfg, model))
    deployed, _ = attach_output_processors(deployed, cfg.output_processors)
    check_input_memory(deployed, "input_processors", "fix the processor's padding / shapes")


def check_extra_shapes(cfg: BuildConfig, model: onnx.ModelProto) -> None:
    """Every ``src_extra_shapes`` group against the model: the input's rank, the same number of groups
    for every input, and memory for one sample (the compiler uses them long after the first write)."""
    from pulsar.frontend.graph import graph_input_names
    from pulsar.frontend.processors.chain import assign

    names = graph_input_names(model.graph)
    inputs = {name: (dims, dtype) for name, dims, dtype, _size in input_bytes(model)}
    counts = dict.fromkeys(names, 0)
    avail = available_memory()
    for name, index, p in assign(cfg.input_processors, names, "input_processors", "input"):
        dims, dtype = inputs.get(name, ([], "float"))
        counts[name] = len(p.src_extra_shapes)
        for k, extra in enumerate(p.src_extra_shapes):
            shape, where = list(extra.shape), f"input_processors[{index}].src_extra_shapes[{k}]"
            if dims and len(shape) != len(dims):
                raise PulsarError(f"{where}: shape {shape} has rank {len(shape)}, input {name!r} {dims} has rank "
                                  f"{len(dims)}; give a shape of the model's input layout")
            size = math.prod(shape) * _itemsize(model, name)
            if avail is not None and size > _INPUT_SHARE * avail:
                raise PulsarError(f"{where}: shape {shape} {dtype} needs {human_bytes(size)} per sample, this "
                                  f"machine has {human_bytes(avail)} available; give a smaller shape")
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{n!r}: {c}" for n, c in counts.items())
        raise PulsarError(f"src_extra_shapes: every input needs the same number of extra shapes (group i takes "
                          f"the i-th of each); the inputs list {listed}")


def _itemsize(model: onnx.ModelProto, name: str) -> int:
    for vi in model.graph.input:
        if vi.name == name and vi.type.HasField("tensor_type"):
            try:
                return int(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).itemsize)
            except (KeyError, TypeError, ValueError):
                break
    return 4


def check_sample_paths(cfg: BuildConfig) -> None:
    """The sample directories exist (their files are read by quant.samples.check_sample_dirs)."""
    for field, value in (("quant.input_sample_dir", cfg.quant.input_sample_dir),
                         ("compiler.input_sample_dir", cfg.compiler.input_sample_dir)):
        if value and not Path(value).is_dir():
            what = "does not exist" if not Path(value).exists() else "is not a directory"
            raise PulsarError(f"{field}: '{value}' {what}; give a directory of samples (one file per input "
                              "tensor, or one sub-directory per sample)")


def preflight(ctx: BuildContext) -> tuple[onnx.ModelProto, CalibrationData]:
    """The loaded (patched, shape-fixed) float model and the opened calibration data, after every
    check that needs no artifact; raises PulsarError on the first problem."""
    cfg = ctx.cfg
    st = ctx.stages
    with st.stage("load model"):
        original = load_and_check(ctx)
        hint = ("fix input_shapes" if cfg.input_shapes else
                "give smaller shapes with input_shapes (e.g. --input_shapes 'x:1x3x224x224')")
        check_input_memory(original, "input_shapes" if cfg.input_shapes else "input", hint)
        check_sample_paths(cfg)
        if cfg.quant.device != "cpu":  # calibration (and fine-tuning) run there
            from pulsar.quant.finetune import resolve_device  # imports torch: only when a device is asked for

            resolve_device(cfg.quant.device)  # a CUDA device this machine lacks: before anything is written
        cores_for(load_profile(cfg.target_hardware), cfg.npu_mode)
        check_extra_shapes(cfg, original)
        check_processors(ctx, original)
        check_sample_dirs(cfg, original)  # every sample file, in the deployed format
        if cfg.evaluation.metric or cfg.evaluation.input_configs or cfg.evaluation.labels or cfg.evaluation.output:
            from pulsar.evaluation.evaluate import check_evaluation

            check_evaluation(cfg, original)  # the metric (a plugin is imported now), its data and labels
    with st.stage("calibration data"):
        data = open_calibration(ctx, original)
    return original, data
