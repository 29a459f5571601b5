"""Input processors: a preprocessing subgraph in front of each model input.

The deployed model takes the camera / host buffer as it is (uint8 NHWC BGR, NV12, YUYV, ...); the
conversion to the tensor the model was trained on becomes part of the graph, so it is quantized and
compiled with the model instead of being re-implemented on every target. The conventions (deployed
shapes, padding / slicing, order of the steps) are documented in :mod:`pulsar.frontend.processors`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.graph import dims_of, drop_value_info, graph_input_names, rename_uses
from pulsar.frontend.processors.chain import (
    CHANNEL_AXIS,
    DTYPES,
    SPATIAL_AXES,
    Chain,
    Dims,
    assign,
    field,
    renamed_value_info,
    require_opset,
    set_type,
    shape_text,
    type_name,
)
from pulsar.frontend.processors.color import (
    CHANNELS,
    COLOR_CONVERSIONS,
    CSC_MODES,
    YUV_FORMATS,
    apply_csc,
    unpack_yuv,
)

log = logging.getLogger(__name__)

AUTO = "AutoColorSpace"
_AUTO_FORMAT = {3: "BGR", 1: "GRAY"}
_END = np.iinfo(np.int64).max


@dataclass
class InputPlan:
    """One input's resolved, validated processor: what is deployed and what the model expects."""

    name: str
    rank: int | None
    model_type: int
    model_dims: Dims | None
    tensor_format: str | None  # None: no colour meaning (RAW)
    tensor_layout: str
    src_format: str  # RGB / BGR / GRAY / RAW or a YUV_FORMATS key
    src_layout: str
    src_type: int
    csc: tuple[str, np.ndarray, bool] | None  # (mode, 3x4 matrix, clip)
    mean: list[float]
    std: list[float]
    pads: list[int] | None  # [top, left, bottom, right]
    pad_value: float
    crop: list[int] | None  # [top, left, bottom, right]
    src_dims: Dims | None = None
    image_hw: tuple[Any, Any] | None = None


class _Fields:
    """Error messages that name ``input_processors[i].<field>``."""

    def __init__(self, index: int, vi: onnx.ValueInfoProto):
        self.where = f"input_processors[{index}]"
        self.name = vi.name
        self.shape = shape_text(dims_of(vi))

    def error(self, name: str, message: str) -> PulsarError:
        return PulsarError(f"{self.where}.{name}: {message}")


def _resolve_tensor_format(p: Any, f: _Fields, rank: int | None, channels: Any, layout: str) -> str | None:
    fmt = field(p, "tensor_format") or AUTO
    if fmt == AUTO:
        return _AUTO_FORMAT.get(channels) if rank == 4 else None
    if fmt not in CHANNELS:
        raise f.error("tensor_format", f'unknown format "{fmt}"{did_you_mean(fmt, [AUTO, *CHANNELS])}')
    if rank != 4 or channels != CHANNELS[fmt]:
        raise f.error("tensor_format", f'{fmt} needs a 4-D input with {CHANNELS[fmt]} channel(s) on the '
                      f'{layout} channel axis, input "{f.name}" is {f.shape}; fix tensor_format / tensor_layout')
    return fmt


def _resolve_src_format(p: Any, f: _Fields, tensor_format: str | None) -> str:
    src = field(p, "src_format") or AUTO
    if src == AUTO:
        return tensor_format or "RAW"
    known = ["RAW", *CHANNELS, *YUV_FORMATS]
    if src not in known:
        raise f.error("src_format", f'unknown format "{src}"{did_you_mean(src, known)}')
    if src in YUV_FORMATS and tensor_format not in ("RGB", "BGR"):
        raise f.error("src_format", f'{src} converts to RGB / BGR, but input "{f.name}" {f.shape} is '
                      f"{tensor_format or 'not a 1- or 3-channel image'} (tensor_format); feed GRAY models "
                      f"the Y plane with src_format GRAY")
    if src in CHANNELS and tensor_format is None:
        raise f.error("src_format", f'{src} needs a 4-D image input with 1 or 3 channels, input "{f.name}" is '
                      f"{f.shape}; use src_format RAW (no colour conversion)")
    return src


