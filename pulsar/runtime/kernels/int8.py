"""Exact int8 backends of torch for the convolution kernels, each enabled only after a self-check.

``torch._int_mm`` (int8 x int8 -> int32 matrix product) and oneDNN's quantized 2-D convolution give
the exact integer sums of 8-bit operands, much faster than float accumulation, on torch >= 2.6 with a
VNNI CPU. Elsewhere (or when a check fails) the kernels take their float path, with identical results.
"""

from __future__ import annotations

import functools
from typing import Any


def _vnni_torch() -> bool:
    """torch >= 2.6 on a CPU with VNNI. Without VNNI oneDNN's int8 kernels add u8 x s8 pairs in
    saturating 16-bit lanes (pytorch#136746; torch 2.6 sends ``_int_mm`` to a slow reference loop
    there instead)."""
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    return version >= (2, 6) and bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())


@functools.lru_cache(maxsize=1)
def int8_matmul() -> bool:
    """Whether ``torch._int_mm`` (int8 x int8 -> int32) is exact and fast here: :func:`_vnni_torch`,
    and equal to the exact products on extreme operands (every pair at +-127 / -128, where a
    saturating kernel would fail)."""
    import torch

    if not _vnni_torch():
        return False
    a = torch.tensor([[127] * 64, [-128] * 64, [127, -128] * 32] * 11, dtype=torch.int8)
    b = torch.tensor([[127] * 3 + [-128] * 3 + [127, -128] * 5] * 64, dtype=torch.int8)
    try:
        return bool(torch.equal(torch._int_mm(a, b), a.to(torch.int64).mm(b.to(torch.int64)).to(torch.int32)))
    except (RuntimeError, AttributeError):
        return False


def onednn_conv(x: Any, zp: int, packed: Any, ones: Any, zeros: Any, strides: list[int], pads: list[int],
                 dilations: list[int], group: int) -> Any:
    """oneDNN's quantized 2-D convolution (the x86 inductor op) with unit scales and float32 output:
    ``sum (x - zp) * w`` over uint8 ``x`` and the prepacked int8 weights, as float32."""
    import torch

    return torch.ops.onednn.qconv2d_pointwise(x, 1.0, zp, packed, ones, zeros, None, strides, pads, dilations,
                                              group, 1.0, 0, torch.float32, "none", [], "")


@functools.lru_cache(maxsize=1)
def int8_conv() -> bool:
    """Whether oneDNN's quantized convolution (:func:`onednn_conv`) returns the exact integer sums
    here: :func:`_vnni_torch`, the op present, and equal to exact sums on extreme operands (codes 0
    and 255 against weights -128 and 127, zero points 0 / 200 / 255, a grouped and a depthwise case;
    every |sum| stays below 2**24, so float32 holds it)."""
    import torch
    import torch.nn.functional as F

    if not _vnni_torch():
        return False
    x = torch.full((2, 8, 6, 5), 255, dtype=torch.uint8)
    x[0, :, ::2] = 0
    x[1, ::3] = 0
    try:
        for group, cin in ((1, 8), (2, 4), (8, 1)):
            w = torch.full((8, cin, 3, 3), 127, dtype=torch.int8)
            w[::2, :, 1] = -128
            ones, zeros = torch.ones(8), torch.zeros(8, dtype=torch.int64)
            for zp in (0, 200, 255):
                packed = torch.ops.onednn.qconv_prepack(w, ones, 1.0, zp, [1, 2], [1, 1], [1, 1], group, None)
                got = onednn_conv(x, zp, packed, ones, zeros, [1, 2], [1, 1], [1, 1], group)
                want = F.conv2d(x.double() - zp, w.double(), None, [1, 2], [1, 1], [1, 1], group)
                if not torch.equal(got.double(), want):
                    return False
    except (RuntimeError, AttributeError):
        return False
    return True
