"""Shape, generation and layout ops: Shape / Size, ConstantOfShape, Expand, Tile, Range, EyeLike,
Trilu, OneHot, CumSum / CumProd, ReverseSequence, DepthToSpace / SpaceToDepth, CenterCropPad, Einsum,
Det, Slice, Pad, and the Optional ops on plain tensors.

Indices and shapes come out as int64 (ONNX's type for them); every other output keeps its input's dtype."""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op, torch_pads


def torch_dtype(onnx_type: int) -> torch.dtype:
    """The torch dtype the executor holds an ONNX element type in (wide unsigned types as int64)."""
    dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))
    if dt.kind == "u" and dt.itemsize > 1:
        return torch.int64
    return torch.from_numpy(np.zeros(0, dt)).dtype


def _const(proto: onnx.TensorProto, device: torch.device) -> Tensor:
    a = numpy_helper.to_array(proto)
    if a.dtype.kind == "u" and a.dtype.itemsize > 1:
        a = a.astype(np.int64)
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def _scalar(c: Call, i: int, default: int = 0) -> int:
    t = c.input(i)
    return default if t is None or t.numel() == 0 else int(t.reshape(-1)[0])


def _i64(values: list[int], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


@op("Shape")
def shape(c: Call) -> list[Tensor]:
    """``start`` / ``end`` clamp as Python slicing does, which is what the spec describes."""
    x = _x(c)
    return [_i64(list(x.shape)[c.attr("start", 0):c.attr("end", None)], x)]


@op("Size")
def size(c: Call) -> list[Tensor]:
    x = _x(c)
    return [torch.tensor(x.numel(), dtype=torch.int64, device=x.device)]


@op("ConstantOfShape")
def constant_of_shape(c: Call) -> list[Tensor]:
    x = _x(c)
    value = c.attr("value")
    v = torch.zeros(1, dtype=torch.float32, device=x.device) if value is None else _const(value, x.device)
    return [v.reshape(()).expand(c.ints(0) or []).clone()]


@op("Expand")
def expand(c: Call) -> list[Tensor]:
    """Two-way broadcasting: the shape may be shorter than the input, or hold 1 where it is larger."""
    x, want = _x(c), c.ints(1) or []
    n = max(x.dim(), len(want))
    have, want = [1] * (n - x.dim()) + list(x.shape), [1] * (n - len(want)) + want
    return [x.expand([w if h == 1 else h for h, w in zip(have, want, strict=True)])]


@op("Tile")
def tile(c: Call) -> list[Tensor]:
    return [_x(c).repeat(c.ints(1) or [])]


@op("Range")
def range_(c: Call) -> list[Tensor]:
    """start + i x delta for i < ceil((limit - start) / delta), as the spec computes it."""
    start, limit, delta = _x(c), _x(c, 1), _x(c, 2)
    s, lim, d = start.item(), limit.item(), delta.item()
    n = max(math.ceil((lim - s) / d), 0)
    i = torch.arange(n, device=start.device)
    return [(start.reshape(()) + i.to(start.dtype) * delta.reshape(())).to(start.dtype)]


@op("EyeLike")
def eye_like(c: Call) -> list[Tensor]:
    x = _x(c)
    dt = torch_dtype(c.attr("dtype")) if c.attr("dtype") is not None else x.dtype
    i = torch.arange(x.shape[0], device=x.device)[:, None]
    j = torch.arange(x.shape[1], device=x.device)[None, :]
    return [(j - i == c.attr("k", 0)).to(dt)]


@op("Trilu")
def trilu(c: Call) -> list[Tensor]:
    x, k = _x(c), _scalar(c, 1)
    return [torch.triu(x, k) if c.attr("upper", 1) else torch.tril(x, k)]


@op("OneHot")
def one_hot(c: Call) -> list[Tensor]:
    """Negative indices count from ``depth``; out-of-range ones give a row of off values."""
    idx, values = _x(c).to(torch.int64), _x(c, 2)
    depth = int(_x(c, 1).reshape(-1)[0].item())
    idx = torch.where(idx < 0, idx + depth, idx)
    hot = idx.unsqueeze(-1) == torch.arange(depth, device=idx.device)
    hot = hot.movedim(-1, c.attr("axis", -1) % (idx.dim() + 1))
    return [torch.where(hot, values[1], values[0])]


def _cumulative(c: Call, fn: str) -> list[Tensor]:
    """``reverse`` by flipping; ``exclusive`` by shifting one step along the axis (the identity first)."""
    x = _x(c)
    axis = _scalar(c, 1) % x.dim()
    y = x.flip(axis) if c.attr("reverse", 0) else x
    out = y.cumsum(axis, dtype=x.dtype) if fn == "sum" else y.cumprod(axis, dtype=x.dtype)
    if c.attr("exclusive", 0):
        first = (torch.zeros_like if fn == "sum" else torch.ones_like)(out.narrow(axis, 0, 1))
        out = torch.cat([first, out.narrow(axis, 0, out.shape[axis] - 1)], dim=axis)
    return [out.flip(axis) if c.attr("reverse", 0) else out]


@op("CumSum")
def cumsum(c: Call) -> list[Tensor]:
    return _cumulative(c, "sum")


@op("CumProd")
def cumprod(c: Call) -> list[Tensor]:
    return _cumulative(c, "prod")


@op("ReverseSequence")
def reverse_sequence(c: Call) -> list[Tensor]:
    """A gather along the time axis: position t of batch b reads lens[b]-1-t while t < lens[b]."""
    x, lens = _x(c), _x(c, 1).to(torch.int64)
    b_axis, t_axis = c.attr("batch_axis", 1), c.attr("time_axis", 0)
    t = torch.arange(x.shape[t_axis], device=x.device)[None, :]
    src = torch.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # [batch, time]
    if b_axis > t_axis:
        src = src.t()
    view = [1] * x.dim()
    view[b_axis], view[t_axis] = x.shape[b_axis], x.shape[t_axis]
    return [torch.gather(x, t_axis, src.reshape(view).expand(x.shape))]


@op("DepthToSpace")
def depth_to_space(c: Call) -> list[Tensor]:
    x = _x(c)
    bs = c.attr("blocksize")
    n, ch, h, w = x.shape
    if c.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, bs, bs, ch // bs**2, h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, ch // bs**2, bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    return [y.reshape(n, ch // bs**2, h * bs, w * bs)]


@op("SpaceToDepth")
def space_to_depth(c: Call) -> list[Tensor]:
    x = _x(c)
    bs = c.attr("blocksize")
    n, ch, h, w = x.shape
    perm = (0, 3, 5, 1, 2, 4) if c.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    y = x.reshape(n, ch, h // bs, bs, w // bs, bs).permute(*perm)
    return [y.reshape(n, ch * bs * bs, h // bs, w // bs)]


@op("CenterCropPad")
def center_crop_pad(c: Call) -> list[Tensor]:
    """Per axis, a centered crop or zero pad; an odd difference puts the extra element at the end."""
    x = _x(c)
    target = c.ints(1) or []
    axes = [a % x.dim() for a in (c.attr("axes") or range(x.dim()))]
    for a, size in zip(axes, target, strict=False):
        n = x.shape[a]
        if size < n:
            x = x.narrow(a, (n - size) // 2, size)
        elif size > n:
            pads = [0] * (2 * x.dim())
            pads[a], pads[a + x.dim()] = (size - n) // 2, size - n - (size - n) // 2
            x = F.pad(x, torch_pads(pads))
    return [x]


@op("Einsum")
def einsum(c: Call) -> list[Tensor]:
    return [torch.einsum(c.attr("equation").replace(" ", ""), *[t for t in c.inputs if t is not None])]


@op("Det")
def det(c: Call) -> list[Tensor]:
    return [torch.linalg.det(_x(c))]


@op("OptionalHasElement")
def optional_has_element(c: Call) -> list[Tensor]:
    """Optionals reach the executor as a tensor or an omitted input (None)."""
    x = c.input(0)
    return [torch.tensor(x is not None, device=None if x is None else x.device)]


@op("OptionalGetElement")
def optional_get_element(c: Call) -> list[Tensor]:
    return [_x(c)]


@op("ArrayFeatureExtractor")
def array_feature_extractor(c: Call) -> list[Tensor]:
    """Columns of the last axis; a 1-D input reads as one row (onnxruntime's [1, k] output)."""
    x, idx = _x(c), _x(c, 1).reshape(-1).to(torch.int64)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    return [x.index_select(-1, idx)]


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


@op("Slice")
def slice_(c: Call) -> list[Tensor]:
    """starts / ends / axes / steps from inputs (opset 10+) or attributes (opset 1); negative values
    count from the end, then clamp to [0, n] (step > 0) or [-1, n - 1] (step < 0), as the spec says."""
    x = _x(c)
    if c.attr("starts") is not None:
        starts, ends, axes, steps = c.attr("starts"), c.attr("ends"), c.attr("axes"), None
    else:
        starts, ends, axes, steps = c.ints(1) or [], c.ints(2) or [], c.ints(3), c.ints(4)
    axes = list(axes) if axes is not None else list(range(len(starts)))
    steps = list(steps) if steps is not None else [1] * len(starts)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a %= x.dim()
        n = x.shape[a]
        s, e = s + n if s < 0 else s, e + n if e < 0 else e
        if st > 0:
            s, e = _clamp(s, 0, n), _clamp(e, 0, n)
            x = x[(slice(None),) * a + (slice(s, e, st),)]
        else:
            s, e = _clamp(s, 0, n - 1), _clamp(e, -1, n - 1)
            x = x.index_select(a, torch.arange(s, e, st, device=x.device))
    return [x]


def _pad_index(n: int, begin: int, end: int, mode: str, device: torch.device) -> Tensor:
    """Source positions of an axis of length n padded by begin / end (>= 0) in ``mode``."""
    i = torch.arange(-begin, n + end, device=device)
    if mode == "edge":
        return i.clamp(0, n - 1)
    if mode == "wrap":
        return i % n
    if n == 1:
        return torch.zeros_like(i)
    i = i % (2 * (n - 1))  # reflect: period 2(n - 1), mirrored in its second half
    return torch.where(i >= n, 2 * (n - 1) - i, i)


@op("Pad")
def pad(c: Call) -> list[Tensor]:
    """pads / value as attributes (opset < 11) or inputs, optionally only on ``axes`` (opset 18);
    negative pads crop (before the other side pads). Constant mode by F.pad, the others as a gather per axis."""
    x = _x(c)
    mode = c.attr("mode", "constant")
    if c.attr("pads") is not None:
        raw, value = list(c.attr("pads")), float(c.attr("value", 0.0))
    else:
        raw = c.ints(1) or []
        v = c.input(2)
        value = v.reshape(-1)[0].item() if v is not None and v.numel() else 0
    axes = [a % x.dim() for a in (c.ints(3) or range(x.dim()))]
    full = [0] * (2 * x.dim())
    for k, a in enumerate(axes):
        full[a], full[a + x.dim()] = raw[k], raw[k + len(axes)]
    if mode == "constant":
        if x.dtype == torch.bool:
            return [F.pad(x.to(torch.uint8), torch_pads(full), value=float(value)).to(torch.bool)]
        return [F.pad(x, torch_pads(full), value=value)]
    for a in range(x.dim()):
        begin, end = full[a], full[a + x.dim()]
        crop_b, crop_e = max(-begin, 0), max(-end, 0)  # crop first, then pad what is left (onnxruntime)
        x = x.narrow(a, crop_b, x.shape[a] - crop_b - crop_e)
        if begin > 0 or end > 0:
            x = x.index_select(a, _pad_index(x.shape[a], max(begin, 0), max(end, 0), mode, x.device))
    return [x]