def _resolve_csc(p: Any, f: _Fields, src: str) -> tuple[str, np.ndarray, bool] | None:
    mode = field(p, "csc_mode") or "NoCSC"
    mat = field(p, "csc_mat")
    if mode != "NoCSC" and mode not in CSC_MODES:
        raise f.error("csc_mode", f'unknown mode "{mode}"{did_you_mean(mode, ["NoCSC", *CSC_MODES])}')
    if mat is not None and mode != "Matrix":
        raise f.error("csc_mat", f"csc_mat is used only with csc_mode Matrix (csc_mode is {mode}); "
                      f"set csc_mode: Matrix or remove csc_mat")
    if src not in YUV_FORMATS:
        if mode != "NoCSC":
            raise f.error("csc_mode", f"csc_mode {mode} converts YUV input, but src_format is {src}; "
                          f"remove csc_mode or set a YUV src_format")
        return None
    if mode == "NoCSC":
        raise f.error("csc_mode", f"src_format {src} needs a YUV->RGB conversion: set csc_mode to FullRange "
                      f"(BT.601 full range, JPEG), LimitedRange (BT.601 video range, Y 16..235) or Matrix")
    if mode == "Matrix" and (mat is None or len(mat) != 12):
        raise f.error("csc_mat", f"csc_mode Matrix needs csc_mat, 12 numbers (3x4 row-major, rows R, G, B, "
                      f"columns Y, U, V, bias); got {'nothing' if mat is None else f'{len(mat)} numbers'}")
    build, clip = CSC_MODES[mode]
    return mode, build(list(mat or [])), clip


def _resolve_norm(p: Any, f: _Fields, calibration: tuple[Any, Any], rank: int | None, channels: Any,
                  layout: str) -> tuple[list[float], list[float]]:
    values = {}
    for name, default in zip(("mean", "std"), calibration, strict=True):
        own = field(p, name)
        vals = [float(v) for v in (default if own is None else own) or ()]
        origin = "" if own is not None else f" (from the calibration {name} of this input)"
        if vals and (rank != 4 or not isinstance(channels, int)):
            raise f.error(name, f'{name}{origin} needs a 4-D input with a known channel count, input "{f.name}" '
                          f"is {f.shape}")
        if vals and len(vals) != channels:
            raise f.error(name, f'{name}{origin} has {len(vals)} values, input "{f.name}" {f.shape} has '
                          f"{channels} channels ({layout}); give one value per channel, in the model's "
                          f"channel order")
        values[name] = vals
    if any(v == 0 for v in values["std"]):
        raise f.error("std", "std contains 0; every std value must be non-zero")
    return values["mean"], values["std"]


def _resolve_sides(p: Any, f: _Fields, name: str, rank: int | None) -> list[int] | None:
    values = field(p, name)
    if not values:
        return None
    if len(values) not in (2, 4) or any(int(v) != v or v < 0 for v in values):
        raise f.error(name, f"{name} needs 4 non-negative integers [top, left, bottom, right] or 2 "
                      f"[vertical, horizontal]; got {list(values)}")
    if rank != 4:
        raise f.error(name, f'{name} needs a 4-D image input, input "{f.name}" is {f.shape}')
    sides = [int(v) for v in values]
    return sides * 2 if len(sides) == 2 else sides


def _image_size(plan: InputPlan, f: _Fields) -> tuple[Any, Any]:
    """Deployed image H, W: the model's spatial size minus padding plus the cropped margins."""
    pads = plan.pads or [0, 0, 0, 0]
    crop = plan.crop or [0, 0, 0, 0]
    size = []
    for k, axis in enumerate(SPATIAL_AXES[plan.tensor_layout]):
        dim = plan.model_dims[axis]  # type: ignore[index]
        if not isinstance(dim, int):
            size.append(dim if plan.pads is None and plan.crop is None else None)
            continue
        inner = dim - pads[k] - pads[k + 2]
        if inner < 1:
            raise f.error("padding", f"padding {plan.pads} leaves no pixels of input \"{f.name}\" {f.shape}; "
                          f"pads must sum to less than the model's height and width")
        size.append(inner + crop[k] + crop[k + 2])
    return size[0], size[1]


