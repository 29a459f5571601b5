"""QConv / QConvTranspose: exact integer convolutions computed by torch's float kernels.

The accumulation ``sum (x - x_zp) * w`` runs in float32 when every partial sum is provably an
integer of magnitude below 2**24 (bound = max over output channels of sum|w_c| * max|x - x_zp|,
first from the input dtype, then from the actual data), otherwise in float64 (exact below 2**53);
the bias and the requantization then run in :class:`Requant` (float64 when its bound proves that
exact, else int64). Padding is applied to ``x - x_zp``, so the padding value is the zero point
(real 0). A convolution without padding sums the raw codes instead and folds ``- x_zp * sum(w_c)``
into the bias when the raw bound keeps float32 exact: one pass over the input less.

2-D convolutions run channels-last (torch's fastest CPU layout; the summation order does not matter
for exact integer sums) and their outputs keep that memory layout: numpy arrays of the logical NCHW
shape with NHWC strides, which the next convolution reads without a copy.

8-bit activations with int8 weights skip the float input copy on CPUs with VNNI (see
:func:`int8_matmul` and :func:`int8_conv` for when the int8 kernels are trusted):

- A stride-1 2-D 1x1 convolution is a matrix product ``[N*H*W, Cin] @ [Cin, Cout]`` over the NHWC
  rows, on int8 with int32 sums (``torch._int_mm``, several times the float32 speed): uint8 codes
  enter as ``x - 128`` and ``(128 - x_zp) * sum(w_c)`` joins the bias. (Without the int8 kernel the
  product runs in float.) It runs block by block into a per-thread scratch buffer, each block
  requantized while it is in cache (:meth:`Requant.by_rows`): a batched body's full sums would be
  tens of MiB streamed through memory twice, and a fresh allocation that large is mapped from the OS
  at every call.
- Other 2-D convolutions with symmetric pads run on oneDNN's quantized convolution with unit scales
  and float32 output: the uint8 codes and ``x_zp`` go in as they are (oneDNN pads with the zero
  point, i.e. real 0), the int32 sums come out converted to float32, exact under the same 2**24
  bound as the float32 path.
Without VNNI, pointwise convolutions on 8-bit codes with int8 weights run on onnxruntime's uint8 x
uint8 ``MatMulInteger`` (:mod:`pulsar.runtime.kernels.ort_int`, exact int32 sums; int8 codes enter as
``x + 128`` against ``x_zp + 128``), block by block like the int8 product; 16-bit weights too, split
into high and low bytes (``w = 256 * hi + lo``, both int8) for one product of double width whose halves
combine as ``256 * hi_sums + lo_sums`` in int32, where float32 sums would not be exact; the others stay on torch's
float kernels, except depthwise ones, which oneDNN's quantized convolution runs exactly without VNNI
as well. :func:`pulsar.runtime.kernels.int8.kernel_paths` tells which path runs.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.kernels import INT_DOMAIN, Kernel, register
from pulsar.runtime.kernels.common import (
    FLOAT32_EXACT,
    OutSpec,
    accum_float,
    as_int64,
    centered_bound,
    channel_param,
    check_shift,
    data_bound,
    int_attr,
    ints_attr,
    scratch,
    str_attr,
    to_torch,
    weight_minus_zero_points,
)
from pulsar.runtime.kernels.int8 import depthwise_conv, int8_conv, int8_matmul, onednn_conv, u8u8_matmul
from pulsar.runtime.kernels.ort_int import MAX_DEPTH, U8U8Matmul, byte_split, split_exact
from pulsar.runtime.kernels.requant import Requant

INT32_LIMIT = 1 << 31


def spatial_attr(attrs: dict[str, Any], name: str, nd: int, default: int) -> list[int]:
    value = ints_attr(attrs, name) or [default] * nd
    if len(value) != nd:
        raise PulsarError(f"attribute {name!r} has {len(value)} values; expected {nd} for a {nd}-D op")
    return value


def conv_geometry(attrs: dict[str, Any], nd: int) -> tuple[list[int], list[int], list[int]]:
    """(strides, pads [begin..., end...], dilations) of a conv-like node."""
    if str_attr(attrs, "auto_pad", "NOTSET") != "NOTSET":
        raise PulsarError("auto_pad is not supported in NPU bodies; the lowering writes explicit pads")
    pads = ints_attr(attrs, "pads") or [0] * (2 * nd)
    if len(pads) != 2 * nd or min(pads) < 0:
        raise PulsarError(f"attribute 'pads' = {pads} must hold {2 * nd} non-negative values")
    return spatial_attr(attrs, "strides", nd, 1), pads, spatial_attr(attrs, "dilations", nd, 1)


def pad_tensor(xt: Any, begin: list[int], end: list[int], value: float = 0.0) -> Any:
    """torch F.pad with ONNX-ordered (begin, end) spatial pads (torch wants last axis first)."""
    import torch.nn.functional as F

    flat = [p for i in reversed(range(len(begin))) for p in (begin[i], end[i])]
    return F.pad(xt, flat, value=value) if any(flat) else xt


class _Weights:
    """Everything derived once from (w, bias, M, N) and the attributes: geometry, torch weights,
    |w| sums, requantizers."""

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, m: np.ndarray, n: np.ndarray,
                 spec: OutSpec, attrs: dict[str, Any], transposed: bool) -> None:
        w = as_int64(w, "weight")
        if not 3 <= w.ndim <= 5:
            raise PulsarError(f"weight has shape {w.shape}; expected [C, C', k...] with 1 to 3 spatial axes")
        self.nd = w.ndim - 2
        self.group = group = int_attr(attrs, "group", 1)
        self.strides, self.pads, self.dilations = conv_geometry(attrs, self.nd)
        self.transposed = transposed
        self.out_pad = spatial_attr(attrs, "output_padding", self.nd, 0) if transposed else None
        absw = np.abs(w)
        if transposed:  # [Cin, Cout/g, k...] -> per output channel
            cin, cpg = w.shape[:2]
            if cin % group:
                raise PulsarError(f"weight has {cin} input channels, not divisible by group {group}")
            sums = absw.reshape(group, cin // group, cpg, -1).sum(axis=(1, 3)).reshape(-1)
        else:
            sums = absw.reshape(w.shape[0], -1).sum(axis=1)
        self.sumabs = sums.astype(np.int64)
        # sum of w_c (signed), for folding a zero point into the bias; only for unpadded convolutions
        self.unpadded = not transposed and not any(self.pads)
        self.sumw = w.reshape(w.shape[0], -1).sum(axis=1) if self.unpadded else None
        self.top = int(self.sumabs.max()) if self.sumabs.size else 0  # the largest sum |w_c|
        # 1x1, one group, stride 1, no padding: a matrix product over the channels
        self.pointwise = (not transposed and self.nd == 2 and group == 1 and w.shape[2:] == (1, 1)
                          and not any(self.pads) and self.strides == [1, 1])
        self.cout = int(self.sumabs.size)
        # one input and one output channel per group: oneDNN's depthwise kernel (exact without VNNI)
        self.depthwise = not transposed and self.nd == 2 and w.shape[1] == 1 and group == w.shape[0] > 1
        self.w = w
        self.spec = spec
        self.bias = channel_param(bias, "bias", self.cout, self.nd)
        self.m = channel_param(m, "M", self.cout, self.nd)
        self.n = check_shift(channel_param(n, "N", self.cout, self.nd))
        self._torch_w: dict[str, Any] = {}
        self._packed: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._u8u8: dict[int, U8U8Matmul] = {}
        self._rq: dict[tuple[int, int], Requant] = {}
        self._plans: dict[np.dtype, tuple[int, str | None, Requant]] = {}

    @property
    def channels_last(self) -> bool:
        """2-D convolutions run in torch's channels-last layout."""
        return self.nd == 2 and not self.transposed

    def weight(self, kind: str) -> Any:
        if kind not in self._torch_w:
            import torch

            wt = torch.from_numpy(self.w.astype(kind))
            if self.channels_last:
                wt = wt.contiguous(memory_format=torch.channels_last)
            self._torch_w[kind] = wt
        return self._torch_w[kind]

    def matrix(self, kind: str) -> Any:
        """The weights of a pointwise convolution as a [Cin, Cout] matrix of ``kind`` (a float type or
        int8)."""
        key = f"matrix/{kind}"
        if key not in self._torch_w:
            import torch

            self._torch_w[key] = torch.from_numpy(np.ascontiguousarray(self.w.reshape(self.cout, -1).T.astype(kind)))
        return self._torch_w[key]

    @functools.cached_property
    def int8_weights(self) -> bool:
        """Whether every weight is an int8 value (an int8 matrix product or quantized convolution)."""
        return self.w.size == 0 or (int(self.w.min()) >= -128 and int(self.w.max()) <= 127)

    def int8_kind(self, dtype: np.dtype, bound: int) -> str | None:
        """How 8-bit inputs whose sums stay within ``bound`` can run on int8: "int8" (pointwise, the
        int8 matrix product: int32 sums, so bound < 2**31), "qconv" (a 2-D convolution with symmetric
        pads on oneDNN's quantized convolution: float32 sums, so bound < 2**24), or None."""
        if dtype.itemsize != 1 or self.transposed or self.nd != 2 or not self.int8_weights:
            return None
        if self.pointwise:
            return "int8" if bound < INT32_LIMIT and int8_matmul() else None
        symmetric = self.pads[:2] == self.pads[2:]
        trusted = int8_conv() or (self.depthwise and depthwise_conv())
        return "qconv" if symmetric and bound < FLOAT32_EXACT and trusted else None

    @functools.cached_property
    def byte_halves(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Pointwise weights past int8 as (hi, lo) int8 matrices [Cin, Cout] with ``w = 256*hi + lo``
        (:func:`byte_split`), or None (int8 weights, or too wide to split)."""
        if not self.pointwise or self.int8_weights:
            return None
        return byte_split(self.w.reshape(self.cout, -1).T)

    def u8u8_zp(self, dtype: np.dtype, x_zp: int) -> int | None:
        """The uint8 zero point a pointwise convolution of 8-bit ``dtype`` codes passes to
        onnxruntime's ``MatMulInteger`` (int8 codes enter as ``x + 128``), or None when that path does
        not apply: not pointwise, weights past int8 that :attr:`byte_halves` cannot split (or where
        the float32 product is exact already), sums (of each half too) that could leave int32, or not
        trusted."""
        if not self.pointwise or dtype.itemsize != 1 or self.w.shape[1] > MAX_DEPTH:
            return None
        zp = x_zp + (128 if dtype.kind == "i" else 0)
        xmax = centered_bound(dtype, x_zp)
        if not 0 <= zp <= 255 or self.top * xmax >= INT32_LIMIT or not u8u8_matmul():
            return None
        if self.int8_weights:
            return zp
        halves = self.byte_halves
        if halves is None or self.top * xmax < FLOAT32_EXACT or not split_exact():
            return None  # a float32 product is as fast as the double-width one
        if any(int(np.abs(h).sum(axis=0).max()) * xmax >= INT32_LIMIT for h in halves):
            return None
        return zp

    def u8u8_rows(self, x: np.ndarray) -> Any:
        """The NHWC rows ``[N*H*W, Cin]`` of 8-bit ``x`` as uint8 (int8 codes as ``x + 128``), a view
        when ``x`` is channels-last uint8."""
        import torch

        n, c, h, w = x.shape
        src = to_torch(x).permute(0, 2, 3, 1)
        if x.dtype.kind == "i":  # int8 v + 128 is v ^ 0x80 read as uint8
            codes = scratch("conv_in/uint8", (n, h, w, c), torch.uint8)
            torch.bitwise_xor(src.view(torch.uint8), 0x80, out=codes)
            src = codes
        return src.reshape(n * h * w, c).numpy()

    def qconv_sums(self, x: np.ndarray, zp: int) -> Any:
        """The exact sums of ``x - zp`` (8-bit codes) from oneDNN's quantized convolution as a
        float32 channels-last tensor; int8 codes enter as uint8 ``x + 128`` against ``zp + 128``."""
        import torch

        src = to_torch(x)
        if x.dtype.kind == "i":  # int8 v + 128 is v ^ 0x80 read as uint8
            codes = scratch("conv_in/uint8", tuple(x.shape), torch.uint8, channels_last=True)
            torch.bitwise_xor(src.view(torch.uint8), 0x80, out=codes)
            src, zp = codes, zp + 128
        key = (zp, tuple(x.shape))
        if key not in self._packed:
            w8 = torch.from_numpy(self.w.astype(np.int8))
            ones, zeros = torch.ones(self.cout), torch.zeros(self.cout, dtype=torch.int64)
            packed = torch.ops.onednn.qconv_prepack(w8, ones, 1.0, zp, self.strides, self.pads[:2], self.dilations,
                                                    self.group, list(x.shape))
            self._packed[key] = (packed, ones, zeros)
        packed, ones, zeros = self._packed[key]
        return onednn_conv(src, zp, packed, ones, zeros, self.strides, self.pads[:2], self.dilations, self.group)

    def pointwise_conv(self, x: np.ndarray, kind: str, sub_zp: int, rq: Requant) -> np.ndarray:
        """A stride-1 1x1 convolution as a matrix product of NHWC rows ``[N*H*W, Cin] @ [Cin, Cout]``:
        int8 with exact int32 sums (uint8 codes enter as ``x - 128``, the requantizer's bias holds the
        rest), or float ``kind`` on ``x - sub_zp``. Blocks of rows are multiplied into cache-resident
        scratch and requantized at once (:meth:`Requant.by_rows`); when that form does not apply, the
        whole product is requantized. Output channels-last."""
        import torch

        n, c, h, w = x.shape
        src = to_torch(x).permute(0, 2, 3, 1)
        if kind == "u8u8":
            zp = sub_zp + (128 if x.dtype.kind == "i" else 0)  # as u8u8_zp gave it to plan
            halves = self.byte_halves
            if zp not in self._u8u8:
                wm = self.w.reshape(self.cout, -1).T if halves is None else np.concatenate(halves, axis=1)
                self._u8u8[zp] = U8U8Matmul(wm, zp)
            product, codes = self._u8u8[zp], self.u8u8_rows(x)

            def sums(i: int, j: int) -> Any:
                got = torch.from_numpy(product(codes[i:j]))
                if halves is None:
                    return got
                # 16-bit weights: 256 * hi sums + lo sums, in int32 (|sum| <= top * xmax < 2**31)
                out = scratch("conv_out/split", (j - i, self.cout), torch.int32)
                return torch.add(got[:, self.cout:], got[:, :self.cout], alpha=256, out=out)

            out = rq.by_rows((n, self.cout, h, w), True, sums)
            if out is None:
                out = rq.torch(sums(0, n * h * w).view(n, h, w, self.cout).permute(0, 3, 1, 2))
            return out
        if kind == "int8":
            xs = scratch("conv_in/int8", (n, h, w, c), torch.int8)
            if x.dtype.kind == "u":  # uint8 u - 128 is u ^ 0x80 read as int8
                torch.bitwise_xor(src, 0x80, out=xs.view(torch.uint8))
            else:
                xs.copy_(src)
            mm, sums = torch._int_mm, torch.int32
        else:
            xs = scratch("conv_in", (n, h, w, c), getattr(torch, kind))
            xs.copy_(src)
            if sub_zp:
                xs -= sub_zp
            mm, sums = torch.mm, xs.dtype
        rows, wm, count = xs.view(n * h * w, c), self.matrix(kind), n * h * w

        def produce(i: int, j: int) -> Any:
            return mm(rows[i:j], wm, out=scratch("conv_out", (j - i, self.cout), sums))

        out = rq.by_rows((n, self.cout, h, w), True, produce)
        if out is None:
            out = rq.torch(produce(0, count).view(n, h, w, self.cout).permute(0, 3, 1, 2))
        return out

    def requant(self, xmax: int, zp_in_bias: int = 0) -> Requant:
        """Requantizer for accumulators of inputs with max |x| <= xmax (its bound proves the fast
        forms); ``zp_in_bias``: the sums ran on the raw x, so ``- zp * sum(w_c)`` joins the bias."""
        key = (xmax, zp_in_bias)
        if key not in self._rq:
            bound = self.sumabs.reshape((-1,) + (1,) * self.nd) * xmax
            bias = self.bias
            if zp_in_bias:
                assert self.sumw is not None
                shift = channel_param(-zp_in_bias * self.sumw, "bias", self.cout, self.nd)
                bias = shift if bias is None else bias + shift
            self._rq[key] = Requant(self.m, self.n, self.spec, bias, bound)
        return self._rq[key]

    def accumulate(self, xt: Any, kind: str) -> Any:
        """The exact integer sums as a float torch tensor (``xt`` is ``x - x_zp`` in float ``kind``).

        No autograd context is needed: neither operand requires a gradient."""
        import torch.nn.functional as F

        nd, wt = self.nd, self.weight(kind)
        if self.transposed:
            return _conv_transpose(F, xt, wt, self.strides, self.pads, self.dilations, self.group, self.out_pad)
        begin, end = self.pads[:nd], self.pads[nd:]
        padding: Any = begin
        if begin != end:
            xt, padding = pad_tensor(xt, begin, end), 0
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        return conv(xt, wt, None, self.strides, padding, self.dilations, self.group)

    def accumulate_as(self, x: np.ndarray, x_zp: int) -> tuple[str, int]:
        """(float dtype for the accumulation, operand bound of the dtype) for input ``x``."""
        xmax = centered_bound(x.dtype, x_zp) if x.dtype.kind in "iu" else 0
        if self.top * xmax < FLOAT32_EXACT:
            return "float32", xmax
        return accum_float(self.top * data_bound(x, x_zp), "QConv accumulator"), xmax

    def plan(self, dtype: np.dtype, x_zp: int) -> tuple[int, str | None, Requant]:
        """How inputs of ``dtype`` run: (zero point subtracted from x, kind of the sums: a float type,
        "int8" for the int8 matrix product (zero point in the bias), "u8u8" for onnxruntime's
        ``MatMulInteger`` (zero point passed to it), "qconv" for oneDNN's quantized convolution
        (float32 sums), or None when the dtype's bound is too large for float32 and the
        data decide, requantizer)."""
        if dtype not in self._plans:
            if dtype.kind not in "iu":
                raise PulsarError(f"input has dtype {dtype}; NPU activations are integer tensors")
            raw = centered_bound(dtype, 0)
            xmax = centered_bound(dtype, x_zp)

            def float32(bound: int) -> str:  # oneDNN's quantized convolution, or torch's float32 one
                return "qconv" if self.int8_kind(dtype, bound) == "qconv" else "float32"

            if self.int8_kind(dtype, self.top * 128) == "int8":  # int8 codes, zp into the bias
                self._plans[dtype] = (0, "int8", self.requant(128, x_zp - (128 if dtype.kind == "u" else 0)))
            elif self.u8u8_zp(dtype, x_zp) is not None:  # uint8 codes, zp into MatMulInteger
                self._plans[dtype] = (x_zp, "u8u8", self.requant(xmax))
            elif x_zp and self.unpadded and self.top * raw < FLOAT32_EXACT:  # raw codes, zp into the bias
                self._plans[dtype] = (0, float32(self.top * raw), self.requant(raw, x_zp))
            else:
                kind = float32(self.top * xmax) if self.top * xmax < FLOAT32_EXACT else None
                self._plans[dtype] = (x_zp, kind, self.requant(xmax))
        return self._plans[dtype]


def centered_float(x: np.ndarray, zp: int, kind: str, channels_last: bool = False,
                   scratch_key: str | None = None) -> Any:
    """A new torch tensor of ``x - zp`` in float ``kind`` (exact: |x - zp| < 2**17), in channels-last
    memory layout when asked (4-D only); the cast and the relayout are one copy. With ``scratch_key``
    the tensor lives in that per-thread scratch buffer (see :func:`scratch`)."""
    import torch

    if x.dtype.kind not in "iu":
        raise PulsarError(f"input has dtype {x.dtype}; NPU activations are integer tensors")
    src = to_torch(x)
    dtype = getattr(torch, kind)
    cl = channels_last and x.ndim == 4
    if scratch_key is not None:
        xt = scratch(scratch_key, tuple(x.shape), dtype, channels_last=cl)
        xt.copy_(src)
    else:
        xt = src.to(dtype=dtype, memory_format=torch.channels_last if cl else torch.preserve_format, copy=True)
    if zp:
        xt -= zp
    return xt


def _make(attrs: dict[str, Any], consts: list[np.ndarray | None], transposed: bool) -> Kernel:
    spec = OutSpec.from_attrs(attrs)
    x_zp = int_attr(attrs, "x_zp", 0)
    if transposed and attrs.get("output_shape") is not None:
        raise PulsarError("QConvTranspose: attribute output_shape is not supported; write pads / output_padding")
    consts = list(consts) + [None] * (6 - len(consts))
    if consts[1] is not None and consts[5] is not None:  # U4 weights: stored affine, centred once here
        consts[1] = weight_minus_zero_points(consts[1], consts[5], 1 if transposed else 0)
    prepared: _Weights | None = None
    if consts[1] is not None and consts[3] is not None and consts[4] is not None:
        prepared = _Weights(consts[1], consts[2], consts[3], consts[4], spec, attrs, transposed)

    def run(inputs: list[np.ndarray | None]) -> list[np.ndarray]:
        x, w, b, m, n = (list(inputs) + [None] * 5)[:5]
        core = prepared
        if core is None or (b is not None and consts[2] is None):  # run-time weights or bias
            if w is None or m is None or n is None:
                raise PulsarError("inputs x, w, M and N are required")
            core = _Weights(w, b, m, n, spec, attrs, transposed)
        if x is None or x.ndim != core.nd + 2:
            raise PulsarError(f"input has shape {None if x is None else x.shape}; expected rank {core.nd + 2} "
                              f"for weight {core.w.shape}")
        sub_zp, kind, rq = core.plan(x.dtype, x_zp)
        if kind is None:
            kind = accum_float(core.top * data_bound(x, x_zp), "QConv accumulator")
        if kind == "qconv":
            try:
                return [rq.torch(core.qconv_sums(x, sub_zp))]
            except RuntimeError:  # a geometry oneDNN refuses: torch's float32 convolution, same sums
                kind = "float32"
        if core.pointwise:
            return [core.pointwise_conv(x, kind, sub_zp, rq)]
        acc = core.accumulate(centered_float(x, sub_zp, kind, core.channels_last, "conv_in"), kind)
        return [rq.torch(acc)]

    return run


def _conv_transpose(F: Any, xt: Any, wt: Any, strides: list[int], pads: list[int], dilations: list[int],
                    group: int, out_pad: list[int]) -> Any:
    """ONNX ConvTranspose: the full transposed conv, ``out_pad`` zeros at the end, then the pads cropped."""
    nd = len(strides)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    full = fn(xt, wt, None, strides, 0, 0, group, dilations)
    full = pad_tensor(full, [0] * nd, out_pad)
    index = [slice(None), slice(None)]
    for i in range(nd):
        size = full.shape[2 + i] - pads[i] - pads[nd + i]
        if size <= 0:
            raise PulsarError(f"pads {pads} leave no output along spatial axis {i}")
        index.append(slice(pads[i], pads[i] + size))
    return full[tuple(index)]


@register("QConv", domain=INT_DOMAIN)
def make_qconv(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    return _make(attrs, consts, transposed=False)


@register("QConvTranspose", domain=INT_DOMAIN)
def make_qconv_transpose(attrs: dict[str, Any], consts: list[np.ndarray | None]) -> Kernel:
    return _make(attrs, consts, transposed=True)
