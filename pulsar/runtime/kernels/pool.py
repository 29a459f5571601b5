"""Pooling and reductions: QAvgPool, QReduceMean (integer) and MaxPool, GlobalMaxPool, ReduceMax.

Window geometry follows onnxruntime (the QDQ reference runs there): with ceil_mode the output size is
``ceil((in + pads - ((k-1)*d + 1)) / s) + 1``, minus one when the last window would start in the end
padding. QAvgPool's count ``c`` is the number of in-bounds elements, or with count_include_pad the
number of window positions inside the padded input (the kernel size, except for a ceil_mode window
that hangs past the end padding, which counts only the part inside it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import (
    OutSpec,
    accum_float,
    array0,
    as_int64,
    centered_bound,
    check_shift,
    data_bound,
    dtype_range,
    int_attr,
    ints_attr,
    requant,
)
from pulsar.runtime.kernels.conv import centered_float, conv_geometry, pad_tensor
from pulsar.runtime.kernels.requant import Requant


def pooled_size(size: int, k: int, s: int, pb: int, pe: int, d: int, ceil_mode: bool) -> int:
    span = (k - 1) * d + 1
    if ceil_mode:
        out = -(-(size + pb + pe - span) // s) + 1
        if (out - 1) * s >= size + pb:
            out -= 1
    else:
        out = (size + pb + pe - span) // s + 1
    if out <= 0:
        raise PulsarError(f"pooling window ({k}, stride {s}, pads {pb}/{pe}) does not fit an input of size {size}")
    return out


class _Window:
    """Pooling geometry of one node: kernel, strides, pads, dilations, ceil_mode."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.kernel = ints_attr(attrs, "kernel_shape")
        if not self.kernel:
            raise PulsarError("attribute 'kernel_shape' is missing")
        self.nd = len(self.kernel)
        self.strides, self.pads, self.dilations = conv_geometry(attrs, self.nd)
        self.ceil_mode = bool(int_attr(attrs, "ceil_mode", 0))

    def out_shape(self, spatial: tuple[int, ...]) -> list[int]:
        nd = self.nd
        if len(spatial) != nd:
            raise PulsarError(f"input has {len(spatial)} spatial axes; kernel_shape {self.kernel} has {nd}")
        return [pooled_size(spatial[i], self.kernel[i], self.strides[i], self.pads[i], self.pads[nd + i],
                            self.dilations[i], self.ceil_mode) for i in range(nd)]

    def framed_shape(self, spatial: tuple[int, ...]) -> list[int]:
        """Length of each framed axis: exactly ``out_shape`` windows fit, starting at input index -pad."""
        out = self.out_shape(spatial)
        return [(out[i] - 1) * self.strides[i] + (self.kernel[i] - 1) * self.dilations[i] + 1
                for i in range(self.nd)]

    def frame(self, xt: Any, spatial: tuple[int, ...], value: float) -> Any:
        """Begin pads in front, and the end padded (or cropped) to ``framed_shape``."""
        begin = self.pads[: self.nd]
        framed = self.framed_shape(spatial)
        return pad_tensor(xt, begin, [framed[i] - begin[i] - spatial[i] for i in range(self.nd)], value)

    def sum_pool(self, xt: Any) -> Any:
        """Window sums of a framed [N, C, ...] torch tensor (a depthwise conv with a ones kernel)."""
        import torch
        import torch.nn.functional as F

        channels = xt.shape[1]
        ones = torch.ones((channels, 1, *self.kernel), dtype=xt.dtype)
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.nd - 1]
        with torch.no_grad():
            return conv(xt, ones, None, self.strides, 0, self.dilations, channels)

    def counts(self, spatial: tuple[int, ...], include_pad: bool) -> np.ndarray:
        """Elements counted by each window: the in-bounds ones, or those inside the padded input."""
        import torch

        if not include_pad:
            mask = self.frame(torch.ones((1, 1, *spatial), dtype=torch.float64), spatial, 0.0)
        else:  # the padded extent [-pad_begin, size + pad_end) starts at framed index 0
            nd = self.nd
            extent = [spatial[i] + self.pads[i] + self.pads[nd + i] for i in range(nd)]
            framed = self.framed_shape(spatial)
            mask = pad_tensor(torch.ones((1, 1, *extent), dtype=torch.float64), [0] * nd,
                              [framed[i] - extent[i] for i in range(nd)], 0.0)
        return np.rint(self.sum_pool(mask).numpy()[0, 0]).astype(np.int64)


