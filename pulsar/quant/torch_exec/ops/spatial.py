"""Spatial ops: transposed and deformable convolution, grid sampling, Lp pooling, unpooling, Col2Im and
region pooling. Each follows onnxruntime's arithmetic where the spec leaves room (ConvTranspose's
auto_pad split, RoiAlign's sampling and its ``max`` mode) and stays differentiable in the data."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, onnx_pads, op, torch_pads

_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _spatial_list(c: Call, name: str, n: int, default: int) -> list[int]:
    return [int(v) for v in (c.attr(name) or [default] * n)]


@op("ConvTranspose")
def conv_transpose(c: Call) -> list[Tensor]:
    """F.conv_transpose with no padding gives the full output ``(in - 1) * s + (k - 1) * d + 1``; the
    ONNX output is a window of it (pads crop, output_padding / output_shape extend with zeros)."""
    x, w, b = _x(c), _x(c, 1), c.input(2)
    n = w.dim() - 2
    strides, dil = _spatial_list(c, "strides", n, 1), _spatial_list(c, "dilations", n, 1)
    adj = _spatial_list(c, "output_padding", n, 0)
    y = _CONV_T[n](x, w, None, stride=strides, groups=int(c.attr("group", 1)), dilation=dil)
    out_shape = c.attr("output_shape")
    out_shape = [int(v) for v in out_shape][-n:] if out_shape else None
    auto = c.attr("auto_pad", "NOTSET")
    pads = [int(p) for p in (c.attr("pads") or [0] * (2 * n))]
    for d in range(n):
        full = (x.shape[2 + d] - 1) * strides[d] + (w.shape[2 + d] - 1) * dil[d] + 1
        if auto in ("SAME_UPPER", "SAME_LOWER") or out_shape is not None:
            target = out_shape[d] if out_shape is not None else x.shape[2 + d] * strides[d]
            total = full + adj[d] - target  # negative: output_shape reaches past the full output
            if out_shape is None:  # auto_pad never extends (onnxruntime)
                total = max(0, total)
            # the spec: SAME_UPPER puts the odd pad at the end, SAME_LOWER / NOTSET at the start
            head = max(0, total // 2 if auto == "SAME_UPPER" else total - total // 2)
            pads[d], pads[d + n] = head, total - head
        elif auto == "VALID":
            pads[d] = pads[d + n] = 0
    # crop pads, extend by output_padding: negative F.pad amounts crop
    fp: list[int] = []
    for d in reversed(range(n)):
        fp += [-pads[d], adj[d] - pads[d + n]]
    if any(fp):
        y = F.pad(y, fp)
    if b is not None:
        y = y + b.reshape([1, -1] + [1] * n)
    return [y]


def _reflect(v: Tensor, lo: float, hi: float) -> Tensor:
    """Fold coordinates into [lo, hi] by reflection at the bounds (onnxruntime's GsReflect)."""
    span = hi - lo
    if span <= 0:
        return torch.full_like(v, lo)
    below, above = lo - v, v - hi
    dist = torch.where(v < lo, below, torch.where(v > hi, above, torch.zeros_like(v)))
    n = torch.floor(dist / span)
    r = dist - n * span
    even = torch.remainder(n, 2) == 0
    low_side = torch.where(even, lo + r, hi - r)
    high_side = torch.where(even, hi - r, lo + r)
    return torch.where(v < lo, low_side, torch.where(v > hi, high_side, v))


def _nearest_reflect_grid(x: Tensor, grid: Tensor, corners: bool) -> Tensor:
    """onnxruntime rounds a nearest sample to a pixel before reflecting it (F.grid_sample reflects
    first): the grid moved onto the reflected pixel centres, which grid_sample then reads as is."""
    cols = []
    for i in range(grid.shape[-1]):
        size = x.shape[-1 - i]
        g = grid[..., i]
        v = (g + 1) / 2 * (size - 1) if corners else ((g + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if corners else (-0.5, size - 0.5)
        v = _reflect(torch.round(v), lo, hi)
        v = torch.clamp(torch.round(v), 0, size - 1)
        cols.append(v / max(size - 1, 1) * 2 - 1 if corners else (2 * v + 1) / size - 1)
    return torch.stack(cols, -1)


@op("GridSample")
def grid_sample(c: Call) -> list[Tensor]:
    """F.grid_sample has the same modes, paddings and corner convention as onnxruntime, but for
    the order of rounding and reflection of a nearest sample."""
    x, grid = _x(c), _x(c, 1).to(_x(c).dtype)
    mode = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest", "cubic": "bicubic",
            "bicubic": "bicubic"}[c.attr("mode", "linear" if x.dim() != 4 else "bilinear")]
    padding, corners = c.attr("padding_mode", "zeros"), bool(c.attr("align_corners", 0))
    if mode == "nearest" and padding == "reflection":
        grid = _nearest_reflect_grid(x, grid, corners)
    return [F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=corners)]


@op("AffineGrid")
def affine_grid(c: Call) -> list[Tensor]:
    """Normalized pixel positions (x first) times theta; written out because F.affine_grid puts a
    size-1 axis at 0 where onnxruntime (align_corners) puts it at +1."""
    theta, size = _x(c), c.ints(1) or []
    spatial = size[2:]
    corners = bool(c.attr("align_corners", 0))
    axes = []
    for n in reversed(spatial):  # x (the last axis) first
        i = torch.arange(n, dtype=theta.dtype, device=theta.device)
        if corners:  # a size-1 axis sits at +1 (onnxruntime, Eigen's LinSpaced)
            axes.append(torch.linspace(-1, 1, n, dtype=theta.dtype, device=theta.device) if n > 1 else i + 1)
        else:
            axes.append((2 * i + 1) / n - 1)
    mesh = torch.meshgrid(*reversed(axes), indexing="ij")  # each [*spatial]
    base = torch.stack([*reversed(mesh), torch.ones_like(mesh[0])], -1)  # [*spatial, nd + 1]
    grid = torch.einsum("...k,bjk->b...j", base, theta)
    return [grid]


def _window_sum(c: Call, x: Tensor, kernel: list[int]) -> Tensor:
    """Sum of ``x`` over each pooling window (zero padding, dilations, ceil_mode), as a depthwise
    convolution with a kernel of ones."""
    n = len(kernel)
    strides, dil = _spatial_list(c, "strides", n, 1), _spatial_list(c, "dilations", n, 1)
    pads = onnx_pads(c, x, kernel, strides, [1] * n)  # onnxruntime sizes SAME pads without dilations
    if c.attr("ceil_mode", 0):
        for d in range(n):
            size = x.shape[2 + d] + pads[d] + pads[d + n]
            eff = (kernel[d] - 1) * dil[d] + 1
            out = math.ceil((size - eff) / strides[d]) + 1
            if (out - 1) * strides[d] >= x.shape[2 + d] + pads[d]:
                out -= 1
            pads[d + n] += max(0, (out - 1) * strides[d] + eff - size)
    xs = F.pad(x, torch_pads(pads)) if any(pads) else x
    ch = x.shape[1]
    ones = torch.ones([ch, 1, *kernel], dtype=x.dtype, device=x.device)
    return _CONV[n](xs, ones, stride=strides, dilation=dil, groups=ch)


@op("LpPool")
def lp_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    p = float(c.attr("p", 2))
    return [_window_sum(c, x.abs() ** p, list(c.attr("kernel_shape"))) ** (1.0 / p)]


@op("GlobalLpPool")
def global_lp_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    p = float(c.attr("p", 2))
    return [(x.abs() ** p).sum(dim=tuple(range(2, x.dim())), keepdim=True) ** (1.0 / p)]


@op("MaxUnpool")
def max_unpool(c: Call) -> list[Tensor]:
    """MaxPool's indices are flat over the whole output tensor: a scatter into zeros."""
    x, idx = _x(c), _x(c, 1)
    shape = c.ints(2)
    if not shape:
        kernel = list(c.attr("kernel_shape"))
        n = len(kernel)
        strides = _spatial_list(c, "strides", n, 1)
        pads = [int(p) for p in (c.attr("pads") or [0] * (2 * n))]
        shape = list(x.shape[:2]) + [(x.shape[2 + d] - 1) * strides[d] + kernel[d] - pads[d] - pads[d + n]
                                     for d in range(n)]
    flat = x.new_zeros(math.prod(shape)).scatter(0, idx.reshape(-1).long(), x.reshape(-1))
    return [flat.reshape(shape)]


@op("Col2Im")
def col2im(c: Call) -> list[Tensor]:
    """Each column is one block position (row-major over the block grid); its rows are the block's
    pixels, channel-major. The blocks are summed into the padded image with index_add."""
    x = _x(c)
    image, block = c.ints(1) or [], c.ints(2) or []
    n = len(image)
    strides, dil = _spatial_list(c, "strides", n, 1), _spatial_list(c, "dilations", n, 1)
    pads = [int(p) for p in (c.attr("pads") or [0] * (2 * n))]
    padded = [image[d] + pads[d] + pads[d + n] for d in range(n)]
    grid = [(padded[d] - (dil[d] * (block[d] - 1) + 1)) // strides[d] + 1 for d in range(n)]
    kpos = np.stack(np.meshgrid(*[np.arange(k) for k in block], indexing="ij"), -1).reshape(-1, n)
    bpos = np.stack(np.meshgrid(*[np.arange(g) for g in grid], indexing="ij"), -1).reshape(-1, n)
    coords = bpos[None, :, :] * np.array(strides) + kpos[:, None, :] * np.array(dil)  # [K, L, n]
    flat = np.ravel_multi_index(tuple(coords[..., d] for d in range(n)), padded).reshape(-1)
    nb, k = x.shape[0], math.prod(block)
    ch = x.shape[1] // k
    cols = x.reshape(nb, ch, k * x.shape[2])
    out = x.new_zeros(nb, ch, math.prod(padded)).index_add(2, torch.from_numpy(flat).to(x.device), cols)
    out = out.reshape(nb, ch, *padded)
    crop = (slice(None), slice(None)) + tuple(slice(pads[d], pads[d] + image[d]) for d in range(n))
    return [out[crop]]


def _bilinear_zero(img: Tensor, y: Tensor, x: Tensor) -> Tensor:
    """Bilinear samples of ``img`` [N, C, H, W] at float positions y, x [N, ...] (same shape), each of
    the four neighbours outside the image counting as zero. Returns [N, C, ...]."""
    n, ch, h, w = img.shape
    flat = img.reshape(n, ch, h * w)
    y0, x0 = torch.floor(y), torch.floor(x)
    out = None
    for dy in (0, 1):
        for dx in (0, 1):
            yi, xi = y0 + dy, x0 + dx
            wgt = (1 - (y - yi).abs()) * (1 - (x - xi).abs())
            inside = (yi >= 0) & (yi <= h - 1) & (xi >= 0) & (xi <= w - 1)
            pos = (yi.clamp(0, h - 1) * w + xi.clamp(0, w - 1)).long().reshape(n, 1, -1).expand(n, ch, -1)
            v = flat.gather(2, pos).reshape(n, ch, *y.shape[1:])
            term = v * (wgt * inside).unsqueeze(1)
            out = term if out is None else out + term
    assert out is not None
    return out


@op("DeformConv")
def deform_conv(c: Call) -> list[Tensor]:
    """2-D deformable convolution: each kernel tap samples the input bilinearly at its offset position
    (zeros outside), scaled by the mask, then a grouped matrix product with the weights."""
    x, w, offset, b, mask = _x(c), _x(c, 1), _x(c, 2), c.input(3), c.input(4)
    if w.dim() != 4:
        raise NotImplementedError("DeformConv other than 2-D")
    nb, ch, h, wd = x.shape
    oc, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    sh, sw = _spatial_list(c, "strides", 2, 1)
    dh, dw = _spatial_list(c, "dilations", 2, 1)
    pads = [int(p) for p in (c.attr("pads") or [0] * 4)]
    groups, og = int(c.attr("group", 1)), int(c.attr("offset_group", 1))
    oh, ow = offset.shape[2], offset.shape[3]
    k = kh * kw
    ky, kx = torch.meshgrid(torch.arange(kh), torch.arange(kw), indexing="ij")
    base_y = (torch.arange(oh) * sh - pads[0]).reshape(1, 1, oh, 1) + (ky.reshape(1, k, 1, 1) * dh)
    base_x = (torch.arange(ow) * sw - pads[1]).reshape(1, 1, 1, ow) + (kx.reshape(1, k, 1, 1) * dw)
    off = offset.reshape(nb, og, k, 2, oh, ow)
    py = base_y.to(x.dtype).unsqueeze(1) + off[:, :, :, 0]  # [N, og, K, oh, ow]
    px = base_x.to(x.dtype).unsqueeze(1) + off[:, :, :, 1]
    cpg = ch // og
    parts = []
    for g in range(og):
        img = x[:, g * cpg:(g + 1) * cpg]
        parts.append(_bilinear_zero(img, py[:, g], px[:, g]))  # [N, cpg, K, oh, ow]
    cols = torch.stack(parts, 1)  # [N, og, cpg, K, oh, ow]
    if mask is not None:
        cols = cols * mask.reshape(nb, og, 1, k, oh, ow)
    cols = cols.reshape(nb, groups, (ch // groups) * k, oh * ow)
    wg = w.reshape(groups, oc // groups, (ch // groups) * k)
    y = torch.einsum("gok,ngkp->ngop", wg, cols).reshape(nb, oc, oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return [y]


def _roi_axis(start: float, size: float, bins: int, grid: int, length: int) -> tuple[np.ndarray, ...]:
    """onnxruntime's RoiAlign sampling along one axis: for each (bin, sample) the low / high pixel and
    their bilinear weights (zero for a sample outside [-1, length])."""
    pos = start + np.arange(bins)[:, None] * (size / bins) + (np.arange(grid)[None, :] + 0.5) * (size / bins) / grid
    valid = (pos >= -1.0) & (pos <= length)
    pos = np.maximum(pos, 0.0)
    low = np.floor(pos).astype(np.int64)
    edge = low >= length - 1
    low = np.where(edge, length - 1, low)
    high = np.where(edge, length - 1, low + 1)
    pos = np.where(edge, low, pos)
    frac = pos - low
    return low, high, np.where(valid, 1 - frac, 0.0), np.where(valid, frac, 0.0)


@op("RoiAlign")
def roi_align(c: Call) -> list[Tensor]:
    """Average: a separable weight matrix per roi (rows: bins, columns: pixels). Max (onnxruntime's
    definition): per bin the max over samples and corners of weight x pixel."""
    x, rois, batch = _x(c), _x(c, 1), _x(c, 2)
    oh, ow = int(c.attr("output_height", 1)), int(c.attr("output_width", 1))
    ratio, scale = int(c.attr("sampling_ratio", 0)), float(c.attr("spatial_scale", 1.0))
    half = c.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    h, w = x.shape[2], x.shape[3]
    outs = []
    for r, box in enumerate(rois.detach().double().cpu().numpy()):
        off = 0.5 if half else 0.0
        x0, y0, x1, y1 = (float(v) * scale - off for v in box)
        rw, rh = x1 - x0, y1 - y0
        if not half:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else math.ceil(rh / oh)
        gw = ratio if ratio > 0 else math.ceil(rw / ow)
        ylo, yhi, wyl, wyh = _roi_axis(y0, rh, oh, gh, h)
        xlo, xhi, wxl, wxh = _roi_axis(x0, rw, ow, gw, w)
        img = x[int(batch[r])]  # [C, H, W]
        if c.attr("mode", "avg") == "avg":
            ay, ax = np.zeros((oh, h)), np.zeros((ow, w))
            for i in range(gh):
                np.add.at(ay, (np.arange(oh), ylo[:, i]), wyl[:, i] / gh)
                np.add.at(ay, (np.arange(oh), yhi[:, i]), wyh[:, i] / gh)
            for i in range(gw):
                np.add.at(ax, (np.arange(ow), xlo[:, i]), wxl[:, i] / gw)
                np.add.at(ax, (np.arange(ow), xhi[:, i]), wxh[:, i] / gw)
            ty, tx = (torch.from_numpy(a).to(x.device, x.dtype) for a in (ay, ax))
            outs.append(torch.einsum("ph,chw,qw->cpq", ty, img, tx))
            continue
        yi = torch.from_numpy(np.stack([ylo, yhi], -1)).to(x.device)   # [oh, gh, 2]
        xi = torch.from_numpy(np.stack([xlo, xhi], -1)).to(x.device)   # [ow, gw, 2]
        wy = torch.from_numpy(np.stack([wyl, wyh], -1)).to(x.device, x.dtype)
        wx = torch.from_numpy(np.stack([wxl, wxh], -1)).to(x.device, x.dtype)
        v = img[:, yi.reshape(-1)][:, :, xi.reshape(-1)].reshape(-1, oh, gh, 2, ow, gw, 2)
        v = v * wy.reshape(1, oh, gh, 2, 1, 1, 1) * wx.reshape(1, 1, 1, 1, ow, gw, 2)
        outs.append(v.amax(dim=(2, 3, 5, 6)))
    if not outs:
        return [x.new_zeros(0, x.shape[1], oh, ow)]
    return [torch.stack(outs)]


@op("MaxRoiPool")
def max_roi_pool(c: Call) -> list[Tensor]:
    """onnxruntime's MaxRoiPool: roi corners rounded to pixels, bins floor/ceil-split, empty bins 0."""
    x, rois = _x(c), _x(c, 1)
    ph, pw = (int(v) for v in c.attr("pooled_shape"))
    scale = float(c.attr("spatial_scale", 1.0))
    h, w = x.shape[2], x.shape[3]
    outs = []
    for box in rois.detach().double().cpu().numpy():
        b = int(box[0])
        xs, ys, xe, ye = (int(np.round(v * scale)) for v in box[1:])
        rh, rw = max(ye - ys + 1, 1), max(xe - xs + 1, 1)
        rows = []
        for i in range(ph):
            hs = min(max(math.floor(i * rh / ph) + ys, 0), h)
            he = min(max(math.ceil((i + 1) * rh / ph) + ys, 0), h)
            cells = []
            for j in range(pw):
                ws = min(max(math.floor(j * rw / pw) + xs, 0), w)
                we = min(max(math.ceil((j + 1) * rw / pw) + xs, 0), w)
                if he <= hs or we <= ws:
                    cells.append(x.new_zeros(x.shape[1]))
                else:
                    cells.append(x[b, :, hs:he, ws:we].amax(dim=(1, 2)))
            rows.append(torch.stack(cells, -1))
        outs.append(torch.stack(rows, -2))
    return [torch.stack(outs)]
