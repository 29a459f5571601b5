"""MaxPool and AveragePool in every form ONNX allows: asymmetric and ``auto_pad`` pads, pads wider
than half the kernel, dilations, ``ceil_mode``, ``count_include_pad``, and MaxPool's indices.

torch's pooling refuses pads over half the kernel and has no dilated average pool, so the input is
padded explicitly and the average is a depthwise sum (a convolution with a ones kernel) divided by
the count of the elements each window covers (the same sum over a mask)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, onnx_pads, op, torch_pads

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _geometry(c: Call, x: Tensor) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """kernel, strides, dilations, pads (ONNX order) and the extra end padding ``ceil_mode`` adds."""
    kernel = list(c.attr("kernel_shape"))
    n = len(kernel)
    strides = list(c.attr("strides", [1] * n))
    dil = list(c.attr("dilations", [1] * n))
    pads = onnx_pads(c, x, kernel, strides, dil)
    extra = [0] * n
    if c.attr("ceil_mode", 0):
        for d in range(n):
            size = x.shape[2 + d] + pads[d] + pads[d + n]
            span = dil[d] * (kernel[d] - 1) + 1
            out = math.ceil((size - span) / strides[d]) + 1
            if (out - 1) * strides[d] >= x.shape[2 + d] + pads[d]:
                out -= 1  # a window may not start in the end padding
            extra[d] = max(0, (out - 1) * strides[d] + span - size)
    return kernel, strides, dil, pads, extra


@op("MaxPool")
def max_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    kernel, strides, dil, pads, extra = _geometry(c, x)
    n = len(kernel)
    full = [*pads[:n], *(p + e for p, e in zip(pads[n:], extra, strict=True))]
    low = -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
    xp = F.pad(x.float() if not x.dtype.is_floating_point else x, torch_pads(full), value=low)
    if c.n_outputs == 1:
        y = _MAX[n](xp, kernel, strides, 0, dilation=dil)
        return [y.to(x.dtype)]
    y, idx = _MAX[n](xp, kernel, strides, 0, dilation=dil, return_indices=True)
    # torch: flat index over the padded spatial plane; ONNX: over the whole unpadded input, in
    # row-major order (column-major over the spatial axes with storage_order 1)
    padded = xp.shape[2:]
    coords = []
    rest = idx
    for d in reversed(range(n)):
        coords.append(rest % padded[d] - full[d])
        rest = rest // padded[d]
    coords.reverse()
    spatial = x.shape[2:]
    flat = torch.zeros_like(idx)
    order = range(n) if not c.attr("storage_order", 0) else reversed(range(n))
    for d in order:
        flat = flat * spatial[d] + coords[d]
    plane = math.prod(spatial)
    nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *([1] * n))
    return [y.to(x.dtype), flat + nc * plane]


@op("AveragePool")
def avg_pool(c: Call) -> list[Tensor]:
    x = _x(c)
    kernel, strides, dil, pads, extra = _geometry(c, x)
    n = len(kernel)
    ch = x.shape[1]
    ones = torch.ones(ch, 1, *kernel, dtype=x.dtype, device=x.device)
    xp = F.pad(F.pad(x, torch_pads(pads)), torch_pads([0] * n + extra))
    mask = torch.ones(1, 1, *x.shape[2:], dtype=x.dtype, device=x.device)
    mask = F.pad(mask, torch_pads(pads), value=1.0 if c.attr("count_include_pad", 0) else 0.0)
    mask = F.pad(mask, torch_pads([0] * n + extra))
    total = _CONV[n](xp, ones, None, strides, 0, dil, ch)
    count = _CONV[n](mask, ones[:1], None, strides, 0, dil, 1)
    return [total / count]
