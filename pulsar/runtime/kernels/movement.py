"""Standard data-movement ops on integer tensors (no arithmetic; the grid is unchanged).

Opset-17 input conventions: Squeeze / Unsqueeze axes, Split sizes, Pad pads and Reshape shape are
inputs (the attribute forms of older opsets are accepted too). Resize supports mode "nearest" with
the coordinate arithmetic of onnxruntime (float32), which computes the QDQ reference.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import numpy_helper

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import Kernel, register
from pulsar.runtime.kernels.common import array0, contiguous, int_attr, ints_attr, str_attr

Inputs = list[np.ndarray | None]


def _ints(value: np.ndarray | None) -> list[int] | None:
    return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise PulsarError(f"axis {axis} is out of range for a rank-{rank} tensor")
    return axis + rank if axis < 0 else axis


@register("Identity")
def make_identity(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    return lambda inputs: [inputs[0]]


@register("Constant")
def make_constant(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    if "value" not in attrs:
        raise PulsarError(f"Constant needs a tensor 'value' attribute, got {sorted(attrs)}")
    value = numpy_helper.to_array(attrs["value"])
    return lambda inputs: [value]


@register("Reshape")
def make_reshape(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    allowzero = bool(int_attr(attrs, "allowzero", 0))

    def run(inputs: Inputs) -> list[np.ndarray]:
        x, shape = inputs[0], _ints(inputs[1])
        if not allowzero:
            shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return [x.reshape(shape)]

    return run


@register("Transpose")
def make_transpose(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    perm = ints_attr(attrs, "perm")
    return lambda inputs: [contiguous(np.transpose(inputs[0], perm))]


@register("Flatten")
def make_flatten(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    axis = int_attr(attrs, "axis", 1)

    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        a = axis + x.ndim if axis < 0 else axis
        return [x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))]

    return run


@register("Squeeze")
def make_squeeze(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        axes = _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else ints_attr(attrs, "axes")
        if not axes:
            return [np.squeeze(x)]
        return [np.squeeze(x, axis=tuple(_axis(a, x.ndim) for a in axes))]

    return run


@register("Unsqueeze")
def make_unsqueeze(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        axes = _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else ints_attr(attrs, "axes")
        rank = x.ndim + len(axes)
        return [np.expand_dims(x, tuple(sorted(_axis(a, rank) for a in axes)))]

    return run


def _slice_bounds(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX Slice clamping (negative indices count from the end; out-of-range values are clamped)."""
    if step == 0:
        raise PulsarError("Slice step must not be 0")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start = min(max(start, 0), dim - 1)
    end = min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@register("Slice")
def make_slice(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        starts, ends = _ints(inputs[1]), _ints(inputs[2])
        axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
        steps = _ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
        index = [slice(None)] * x.ndim
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            a = _axis(a, x.ndim)
            index[a] = _slice_bounds(s, e, st, x.shape[a])
        return [contiguous(x[tuple(index)])]

    return run


@register("Split")
def make_split(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    """Sizes from the second input (or the old 'split' attribute), else num_outputs equal chunks
    (the last one smaller when the axis does not divide; the simulator fills num_outputs from the node)."""
    axis = int_attr(attrs, "axis", 0)
    count = attrs.get("num_outputs")

    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        a = _axis(axis, x.ndim)
        sizes = _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else ints_attr(attrs, "split")
        if not sizes:
            if not count:
                raise PulsarError("Split needs split sizes (second input) or num_outputs")
            chunk = -(-x.shape[a] // int(count))
            sizes = [max(min(chunk, x.shape[a] - i * chunk), 0) for i in range(int(count))]
        if sum(sizes) != x.shape[a]:
            raise PulsarError(f"Split sizes {sizes} do not add up to {x.shape[a]} (axis {axis})")
        return [contiguous(p) for p in np.split(x, np.cumsum(sizes)[:-1], axis=a)]

    return run


@register("Concat")
def make_concat(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    axis = int_attr(attrs, "axis")
    return lambda inputs: [np.concatenate([v for v in inputs if v is not None], axis=axis)]


@register("Pad")
def make_pad(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    mode = str_attr(attrs, "mode", "constant")
    if mode != "constant":
        raise PulsarError(f"Pad mode {mode!r} is not supported in NPU bodies (constant only)")

    def run(inputs: Inputs) -> list[np.ndarray]:
        x, pads = inputs[0], _ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else ints_attr(
            attrs, "pads")
        value = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
        axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(x.ndim))
        axes = [_axis(a, x.ndim) for a in axes]
        if len(pads) != 2 * len(axes):
            raise PulsarError(f"Pad pads has {len(pads)} values; expected {2 * len(axes)}")
        begin, end = [0] * x.ndim, [0] * x.ndim
        for i, a in enumerate(axes):
            begin[a], end[a] = pads[i], pads[len(axes) + i]
        crop = tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0)) for i, (b, e) in enumerate(zip(begin, end,
                                                                                               strict=True)))
        x = x[crop] if crop else x  # x[()] of a rank-0 array is a scalar
        fill = 0 if value is None else np.asarray(value).reshape(-1)[0]
        widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end, strict=True)]
        if not any(b or e for b, e in widths):  # nothing to add (a rank-0 x has no widths at all)
            return [x.copy()]
        return [np.pad(x, widths, mode="constant", constant_values=fill)]

    return run