def _deployed_dims(plan: InputPlan, f: _Fields) -> Dims | None:
    if plan.rank != 4:
        return plan.model_dims
    h, w = plan.image_hw  # type: ignore[misc]
    n = plan.model_dims[0]  # type: ignore[index]
    yuv = YUV_FORMATS.get(plan.src_format)
    if yuv is not None:
        if not isinstance(h, int) or not isinstance(w, int):
            raise f.error("src_format", f'{plan.src_format} needs a fixed height and width, input "{f.name}" is '
                          f"{f.shape}; set input_shapes")
        if w % 2 or (yuv.even_height and h % 2):
            need = "height and width" if yuv.even_height else "width"
            raise f.error("src_format", f"{plan.src_format} needs an even {need}, the deployed image is {h}x{w} "
                          f"(model input {f.shape} with padding / slicing); adjust padding or slicing")
        return yuv.shape(n, h, w, plan.src_layout)
    c = CHANNELS.get(plan.src_format, plan.model_dims[CHANNEL_AXIS[plan.tensor_layout]])  # type: ignore[index]
    return [n, c, h, w] if plan.src_layout == "NCHW" else [n, h, w, c]


def resolve(index: int, p: Any, vi: onnx.ValueInfoProto, calibration: tuple[Any, Any]) -> InputPlan:
    """Validate one processor against its input and fill in every default."""
    f = _Fields(index, vi)
    dims = dims_of(vi)
    rank = len(dims) if dims is not None else None
    layout = field(p, "tensor_layout") or "NCHW"
    if layout not in CHANNEL_AXIS:
        raise f.error("tensor_layout", f'unknown layout "{layout}"; use NCHW or NHWC')
    channels = dims[CHANNEL_AXIS[layout]] if rank == 4 else None  # type: ignore[index]
    tensor_format = _resolve_tensor_format(p, f, rank, channels, layout)
    src = _resolve_src_format(p, f, tensor_format)
    src_layout = field(p, "src_layout") or layout
    if src_layout not in CHANNEL_AXIS:
        raise f.error("src_layout", f'unknown layout "{src_layout}"; use NCHW or NHWC')
    if src_layout != layout and rank != 4:
        raise f.error("src_layout", f'{src_layout}->{layout} needs a 4-D input, input "{f.name}" is {f.shape}')
    src_dtype = field(p, "src_dtype")
    if src_dtype is not None and src_dtype not in DTYPES:
        raise f.error("src_dtype", f'unknown dtype "{src_dtype}"{did_you_mean(src_dtype, DTYPES)}')
    mode = field(p, "padding_mode") or "constant"
    if mode != "constant":
        raise f.error("padding_mode", f'only "constant" padding is supported, got "{mode}"')
    mean, std = _resolve_norm(p, f, calibration, rank, channels, layout)
    plan = InputPlan(
        name=vi.name, rank=rank, model_type=vi.type.tensor_type.elem_type, model_dims=dims,
        tensor_format=tensor_format, tensor_layout=layout, src_format=src, src_layout=src_layout,
        src_type=DTYPES[src_dtype] if src_dtype else vi.type.tensor_type.elem_type,
        csc=_resolve_csc(p, f, src), mean=mean, std=std,
        pads=_resolve_sides(p, f, "padding", rank), pad_value=float(field(p, "padding_constant_value") or 0.0),
        crop=_resolve_sides(p, f, "slicing", rank),
    )
    if rank == 4:
        plan.image_hw = _image_size(plan, f)
    plan.src_dims = _deployed_dims(plan, f)
    return plan


# ---- building the chain -------------------------------------------------------------------------


def _sides_step(chain: Chain, sides: list[int], op: str, value: float = 0.0) -> None:
    top, left, bottom, right = sides
    ah, aw = SPATIAL_AXES[chain.layout]  # type: ignore[index]
    if op == "Slice":
        ends = [-bottom if bottom else _END, -right if right else _END]
        chain.apply("Slice", chain.const("starts", [top, left], np.int64), chain.const("ends", ends, np.int64),
                    chain.const("axes", [ah, aw], np.int64))
        chain.steps.append(f"crop [top, left, bottom, right] = {sides}")
        return
    pads = [0] * 8
    pads[ah], pads[aw], pads[4 + ah], pads[4 + aw] = top, left, bottom, right
    chain.apply("Pad", chain.const("pads", pads, np.int64), chain.const("pad_value", value, np.float32),
                mode="constant")
    chain.steps.append(f"pad [top, left, bottom, right] = {sides} with {value:g}")