@register("QAvgPool", domain=INT_DOMAIN)
def make_qavgpool(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """acc = window sum of (x - x_zp); y = requant(acc, M[c], N) with c the window's element count."""
    spec = OutSpec.from_attrs(attrs)
    win = _Window(attrs)
    x_zp = int_attr(attrs, "x_zp", 0)
    n = int(check_shift(int_attr(attrs, "N")))
    include_pad = bool(int_attr(attrs, "count_include_pad", 0))
    table_const = consts[1] if len(consts) > 1 else None
    cache: dict[tuple, Requant] = {}
    ksize = math.prod(win.kernel)

    def requantizer(table: np.ndarray, spatial: tuple[int, ...], xmax: int) -> Requant:
        key = (spatial, xmax)
        if table is table_const and key in cache:
            return cache[key]
        table = as_int64(table, "M").reshape(-1)
        if table.size < ksize + 1:
            raise PulsarError(f"M table has {table.size} entries; expected {ksize + 1} (prod(kernel_shape) + 1)")
        count = win.counts(spatial, include_pad)
        rq = Requant(table[count], np.asarray(n), spec, bound=count * xmax)
        if table is table_const:
            cache[key] = rq
        return rq

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x, table = inputs[0], inputs[1] if len(inputs) > 1 else None
        if x is None or table is None:
            raise PulsarError("inputs x and M are required")
        spatial = tuple(x.shape[2:])
        xmax = centered_bound(x.dtype, x_zp)
        kind = "float32" if ksize * xmax < (1 << 24) else accum_float(ksize * data_bound(x, x_zp))
        acc = win.sum_pool(win.frame(centered_float(x, x_zp, kind), spatial, 0.0))
        return [requantizer(table, spatial, xmax).torch(acc)]

    return run


def _axes(attrs: dict[str, Any], rank: int, given: np.ndarray | None = None) -> tuple[int, ...] | None:
    axes = ints_attr(attrs, "axes") if given is None else [int(a) for a in np.asarray(given).reshape(-1)]
    if not axes:
        return None
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


@register("QReduceMean", domain=INT_DOMAIN)
def make_qreducemean(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """acc = sum over axes of (x - x_zp); y = requant(acc, M, N) (M / 2**N ~ s_x / (s_y * count))."""
    spec = OutSpec.from_attrs(attrs)
    x_zp = int_attr(attrs, "x_zp", 0)
    keepdims = bool(int_attr(attrs, "keepdims", 1))
    m, n = int_attr(attrs, "M"), int(check_shift(int_attr(attrs, "N")))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        axes = _axes(attrs, x.ndim) or tuple(range(x.ndim))
        acc = array0(x.sum(axis=axes, dtype=np.int64, keepdims=keepdims))  # all axes, no keepdims: rank 0
        if x_zp:
            acc -= x_zp * math.prod(x.shape[a] for a in axes)
        return [requant(acc, m, n, spec)]

    return run


@register("MaxPool")
def make_maxpool(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """Max over each window; padded positions never win (they hold the dtype's minimum)."""
    win = _Window(attrs)
    if int_attr(attrs, "storage_order", 0):
        raise PulsarError("MaxPool storage_order 1 (Indices output) is not supported in NPU bodies")

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        import torch  # at run time: preparing a program (the compiler's load check) needs no torch
        import torch.nn.functional as F

        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[win.nd - 1]
        x = inputs[0]
        if x.dtype.kind not in "iu":
            raise PulsarError(f"input has dtype {x.dtype}; NPU activations are integer tensors")
        kind = "float32" if x.dtype.itemsize <= 2 else "float64"
        framed = win.frame(torch.from_numpy(x.astype(kind)), tuple(x.shape[2:]), float(dtype_range(x.dtype)[0]))
        with torch.no_grad():
            y = pool(framed, win.kernel, win.strides, 0, win.dilations)
        return [y.numpy().astype(x.dtype)]

    return run


@register("GlobalMaxPool")
def make_global_maxpool(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]

    return run


@register("ReduceMax")
def make_reducemax(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    """Axes from the attribute (opset <= 17) or the second input (opset 18)."""
    keepdims = bool(int_attr(attrs, "keepdims", 1))
    noop = bool(int_attr(attrs, "noop_with_empty_axes", 0))

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        axes = _axes(attrs, x.ndim, inputs[1] if len(inputs) > 1 and inputs[1] is not None else None)
        if axes is None:
            if noop:
                return [x]
            axes = tuple(range(x.ndim))
        return [array0(x.max(axis=axes, keepdims=keepdims))]

    return run