@register("DepthToSpace")
def make_depth_to_space(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    b = int_attr(attrs, "blocksize")
    mode = str_attr(attrs, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise PulsarError(f"DepthToSpace mode {mode!r} must be DCR or CRD")

    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        n, c, h, w = x.shape
        if mode == "DCR":
            t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        return [t.reshape(n, c // (b * b), h * b, w * b)]

    return run


@register("SpaceToDepth")
def make_space_to_depth(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    b = int_attr(attrs, "blocksize")

    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        n, c, h, w = x.shape
        t = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
        return [t.reshape(n, c * b * b, h // b, w // b)]

    return run


@register("Gather")
def make_gather(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    axis = int_attr(attrs, "axis", 0)
    return lambda inputs: [array0(np.take(inputs[0], np.asarray(inputs[1], dtype=np.int64), axis=axis))]


@register("Expand")
def make_expand(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        shape = np.broadcast_shapes(x.shape, tuple(_ints(inputs[1])))
        return [contiguous(np.broadcast_to(x, shape))]

    return run


@register("Tile")
def make_tile(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    return lambda inputs: [np.tile(inputs[0], _ints(inputs[1]))]


# ---------------------------------------------------------------------------------------------------
# Resize (nearest): onnxruntime's float32 coordinate arithmetic, in its order of operations
# ---------------------------------------------------------------------------------------------------

_F = np.float32
_HALF = _F(0.5)
_TIE = _F(1e-6)  # onnxruntime treats |frac - 0.5| <= 1e-6 as a tie


def _half_pixel_symmetric(o: np.ndarray, scale: np.float32, out: np.float32, size: np.float32) -> np.ndarray:
    adjustment = out / (scale * size)
    offset = (size / _F(2)) * (_F(1) - adjustment)
    # onnxruntime writes this line with double literals: the sum is formed in float64, then rounded
    wide = np.float64(offset) + (o.astype(np.float64) + 0.5) / np.float64(scale) - 0.5
    return wide.astype(np.float32)


_COORDINATES = {
    "half_pixel": lambda o, scale, out, size: (o + _HALF) / scale - _HALF,
    "pytorch_half_pixel": lambda o, scale, out, size: (
        (o + _HALF) / scale - _HALF if out > 1 else np.zeros_like(o)),
    "asymmetric": lambda o, scale, out, size: o / scale,
    "align_corners": lambda o, scale, out, size: (
        np.zeros_like(o) if out == 1 else o * (size - _F(1)) / (out - _F(1))),
    "tf_half_pixel_for_nn": lambda o, scale, out, size: (o + _HALF) / scale,
    "half_pixel_symmetric": _half_pixel_symmetric,
}


def _round_half(x: np.ndarray, up: bool) -> np.ndarray:
    """Nearest integer; halves (within the tie tolerance) go up or down as the mode prefers."""
    low = np.floor(x)
    tie = np.abs((x - low) - _HALF) <= _TIE
    t = np.trunc(x)
    nearest = np.where(np.abs(x - t) >= _HALF, t + np.sign(x), t)
    return np.where(tie, low + 1 if up else low, nearest)


_NEAREST = {
    "round_prefer_floor": lambda x: _round_half(x, up=False),
    "round_prefer_ceil": lambda x: _round_half(x, up=True),
    "floor": np.floor,
    "ceil": np.ceil,
}


@register("Resize")
def make_resize(attrs: dict[str, Any], consts: Inputs) -> Kernel:
    """Nearest-neighbour Resize (inputs X, roi, scales, sizes); other modes are arithmetic, not movement."""
    mode = str_attr(attrs, "mode", "nearest")
    coord = str_attr(attrs, "coordinate_transformation_mode", "half_pixel")
    nearest = str_attr(attrs, "nearest_mode", "round_prefer_floor")
    policy = str_attr(attrs, "keep_aspect_ratio_policy", "stretch")
    if mode != "nearest":
        raise PulsarError(f"Resize mode {mode!r} is not supported in NPU bodies (nearest only)")
    if coord not in _COORDINATES:
        raise PulsarError(f"Resize coordinate_transformation_mode {coord!r} is not supported; "
                          f"use one of {sorted(_COORDINATES)}")
    if nearest not in _NEAREST:
        raise PulsarError(f"Resize nearest_mode {nearest!r} is not supported; use one of {sorted(_NEAREST)}")
    if policy != "stretch":
        raise PulsarError(f"Resize keep_aspect_ratio_policy {policy!r} is not supported (stretch only)")
    axes_attr = ints_attr(attrs, "axes")
    to_coord, to_index = _COORDINATES[coord], _NEAREST[nearest]

    def run(inputs: Inputs) -> list[np.ndarray]:
        x = inputs[0]
        scales = inputs[2] if len(inputs) > 2 and inputs[2] is not None and inputs[2].size else None
        sizes = inputs[3] if len(inputs) > 3 and inputs[3] is not None and inputs[3].size else None
        axes = [_axis(a, x.ndim) for a in axes_attr] if axes_attr else list(range(x.ndim))
        y = x
        for i, a in enumerate(axes):
            size = x.shape[a]
            if sizes is not None:
                out = int(np.asarray(sizes).reshape(-1)[i])
                scale = _F(out) / _F(size)
            elif scales is not None:
                scale = _F(np.asarray(scales, dtype=np.float32).reshape(-1)[i])
                out = int(scale * _F(size))
            else:
                raise PulsarError("Resize needs a scales or a sizes input")
            if out == size:  # onnxruntime maps an unchanged axis one to one
                continue
            o = np.arange(out, dtype=np.float32)
            src = to_index(to_coord(o, scale, _F(out), _F(size)))
            y = np.take(y, np.clip(src, 0, size - 1).astype(np.int64), axis=a)
        return [y]

    return run
