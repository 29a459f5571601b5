"""Resize and Upsample in torch, exact with onnxruntime in every mode.

Resize is separable: each resized axis is one 1-D interpolation, built here (in numpy, from constant
shapes and scales) as a gather table — for each output position ``K`` input indices and ``K``
weights — and applied with ``index_select`` and a weighted sum, so the result is differentiable in
the input and reproduces onnxruntime's arithmetic: source coordinates in float32 as its kernels
compute them, its nearest-rounding rules, edge clamping, ``exclude_outside`` and its antialias filter
(a PIL-style filter widened by the downscale factor).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op

F32 = np.float32


def _source_coords(ctm: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """Input coordinate of each output position (float32, as onnxruntime computes it)."""
    y = np.arange(out_len, dtype=F32)
    s, n_in, n_out = F32(scale), F32(in_len), F32(out_len)
    half = F32(0.5)
    if ctm == "asymmetric":
        return np.asarray(y / s)
    if ctm == "align_corners":
        return np.asarray(np.zeros_like(y) if out_len == 1 else y * (n_in - 1) / (n_out - 1))
    if ctm == "pytorch_half_pixel":
        return np.asarray((y + half) / s - half if out_len > 1 else np.zeros_like(y))
    if ctm == "half_pixel":
        return np.asarray((y + half) / s - half)
    if ctm == "half_pixel_symmetric":
        adjustment = n_out / (s * n_in)
        offset = n_in / 2 * (1 - adjustment)
        return np.asarray(offset + (y + half) / s - half)
    if ctm == "tf_crop_and_resize":
        r0, r1 = F32(roi[0]), F32(roi[1])
        if out_len > 1:
            return np.asarray(r0 * (n_in - 1) + (y * (r1 - r0) * (n_in - 1)) / (n_out - 1))
        return np.asarray(np.full_like(y, half * (r0 + r1) * (n_in - 1)))
    raise NotImplementedError(f"Resize coordinate_transformation_mode {ctm}")


def _nearest_index(x: np.ndarray, rule: str, downsample: bool) -> np.ndarray:
    """onnxruntime's nearest-pixel rules (``simple`` is what Resize-10 / Upsample use)."""
    away = np.sign(x) * np.floor(np.abs(x) + 0.5)   # std::round: halves away from zero
    if rule == "round_prefer_floor":
        return np.asarray(np.where(x == np.trunc(x) + F32(0.5), np.floor(x), away))
    if rule == "round_prefer_ceil":
        return np.asarray(away)
    if rule == "floor":
        return np.asarray(np.floor(x))
    if rule == "ceil":
        return np.asarray(np.ceil(x))
    if rule == "simple":
        return np.asarray(np.ceil(x) if downsample else np.trunc(x))
    raise NotImplementedError(f"Resize nearest_mode {rule}")


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel with coefficient ``a`` (Keys)."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _antialias(x: np.ndarray, in_len: int, scale: float, cubic_a: float | None,
               exclude: bool, identity: bool) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's antialias filter: a triangle (linear) or cubic kernel stretched by the downscale
    factor, window ``[floor(c - support + .5), floor(c + support + .5))`` around ``c = x + .5``."""
    inv = 1.0 / float(F32(scale))
    half_support = 2.0 if cubic_a is not None else 1.0
    support = half_support * inv if inv >= 1.0 else half_support
    stretch = 1.0 / inv if inv >= 1.0 else 1.0
    center = (np.arange(len(x), dtype=np.float64) if identity else x.astype(np.float64)) + 0.5
    lo = np.floor(center - support + 0.5).astype(np.int64)
    hi = np.floor(center + support + 0.5).astype(np.int64)
    k = int((hi - lo).max())
    idx = lo[:, None] + np.arange(k)[None, :]
    arg = (idx - center[:, None] + 0.5) * stretch
    w = _cubic(arg, cubic_a) if cubic_a is not None else np.clip(1 - np.abs(arg), 0, 1)
    w = np.where(idx < hi[:, None], w, 0.0)
    if exclude:
        w = np.where((idx < 0) | (idx >= in_len), 0.0, w)
    total = w.sum(axis=1, keepdims=True)
    return idx, w / np.where(total == 0, 1.0, total)


def _axis_table(c: Call, mode: str, in_len: int, out_len: int, scale: float, roi: tuple[float, float],
                opset10: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(indices [out, K], weights [out, K], extrapolated positions or None) of one resized axis."""
    ctm = "asymmetric" if opset10 else c.attr("coordinate_transformation_mode", "half_pixel")
    x = _source_coords(ctm, out_len, in_len, scale, roi)
    extra = ((x < 0) | (x > in_len - 1)) if ctm == "tf_crop_and_resize" else None
    exclude = bool(c.attr("exclude_outside", 0))
    if mode == "nearest":
        rule = "simple" if opset10 else c.attr("nearest_mode", "round_prefer_floor")
        idx = _nearest_index(x, rule, scale < 1)[:, None].astype(np.int64)
        w = np.ones_like(idx, dtype=np.float64)
    elif c.attr("antialias", 0):
        a = float(c.attr("cubic_coeff_a", -0.75)) if mode == "cubic" else None
        idx, w = _antialias(x, in_len, scale, a, exclude, scale == 1.0)
    elif mode == "cubic":
        base = np.floor(x)
        s = (x - base).astype(np.float64)
        idx = base.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :]
        w = _cubic(s[:, None] - np.arange(-1, 3)[None, :], float(c.attr("cubic_coeff_a", -0.75)))
        if exclude:
            w = np.where((idx < 0) | (idx >= in_len), 0.0, w)
            w = w / w.sum(axis=1, keepdims=True)
    else:  # linear: onnxruntime clamps the coordinate into the input first
        xc = np.clip(x, 0, in_len - 1).astype(np.float64)
        x1 = np.minimum(np.floor(xc), in_len - 1)
        idx = np.stack([x1, np.minimum(x1 + 1, in_len - 1)], axis=1).astype(np.int64)
        frac = xc - x1
        w = np.stack([1 - frac, frac], axis=1)
    return np.clip(idx, 0, in_len - 1), w, extra


