"""Exact integer backends for the convolution and matrix kernels, each enabled only after a self-check.

``torch._int_mm`` (int8 x int8 -> int32 matrix product) and oneDNN's quantized 2-D convolution give
the exact integer sums of 8-bit operands, much faster than float accumulation, on torch >= 2.6 with a
VNNI CPU: the "vnni" path. Without VNNI (the "avx2" path), matrix products (pointwise convolutions)
run on onnxruntime's uint8 x uint8 ``MatMulInteger`` (exact int32 sums, see
:mod:`pulsar.runtime.kernels.ort_int`), and depthwise convolutions on oneDNN's quantized convolution
all the same: a depthwise kernel has no sum over input channels, so it widens each product to 32 bits
instead of adding u8 x s8 pairs in saturating 16-bit lanes (checked, :func:`_depthwise_exact`).
Elsewhere (or when a check fails) the kernels take their float path ("float32": exact float sums, see
:mod:`pulsar.runtime.kernels.conv`), with identical results.

Every path gives the same bits, so the choice is only speed; :data:`FORCE` (or the environment
variable ``PULSAR_SIM_KERNELS``) pins one, so tests run every path on every machine: ``vnni``,
``avx2`` or ``float32`` (a kernel whose check fails here takes the float path instead).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pulsar.errors import PulsarError
from pulsar.runtime.kernels.ort_int import u8u8_exact

PATHS = ("vnni", "avx2", "float32")
ENV = "PULSAR_SIM_KERNELS"
# the path tests (or a caller) pin; None: the environment variable, else the fastest trusted one
FORCE: str | None = None


def forced() -> str | None:
    """The pinned path (:data:`FORCE`, else ``$PULSAR_SIM_KERNELS``; ``auto`` or empty: none)."""
    value = FORCE if FORCE is not None else os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PATHS:
        raise PulsarError(f"{ENV}={value!r} is not a kernel path; use auto, {', '.join(PATHS)}")
    return value


def _allowed(path: str) -> bool:
    pinned = forced()
    return pinned is None or pinned == path


def int8_matmul() -> bool:
    """Whether pointwise convolutions run on ``torch._int_mm`` ("vnni"): allowed and trusted here."""
    return _allowed("vnni") and _int_mm_exact()


def int8_conv() -> bool:
    """Whether 2-D convolutions run on oneDNN's quantized convolution ("vnni"): allowed and trusted."""
    return _allowed("vnni") and _qconv_exact()


def u8u8_matmul() -> bool:
    """Whether pointwise convolutions may run on onnxruntime's uint8 x uint8 ``MatMulInteger``
    ("avx2"): allowed and trusted here (the "vnni" kernel, where trusted, comes first)."""
    return _allowed("avx2") and u8u8_exact()


def depthwise_conv() -> bool:
    """Whether depthwise 2-D convolutions run on oneDNN's quantized convolution: the "vnni" path, or
    the "avx2" one where oneDNN's depthwise kernel is exact (:func:`_depthwise_exact`)."""
    return int8_conv() or (_allowed("avx2") and _depthwise_exact())


def kernel_paths() -> dict[str, str]:
    """The kernel each family runs on here: ``matmul`` (pointwise convolutions: "vnni", "ort-u8u8"
    or "float32"), ``depthwise`` and ``conv`` (other 2-D convolutions: "vnni", "onednn" or
    "float32"), and ``path``, the set in use ("vnni", "avx2" or "float32")."""
    matmul = "vnni" if int8_matmul() else "ort-u8u8" if u8u8_matmul() else "float32"
    conv = "vnni" if int8_conv() else "float32"
    depthwise = conv if conv != "float32" else "onednn" if depthwise_conv() else "float32"
    path = "vnni" if "vnni" in (matmul, conv) else "avx2" if "float32" not in (matmul, depthwise) else "float32"
    return {"matmul": matmul, "depthwise": depthwise, "conv": conv, "path": path}


def _vnni_torch() -> bool:
    """torch >= 2.6 on a CPU with VNNI. Without VNNI oneDNN's int8 kernels add u8 x s8 pairs in
    saturating 16-bit lanes (pytorch#136746; torch 2.6 sends ``_int_mm`` to a slow reference loop
    there instead)."""
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    return version >= (2, 6) and bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())


@functools.lru_cache(maxsize=1)
def _int_mm_exact() -> bool:
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
def _qconv_exact() -> bool:
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


@functools.lru_cache(maxsize=1)
def _depthwise_exact() -> bool:
    """Whether oneDNN's quantized convolution returns the exact sums of depthwise convolutions here
    (any CPU, VNNI or not): equal to exact sums on extreme operands (codes 0 and 255 against weights
    -128 and 127, zero points 0 / 200 / 255, 3x3 and 5x5 kernels, strides 1 and 2)."""
    import torch
    import torch.nn.functional as F

    x = torch.full((2, 16, 9, 8), 255, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    x[0, :, ::2] = 0
    x[1, ::3] = 0
    try:
        for k, stride in ((3, 1), (5, 2)):
            w = torch.full((16, 1, k, k), 127, dtype=torch.int8)
            w[::2, :, 1] = -128
            w[1::4] = -128
            ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
            geometry = ([stride, stride], [k // 2, k // 2], [1, 1])
            for zp in (0, 200, 255):
                packed = torch.ops.onednn.qconv_prepack(w, ones, 1.0, zp, *geometry, 16, None)
                got = onednn_conv(x, zp, packed, ones, zeros, *geometry, 16)
                want = F.conv2d(x.double() - zp, w.double(), None, *geometry, 16)
                if not torch.equal(got.double(), want):
                    return False
    except (RuntimeError, AttributeError):
        return False
    return True