def _normalize(chain: Chain, mean: list[float], std: list[float]) -> None:
    shape = [-1, 1, 1] if chain.layout == "NCHW" else [-1]
    if mean:
        chain.apply("Sub", chain.const("mean", np.reshape(mean, shape), np.float32))
    if std:
        chain.apply("Div", chain.const("std", np.reshape(std, shape), np.float32))
    chain.steps.append(f"(x - {mean or 0}) / {std or 1}" if std else f"x - {mean}")


def build_chain(graph: onnx.GraphProto, plan: InputPlan) -> Chain:
    """The preprocessing steps, in order: cast, unpack YUV, crop, colour, pad, mean / std, layout, cast."""
    chain = Chain(graph, plan.name, plan.src_type, plan.src_layout if plan.rank == 4 else None,
                  prefix=f"{plan.name}/pre")
    yuv = YUV_FORMATS.get(plan.src_format)
    color = None
    if yuv is None and plan.src_format != "RAW" and plan.src_format != plan.tensor_format:
        color = COLOR_CONVERSIONS[(plan.src_format, plan.tensor_format)]  # type: ignore[index]
    arithmetic = yuv is not None or (color is not None and color[1]) or bool(plan.mean or plan.std)
    if arithmetic or plan.pads or plan.src_type != plan.model_type:
        chain.cast(TensorProto.FLOAT)
    if yuv is not None:
        h, w = plan.image_hw  # type: ignore[misc]
        unpack_yuv(chain, plan.src_format, h, w)
    if plan.crop:
        _sides_step(chain, plan.crop, "Slice")
    if plan.csc is not None:
        mode, matrix, clip = plan.csc
        apply_csc(chain, matrix, yuv.columns, plan.tensor_format, clip,  # type: ignore[union-attr,arg-type]
                  f"YUV->{plan.tensor_format} (csc_mode {mode})")
    elif color is not None:
        color[0](chain)
    if plan.pads:
        _sides_step(chain, plan.pads, "Pad", plan.pad_value)
    if plan.mean or plan.std:
        _normalize(chain, plan.mean, plan.std)
    if plan.rank == 4:
        chain.to_layout(plan.tensor_layout)
    chain.to_type(plan.model_type)
    return chain


def attach_input_processors(
    model: onnx.ModelProto, processors: Sequence[Any], calibration: dict[str, tuple[list[float], list[float]]]
) -> tuple[onnx.ModelProto, list[str]]:
    """Put each input's preprocessing in front of the model; the graph input keeps its name.

    ``processors`` are ``input_processors`` entries (attributes as in the config, None = unset);
    ``calibration`` maps an input to its calibration (mean, std), the default for unset mean / std.
    Returns a new model (the argument is not modified) and one log line per processed input.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    inputs = {vi.name: vi for vi in graph.input}
    lines = []
    for name, index, p in assign(processors, graph_input_names(graph), "input_processors", "input"):
        vi = inputs[name]
        plan = resolve(index, p, vi, calibration.get(name, ((), ())))
        chain = build_chain(graph, plan)
        deployed = f"{plan.src_format} {type_name(plan.src_type)} {shape_text(plan.src_dims)}"
        model_side = f"model input {type_name(plan.model_type)} {shape_text(plan.model_dims)}"
        if not chain.nodes:
            lines.append(f"{name}: nothing to do, deployed {deployed} is the {model_side}")
            continue
        require_opset(result, f"input_processors[{index}]")
        internal = chain.unique(f"{name}_preprocessed")
        rename_uses(graph, name, internal)
        chain.install(graph, internal, front=True)
        drop_value_info(graph, [name, internal])
        graph.value_info.append(renamed_value_info(vi, internal))
        set_type(vi, plan.src_type, plan.src_dims)
        lines.append(f"{name}: deployed {deployed} ({plan.src_layout if plan.rank == 4 else 'as is'}) -> "
                     + " -> ".join(chain.steps) + f" -> {model_side}")
    for line in lines:
        log.debug("input processor %s", line)
    return result, lines