def _apply_axis(x: Tensor, axis: int, idx: np.ndarray, w: np.ndarray, extra: np.ndarray | None,
                fill: float) -> Tensor:
    """Sum over the K taps of ``w[:, k] * x[..., idx[:, k], ...]`` along ``axis``."""
    shape = [1] * x.dim()
    shape[axis] = idx.shape[0]
    out: Tensor | None = None
    for k in range(idx.shape[1]):
        wk = w[:, k]
        if not wk.any():
            continue
        tap = x.index_select(axis, torch.from_numpy(idx[:, k]).to(x.device))
        if not np.all(wk == 1.0):
            tap = tap * torch.from_numpy(wk).to(x.device, x.dtype).reshape(shape)
        out = tap if out is None else out + tap
    if out is None:
        out = x.index_select(axis, torch.from_numpy(idx[:, 0]).to(x.device)) * 0
    if extra is not None and extra.any():
        mask = torch.from_numpy(extra).to(x.device).reshape(shape)
        out = torch.where(mask, torch.full_like(out, fill), out)
    return out


def _plan(c: Call, x: Tensor, scales: list[float] | None, sizes: list[int] | None,
          roi: list[float] | None) -> tuple[list[int], list[float], list[tuple[float, float]]]:
    """Output shape, per-axis float32 scales and per-axis roi, with ``axes`` and
    ``keep_aspect_ratio_policy`` resolved as onnxruntime does."""
    r = x.dim()
    axes = [int(a) % r for a in (c.attr("axes") or range(r))]
    shape = list(x.shape)
    rois = [(0.0, 1.0)] * r
    if roi:
        n = len(roi) // 2
        for i, a in enumerate(axes if n == len(axes) else range(r)):
            rois[a] = (float(roi[i]), float(roi[i + n]))
    sc = [1.0] * r
    out = list(shape)
    if sizes:
        for i, a in enumerate(axes):
            sc[a] = float(F32(sizes[i]) / F32(shape[a]))
            out[a] = int(sizes[i])
        policy = c.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            s = pick(sc[a] for a in axes)
            for a in axes:
                sc[a] = s
                out[a] = int(math.floor(float(F32(s) * F32(shape[a])) + 0.5))
    elif scales:
        for i, a in enumerate(axes):
            sc[a] = float(F32(scales[i]))
            out[a] = int(F32(scales[i]) * F32(shape[a]))
    return out, sc, rois


def _resize(c: Call, x: Tensor, scales: list[float] | None, sizes: list[int] | None,
            roi: list[float] | None, opset10: bool) -> Tensor:
    mode = str(c.attr("mode", "nearest")).replace("bilinear", "linear").replace("trilinear", "linear")
    out_shape, sc, rois = _plan(c, x, scales, sizes, roi)
    is_int = not (x.is_floating_point() or x.is_complex())
    y = x.to(torch.float32) if is_int else x
    fill = float(c.attr("extrapolation_value", 0.0))
    if 0 in out_shape:
        return x.new_zeros(out_shape)
    for a in range(x.dim()):
        n_in, n_out = int(x.shape[a]), out_shape[a]
        if n_in == n_out and sc[a] == 1.0:  # onnxruntime leaves such an axis alone, roi or not
            continue
        idx, w, extra = _axis_table(c, mode, n_in, n_out, sc[a], rois[a], opset10)
        y = _apply_axis(y, a, idx, w, extra, fill)
    if is_int:
        y = torch.round(y).clamp(*_int_range(x.dtype)).to(x.dtype)
    return y


def _int_range(dtype: torch.dtype) -> tuple[float, float]:
    info = torch.iinfo(dtype) if dtype != torch.bool else torch.iinfo(torch.uint8)
    return float(info.min), float(info.max)


def _floats(t: Tensor | None) -> list[float] | None:
    return None if t is None or t.numel() == 0 else [float(v) for v in t.reshape(-1).tolist()]


@op("Resize")
def resize(c: Call) -> list[Tensor]:
    """Resize-10 has inputs (X, scales); Resize-11 and later (X, roi, scales, sizes)."""
    x = _x(c)
    if len(c.inputs) == 2:
        return [_resize(c, x, _floats(c.inputs[1]), None, None, opset10=True)]
    sizes = c.ints(3)
    return [_resize(c, x, _floats(c.input(2)), sizes if sizes else None, _floats(c.input(1)), opset10=False)]


@op("Upsample")
def upsample(c: Call) -> list[Tensor]:
    """Upsample (opsets 7-9): asymmetric coordinates, scales as an attribute (7) or an input (9)."""
    x = _x(c)
    scales = c.attr("scales") or _floats(c.input(1)) or []
    return [_resize(c, x, [float(v) for v in scales], None, None, opset10=True)]
